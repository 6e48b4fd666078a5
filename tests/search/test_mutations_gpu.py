"""Corpora that change, searched on the GPU: deletes, subset= filters and compaction give the same
answer on CUDA as the exact oracle, for every encoding and wherever the corpus lives (on the
device, or streamed from host memory in chunks under a small ``gpu_memory``).

Tokens are small integers (see test_mutations). For fp32 and bfloat16 corpora every score is then
exact on the GPU as well and a search equals its oracle bit for bit. int8 and fp8 corpora quantise
each query token to the corpus's format on Hopper (``maxsim.selection.varlen.quantize_query``), so
their scores are not the oracle's: there the answer must equal that of a fresh corpus holding only
the documents that should be searched, scored the same way."""

import numpy as np
import pytest
import torch

from maxsim.search import Corpus
from placement import place
from test_mutations import assert_oracle, int_docs, int_queries, oracle, small_budget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENCODINGS = [None, "bfloat16", "int8", "fp8"]


def three_segments(encoding, tmp_path):
    """A saved corpus of three segments (20, 15, 25 documents), ids d0 .. d59, and its documents."""
    parts = [int_docs(n, encoding) for n in (20, 15, 25)]
    ids = [f"d{j}" for j in range(60)]
    Corpus.from_list(parts[0], ids=ids[:20], encoding=encoding).save(tmp_path / "c")
    Corpus.from_list(parts[1], ids=ids[20:35], encoding=encoding).save(tmp_path / "c", append=True)
    Corpus.from_list(parts[2], ids=ids[35:], encoding=encoding).save(tmp_path / "c", append=True)
    return Corpus.load(tmp_path / "c"), parts[0] + parts[1] + parts[2], ids


def cuda_search(corpus, queries, k, where, tmp_path, **kwargs):
    """corpus.search on CUDA with the corpus on the device or in pinned host memory (streamed under
    a budget of a few dozen documents); an ``mmap`` corpus is searched as loaded. Scores and
    positions come back on the CPU for the comparison."""
    if corpus.encoding.exact:
        queries = [q.to(corpus.dtype) for q in queries]
    budget = None if where == "device" else small_budget(queries, k)
    placed = place(corpus, where, tmp_path / "placed") if where != "mmap" else corpus
    result = placed.search(queries, k, gpu_memory=budget, progress=False, device="cuda", **kwargs)
    return result._replace(scores=result.scores.cpu(), indices=result.indices.cpu())


def assert_answer(result, queries, docs, ids, wanted, k, encoding):
    """``result`` equals the oracle over the ``wanted`` positions (exact encodings), or the answer
    of a fresh corpus of just those documents on the GPU (query-quantising encodings)."""
    if encoding not in ("int8", "fp8"):
        assert_oracle(result, oracle(queries, docs, wanted, k), ids)
        return
    kept = np.flatnonzero(wanted)
    if kept.size == 0:
        assert result.scores.shape == (len(queries), 0)
        return
    fresh = Corpus.from_list([docs[j] for j in kept], ids=[ids[j] for j in kept], encoding=encoding)
    want = fresh.to("cuda").search(queries, k, progress=False, device="cuda")
    assert torch.equal(result.scores, want.scores.cpu())
    assert result.ids == want.ids


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_deleted_documents_never_come_back_on_the_gpu(tmp_path, encoding, where):
    corpus, docs, ids = three_segments(encoding, tmp_path)
    queries = int_queries()
    gone = np.random.choice(60, size=int(np.random.randint(1, 50)), replace=False)
    corpus.delete([ids[j] for j in gone])
    live = corpus.live
    for k in (1, 7, int(live.sum()), 100):
        result = cuda_search(corpus, queries, k, where, tmp_path)
        assert_answer(result, queries, docs, ids, live, k, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_subset_on_the_gpu_equals_the_oracle_restricted_to_it(tmp_path, encoding):
    corpus, docs, ids = three_segments(encoding, tmp_path)
    queries = int_queries()
    gone = np.random.choice(60, size=10, replace=False)
    corpus.delete([ids[j] for j in gone])
    for size in (0, 1, 5, 40):
        chosen = np.random.choice(60, size=size, replace=False)
        candidates = np.zeros(60, dtype=bool)
        candidates[chosen] = True
        candidates[gone] = False
        for where in ("device", "pinned"):
            result = cuda_search(corpus, queries, 9, where, tmp_path, subset=[ids[j] for j in chosen])
            assert_answer(result, queries, docs, ids, candidates, 9, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_compacted_corpus_answers_the_same_on_the_gpu(tmp_path, encoding):
    corpus, docs, ids = three_segments(encoding, tmp_path)
    queries = int_queries()
    corpus.delete([ids[j] for j in np.random.choice(60, size=25, replace=False)])
    live = corpus.live
    kept = [x for x, alive in zip(ids, live) if alive]
    corpus.compact(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.ids == kept and loaded.num_deleted == 0
    live_docs = [d for d, alive in zip(docs, live) if alive]
    for where in ("device", "pinned", "mmap"):
        on_disk = Corpus.load(tmp_path / "c", mmap=True) if where == "mmap" else loaded
        result = cuda_search(on_disk, queries, 11, where, tmp_path)
        assert_answer(result, queries, live_docs, kept, np.ones(len(kept), dtype=bool), 11, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_device_corpus_pinned_is_the_same_corpus_in_host_memory(encoding):
    docs = int_docs(12, encoding)
    on_device = Corpus.from_list(docs, encoding=encoding).to("cuda")
    pinned = on_device.pin_memory()
    assert pinned.device.type == "cpu" and all(t.is_pinned() for s in pinned.segments for t in s.parts())
    for a, b in zip(on_device.segments, pinned.segments):
        for x, y in zip(a.parts(), b.parts()):
            assert x.dtype == y.dtype and torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))
    queries = int_queries()
    assert torch.equal(on_device.search(queries, 5, progress=False).indices.cpu(),
                       pinned.search(queries, 5, progress=False, device="cuda").indices.cpu())
