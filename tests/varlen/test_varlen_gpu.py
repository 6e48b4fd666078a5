"""GPU tier: a million pairs in one call, no recompilation across sizes, real length mixes."""

import pytest
import torch

import maxsim
from maxsim.varlen.forward import _maxsim_pairs_kernel
from oracle import grad_step, rel_err

pytestmark = pytest.mark.gpu


def random_packed(n, lo, hi, dim=128, dtype=torch.float16):
    lengths = torch.randint(lo, hi + 1, (n,))
    cu = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    x = torch.randn(int(cu[-1]), dim, device="cuda", dtype=dtype)
    return x, cu.cuda(), int(lengths.max())


def compiled_variants():
    return sum(len(c[0]) for c in _maxsim_pairs_kernel.device_caches.values())


def test_million_pairs_one_call_matches_padded_dense():
    q, cu_q, mq = random_packed(1000, 20, 32)
    d, cu_d, md = random_packed(5000, 30, 300)
    P = 1_000_000
    pq = torch.randint(0, 1000, (P,), device="cuda")
    pd = torch.randint(0, 5000, (P,), device="cuda")
    maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq[:10], pd[:10], max_seqlen_q=mq, max_seqlen_d=md)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host synchronisation inside the call raises
    try:
        scores = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    Qp, qm = maxsim.packed_to_padded(q, cu_q, mq)
    Dp, dm = maxsim.packed_to_padded(d, cu_d, md)
    full = maxsim.maxsim(Qp, Dp, qm, dm)  # [1000, 5000]
    assert scores.shape == (P,)
    assert rel_err(scores, full[pq, pd]) < 1e-5


def test_cross_product_matches_padded_dense():
    q, cu_q, mq = random_packed(37, 1, 64, dtype=torch.bfloat16)
    d, cu_d, md = random_packed(500, 0, 512, dtype=torch.bfloat16)
    out = maxsim.maxsim_varlen(q, d, cu_q, cu_d)
    Qp, qm = maxsim.packed_to_padded(q, cu_q, mq)
    Dp, dm = maxsim.packed_to_padded(d, cu_d, md)
    assert rel_err(out, maxsim.maxsim(Qp, Dp, qm, dm)) < 1e-5


def test_no_recompilation_across_sizes():
    q, cu_q, _ = random_packed(64, 20, 32)
    d, cu_d, _ = random_packed(2000, 10, 300)
    maxsim.score_pairs_packed(q, d, cu_q, cu_d, torch.zeros(5, dtype=torch.int64, device="cuda"),
                              torch.zeros(5, dtype=torch.int64, device="cuda"), max_seqlen_q=32, max_seqlen_d=300)
    before = compiled_variants()
    for P in (1, 17, 1000, 123_457):
        pq = torch.randint(0, 64, (P,), device="cuda")
        pd = torch.randint(0, 2000, (P,), device="cuda")
        maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=32, max_seqlen_d=300)
    torch.cuda.synchronize()
    assert compiled_variants() == before


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_gradients_real_shape(backward):
    q, cu_q, mq = random_packed(32, 1, 32, dtype=torch.bfloat16)
    d, cu_d, md = random_packed(300, 0, 512, dtype=torch.bfloat16)

    def grads(fn):
        return grad_step(lambda qq, dd, _qm, _dm: fn(qq, dd), q, d)

    def padded(qq, dd):
        Qp, qm = maxsim.packed_to_padded(qq, cu_q, mq)
        Dp, dm = maxsim.packed_to_padded(dd, cu_d, md)
        return maxsim.maxsim(Qp, Dp, qm, dm, backward=backward)

    a = grads(lambda qq, dd: maxsim.maxsim_varlen(qq, dd, cu_q, cu_d, mq, md, backward=backward))
    b = grads(padded)
    assert rel_err(a[0], b[0]) < 1e-5 and rel_err(a[1], b[1]) < 2e-2 and rel_err(a[2], b[2]) < 2e-2
