"""The PyTorch reference against the independent float64 oracle, rule by rule (CPU)."""

import math

import pytest
import torch

import maxsim
from maxsim.reference import maxsim_reference
from oracle import oracle, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def check(Q, D, q_mask=None, d_mask=None, tol=1e-5, **kw):
    scores, arg = maxsim_reference(Q, D, q_mask, d_mask, return_argmax=True, **kw)
    ref, ref_arg = oracle(Q, D, q_mask, d_mask, **kw)
    err = rel_err(scores, ref)
    print(f"rel err {err:.2e}")
    assert scores.dtype == torch.float32
    assert err <= tol
    assert torch.equal(arg.long(), ref_arg)
    return scores


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nd,lq,ld,d", [(3, 4, 5, 7, 16), (2, 3, 1, 1, 8), (1, 5, 13, 31, 24)])
def test_cross_product_matches_oracle(dtype, nq, nd, lq, ld, d):
    check(rand(nq, lq, d, dtype=dtype), rand(nd, ld, d, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_candidate_layout_matches_oracle(dtype):
    check(rand(3, 6, 16, dtype=dtype), rand(3, 4, 9, 16, dtype=dtype))


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("normalize", [False, True])
def test_masks_with_holes_and_empty_rows(mask_mode, normalize):
    Q, D = rand(4, 8, 16), rand(5, 11, 16)
    q_mask = torch.rand(4, 8) > 0.4
    d_mask = torch.rand(5, 11) > 0.5
    q_mask[1] = False  # a query with no real token
    d_mask[2] = False  # a document with no real token
    scores = check(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=normalize)
    assert torch.all(scores[1] == 0)
    if mask_mode == "exclude":
        assert torch.all(scores[:, 2] == 0)


def test_masked_tokens_never_win_even_when_large():
    Q = rand(2, 4, 8).abs()
    D = rand(3, 6, 8).abs()
    D[:, 0] = 100.0  # huge but masked out
    d_mask = torch.ones(3, 6, dtype=torch.bool)
    d_mask[:, 0] = False
    scores = check(Q, D, None, d_mask)
    assert float(scores.max()) < 100.0


def test_multiply_mode_is_pylate():
    # PyLate: scores * q_mask * d_mask, then max over doc tokens, then sum.
    Q, D = rand(3, 5, 16), rand(4, 7, 16)
    q_mask = torch.rand(3, 5) > 0.3
    d_mask = torch.rand(4, 7) > 0.3
    S = torch.einsum("ash,bth->abst", Q, D) * q_mask[:, None, :, None] * d_mask[None, :, None, :]
    pylate = S.max(-1).values.sum(-1)
    out = maxsim_reference(Q, D, q_mask, d_mask, mask_mode="multiply")
    torch.testing.assert_close(out, pylate, rtol=1e-5, atol=1e-5)


def test_empty_sets_give_zero_scores():
    for nq, nd, lq, ld in [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)]:
        out = maxsim_reference(rand(nq, lq, 8), rand(nd, ld, 8))
        assert out.shape == (nq, nd)
        assert torch.all(out == 0)


def test_nan_propagates_and_masked_nan_does_not():
    Q, D = rand(2, 3, 8), rand(3, 4, 8)
    D[1, 2, 5] = math.nan
    out = maxsim_reference(Q, D)
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, [0, 2]]).any()
    d_mask = torch.ones(3, 4, dtype=torch.bool)
    d_mask[1, 2] = False
    assert not torch.isnan(maxsim_reference(Q, D, None, d_mask)).any()
    Q[0, 1, 0] = math.nan
    q_mask = torch.ones(2, 3, dtype=torch.bool)
    q_mask[0, 1] = False
    assert not torch.isnan(maxsim_reference(Q, D, q_mask, d_mask)).any()


def test_ties_go_to_lowest_index():
    Q = rand(2, 3, 8)
    D = rand(2, 6, 8)
    D[:, 4] = D[:, 1]  # exact duplicate tokens: same similarity at t=1 and t=4
    D[:, 5] = D[:, 1]
    _, arg = maxsim_reference(Q, D, return_argmax=True)
    _, ref_arg = oracle(Q, D)
    assert torch.equal(arg.long(), ref_arg)
    assert not torch.any((arg == 4) | (arg == 5))


def test_two_d_inputs():
    q, doc = rand(5, 16), rand(7, 16)
    Q, D = rand(3, 5, 16), rand(4, 7, 16)
    assert maxsim_reference(q, doc).shape == ()
    assert maxsim_reference(q, D).shape == (4,)
    assert maxsim_reference(Q, doc).shape == (3,)
    torch.testing.assert_close(maxsim_reference(q, D), maxsim_reference(q[None], D)[0])
    torch.testing.assert_close(maxsim_reference(Q, doc), maxsim_reference(Q, doc[None])[:, 0])


def test_float_masks_accepted_as_bool():
    Q, D = rand(2, 5, 8), rand(3, 6, 8)
    qb = torch.rand(2, 5) > 0.5
    db = torch.rand(3, 6) > 0.5
    a = maxsim_reference(Q, D, qb, db)
    b = maxsim_reference(Q, D, qb.float(), db.long())
    assert torch.equal(a, b)


def test_chunking_bounds_memory_without_changing_results():
    Q, D = rand(9, 17, 16), rand(23, 29, 16)
    q_mask = torch.rand(9, 17) > 0.2
    big = maxsim_reference(Q, D, q_mask, return_argmax=True)
    # A budget of a few KB forces chunks over queries, documents and query tokens.
    small = maxsim_reference(Q, D, q_mask, return_argmax=True, max_chunk_bytes=4096)
    torch.testing.assert_close(small[0], big[0], rtol=1e-6, atol=1e-5)
    assert small[1].shape == big[1].shape == (9, 23, 17)  # [Nq, Nd, Lq]: the winning document token
    assert torch.equal(small[1] < 0, big[1] < 0)  # -1: a masked query token, in both
    # Chunks round the products apart by an ulp, so two document tokens within rounding of each
    # other may swap as the winner; a winner that differs must be such a near-tie (float64 products).
    differ = small[1] != big[1]
    sim = torch.einsum("qid,njd->qnij", Q.double(), D.double())  # [Nq, Nd, Lq, Ld]
    def winner(argmax):  # [Nq, Nd, Lq]: the float64 product of each winning document token
        return sim.gather(-1, argmax.clamp(min=0).long()[..., None])[..., 0]

    torch.testing.assert_close(winner(small[1])[differ], winner(big[1])[differ], rtol=0, atol=1e-5)
    assert int(differ.sum()) <= 2


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("candidates", [False, True])
def test_float64_products_match_the_float64_oracle(mask_mode, candidates):
    # dtype=torch.float64: what an fp32 kernel's error is measured against. Within float64
    # rounding of the oracle (the fp32 reference is ~1e-7 off), in chunks of a few KB too.
    Q = rand(3, 17, 24)
    D = rand(3, 5, 29, 24) if candidates else rand(7, 29, 24)
    q_mask = torch.rand(3, 17) > 0.2
    d_mask = torch.rand(*D.shape[:-1]) > 0.3
    want = oracle(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=True)[0]
    for budget in (None, 4096):
        got, arg = maxsim_reference(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=True, return_argmax=True,
                                    dtype=torch.float64, max_chunk_bytes=budget)
        assert got.dtype == torch.float64
        assert rel_err(got, want) < 1e-13
        assert torch.equal(arg.long(), oracle(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=True)[1])
    fp32 = maxsim_reference(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=True)
    assert fp32.dtype == torch.float32 and 0 < rel_err(fp32, want) < 1e-6


def test_a_compute_dtype_other_than_fp32_or_float64_is_named():
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.float64, got torch.float16"):
        maxsim_reference(rand(1, 2, 8), rand(1, 3, 8), dtype=torch.float16)


def test_differentiable_through_autograd():
    Q = rand(2, 4, 8).requires_grad_()
    D = rand(3, 5, 8).requires_grad_()
    maxsim_reference(Q, D).sum().backward()
    assert Q.grad is not None and D.grad is not None and Q.grad.abs().sum() > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's behaviour")
def test_warmup_on_a_machine_without_cuda():
    # Nothing to compile: the default returns at once; asking for CUDA says why it cannot.
    assert maxsim.warmup() == 0
    with pytest.raises(RuntimeError, match="no CUDA device"):
        maxsim.warmup(device="cuda")


def test_warmup_runs_every_combination():
    import maxsim

    n = maxsim.warmup(query_lengths=(8, 32), num_queries=(1, 3), dims=(16,), dtypes=(torch.float32,), device="cpu")
    assert n == 2 * 2 * 2  # x masks (False, True)


@pytest.mark.parametrize("nq,candidates", [(1, False), (3, False), (5, True)])
def test_warmup_reaches_every_corpus_class(nq, candidates):
    # The document sets a CUDA warm-up scores: one tiny, then one at the first size of each
    # larger class, so the rule picks each class's configuration (and nothing on the CPU).
    from maxsim.tuning import is_big_corpus
    from maxsim.tuning.tables import BIG_CORPUS_TOKENS, WS_ONE_BLOCK_MIN_TOKENS
    from maxsim.warmup import _document_sets

    def warp_specialize_pays(tokens):  # one 128-token query's class
        return tokens >= WS_ONE_BLOCK_MIN_TOKENS

    def tokens(D):
        return D.shape[:-1].numel()

    assert len(list(_document_sets(nq, 16, torch.float16, candidates, "cpu", corpus_classes=False))) == 1
    tiny, big, one_query_ws = _document_sets(nq, 16, torch.float16, candidates, "cpu", corpus_classes=True)
    assert tiny.shape[:-3] == big.shape[:-3] == ((nq,) if candidates else ())
    assert not is_big_corpus(tokens(tiny)) and not warp_specialize_pays(tokens(tiny))
    assert is_big_corpus(tokens(big)) and not warp_specialize_pays(tokens(big))
    assert warp_specialize_pays(tokens(one_query_ws))
    for D, threshold in [(big, BIG_CORPUS_TOKENS), (one_query_ws, WS_ONE_BLOCK_MIN_TOKENS)]:
        assert threshold <= tokens(D) < threshold + tokens(D[..., :1, :, :])  # the smallest such set
