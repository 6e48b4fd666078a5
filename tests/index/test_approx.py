"""The fused PLAID approximate-score kernel against the PyTorch gather-and-scatter path.

Without a GPU the kernel runs in Triton's interpreter (MAXSIM_BACKEND=triton); the PyTorch path
(MAXSIM_BACKEND=reference) is the oracle.
"""

import pytest
import torch

from maxsim.compressed import ResidualCodec
from maxsim.index import PlaidIndex
from maxsim.index import search as plaid_search
from maxsim.index.approx import approx_scores_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _index(seed, num_docs=40, dim=32, num_centroids=24, code_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim, generator=g), dim=-1)
    codec = ResidualCodec(centroids, torch.linspace(-0.1, 0.1, 4), 2)
    lengths = torch.randint(0, 40, (num_docs,), generator=g)  # empty documents too
    lengths[3] = 0
    total = int(lengths.sum())
    codes = torch.randint(0, num_centroids, (total,), generator=g).to(code_dtype)
    residuals = torch.randint(0, 256, (total, dim // 4), generator=g, dtype=torch.uint8)
    ivf_lengths = torch.zeros(num_centroids, dtype=torch.int64)
    return PlaidIndex(format="test", path=None, codec=codec, codes=codes.to(DEVICE), residuals=residuals.to(DEVICE),
                      doc_lengths=lengths.to(DEVICE), ivf=torch.zeros(0, dtype=torch.int64, device=DEVICE),
                      ivf_lengths=ivf_lengths.to(DEVICE))


def _pairs(seed, num_queries, num_docs, count):
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randint(0, num_queries, (count,), generator=g)
    pids = torch.randint(0, num_docs, (count,), generator=g)
    order = torch.argsort(query * num_docs + pids)
    return query[order].to(DEVICE), pids[order].to(DEVICE)


@pytest.mark.parametrize("threshold", [None, 0.2])
@pytest.mark.parametrize("code_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("query_len", [5, 32])
def test_fused_equals_torch_path(monkeypatch, threshold, code_dtype, query_len):
    seed = 7 + query_len
    index = _index(seed, code_dtype=code_dtype)
    num_queries = 3
    g = torch.Generator().manual_seed(seed + 2)
    Q = torch.nn.functional.normalize(torch.randn(num_queries, query_len, index.codec.dim, generator=g), dim=-1)
    real = torch.rand(num_queries, query_len, generator=g) > 0.25
    real[:, 0] = True
    Q, real = Q.to(DEVICE), real.to(DEVICE)
    S = Q @ index.codec.centroids.to(DEVICE).T  # [Nq, Lq, C]
    query, pids = _pairs(seed, num_queries, len(index), 50)

    monkeypatch.setenv("MAXSIM_BACKEND", "reference")
    expected = plaid_search._approx_scores(index, S, real, query, pids, threshold)
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    calls = []
    real_fused = plaid_search.approx_scores_fused
    monkeypatch.setattr(plaid_search, "approx_scores_fused", lambda *a: calls.append(1) or real_fused(*a))
    got = plaid_search._approx_scores(index, S, real, query, pids, threshold)
    assert calls and got.shape == (50,)
    # the same maxima of the same fp32 numbers, summed in another order
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    empty = pids == 3  # a document with no tokens: every real query token scores -9999
    if bool(empty.any()):
        assert torch.equal(got[empty], -9999.0 * real.sum(1)[query[empty]].float())


def test_declines_where_it_cannot_run(monkeypatch):
    index = _index(3)
    monkeypatch.setenv("MAXSIM_BACKEND", "reference")
    by_code = torch.zeros(1, 24, 4, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert approx_scores_fused(by_code, None, index.codes, index.cu_seqlens[:-1], index.doc_lengths, one, one,
                               torch.ones(1, 4, dtype=torch.bool, device=DEVICE)) is None
