"""python -m maxsim serve on the CPU: search equals Corpus.search, concurrent requests are batched,
writes need the key and are durable, every bad request is a one-line 4xx and the server goes on."""

import json
import random
import threading
import urllib.request

import numpy as np
import pytest
import torch

import maxsim
from maxsim.client import Client, ServerError

pytest.importorskip("fastapi", reason="the server's tests need FastAPI and uvicorn (the [serve] extra)")
pytest.importorskip("uvicorn", reason="the server's tests need FastAPI and uvicorn (the [serve] extra)")

from served import serving  # noqa: E402 (after the skips: it starts servers that need them)

serve = pytest.fixture(serving, name="serve")

D = 16


def make_corpus(folder, n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randn(int(L), D, generator=g) for L in torch.randint(1, 9, (n,), generator=g)]
    ids = [f"d{j}" for j in range(n)]
    maxsim.Corpus.from_list(docs, ids=ids).save(folder)
    return docs, ids


def expected(folder, queries, k, subset=None):
    result = maxsim.Corpus.load(folder).search([torch.from_numpy(q) for q in queries], k, progress=False,
                                               subset=subset)
    return result.ids, result.scores.tolist()


def test_search_matches_the_corpus_and_batches_concurrent_clients(tmp_path, serve):
    make_corpus(tmp_path / "c")
    server = serve(tmp_path / "c", "--max-wait-ms", "20")
    client = Client(server.url)
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ()).item()))
    queries = [rng.standard_normal((int(rng.integers(1, 6)), D)).astype(np.float32) for _ in range(24)]
    hits = client.search(queries, k=5)
    want_ids, want_scores = expected(tmp_path / "c", queries, 5)
    assert [h.ids for h in hits] == want_ids
    np.testing.assert_allclose([h.scores for h in hits], want_scores, rtol=1e-6, atol=1e-5)
    subset = [f"d{j}" for j in range(0, 60, 3)]
    hits = client.search(queries[:2], k=3, subset=subset)
    assert [h.ids for h in hits] == expected(tmp_path / "c", queries[:2], 3, subset)[0]
    # 24 clients at once, one query each: every answer right, fewer searches than queries
    before = client.stats()["searches"]
    answers = [None] * len(queries)

    def one(i):
        answers[i] = Client(server.url).search(queries[i][None], k=4)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [a.ids for a in answers] == expected(tmp_path / "c", queries, 4)[0]
    stats = client.stats()
    assert stats["queries"] >= 24 + 24 + 2 and stats["searches"] - before < len(queries)  # batched
    assert stats["live"] == 60 and stats["encoding"] == "float32" and stats["dim"] == D


def test_writes_need_the_key_and_survive_a_restart(tmp_path, serve):
    docs, ids = make_corpus(tmp_path / "c", n=20)
    server = serve(tmp_path / "c", api_key="s3cret")
    anonymous, client = Client(server.url), Client(server.url, api_key="s3cret")
    new = np.random.default_rng().standard_normal((3, D)).astype(np.float32)
    with pytest.raises(ServerError) as err:
        anonymous.add(["n1"], [new])
    assert err.value.status == 401
    req = urllib.request.Request(server.url + "/documents", data=json.dumps({"ids": ["n1"], "documents": [new.tolist()]})
                                 .encode(), method="POST", headers={"X-API-Key": "s3cret"})
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read()) == {"appended": 1, "live": 21}
    assert client.delete(["d3", "unknown"]) == {"deleted": 1, "live": 20}
    with pytest.raises(ServerError) as err:
        client.add(["n1"], [new])
    assert err.value.status == 409 and "DELETE /documents" in err.value.message
    hit = client.search(new[None], k=1)[0]
    assert hit.ids == ["n1"]
    server.kill()  # no shutdown: what was acknowledged is in the folder
    stored = maxsim.Corpus.load(tmp_path / "c")
    assert set(np.asarray(stored.ids)[stored.live].tolist()) == (set(ids) - {"d3"}) | {"n1"}
    again = serve(tmp_path / "c", api_key="s3cret")
    assert Client(again.url).search(new[None], k=1)[0].ids == ["n1"]


@pytest.mark.parametrize("case", ["wrong d", "nan", "k", "not json", "no queries", "ragged", "huge", "bad npy",
                                  "subset type", "doc shape", "ids mismatch"])
def test_bad_requests_are_one_line_4xx_and_the_server_goes_on(tmp_path, serve, case):
    make_corpus(tmp_path / "c", n=10)
    server = serve(tmp_path / "c", "--max-body-mb", "1")
    good = {"queries": np.zeros((1, 2, D)).tolist(), "k": 3}
    bodies = {
        "wrong d": {"queries": np.zeros((1, 2, D + 1)).tolist()},
        "nan": {"queries": [[[float("nan")] * D]]},
        "k": dict(good, k=-1),
        "not json": b"{queries:",
        "no queries": {"k": 2},
        "ragged": {"queries": [[[0.0] * D, [0.0] * 3]]},
        "huge": b"[" + b"0.0," * 400_000 + b"0]",
        "bad npy": {"queries_npy": "bm90IGEgZmlsZQ=="},
        "subset type": dict(good, subset=[1, 2]),
        "doc shape": ("/documents", {"ids": ["x"], "documents": [[[0.0] * (D - 1)]]}),
        "ids mismatch": ("/documents", {"ids": ["x", "y"], "documents": [[[0.0] * D]]}),
    }
    path, body = bodies[case] if isinstance(bodies[case], tuple) else ("/search", bodies[case])
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    status, text = err.value.code, err.value.read().decode()
    assert 400 <= status < 500 and (status == 413) == (case == "huge"), (status, text)
    message = json.loads(text)["error"]
    assert message and "\n" not in message and "Traceback" not in message
    assert Client(server.url).health() == {"status": "ok"}
    assert len(Client(server.url).search(np.zeros((1, 2, D), dtype=np.float32), k=3)[0].ids) == 3


def test_kill_at_random_points_keeps_every_acknowledged_write(tmp_path, serve):
    """A writer appends and deletes while the server is killed (SIGKILL) at random moments, then
    restarted: the folder always loads, holds every acknowledged write, and of the one write in
    flight at the kill either all or nothing."""
    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    _, ids = make_corpus(tmp_path / "c", n=30, seed=seed % 1000)
    live, next_id, total = set(ids), 0, 0
    for round_ in range(4):
        server = serve(tmp_path / "c")
        client = Client(server.url, timeout=10)
        acknowledged, in_flight = [], [None]
        stop = threading.Event()

        def writer():
            nonlocal next_id
            while not stop.is_set():
                if rng.random() < 0.6 or len(live) < 5:
                    names = [f"n{next_id}-{i}" for i in range(rng.randint(1, 3))]
                    next_id += 1
                    op = ("add", names)
                    docs = [np.full((rng.randint(1, 4), D), 0.5, dtype=np.float32) for _ in names]
                    in_flight[0] = op
                    try:
                        client.add(names, docs)
                    except OSError:
                        return
                else:
                    op = ("delete", rng.sample(sorted(live), rng.randint(1, 2)))
                    in_flight[0] = op
                    try:
                        client.delete(op[1])
                    except OSError:
                        return
                in_flight[0] = None
                acknowledged.append(op)
                if op[0] == "add":
                    live.update(op[1])
                else:
                    live.difference_update(op[1])

        thread = threading.Thread(target=writer)
        thread.start()
        threading.Event().wait(rng.uniform(0.3, 1.5))
        server.kill()
        stop.set()
        thread.join(30)
        stored = maxsim.Corpus.load(tmp_path / "c")  # the folder loads: never half-written
        got = set(np.asarray(stored.ids)[stored.live].tolist())
        op = in_flight[0]
        if op is not None and got != live:  # the write in flight at the kill: whole or not at all
            landed = live | set(op[1]) if op[0] == "add" else live - set(op[1])
            assert got == landed, (seed, round_, op)
            live = landed
        assert got == live, (seed, round_, len(acknowledged))
        total += len(acknowledged)
    assert total > 0  # writes were acknowledged before the kills
