"""precision="fp16x3": fp32 inputs as two-term fp16 splits on the tensor cores, both ways the
selection runs it: on chip in the fp32 kernels (maxsim._kernels.mma, few query rows per document
token) and as a copy through the 16-bit kernels (maxsim._split, many rows). Scores within fp32
accuracy of float64, the argmax of the IEEE path, the same gradients (the backward keeps the fp32
tensors), any magnitude, NaN kept to its own document, documents copied in groups."""

import pytest
import torch
import triton
import triton.language as tl

import maxsim
from conftest import KERNEL_DEVICE
from maxsim import _split
from maxsim._kernels import mma
from maxsim.dense import forward as dense_forward
from maxsim.tuning import tables as T

DEV = KERNEL_DEVICE


def _rel(got, exact):
    return float(((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max())


def _exact(Q, D, d_mask=None):
    sim = torch.einsum("asd,btd->abst", Q.double(), D.double())
    if d_mask is not None:
        sim = sim.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    return sim.amax(-1).sum(-1)


def _unit(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1).to(DEV)


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


@pytest.fixture(params=["on-chip", "copy"])
def way(request, monkeypatch):
    """Which of the two fp16x3 paths every call of the test takes (the row threshold moved)."""
    monkeypatch.setattr(T, "SPLIT16_MIN_ROWS", 10**9 if request.param == "on-chip" else 0)
    monkeypatch.setattr(T, "SPLIT16_MIN_PRODUCTS", 0)
    return request.param


def test_split_terms_rebuild_the_value_and_lay_out_per_side():
    x = torch.randn(5, 7, 24, device=DEV, dtype=torch.float32) * 3
    q3, kq = _split.split_fp16x3(x, document=False)
    d3, kd = _split.split_fp16x3(x, document=True)
    assert q3.shape == d3.shape == (5, 7, 72) and q3.dtype == torch.float16
    scale = 2.0 ** float(kq)
    assert float(kq) == float(kd) and 2**13 <= float(x.abs().max()) * scale < 2**14
    hi, lo = q3[..., :24].float(), q3[..., 24:48].float()  # queries: [hi, lo, hi]
    assert torch.equal(q3[..., 48:], q3[..., :24]) and torch.equal(d3[..., 48:], q3[..., :24])
    assert torch.equal(d3[..., 24:48], q3[..., :24]) and torch.equal(d3[..., :24], q3[..., 24:48])  # [lo, hi, hi]
    # hi + lo carries 22 bits, except where lo falls below fp16's normal range: there its
    # rounding is half the subnormal step, 2**-25 in scaled units (seed 55637769 has x = 2.4e-5).
    error = ((hi + lo) - x * scale).abs()  # scaled units
    bound = torch.clamp(2**-22 * (1 + 2**-11) * (x * scale).abs(), min=2**-25)
    assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("layout", ["cross", "candidates", "packed", "pairs"])
def test_fp16x3_scores_are_fp32_accurate_and_pick_the_ieee_argmax(layout, way):
    Q, D = _unit(3, 7, 40), _unit(6, 9, 40, seed=1)
    exact = _exact(Q, D)
    if layout == "cross":
        got, arg = maxsim.maxsim(Q, D, precision="fp16x3", return_argmax=True)
        _, want_arg = maxsim.maxsim(Q, D, precision="ieee", return_argmax=True)
        assert torch.equal(arg, want_arg)
    elif layout == "candidates":
        cands = D[:4].reshape(2, 2, 9, 40).expand(3, 2, 2, 9, 40).reshape(3, 4, 9, 40)
        got = maxsim.maxsim(Q, cands, precision="fp16x3")
        exact = exact[:, :4]
    elif layout == "packed":
        got = maxsim.maxsim_varlen(list(Q), [D[i, : 3 + i] for i in range(6)], precision="fp16x3")
        exact = torch.stack([_exact(Q, D[i: i + 1, : 3 + i])[:, 0] for i in range(6)], 1)
    else:
        q, cu_q, max_q = maxsim.pack(list(Q))
        d, cu_d, max_d = maxsim.pack(list(D))
        pq, pd = torch.tensor([0, 1, 2, 2], device=DEV), torch.tensor([5, 0, 3, 1], device=DEV)
        got = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_q, max_d, precision="fp16x3")
        exact = exact[pq.cpu(), pd.cpu()]
    assert _rel(got, exact.to(got.device)) <= 1e-6


@pytest.mark.parametrize("magnitude", [1e-35, 1e-6, 1e-3, 1e3, 1e6, 1e30])
def test_any_magnitude_keeps_the_accuracy(magnitude, way):
    # fp16 alone would overflow (> 65504) or flush to zero here: the per-tensor power of two fixes it
    # (at 1e-35 the exact 2^k would pass fp32's range: the scale stops at 2^126)
    Q, D = _unit(2, 5, 32) * magnitude, _unit(4, 6, 32, seed=2) * 7.0
    got = maxsim.maxsim(Q, D, precision="fp16x3")
    assert torch.isfinite(got).all()
    assert _rel(got, _exact(Q, D).to(got.device)) <= 1e-6


def test_normalize_and_masks_follow_the_ieee_path(way):
    Q, D = _unit(3, 6, 32) * 5, _unit(5, 8, 32, seed=3) * 0.2
    gen = torch.Generator().manual_seed(4)
    q_mask = (torch.rand(3, 6, generator=gen) > 0.3).to(DEV)
    d_mask = (torch.rand(5, 8, generator=gen) > 0.3).to(DEV)
    d_mask[:, 0] = True
    for mode in ("exclude", "multiply"):
        want = maxsim.maxsim(Q, D, q_mask, d_mask, normalize=True, mask_mode=mode, precision="ieee")
        got = maxsim.maxsim(Q, D, q_mask, d_mask, normalize=True, mask_mode=mode, precision="fp16x3")
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_nan_stays_in_its_own_document(way):
    Q, D = _unit(2, 5, 32), _unit(4, 6, 32, seed=5) * 9.0
    D[2, 3, 7] = float("nan")
    got = maxsim.maxsim(Q, D, precision="fp16x3")
    assert torch.isnan(got[:, 2]).all()
    keep = [0, 1, 3]
    assert _rel(got[:, keep], _exact(Q, D[keep]).to(got.device)) <= 1e-6


def test_documents_in_groups_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(T, "SPLIT16_MIN_ROWS", 0)  # the copy path
    monkeypatch.setattr(T, "SPLIT16_MIN_PRODUCTS", 0)
    Q, D = _unit(3, 5, 32), _unit(7, 6, 32, seed=6)
    whole, whole_arg = maxsim.maxsim(Q, D, precision="fp16x3", return_argmax=True)
    launches = []
    real = dense_forward.launch

    def count(kernel, *args, **kwargs):
        if kernel is dense_forward._maxsim_fwd_kernel:
            launches.append(1)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(dense_forward, "launch", count)
    monkeypatch.setattr(T, "SPLIT16_CHUNK_BYTES", 2 * 6 * 3 * 32 * 2)  # two documents a group
    parts, parts_arg = maxsim.maxsim(Q, D, precision="fp16x3", return_argmax=True)
    assert len(launches) == 4
    assert torch.equal(parts_arg, whole_arg)
    # each group has its own power of two; the scores agree to fp32 rounding of the sums
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=0)
    # the scratch bound is the larger of the floor and a fraction of the documents' bytes
    launches.clear()
    monkeypatch.setattr(T, "SPLIT16_CHUNK_BYTES", 1)
    monkeypatch.setattr(T, "SPLIT16_SCRATCH_FRACTION", (3 * 6 * 3 * 32 * 2) / (D.numel() * 4))  # three a group
    maxsim.maxsim(Q, D, precision="fp16x3")
    assert len(launches) == 3


def test_one_group_copy_is_alive_at_a_time(monkeypatch):
    """The bound is on the peak: each group's fp16 copy is freed before the next one is made (a
    copy held over a loop iteration doubled the fp32 searches' scratch on the H100)."""
    import weakref

    from maxsim.dense import ops

    monkeypatch.setattr(T, "SPLIT16_MIN_ROWS", 0)
    monkeypatch.setattr(T, "SPLIT16_MIN_PRODUCTS", 0)
    monkeypatch.setattr(T, "SPLIT16_CHUNK_BYTES", 2 * 6 * 3 * 32 * 2)  # two documents a group
    Q, D = _unit(3, 5, 32), _unit(7, 6, 32, seed=8)
    copies, alive_at_each_copy = [], []
    real = ops.split_fp16x3

    def tracked(x, *, document, normalize):
        if document:
            alive_at_each_copy.append(sum(ref() is not None for ref in copies))
        out = real(x, document=document, normalize=normalize)
        if document:
            copies.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(ops, "split_fp16x3", tracked)
    maxsim.maxsim(Q, D, precision="fp16x3")
    assert alive_at_each_copy == [0, 0, 0, 0]  # four groups, none outliving its launch


def test_split_scratch_is_bounded():
    """The copy never takes more than 256 MB or 5 % of the documents, whichever is larger; a packed
    call whose copy would pass it takes the on-chip split (no copy)."""
    from maxsim.selection.common import precision_choice

    assert T.split16_scratch_bytes(1 << 20) == 256 << 20
    assert T.split16_scratch_bytes(40 << 30) == 2 << 30
    values = 64 << 20  # 256 MB of fp32 documents: a 384 MB copy
    dot, why = precision_choice(torch.float32, "auto", "sm90", rows=4096, doc_values=values, packed=True)
    assert dot == "fp16x3" and "scratch limit" in why
    dot, _ = precision_choice(torch.float32, "auto", "sm90", rows=4096, doc_values=values // 4, packed=True)
    assert dot == "fp16x3-copy"


def test_gradients_are_the_ieee_paths(way):
    Q, D = _unit(3, 5, 32), _unit(4, 6, 32, seed=7)
    grads = {}
    for precision in ("ieee", "fp16x3"):
        q, d = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
        maxsim.maxsim(q, d, precision=precision).square().sum().backward()
        grads[precision] = (q.grad, d.grad)
    for a, b in zip(grads["ieee"], grads["fp16x3"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@triton.jit
def _mma_tile(q_ptr, d_ptr, out_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    o_m, o_n, o_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    b_q = tl.load(q_ptr + o_m[:, None] * BK + o_k[None, :])  # [BM, BK]
    b_d = tl.load(d_ptr + o_n[:, None] * BK + o_k[None, :])  # [BN, BK]
    b_s = mma(tl.zeros([BM, BN], dtype=tl.float32), b_q, b_d, "fp16x3")
    tl.store(out_ptr + o_m[:, None] * BN + o_n[None, :], b_s)


@pytest.mark.parametrize("bm, bn", [(32, 64), (16, 128), (64, 64)])
def test_both_orientations_of_the_on_chip_product(bm, bn):
    # Fewer than 64 query rows against 64+ tokens: document tokens are the product's rows, each
    # scaled from its L1 norm; otherwise query rows, scaled from their max. Rows of every
    # magnitude in one tile (each row keeps fp32 accuracy), a zero row, a NaN in one row only.
    gen = torch.Generator().manual_seed(bm + bn)
    Q = torch.randn(bm, 64, generator=gen) * torch.logspace(-6, 6, bm)[:, None]
    D = torch.randn(bn, 64, generator=gen) * torch.logspace(-30, 30, bn)[:, None]
    D[5] = 0.0
    D[9, 3] = float("nan")
    out = torch.empty(bm, bn, device=DEV)
    _mma_tile[(1,)](Q.to(DEV), D.to(DEV), out, bm, bn, 64)
    exact = Q.double() @ D.double().T  # [BM, BN]
    assert torch.isnan(out[:, 9]).all() and not torch.isnan(out[:, torch.arange(bn) != 9]).any()
    assert torch.equal(out[:, 5].cpu(), torch.zeros(bm))
    # fp32 accuracy against each dot's own scale (the sum of |q_k d_k|): cancellation aside
    scale = Q.double().abs() @ D.double().abs().T
    keep = torch.arange(bn) != 9
    err = ((out.cpu().double() - exact).abs() / scale.clamp_min(1e-300))[:, keep]
    assert float(err.max()) <= 2e-6


@pytest.mark.gpu
def test_gpu_fp16x3_on_a_training_and_a_rerank_shape(way):
    # In-batch training (64 x 64, masked) and one query against 1K and 256 documents, unit-norm
    # tokens. The tensor cores' accumulator truncates: with hi.hi summed first every product's steps
    # truncate at the score's magnitude, a bias of about 1e-6 (benchmarks/fp32_precision_emulation.py);
    # the small products first keep it near 2e-7, which the bound below tells apart.
    torch.manual_seed(0)
    for nq, nd, lq, ld in ((64, 64, 32, 180), (1, 1000, 32, 300), (1, 256, 32, 768)):
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda"), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda"), dim=-1)
        d_mask = torch.arange(ld, device="cuda")[None] < torch.randint(ld // 4, ld + 1, (nd, 1), device="cuda")
        sim = torch.einsum("asd,btd->abst", Q.double(), D.double()).masked_fill(~d_mask[None, :, None], -1e9)
        exact = sim.amax(-1).sum(-1)
        got, arg = maxsim.maxsim(Q, D, d_mask=d_mask, precision="fp16x3", return_argmax=True)
        _, want_arg = maxsim.maxsim(Q, D, d_mask=d_mask, precision="ieee", return_argmax=True)
        assert _rel(got, exact) <= 6e-7
        assert float((arg == want_arg).float().mean()) > 0.999  # (near-ties may differ in the last bit)
