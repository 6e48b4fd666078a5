"""Corpus.search(refine=...): a compressed first stage keeps k * refine_factor candidates, which are
scored again from a float (or one-byte) corpus of the same documents; the answer is the exact top-k
of those candidates (ties to the lower index), whatever the refine corpus's placement (memory,
a memory-mapped file), for padded, 2-D and list queries, subsets, and deleted documents."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.search import Corpus
from maxsim.search import refine as refine_module


def _docs(generator, n=120, d=32):
    lengths = torch.randint(1, 14, (n,), generator=generator).tolist()
    docs = [F.normalize(torch.randn(L, d, generator=generator), dim=-1) for L in lengths]
    docs[5] = torch.zeros(0, d)  # an empty document scores 0
    docs[9] = docs[4].clone()  # a tie: the lower index first
    return docs


def _oracle(q, docs, candidates) -> dict:
    """{candidate: fp32 MaxSim of q against its float16-rounded tokens}, one document a call: two
    identical documents score bitwise alike, whatever their position (a packed call's blocks may
    round them apart)."""
    return {int(c): float(maxsim.maxsim_varlen([q.half().float()], [docs[c].half().float()])[0, 0])
            for c in candidates if c >= 0}


def _assert_top_k(got_indices, got_scores, oracle: dict, k: int):
    """One result row (indices, -1 padded; scores) is a top-k of ``oracle``: distinct candidates,
    each with its oracle score, whose scores are the k best in order. Candidates within fp32
    rounding of each other may come in either order; equal returned scores come lower index first."""
    got_indices = [int(j) for j in got_indices]
    n = min(k, len(oracle))
    assert got_indices[n:] == [-1] * (len(got_indices) - n)
    got, returned = got_indices[:n], torch.as_tensor(got_scores).cpu()[:n].float()
    want = sorted(oracle, key=lambda j: (-oracle[j], j))[:n]
    assert len(set(got)) == n and set(got) <= set(oracle)
    torch.testing.assert_close(torch.tensor([oracle[j] for j in got]), torch.tensor([oracle[j] for j in want]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returned, torch.tensor([oracle[j] for j in got]), rtol=1e-5, atol=1e-5)
    for a in range(n - 1):
        if returned[a] == returned[a + 1]:
            assert got[a] < got[a + 1], "a tie must come lower index first"


@pytest.mark.parametrize("encoding", ["residual2", "int8", "pq8"])
def test_refined_top_k_is_the_exact_top_k_of_the_candidates(tmp_path, encoding):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g)
    queries = [F.normalize(torch.randn(L, 32, generator=g), dim=-1) for L in (3, 5, 1)]
    first = Corpus.from_list(docs, encoding=encoding)
    full = Corpus.from_list([x.half() for x in docs])
    full.save(tmp_path / "full")
    mapped = Corpus.load(tmp_path / "full", mmap=True)
    k, factor = 5, 3
    stage1 = first.search(queries, k * factor, device=KERNEL_DEVICE)
    oracles = [_oracle(q, docs, cand) for q, cand in zip(queries, stage1.indices.cpu().tolist())]
    for refine in (full, mapped):
        got = first.search(queries, k, refine=refine, refine_factor=factor, device=KERNEL_DEVICE)
        for row, oracle in enumerate(oracles):
            _assert_top_k(got.indices[row].cpu(), got.scores[row], oracle, k)
        assert np.array_equal(np.asarray(got.ids), np.asarray(first.ids)[got.indices.cpu().numpy()])


def test_refine_recovers_the_exact_top_k_when_it_is_among_the_candidates():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=80)
    queries = [F.normalize(torch.randn(4, 32, generator=g), dim=-1) for _ in range(3)]
    first = Corpus.from_list(docs, encoding="residual2")
    full = Corpus.from_list([x.half() for x in docs])
    exact = full.search([q.half() for q in queries], 4, device=KERNEL_DEVICE)
    # a factor that keeps every document: the refined answer is the exact search's
    got = first.search(queries, 4, refine=full, refine_factor=20, device=KERNEL_DEVICE)
    for row, q in enumerate(queries):
        oracle = _oracle(q, docs, range(80))
        _assert_top_k(got.indices[row].cpu(), got.scores[row], oracle, 4)
        _assert_top_k(exact.indices[row].cpu(), exact.scores[row], oracle, 4)


def test_refine_with_two_d_and_padded_queries_subsets_and_deletions():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=60)
    ids = [f"d{i}" for i in range(60)]
    first = Corpus.from_list(docs, ids, encoding="residual4")
    full = Corpus.from_list([x.half() for x in docs], ids)
    Q = F.normalize(torch.randn(2, 4, 32, generator=g), dim=-1)
    q_mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    padded = first.search(Q, 3, q_mask=q_mask, refine=full, refine_factor=4, device=KERNEL_DEVICE)
    as_list = first.search([Q[0, :3], Q[1]], 3, refine=full, refine_factor=4, device=KERNEL_DEVICE)
    assert padded.indices.tolist() == as_list.indices.tolist()
    one = first.search(Q[1], 3, refine=full, refine_factor=4, device=KERNEL_DEVICE)  # 2-D: no query axis
    assert one.indices.dim() == 1 and one.indices.tolist() == as_list.indices[1].tolist()
    subset = ids[10:30]
    sub = first.search([Q[1]], 5, subset=subset, refine=full, refine_factor=2, device=KERNEL_DEVICE)
    assert set(sub.ids[0]) <= set(subset)
    first.delete(sub.ids[0][:1])
    after = first.search([Q[1]], 5, subset=subset, refine=full, refine_factor=2, device=KERNEL_DEVICE)
    assert sub.ids[0][0] not in after.ids[0]


@pytest.mark.parametrize("one_byte", ["int8", "fp8"])
def test_refine_from_one_byte_tokens(one_byte):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=50)
    first = Corpus.from_list(docs, encoding="residual2")
    full = Corpus.from_list(docs[:20], encoding=one_byte).append(docs[20:35]).append(docs[35:])  # 3 segments:
    assert len(full.segments) == 3  # the candidates' rows and scales gathered from each into one copy
    q = [F.normalize(torch.randn(3, 32, generator=g), dim=-1)]
    got = first.search(q, 4, refine=full, refine_factor=50, device=KERNEL_DEVICE)
    dequantized = [full.document(j) for j in range(len(full))]  # values * scales, fp32, scored as they are
    oracle = {j: float(maxsim.maxsim_varlen(q, [dequantized[j]])[0, 0]) for j in range(50)}
    _assert_top_k(got.indices[0].cpu(), got.scores[0], oracle, 4)


@pytest.mark.parametrize("merge_on_host", [True, False])
def test_rerank_is_the_exact_top_k_of_given_candidates(monkeypatch, merge_on_host):
    # Corpus.rerank: candidates from anywhere (padding -1, repeats, a deleted document), scored from
    # the corpus's own tokens; a slot with no candidate has index -1 and id None. The final merge
    # runs on the host for few pairs and on the scoring device for many: both give the same answer.
    if not merge_on_host:
        monkeypatch.setattr(refine_module, "HOST_MERGE_PAIRS", 0)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=40)
    ids = [f"d{i}" for i in range(40)]
    full = Corpus.from_list([x.half() for x in docs], ids)
    queries = [F.normalize(torch.randn(L, 32, generator=g), dim=-1) for L in (2, 6, 3)]
    candidates = torch.randint(0, 40, (3, 7), generator=g)
    candidates[0, 3:] = -1
    candidates[1, 1] = candidates[1, 0]  # a repeat counts once
    got = full.rerank(queries, candidates, 5, device=KERNEL_DEVICE)
    assert got.scores.device.type == got.indices.device.type == torch.device(KERNEL_DEVICE).type
    for row, (q, cand) in enumerate(zip(queries, candidates.tolist())):
        _assert_top_k(got.indices[row].cpu(), got.scores[row], _oracle(q, docs, cand), 5)
        assert got.ids[row] == [ids[j] if j >= 0 else None for j in got.indices[row].tolist()]
    dead = int(candidates[2, 0])
    full.delete([ids[dead]])
    after = full.rerank(queries[2], candidates[2], 7, device=KERNEL_DEVICE)  # 2-D query: no query axis
    assert after.indices.dim() == 1 and dead not in after.indices.tolist()
    with pytest.raises(ValueError, match="indices in 0..39"):
        full.rerank(queries, torch.full((3, 2), 40), 2)
    with pytest.raises(ValueError, match=r"\[Nq=3, K\]"):
        full.rerank(queries, torch.zeros(2, 2, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="integer"):
        full.rerank(queries, torch.zeros(3, 2), 2)
    with pytest.raises(ValueError, match="codes"):
        Corpus.from_list(docs, encoding="residual2").rerank(queries, candidates, 2)


def test_rerank_reads_each_candidate_from_the_segment_that_holds_it():
    # A corpus built slice by slice: candidates in the first and last segments, at a segment's
    # edges, none in the segments between; every token gathered from its own segment.
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=60)
    full = Corpus.from_list([x.half() for x in docs[:10]])
    for a, b in ((10, 11), (11, 30), (30, 41), (41, 60)):
        full.append([x.half() for x in docs[a:b]])
    assert len(full.segments) == 5
    queries = [F.normalize(torch.randn(L, 32, generator=g), dim=-1) for L in (4, 1)]
    picks = [0, 9, 41, 42, 59, 50]  # segments 0 and 4 only, their first and last documents among them
    candidates = torch.tensor([picks, picks[::-1]])
    got = full.rerank(queries, candidates, 6, device=KERNEL_DEVICE)
    for row, q in enumerate(queries):
        _assert_top_k(got.indices[row].cpu(), got.scores[row], _oracle(q, docs, picks), 6)
    middle_picks = [[10, 29, 30, 40], [11, 12, 13, -1]]
    middle = full.rerank(queries, torch.tensor(middle_picks), 4, device=KERNEL_DEVICE)
    for row, (q, cand) in enumerate(zip(queries, middle_picks)):
        _assert_top_k(middle.indices[row].cpu(), middle.scores[row], _oracle(q, docs, cand), 4)


def test_refine_errors_name_the_fix():
    g = torch.Generator().manual_seed(0)
    docs = _docs(g, n=20)
    first = Corpus.from_list(docs, encoding="residual2")
    q = [F.normalize(torch.randn(2, 32, generator=g), dim=-1)]
    with pytest.raises(ValueError, match="same documents"):
        first.search(q, 2, refine=Corpus.from_list([x.half() for x in docs[:19]]))
    with pytest.raises(ValueError, match="ids differ"):
        first.search(q, 2, refine=Corpus.from_list([x.half() for x in docs], list(range(1, 21))))
    with pytest.raises(ValueError, match="refine_factor"):
        first.search(q, 2, refine=Corpus.from_list([x.half() for x in docs]), refine_factor=0)
    with pytest.raises(ValueError, match="codes"):
        first.search(q, 2, refine=first)
    with pytest.raises(TypeError, match="Corpus"):
        first.search(q, 2, refine=torch.zeros(3))


def test_search_command_refines_from_a_corpus_folder(tmp_path, capsys):
    from commands import run

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = _docs(g, n=40)
    docs[5] = torch.randn(2, 32, generator=g)  # (the index command takes no empty document)
    queries = [F.normalize(torch.randn(L, 32, generator=g), dim=-1) for L in (3, 2)]
    np.save(tmp_path / "docs.npy", torch.cat(docs).numpy())
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    torch.save({"embeddings": queries, "ids": ["q1", "q2"]}, tmp_path / "queries.pt")
    for name, extra in (("codes", ["--encoding", "residual2"]), ("full", ["--encoding", "float16"])):
        assert run(["index", "--out", str(tmp_path / name), str(tmp_path / "docs.npy"), "--lengths",
                    str(tmp_path / "lengths.npy"), "--quiet", *extra]) == 0
    argv = ["search", "--corpus", str(tmp_path / "codes"), "--queries", str(tmp_path / "queries.pt"), "-k", "3",
            "--out", str(tmp_path / "run.jsonl"), "--no-progress", "--device", KERNEL_DEVICE]
    assert run(argv + ["--refine", str(tmp_path / "full"), "--refine-factor", "40"]) == 0
    assert "refined from float16 x40" in capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    for row, q in zip(rows, queries):  # a factor of 40 keeps every document: the exact top-3
        _assert_top_k(row["docids"], row["scores"], _oracle(q, docs, range(40)), 3)
    with pytest.raises(ValueError, match="refine from float16"):  # a residual corpus cannot refine (rc 2 in maxsim.cli)
        run(argv + ["--refine", str(tmp_path / "codes")])


def test_refine_tokens_stored_beside_the_codes_follow_appends_deletes_and_compaction(tmp_path, capsys):
    from maxsim.cli import main as run  # python -m maxsim: every command, a mistake as rc 2

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = [F.normalize(torch.randn(int(n), 32, generator=g), dim=-1) for n in torch.randint(1, 9, (50,), generator=g)]
    queries = [F.normalize(torch.randn(L, 32, generator=g), dim=-1) for L in (3, 2)]
    for name, part in (("a", docs[:30]), ("b", docs[30:])):
        np.save(tmp_path / f"{name}.npy", torch.cat(part).numpy())
        np.save(tmp_path / f"{name}-len.npy", np.array([x.shape[0] for x in part]))
    torch.save({"embeddings": queries, "ids": ["q1", "q2"]}, tmp_path / "queries.pt")
    out = tmp_path / "codes"
    assert run(["index", "--out", str(out), str(tmp_path / "a.npy"), "--lengths", str(tmp_path / "a-len.npy"),
                "--encoding", "residual2", "--refine", "float16", "--quiet"]) == 0
    assert run(["index", "--out", str(out), "--append", str(tmp_path / "b.npy"), "--lengths",
                str(tmp_path / "b-len.npy"), "--quiet"]) == 0  # the refine tokens are extended too
    corpus = Corpus.load(out)
    refine = corpus.stored_refine()
    assert refine is not None and refine.encoding == "float16" and len(refine) == len(corpus) == 50
    exact = maxsim.maxsim_varlen([q.half().float() for q in queries], [x.half().float() for x in docs])

    def best(scores, live, k=4):
        return sorted((j for j in range(50) if live[j]), key=lambda j: (-float(scores[j]), j))[:k]

    got = corpus.search(queries, 4, refine=True, refine_factor=50, device=KERNEL_DEVICE)
    assert got.indices.tolist() == [best(s, [True] * 50) for s in exact]
    (tmp_path / "gone.txt").write_text(f"{got.ids[0][0]}\n")
    assert run(["delete", str(out), "--ids", str(tmp_path / "gone.txt"), "--quiet"]) == 0
    assert Corpus.load(out).stored_refine().num_deleted == 1  # deleted in both
    assert run(["compact", str(out), "--quiet"]) == 0
    corpus = Corpus.load(out)
    assert len(corpus) == len(corpus.stored_refine()) == 49
    live = [j != int(got.ids[0][0]) for j in range(50)]
    argv = ["search", "--corpus", str(out), "--queries", str(tmp_path / "queries.pt"), "-k", "4", "--out",
            str(tmp_path / "run.jsonl"), "--no-progress", "--device", KERNEL_DEVICE, "--refine", "--refine-factor", "50"]
    assert run(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [row["docids"] for row in rows] == [best(s, live) for s in exact]  # ids survive compaction
    with pytest.raises(ValueError, match="no refine tokens"):
        Corpus.from_list(docs, encoding="residual2").search(queries, 2, refine=True)
    # replaced without --refine: the old refine tokens go with the corpus they belonged to
    assert run(["index", "--out", str(out), str(tmp_path / "b.npy"), "--lengths", str(tmp_path / "b-len.npy"),
                "--encoding", "residual2", "--overwrite", "--quiet"]) == 0
    assert Corpus.load(out).stored_refine() is None and not (out / "refine").exists()
