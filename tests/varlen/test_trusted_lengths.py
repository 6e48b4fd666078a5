"""The trusted path (both max lengths given, nothing read on the host): every output whose
sequence or pair is invalid is NaN, on every backend; the others are exact. Without max lengths,
or with validate=True / maxsim.varlen.ops.check_packed, the same inputs raise clear errors."""

import pytest
import torch

import maxsim
from conftest import HAS_CUDA, KERNEL_DEVICE
from maxsim.reference import maxsim_reference
from maxsim.varlen.ops import check_packed
from oracle import rel_err

BACKENDS = ["triton", "cpu", "reference"]
NAN = float("nan")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", request.param)
    return request.param


def device_for(backend):
    return KERNEL_DEVICE if backend == "triton" else "cpu"


def _expected_on_gpu(q, d, cu_q, cu_d, rows, max_q, max_d):
    """The same rule for CUDA inputs, in float64 on the GPU: each valid query against every valid
    document at once (the documents gathered into a padded [Nd, L, d] view), one query at a time."""
    Nq, Nd = len(cu_q) - 1, len(cu_d) - 1
    docs = [rows(d, cu_d, j, max_d) for j in range(Nd)]
    valid = torch.tensor([x is not None for x in docs])
    lengths = torch.tensor([0 if x is None else len(x) for x in docs])
    width = max(1, int(lengths.max()))
    padded = torch.zeros(Nd, width, d.shape[1], dtype=torch.float64, device=d.device)  # [Nd, L, d]
    for j, x in enumerate(docs):
        if x is not None and len(x):
            padded[j, :len(x)] = x.double()
    real = (torch.arange(width)[None, :] < lengths[:, None]).to(d.device)  # [Nd, L]
    out = torch.full((Nq, Nd), NAN)
    for i in range(Nq):
        qi = rows(q, cu_q, i, max_q)
        if qi is None:
            continue
        if len(qi) == 0:
            out[i] = torch.where(valid, 0.0, NAN)
            continue
        sims = torch.einsum("sd,jtd->jst", qi.double(), padded)  # [Nd, Lq, L]
        best = sims.masked_fill(~real[:, None, :], float("-inf")).amax(-1)  # [Nd, Lq]
        score = torch.where(lengths.to(d.device) > 0, best.sum(-1), 0.0).float().cpu()
        out[i] = torch.where(valid, score, NAN)
    return out


def expected_scores(q, d, cu_q, cu_d, max_q, max_d, pairs=None):
    """Per (query, document): the reference on the sequences' rows, NaN where the query or the
    document lies outside the data, has decreasing offsets or passes its max length."""
    def rows(x, cu, k, bound):
        lo, hi = int(cu[k]), int(cu[k + 1])
        if lo < 0 or hi < lo or hi > x.shape[0] or hi - lo > bound:
            return None
        return x[lo:hi].float()

    Nq, Nd = len(cu_q) - 1, len(cu_d) - 1
    if q.is_cuda:
        out = _expected_on_gpu(q.detach(), d.detach(), cu_q, cu_d, rows, max_q, max_d)
    else:
        q, d = q.detach().cpu(), d.detach().cpu()
        out = torch.full((Nq, Nd), NAN)
        for i in range(Nq):
            for j in range(Nd):
                qi, dj = rows(q, cu_q, i, max_q), rows(d, cu_d, j, max_d)
                if qi is not None and dj is not None:
                    out[i, j] = maxsim_reference(qi, dj) if len(qi) and len(dj) else 0.0
    if pairs is None:
        return out
    pq, pd = pairs
    res = torch.full((len(pq),), NAN)
    for p, (i, j) in enumerate(zip(pq.tolist(), pd.tolist())):
        if 0 <= i < Nq and 0 <= j < Nd:
            res[p] = out[i, j]
    return res


def packed(lengths, dim=16, device="cpu"):
    x = torch.randn(sum(lengths), dim, device=device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return x, cu.to(device)


def check(out, ref):
    assert out.shape == ref.shape
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(ref)), (out, ref)
    assert rel_err(out, ref) < 1e-5


def test_valid_inputs_are_exact(backend):
    dev = device_for(backend)
    q, cu_q = packed([5, 0, 9, 40], device=dev)
    d, cu_d = packed([7, 1, 0, 70, 33], device=dev)
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=40, max_seqlen_d=70)
    check(out, expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), 40, 70))


@pytest.mark.parametrize("case", ["decreasing", "past_end", "negative_start", "too_long"])
def test_bad_query_offsets_give_nan_rows(backend, case):
    dev = device_for(backend)
    q, cu_q = packed([5, 3, 9, 6], device=dev)  # cu_q = [0, 5, 8, 17, 23]
    d, cu_d = packed([7, 1, 20], device=dev)
    cu_q = cu_q.clone()
    max_q = 9
    if case == "decreasing":
        cu_q[2] = 2  # query 1 = rows 5:2, query 2 = rows 2:17 (15 > max_q: also invalid)
    elif case == "past_end":
        cu_q[4] = 40  # query 3 ends past the packed data
    elif case == "negative_start":
        cu_q[0] = -4  # query 0 starts before the data
    else:
        max_q = 6  # query 2 has 9 tokens: longer than the max given
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=max_q, max_seqlen_d=20)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), max_q, 20)
    assert torch.isnan(ref).any() and not torch.isnan(ref).all()
    check(out, ref)


@pytest.mark.parametrize("max_d", [3, 0, 19])
def test_documents_longer_than_max_seqlen_d_give_nan(backend, max_d):
    dev = device_for(backend)
    q, cu_q = packed([5, 12], device=dev)
    d, cu_d = packed([7, 0, 3, 20, 1], device=dev)
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=12, max_seqlen_d=max_d)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), 12, max_d)
    assert not torch.isnan(ref[:, 1]).any()  # the empty document fits any bound
    check(out, ref)


def test_document_offsets_past_the_data_and_decreasing(backend):
    dev = device_for(backend)
    q, cu_q = packed([4, 6], device=dev)
    d, cu_d = packed([5, 7, 9], device=dev)  # [0, 5, 12, 21]
    cu_d = cu_d.clone()
    cu_d[3] = 25  # document 2 runs past the data
    cu_d[1] = 13  # document 0 = 0:13 (longer than 12 allowed? no: 13 > max 12), document 1 = 13:12 decreasing
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=6, max_seqlen_d=12)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), 6, 12)
    assert torch.isnan(ref).all()
    check(out, ref)


def test_max_seqlen_q_zero_with_real_queries(backend):
    dev = device_for(backend)
    q, cu_q = packed([0, 3], device=dev)
    d, cu_d = packed([4], device=dev)
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=0, max_seqlen_d=4)
    assert out[0, 0].item() == 0.0 and torch.isnan(out[1, 0])


def test_pair_indices_out_of_range_or_negative_give_nan(backend):
    dev = device_for(backend)
    q, cu_q = packed([4, 6, 3], device=dev)
    d, cu_d = packed([5, 7], device=dev)
    pq = torch.tensor([0, -1, 2, 3, 1, 0, -7], device=dev)
    pd = torch.tensor([1, 0, -1, 0, 2, 0, 1], device=dev)
    out = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=6, max_seqlen_d=7)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), 6, 7, pairs=(pq.cpu(), pd.cpu()))
    assert ref.isnan().tolist() == [False, True, True, True, True, False, True]
    check(out, ref)


def test_pairs_with_invalid_sequences_give_nan(backend):
    dev = device_for(backend)
    q, cu_q = packed([4, 6, 3], device=dev)
    d, cu_d = packed([5, 7, 2], device=dev)
    cu_q = cu_q.clone()
    cu_q[2] = 3  # query 1 = 4:3 decreasing; query 2 = 3:13 (10 > max 6)
    pq = torch.tensor([0, 1, 2, 0, 0], device=dev)
    pd = torch.tensor([0, 0, 1, 2, 1], device=dev)
    out = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=6, max_seqlen_d=5)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), 6, 5, pairs=(pq.cpu(), pd.cpu()))
    assert ref.isnan().tolist() == [False, True, True, False, True]  # document 1 has 7 > 5 tokens
    check(out, ref)


def test_gradients_flow_to_valid_pairs_only(backend):
    dev = device_for(backend)
    q, cu_q = packed([4, 6], device=dev)
    d, cu_d = packed([5, 7], device=dev)
    pq = torch.tensor([0, -1, 1, 5], device=dev)
    pd = torch.tensor([1, 0, 0, 0], device=dev)
    qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
    out = maxsim.score_pairs_packed(qg, dg, cu_q, cu_d, pq, pd, max_seqlen_q=6, max_seqlen_d=7)
    assert out.isnan().tolist() == [False, True, False, True]
    out[~out.isnan()].sum().backward()
    # Against the valid pairs alone.
    qr, dr = q.clone().requires_grad_(), d.clone().requires_grad_()
    ref = maxsim.score_pairs_packed(qr, dr, cu_q, cu_d, pq[[0, 2]], pd[[0, 2]], max_seqlen_q=6, max_seqlen_d=7)
    ref.sum().backward()
    assert rel_err(qg.grad, qr.grad) < 1e-5 and rel_err(dg.grad, dr.grad) < 1e-5


def test_without_max_lengths_the_same_inputs_raise(backend):
    dev = device_for(backend)
    q, cu_q = packed([4, 6], device=dev)
    d, cu_d = packed([5, 7], device=dev)
    bad = cu_q.clone()
    bad[1] = 11
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        maxsim.maxsim_varlen(q, d, bad, cu_d)
    past = cu_d.clone()
    past[2] = 14
    with pytest.raises(ValueError, match="cu_seqlens_d must end at the packed length 12; got 14"):
        maxsim.maxsim_varlen(q, d, cu_q, past, max_seqlen_q=6)  # one max length: still checked
    with pytest.raises(ValueError, match="more than max_seqlen_d = 5"):
        maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=6, max_seqlen_d=5, validate=True)
    with pytest.raises(ValueError, match="more than max_seqlen_q = 3"):
        maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=3)
    pq, pd = torch.tensor([0, -1], device=dev), torch.tensor([1, 0], device=dev)
    with pytest.raises(ValueError, match=r"pair_q must index 0..1; got values in \[-1, 0\]"):
        maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=6, max_seqlen_d=7, validate=True)


def test_max_lengths_must_be_non_negative_ints():
    q, cu_q = packed([4, 6])
    d, cu_d = packed([5, 7])
    with pytest.raises(ValueError, match="max_seqlen_d must be >= 0; got -5"):
        maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=6, max_seqlen_d=-5)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int or None; got float"):
        maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=6.0, max_seqlen_d=7)
    with pytest.raises(TypeError, match="validate must be True or False"):
        maxsim.maxsim_varlen(q, d, cu_q, cu_d, validate="yes")


def test_check_packed_names_each_problem():
    q, cu_q = packed([4, 6])
    d, cu_d = packed([5, 7])
    assert check_packed(q, d, cu_q, cu_d, 6, 7) is None
    assert check_packed(q, d, cu_q, cu_d, 6, 7, torch.tensor([1]), torch.tensor([0])) is None
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0; got 1"):
        check_packed(q, d, torch.tensor([1, 4, 10]), cu_d, 6, 7)
    with pytest.raises(ValueError, match="sequence 1 of cu_seqlens_d has 7 tokens, more than max_seqlen_d = 6"):
        check_packed(q, d, cu_q, cu_d, 6, 6)
    with pytest.raises(ValueError, match=r"pair_d must index 0..1; got values in \[0, 2\]"):
        check_packed(q, d, cu_q, cu_d, 6, 7, torch.tensor([0, 1]), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="give both pair_q and pair_d"):
        check_packed(q, d, cu_q, cu_d, 6, 7, torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_trusted_misuse_at_real_shapes(monkeypatch, dtype):
    """Stacked short queries and chunked long ones, many tiles: invalid rows, columns and pairs
    are NaN, the rest matches the reference; nothing faults (compute-sanitizer would show a read)."""
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    gen = torch.Generator().manual_seed(0)
    q_len = torch.randint(1, 300, (64,), generator=gen).tolist()
    d_len = torch.randint(1, 600, (300,), generator=gen).tolist()
    q, cu_q = packed(q_len, dim=128, device="cuda")
    d, cu_d = packed(d_len, dim=128, device="cuda")
    q, d = q.to(dtype), d.to(dtype)
    cu_q, cu_d = cu_q.clone(), cu_d.clone()
    cu_q[10] = cu_q[9] - 1  # query 9 decreasing
    cu_q[-1] = q.shape[0] + 1000  # last query past the data
    cu_d[50] = cu_d[49] - 3
    cu_d[-1] = d.shape[0] + 7
    max_q, max_d = 200, 500  # shorter than some sequences: those are NaN too
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=max_q, max_seqlen_d=max_d)
    ref = expected_scores(q, d, cu_q.cpu(), cu_d.cpu(), max_q, max_d)
    torch.cuda.synchronize()
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(ref))
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    pq = torch.randint(-3, 70, (5000,), generator=gen).cuda()
    pd = torch.randint(-3, 310, (5000,), generator=gen).cuda()
    pairs = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=max_q, max_seqlen_d=max_d)
    ok = (pq >= 0) & (pq < 64) & (pd >= 0) & (pd < 300)
    ref_pairs = torch.where(ok.cpu(), ref[pq.clamp(0, 63).cpu(), pd.clamp(0, 299).cpu()], NAN)
    assert torch.equal(torch.isnan(pairs.cpu()), torch.isnan(ref_pairs))
    assert rel_err(pairs, ref_pairs) < (1e-5 if dtype == torch.float32 else 1e-2)
    qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
    for backward in ["unified", "lowmem"]:
        s = maxsim.score_pairs_packed(qg, dg, cu_q, cu_d, pq, pd, max_seqlen_q=max_q, max_seqlen_d=max_d,
                                      backward=backward)
        s[~s.isnan()].sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(qg.grad.float()).all() and torch.isfinite(dg.grad.float()).all()
