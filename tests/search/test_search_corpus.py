"""Corpus, the corpus file and streamed search against exhaustive maxsim_varlen + a stable sort."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import maxsim
from placement import place, search_within_budget
from maxsim.search import Corpus
from maxsim.search import format as corpus_format
from maxsim.search.stream import plan_chunks


def sorted_topk(full, k):
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


def random_docs(n, d=8, dtype=torch.float32, longest=9, integer=False):
    lengths = torch.randint(0, longest, (n,)).tolist()
    make = (lambda L: torch.randint(-2, 3, (L, d)).to(dtype)) if integer else (lambda L: torch.randn(L, d).to(dtype))
    return [make(L) for L in lengths]


def assert_same(result, want, corpus_ids=None, exact=True):
    """Ids always equal; scores bit-equal on integer inputs. With float inputs the CPU reference
    scores a chunk padded to the chunk's longest document, and its einsum may round the last bit
    differently from the whole-corpus call: equal to fp32 rounding there."""
    assert torch.equal(result.indices, want[1])
    if exact:
        assert torch.equal(result.scores, want[0])
    else:
        torch.testing.assert_close(result.scores, want[0], rtol=2e-6, atol=2e-6)
    if corpus_ids is not None:
        expect = [[corpus_ids[j] for j in row] for row in want[1].tolist()]
        got = result.ids.tolist() if isinstance(result.ids, torch.Tensor) else result.ids
        assert got == expect


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("budget", [None, 60_000, 8_000])
def test_search_modes_equal_exhaustive(tmp_path, integer, budget):
    docs = random_docs(150, integer=integer)
    queries = random_docs(7, integer=integer)
    queries[0] = torch.randn(3, 8) if not integer else queries[0]
    want = sorted_topk(maxsim.maxsim_varlen(queries, docs), 25)
    ids = [f"doc-{j}" for j in range(150)]
    corpus = Corpus.from_list(docs, ids=ids)
    # Resident (CPU) corpus, in-memory search with small budgets (many chunks, query batches).
    assert_same(corpus.search(queries, 25, gpu_memory=budget, progress=False, device="cpu"), want, ids, integer)
    assert_same(corpus.search(queries, 25, gpu_memory=budget, batch_size=2, progress=False, device="cpu"), want, ids, integer)
    # Saved, then memory-mapped and read into memory.
    corpus.save(tmp_path / "c")
    for mmap in (True, False):
        loaded = Corpus.load(tmp_path / "c", mmap=mmap)
        assert loaded.is_mapped == mmap
        assert_same(loaded.search(queries, 25, gpu_memory=budget, progress=False, device="cpu"), want, ids, integer)


def test_padded_and_numpy_constructors(tmp_path):
    D = torch.randn(40, 6, 8)
    d_mask = torch.rand(40, 6) > 0.3
    Q, q_mask = torch.randn(3, 4, 8), torch.rand(3, 4) > 0.2
    want = sorted_topk(maxsim.maxsim(Q, D, q_mask, d_mask), 9)
    for corpus in (Corpus.from_padded(D, d_mask), Corpus.from_padded(D.numpy(), d_mask.numpy().astype(np.int64))):
        r = corpus.search(Q, 9, q_mask=q_mask, progress=False, device="cpu")
        # Packed scoring of the same real tokens; exact on integer inputs, fp32-close here.
        assert torch.equal(r.indices, want[1]) and torch.allclose(r.scores, want[0], atol=1e-5)
        assert torch.equal(r.ids, want[1])  # default ids 0 .. N-1
    packed, cu, _ = maxsim.padded_to_packed(D, d_mask)
    corpus = Corpus(packed.numpy(), cu.numpy())
    assert corpus.num_documents == 40 and corpus.num_tokens == int(d_mask.sum())


def test_bf16_and_append_round_trip(tmp_path):
    docs = random_docs(30, dtype=torch.bfloat16, integer=True)
    more = random_docs(20, dtype=torch.bfloat16, integer=True)
    queries = random_docs(4, dtype=torch.bfloat16, integer=True)
    Corpus.from_list(docs).save(tmp_path / "c")
    Corpus.from_list(more, ids=list(range(30, 50))).save(tmp_path / "c", append=True)
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.dtype == torch.bfloat16 and len(loaded.segments) == 2 and len(loaded) == 50
    want = sorted_topk(maxsim.maxsim_varlen(queries, docs + more), 50)
    assert_same(loaded.search(queries, 50, gpu_memory=20_000, progress=False, device="cpu"), want, list(range(50)))
    # In-memory append gives the same corpus.
    mem = Corpus.from_list(docs).append(more)
    assert_same(mem.search(queries, 50, progress=False, device="cpu"), want, list(range(50)))
    assert torch.equal(loaded.embeddings, mem.embeddings)


def test_interrupted_append_keeps_the_corpus(tmp_path, monkeypatch):
    docs = random_docs(20)
    queries = random_docs(3)
    Corpus.from_list(docs, ids=[f"a{j}" for j in range(20)]).save(tmp_path / "c")
    before = Corpus.load(tmp_path / "c").search(queries, 5, progress=False, device="cpu")

    calls = {"n": 0}
    real = corpus_format._write_array

    def dies_midway(path, array):  # the second file of the segment: a crash mid-write
        calls["n"] += 1
        if calls["n"] == 2:
            with open(path.with_name(path.name + ".tmp"), "wb") as f:
                f.write(b"\x93NUMPY partial")
            raise KeyboardInterrupt
        real(path, array)

    monkeypatch.setattr(corpus_format, "_write_array", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        Corpus.from_list(random_docs(5), ids=[f"b{j}" for j in range(5)]).save(tmp_path / "c", append=True)
    monkeypatch.setattr(corpus_format, "_write_array", real)

    def dies_before_commit(directory, manifest):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus_format, "_replace_manifest", dies_before_commit)
    with pytest.raises(KeyboardInterrupt):
        Corpus.from_list(random_docs(5), ids=[f"c{j}" for j in range(5)]).save(tmp_path / "c", append=True)
    monkeypatch.undo()

    after = Corpus.load(tmp_path / "c")  # orphans of both attempts do not matter
    assert len(after) == 20
    r = after.search(queries, 5, progress=False, device="cpu")
    assert torch.equal(r.indices, before.indices) and torch.equal(r.scores, before.scores) and r.ids == before.ids
    # The next append succeeds and removes the orphans.
    Corpus.from_list(random_docs(5), ids=[f"d{j}" for j in range(5)]).save(tmp_path / "c", append=True)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    listed = {f["name"] for s in manifest["segments"] for f in s["files"].values()} | {"manifest.json"}
    assert {p.name for p in (tmp_path / "c").iterdir()} == listed
    assert len(Corpus.load(tmp_path / "c")) == 25


def _embedding_file(directory: Path) -> Path:
    manifest = json.loads((directory / "manifest.json").read_text())
    return directory / manifest["segments"][0]["files"]["embeddings"]["name"]


def test_truncated_corrupted_and_newer_files(tmp_path):
    Corpus.from_list(random_docs(30)).save(tmp_path / "c")
    emb = _embedding_file(tmp_path / "c")
    data = emb.read_bytes()
    emb.write_bytes(data[:-7])
    with pytest.raises(ValueError, match=f"{emb.name}.*truncated"):
        Corpus.load(tmp_path / "c", verify=False)
    flipped = bytearray(data)
    flipped[len(data) - 3] ^= 0x10
    emb.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=f"{emb.name}.*corrupted"):
        Corpus.load(tmp_path / "c")
    emb.write_bytes(data)
    Corpus.load(tmp_path / "c")
    manifest_path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["version"] = corpus_format.FORMAT_VERSION + 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json.*newer format version"):
        Corpus.load(tmp_path / "c")
    manifest_path.write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is corrupted"):
        Corpus.load(tmp_path / "c")
    with pytest.raises(ValueError, match="not a corpus"):
        Corpus.load(tmp_path / "nothing")


def test_mismatched_queries_name_the_corpus(tmp_path):
    Corpus.from_list(random_docs(10)).save(tmp_path / "c")
    corpus = Corpus.load(tmp_path / "c")
    with pytest.raises(ValueError, match=f"d=4 but the corpus {tmp_path / 'c'} has d=8"):
        corpus.search(torch.randn(2, 3, 4), 3)
    from maxsim.search.stream import QueryDtypeWarning

    Q = torch.randn(2, 3, 8)
    with pytest.warns(QueryDtypeWarning, match=f"float16 queries converted to the float32 of the corpus {tmp_path / 'c'}"):
        got = corpus.search(Q.half(), 3)
    want = corpus.search(Q.half().float(), 3)  # the same values, in the corpus's dtype
    assert torch.equal(got.indices, want.indices) and torch.equal(got.scores, want.scores)
    with pytest.raises(TypeError, match="float64 but the corpus .* pass float16, bfloat16 or float32"):
        corpus.search(Q.double(), 3)
    with pytest.raises(ValueError, match="k must be at least 1"):
        corpus.search(torch.randn(2, 3, 8), 0)
    with pytest.raises(FileExistsError):
        corpus.save(tmp_path / "c")
    with pytest.raises(ValueError, match="d=4 .* d=8"):
        Corpus.from_list(random_docs(3, d=4)).save(tmp_path / "c", append=True)
    with pytest.raises(ValueError, match="already in corpus"):
        Corpus.from_list(random_docs(3)).save(tmp_path / "c", append=True)
    for repeated in (["a", "b", "a"], [0, 2, 2], np.array([3, 1, 3])):  # in order or not
        with pytest.raises(ValueError, match="unique"):
            Corpus.from_list(random_docs(3), ids=repeated)
    assert Corpus.from_list(random_docs(3), ids=np.array([9, 4, 7])).ids.tolist() == [9, 4, 7]


def test_plan_chunks_balanced_and_bounded():
    lengths = np.random.randint(0, 50, size=1000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    chunks = plan_chunks(offsets, 2000, 120)
    assert chunks[0][0] == 0 and chunks[-1][1] == 1000
    assert all(b == c for (_, b), (c, _) in zip(chunks[:-1], chunks[1:]))
    assert all(offsets[b] - offsets[a] <= 2000 and b - a <= 120 for a, b in chunks)
    with pytest.raises(ValueError, match="gpu_memory"):
        plan_chunks(offsets, 10, 120)


def test_shards_cover_the_corpus():
    corpus = Corpus.from_list(random_docs(37), ids=[str(j) for j in range(37)])
    for world in (1, 2, 3, 4):
        shards = [corpus.shard(r, world) for r in range(world)]
        assert [s.base_index for s in shards] == list(np.cumsum([0] + [len(s) for s in shards[:-1]]))
        assert sum(len(s) for s in shards) == 37
        assert torch.equal(torch.cat([s.embeddings for s in shards]), corpus.embeddings)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["pinned", "host", "mmap", "device"])
def test_gpu_streaming_equals_exhaustive(tmp_path, where):
    torch.manual_seed(0)
    docs = [torch.randn(int(n), 128, dtype=torch.float16) for n in torch.randint(1, 300, (6000,))]
    queries = [torch.randn(32, 128, dtype=torch.float16, device="cuda") for _ in range(16)]
    want = sorted_topk(maxsim.maxsim_varlen(queries, [x.cuda() for x in docs]), 100)
    corpus = place(Corpus.from_list(docs), where, tmp_path)
    r = search_within_budget(corpus, queries, 100, 64 << 20, where)
    assert torch.equal(r.indices.cpu(), want[1].cpu()) and torch.equal(r.scores.cpu(), want[0].cpu())


def test_progress_bar_and_ctrl_c(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    from maxsim.search import encodings

    docs, queries = random_docs(60, integer=True), random_docs(2, integer=True)
    corpus = Corpus.from_list(docs)
    want = sorted_topk(maxsim.maxsim_varlen(queries, docs), 5)
    assert_same(corpus.search(queries, 5, gpu_memory=3000, progress=True, device="cpu"), want)
    assert "maxsim search" in capsys.readouterr().err
    calls = {"n": 0}
    real = encodings.Float.score_chunk

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(encodings.Float, "score_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        corpus.search(queries, 5, gpu_memory=3000, progress=True, device="cpu")
    monkeypatch.undo()
    assert_same(corpus.search(queries, 5, gpu_memory=3000, progress=False, device="cpu"), want)
