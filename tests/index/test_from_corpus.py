"""maxsim.index.from_corpus: a PLAID index over a residual maxsim.Corpus (its codes as they are,
the centroid -> passage lists built here), searched as a loaded index is."""

import numpy as np
import pytest
import torch

import maxsim
import maxsim.index
from maxsim.index import ivf as ivf_module


def _residual_corpus(num_docs=80, dim=32, nbits=2, num_centroids=16, ids=None, segments=1):
    lengths = torch.randint(0, 14, (num_docs,))
    lengths[0] = 0  # an empty passage owns no list entry
    x = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), dim), dim=-1)
    offsets = torch.zeros(num_docs + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    codec = maxsim.compressed.ResidualCodec.train(x, nbits, num_centroids=num_centroids)
    cut = num_docs // segments
    corpus = None
    for part in range(segments):
        lo, hi = part * cut, num_docs if part == segments - 1 else (part + 1) * cut
        tokens, offs = x[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo]
        part_ids = None if ids is None else ids[lo:hi]
        if corpus is None:
            corpus = maxsim.Corpus.from_packed(tokens, offs, part_ids, encoding=f"residual{nbits}", codec=codec)
        else:  # a new segment, encoded with the corpus's codec
            corpus.append((tokens, offs), ids=part_ids)
    return corpus, x, offsets


def _lists(codes, lengths, num_centroids):
    passage = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return [torch.unique(passage[codes.long() == c]) for c in range(num_centroids)]


@pytest.mark.parametrize("block", [None, 7])
def test_ivf_lists_every_passage_of_a_cell_once(monkeypatch, block):
    if block is not None:  # several key blocks, a passage split across two of them
        monkeypatch.setattr(ivf_module, "_KEY_BLOCK", block)
    lengths = torch.tensor([3, 0, 5, 1, 0, 4, 6])
    codes = torch.randint(0, 5, (int(lengths.sum()),), dtype=torch.int32)
    ivf, ivf_lengths = ivf_module.build_ivf(codes, lengths, 6)  # centroid 5 holds nothing
    want = _lists(codes, lengths, 6)
    assert ivf.dtype == torch.int32 and ivf_lengths.tolist() == [len(v) for v in want]
    assert torch.equal(ivf.long(), torch.cat(want))
    with pytest.raises(ValueError, match="add up to"):
        ivf_module.build_ivf(codes[:-1], lengths, 6)


@pytest.mark.parametrize("segments", [1, 3])
def test_index_of_a_corpus_holds_its_codes_and_searches_like_a_loaded_one(segments):
    corpus, x, offsets = _residual_corpus(segments=segments)
    index = maxsim.index.from_corpus(corpus)
    assert len(index) == len(corpus) and index.num_embeddings == corpus.num_tokens
    codes = torch.cat([s.embeddings for s in corpus.segments])
    assert torch.equal(index.codes, codes)
    assert torch.equal(index.residuals, torch.cat([s.residuals for s in corpus.segments]))
    lengths = torch.from_numpy(np.diff(corpus.offsets))
    assert torch.equal(index.ivf.long(), torch.cat(_lists(codes, lengths, 16)))
    if segments == 1:  # shared, not copied
        assert index.codes.data_ptr() == corpus.segments[0].embeddings.data_ptr()
    # every cell probed, nothing pruned: the exact stage scores every passage's decoded tokens, as
    # the exhaustive search of the same codes does
    Q = torch.nn.functional.normalize(torch.randn(3, 6, 32), dim=-1)
    everything = dict(ncells=16, centroid_score_threshold=None, ndocs=4 * len(corpus), decode_dtype=torch.float32)
    got = index.search(Q, 5, **everything)
    want = corpus.search(Q, 5, device="cpu")
    torch.testing.assert_close(got.scores, want.scores, atol=2e-3, rtol=0)
    assert (got.indices == want.indices).float().mean() >= 0.9  # near ties may swap under the other rounding
    # refined from the float tokens, the exact top-k
    full = maxsim.Corpus.from_packed(x, offsets)
    refined = index.search(Q, 5, refine=full, refine_factor=20, **everything)
    exact = full.search(Q, 5, device="cpu")
    assert torch.equal(refined.indices, exact.indices)
    torch.testing.assert_close(refined.scores, exact.scores, rtol=1e-5, atol=1e-5)
    # PLAID's own defaults give real answers from the lists built here
    default = index.search(Q, 5)
    assert bool((default.indices >= 0).all()) and bool((default.indices != 0).all())  # passage 0 is empty


def test_refine_gets_k_times_the_factor_candidates_from_the_default_settings(monkeypatch):
    # colbert-ai's k-10 defaults keep 64 passages for the exact stage: a search refined x 8 takes the
    # defaults of k 80 instead, so that the refine corpus sees 80 candidates a query
    corpus, x, offsets = _residual_corpus(num_docs=400, num_centroids=8)
    index = maxsim.index.from_corpus(corpus)
    full = maxsim.Corpus.from_packed(x, offsets)
    seen = []
    real_rerank = maxsim.Corpus.rerank

    def spy(self, Q, candidates, k, **kwargs):
        seen.append(candidates)
        return real_rerank(self, Q, candidates, k, **kwargs)

    monkeypatch.setattr(maxsim.Corpus, "rerank", spy)
    Q = torch.nn.functional.normalize(torch.randn(2, 6, 32), dim=-1)
    got = index.search(Q, 10, refine=full, refine_factor=8)
    assert seen[0].shape == (2, 80) and bool((seen[0] >= 0).all())
    assert got.indices.shape == (2, 10)


def test_results_carry_the_corpus_ids():
    ids = np.arange(80, dtype=np.int64) * 10 + 7
    corpus, _, _ = _residual_corpus(ids=ids)
    index = maxsim.index.from_corpus(corpus)
    Q = torch.nn.functional.normalize(torch.randn(2, 6, 32), dim=-1)
    got = index.search(Q, 4, ncells=16, centroid_score_threshold=None, ndocs=320)
    assert torch.equal(got.ids, torch.from_numpy(ids)[got.indices])
    one = index.search(Q[0], 4, ncells=16, centroid_score_threshold=None, ndocs=320)
    assert torch.equal(one.ids, torch.from_numpy(ids)[one.indices])
    names = [f"doc-{j}" for j in range(80)]
    corpus, _, _ = _residual_corpus(ids=names)
    got = maxsim.index.from_corpus(corpus).search(Q, 3, ncells=16, centroid_score_threshold=None, ndocs=320)
    assert got.ids == [[names[j] for j in row] for row in got.indices.tolist()]


def test_refuses_what_it_cannot_index():
    x = torch.nn.functional.normalize(torch.randn(40, 32), dim=-1)
    offsets = torch.tensor([0, 10, 25, 40])
    with pytest.raises(ValueError, match="residual2' or 'residual4"):
        maxsim.index.from_corpus(maxsim.Corpus.from_packed(x, offsets, encoding="int8"))
    corpus, _, _ = _residual_corpus()
    corpus.delete([3])
    with pytest.raises(ValueError, match="compact"):
        maxsim.index.from_corpus(corpus)


def test_a_join_that_does_not_fit_names_the_ways_out(monkeypatch):
    corpus, _, _ = _residual_corpus(segments=3)

    def no_room(shape, dtype, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    monkeypatch.setattr(ivf_module, "_allocate", no_room)
    with pytest.raises(MemoryError, match=r"3 segments needs .*expandable_segments:True.*corpus\.to\('cpu'\)"):
        maxsim.index.from_corpus(corpus)
    one, _, _ = _residual_corpus(segments=1)  # nothing to join: its codes are shared, no allocation
    assert maxsim.index.from_corpus(one).codes.data_ptr() == one.segments[0].embeddings.data_ptr()


@pytest.mark.gpu
def test_gpu_index_of_a_corpus_matches_cpu():
    corpus, _, _ = _residual_corpus(num_docs=400, dim=128, num_centroids=64)
    cpu = maxsim.index.from_corpus(corpus)
    gpu = maxsim.index.from_corpus(corpus, device="cuda")
    assert gpu.codes.is_cuda and torch.equal(gpu.ivf.cpu(), cpu.ivf) and torch.equal(gpu.ivf_lengths.cpu(), cpu.ivf_lengths)
    Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1)
    want = cpu.search(Q, 10, decode_dtype=torch.float16)
    got = gpu.search(Q.cuda().half(), 10)
    torch.testing.assert_close(got.scores.cpu(), want.scores, atol=2e-3, rtol=0)
    assert (got.indices.cpu() == want.indices).float().mean() >= 0.9
