"""maxsim.chamfer_distance against an independent float64 oracle (tests/chamfer/chamfer_oracle.py)
and against its reference backend. Without a GPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import itertools

import pytest
import torch

from chamfer_oracle import loss64, nearest
from conftest import KERNEL_DEVICE
from maxsim.chamfer import chamfer_distance
from maxsim.selection import chamfer as select

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", request.param)
    return request.param


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def clouds(B, N, M, D, dtype=torch.float32, ragged=True):
    x = torch.randn(B, N, D).to(dtype).to(KERNEL_DEVICE)
    y = torch.randn(B, M, D).to(dtype).to(KERNEL_DEVICE)
    if not ragged:
        return x, y, None, None
    xl = torch.randint(0, N + 1, (B,))
    yl = torch.randint(0, M + 1, (B,))
    xl[0], yl[0] = N, M  # one full cloud
    return x, y, xl.to(KERNEL_DEVICE), yl.to(KERNEL_DEVICE)


def close(out, ref, rtol=1e-5):
    """Elementwise within rtol of the oracle's scale (NaN patterns equal)."""
    if isinstance(ref, tuple):
        assert isinstance(out, tuple) and len(out) == len(ref)
        for o, r in zip(out, ref):
            close(o, r, rtol)
        return
    out = out.detach().double().cpu()
    assert out.dtype == torch.float64 and out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    fin = ~torch.isnan(ref)
    scale = ref[fin].abs().max().item() if bool(fin.any()) else 0.0
    err = (out[fin] - ref[fin]).abs().max().item() if bool(fin.any()) else 0.0
    assert err <= rtol * scale + 1e-12, f"error {err:.3e} against scale {scale:.3e}"


REDUCTIONS = [(p, b) for p in ("mean", "sum", "max") for b in ("mean", "sum", None)] + [(None, None)]


@pytest.mark.parametrize("single", [False, True], ids=["both", "single"])
@pytest.mark.parametrize("norm", [2, 1])
@pytest.mark.parametrize("point_reduction,batch_reduction", REDUCTIONS, ids=[f"{p}-{b}" for p, b in REDUCTIONS])
def test_reductions(backend, point_reduction, batch_reduction, norm, single):
    x, y, xl, yl = clouds(3, 37, 21, 3)
    kw = dict(batch_reduction=batch_reduction, point_reduction=point_reduction, norm=norm, single_directional=single)
    loss, normals = chamfer_distance(x, y, xl, yl, **kw)
    ref, _ = loss64(x, y, xl, yl, **kw)
    assert normals is None
    close(loss, ref)


@pytest.mark.parametrize("abs_cosine", [True, False])
@pytest.mark.parametrize("point_reduction,batch_reduction", [("mean", "mean"), ("sum", None), (None, None)])
@pytest.mark.parametrize("weighted", [False, True])
def test_normals_and_weights(backend, abs_cosine, point_reduction, batch_reduction, weighted):
    x, y, xl, yl = clouds(3, 19, 23, 3)
    xn, yn = torch.randn_like(x), torch.randn_like(y)
    w = torch.rand(3, device=x.device) if weighted else None
    kw = dict(weights=w, batch_reduction=batch_reduction, point_reduction=point_reduction, abs_cosine=abs_cosine)
    loss, loss_n = chamfer_distance(x, y, xl, yl, xn, yn, **kw)
    ref, ref_n = loss64(x, y, xl, yl, xn, yn, **kw)
    close(loss, ref)
    close(loss_n, ref_n)


@pytest.mark.parametrize("batch_reduction", ["mean", "sum", None])
def test_zero_weights(backend, batch_reduction):
    x, y, xl, yl = clouds(2, 9, 8, 3)
    w = torch.zeros(2, device=x.device)
    loss, _ = chamfer_distance(x, y, xl, yl, weights=w, batch_reduction=batch_reduction)
    ref, _ = loss64(x, y, xl, yl, weights=w, batch_reduction=batch_reduction)
    close(loss, ref)
    assert float(loss.abs().sum()) == 0.0


# (B, N, M, D): one point, primes around the interpreter's 16-point tiles, D of the direct kernel
# and of the dot kernel (D > 16; 130 loops over three 64-wide chunks).
SHAPES = [(1, 1, 1, 3), (2, 15, 17, 3), (2, 33, 16, 1), (1, 40, 31, 7), (2, 18, 35, 40), (1, 21, 12, 130)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("norm", [2, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_nearest_against_float64(kernels, shape, norm, dtype):
    """Per-point distances and indices: each distance within a few fp32 ulps of the float64 one
    of the (rounded) input values, each index a true nearest neighbour."""
    B, N, M, D = shape
    x, y, xl, yl = clouds(B, N, M, D, dtype)
    dist, _, idx = chamfer_distance(x, y, xl, yl, point_reduction=None, batch_reduction=None, norm=norm,
                                    return_indices=True)
    for d_out, i_out, src, tgt, sl, tl_ in ((dist[0], idx[0], x, y, xl, yl), (dist[1], idx[1], y, x, yl, xl)):
        d_ref, i_ref = nearest(src, tgt, sl, tl_, norm)
        assert i_out.dtype == torch.int64 and i_out.shape == i_ref.shape
        assert torch.equal(i_out.cpu() < 0, i_ref < 0)
        # the distance of the kernel's winner, in float64: a minimum up to rounding
        sq = (src.double().cpu() ** 2).sum(-1)
        tg = (tgt.double().cpu() ** 2).sum(-1)
        dot_kernel = norm == 2 and D > 16
        slack = 1e-5 * (sq + tg.max(-1).values[:, None]) if dot_kernel else 1e-6 * d_ref
        won = nearest_at(src, tgt, i_out.cpu(), norm)
        assert bool((won - d_ref <= slack + 1e-12).all())
        assert bool(((d_out.double().cpu() - d_ref).abs() <= slack + 1e-12).all())


def nearest_at(src, tgt, idx, norm):
    """float64 distance from each source point to tgt[b, idx] (0 where idx is -1)."""
    B, S, D = src.shape
    g = torch.gather(tgt.double().cpu(), 1, idx.clamp_min(0)[..., None].expand(B, S, D)) if tgt.shape[1] else \
        torch.zeros(B, S, D, dtype=torch.float64)
    diff = src.double().cpu() - g
    d = diff.abs().sum(-1) if norm == 1 else (diff ** 2).sum(-1)
    return torch.where(idx >= 0, d, 0.0)


@pytest.mark.parametrize("D", [3, 24])
def test_ties_go_to_the_lowest_index(backend, D):
    """Integer coordinates in [-1, 1]: exact distances, many ties; the indices must match exactly."""
    x = torch.randint(-1, 2, (2, 30, D)).float().to(KERNEL_DEVICE)
    y = torch.randint(-1, 2, (2, 45, D)).float().to(KERNEL_DEVICE)
    y[:, 20:] = y[:, :25]  # duplicated points: every winner has a later twin
    for norm in (1, 2):
        dist, _, (ix, iy) = chamfer_distance(x, y, point_reduction=None, batch_reduction=None, norm=norm,
                                             return_indices=True)
        rx, jx = nearest(x, y, [30, 30], [45, 45], norm)
        ry, jy = nearest(y, x, [45, 45], [30, 30], norm)
        assert torch.equal(ix.cpu(), jx) and torch.equal(iy.cpu(), jy)
        assert torch.equal(dist[0].double().cpu(), rx) and torch.equal(dist[1].double().cpu(), ry)


def test_empty_and_tiny_clouds(backend):
    x, y, _, _ = clouds(4, 5, 6, 3)
    xl = torch.tensor([0, 1, 5, 0], device=x.device)
    yl = torch.tensor([6, 0, 1, 0], device=x.device)
    for pr, br in REDUCTIONS:
        loss, _, idx = chamfer_distance(x, y, xl, yl, point_reduction=pr, batch_reduction=br, return_indices=True)
        ref, _ = loss64(x, y, xl, yl, point_reduction=pr, batch_reduction=br)
        close(loss, ref)
    assert bool((idx[0][1] == -1).all()) and bool((idx[1][3] == -1).all())  # empty other cloud / padding
    # zero-size clouds and batches
    for shape_x, shape_y in (((2, 0, 3), (2, 4, 3)), ((2, 4, 3), (2, 0, 3)), ((0, 4, 3), (0, 5, 3))):
        a, b = torch.randn(*shape_x, device=x.device), torch.randn(*shape_y, device=x.device)
        loss, _ = chamfer_distance(a, b, batch_reduction="sum")
        assert float(loss) == 0.0


def test_nan_propagates(backend):
    """A NaN distance wins the min, at its lowest index (documented choice)."""
    x, y, _, _ = clouds(2, 20, 18, 3, ragged=False)
    x[0, 3, 1] = float("nan")
    y[1, 7, 0] = float("nan")
    y[1, 11, 2] = float("nan")
    dist, _, (ix, iy) = chamfer_distance(x, y, point_reduction=None, batch_reduction=None, return_indices=True)
    rx, jx = nearest(x, y, [20, 20], [18, 18], 2)
    ry, jy = nearest(y, x, [18, 18], [20, 20], 2)
    close(dist, (rx, ry), rtol=1e-6)
    assert torch.equal(ix.cpu(), jx) and torch.equal(iy.cpu(), jy)
    assert bool(torch.isnan(dist[0][1]).all()) and int(ix[1, 0]) == 7  # every x of cloud 1 sees y[1, 7]
    loss, _ = chamfer_distance(x, y)
    assert bool(torch.isnan(loss))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("norm", [2, 1])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("D,single", [(3, False), (3, True), (40, False)])
def test_gradients_against_float64_autograd(backend, dtype, norm, deterministic, D, single):
    x, y, xl, yl = clouds(2, 27, 19, D, dtype)
    xn, yn = torch.randn(2, 27, 3, device=x.device), torch.randn(2, 19, 3, device=x.device)
    w = torch.rand(2, device=x.device)
    kw = dict(weights=w, norm=norm, single_directional=single)
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    xns, yns = xn.clone().requires_grad_(), yn.clone().requires_grad_()
    loss, loss_n = chamfer_distance(xs, ys, xl, yl, xns, yns, deterministic=deterministic, **kw)
    (loss + 0.5 * loss_n).backward()
    x64, y64 = x.double().cpu().requires_grad_(), y.double().cpu().requires_grad_()
    xn64, yn64 = xn.double().cpu().requires_grad_(), yn.double().cpu().requires_grad_()
    ref, ref_n = loss64(x64, y64, xl, yl, xn64, yn64, **kw)
    (ref + 0.5 * ref_n).backward()
    # 16-bit gradients are rounded to the input dtype once
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    close(xs.grad, x64.grad, rtol)
    close(ys.grad, y64.grad, rtol)
    close(xns.grad, xn64.grad, 1e-5)
    close(yns.grad, yn64.grad, 1e-5)
    assert xs.grad.dtype == dtype and ys.grad.dtype == dtype


@pytest.mark.parametrize("point_reduction", [None, "max"])
def test_gradients_per_point_and_max(backend, point_reduction):
    x, y, xl, yl = clouds(2, 21, 30, 3)
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss, _ = chamfer_distance(xs, ys, xl, yl, point_reduction=point_reduction, batch_reduction=None)
    total = (loss[0].sum() * 2 + (loss[1] ** 2).sum()) if point_reduction is None else (loss * torch.arange(1.0, 3.0, device=loss.device)).sum()
    total.backward()
    x64, y64 = x.double().cpu().requires_grad_(), y.double().cpu().requires_grad_()
    ref, _ = loss64(x64, y64, xl, yl, point_reduction=point_reduction, batch_reduction=None)
    total64 = (ref[0].sum() * 2 + (ref[1] ** 2).sum()) if point_reduction is None else \
        (ref * torch.arange(1.0, 3.0, dtype=torch.float64)).sum()
    total64.backward()
    close(xs.grad, x64.grad)
    close(ys.grad, y64.grad)


def test_deterministic_backward_is_bitwise_repeatable(kernels):
    x, y, xl, yl = clouds(2, 40, 23, 3)
    y[:, 10:] = y[:, :13] * 0 + y[:, :1]  # many points share a winner: long entry lists
    grads = []
    for _ in range(2):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss, _ = chamfer_distance(xs, ys, xl, yl, deterministic=True)
        loss.backward()
        grads.append((xs.grad, ys.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    chamfer_distance(xs, ys, xl, yl)[0].backward()  # atomics: the same up to rounding
    torch.testing.assert_close(xs.grad, grads[0][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ys.grad, grads[0][1], rtol=1e-5, atol=1e-7)


def test_kernels_match_reference(monkeypatch):
    x, y, xl, yl = clouds(3, 29, 34, 3)
    out = {}
    for name in ("triton", "reference"):
        monkeypatch.setenv("MAXSIM_BACKEND", name)
        out[name] = chamfer_distance(x, y, xl, yl, point_reduction=None, batch_reduction=None, return_indices=True)
    assert torch.equal(out["triton"][2][0], out["reference"][2][0])
    assert torch.equal(out["triton"][2][1], out["reference"][2][1])
    torch.testing.assert_close(out["triton"][0], out["reference"][0], rtol=1e-6, atol=0)


def test_non_contiguous_inputs(kernels):
    base = torch.randn(2, 3, 25, device=KERNEL_DEVICE)
    x = base.transpose(1, 2)  # [2, 25, 3], stride 1 on N, not on D
    y = torch.randn(2, 6, 40, device=KERNEL_DEVICE)[:, :3].transpose(1, 2)  # [2, 40, 3]
    loss, _ = chamfer_distance(x, y)
    ref, _ = loss64(x, y)
    close(loss, ref)


def test_selection():
    x3 = torch.randn(1, 4, 3)
    x40 = torch.randn(1, 4, 40)
    assert select.forward_choice(x3, 2, True, family="sm90").kernel.name == "chamfer.direct_forward"
    assert select.forward_choice(x40, 2, True, family="sm90").kernel.name == "chamfer.dot_forward"
    one = select.forward_choice(x40, 1, True, family="sm90")
    assert one.kernel.name == "chamfer.direct_forward" and "not a dot product" in one.describe("forward")
    for family in ("sm90", "unmeasured", "interpreter"):
        c = select.forward_choice(x3.half(), 2, False, family=family)
        assert {"BM", "BN", "BK", "num_warps", "num_stages"} <= set(c.config)
    assert select.backward_choice(x3, True, family="sm90").kernel.name == "chamfer.owned_backward"
    assert select.backward_choice(x3, False, family="sm90").kernel.name == "chamfer.atomic_backward"


BAD = [
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.zeros(2, 5, 3, dtype=torch.float64)), TypeError, "x must be float16"),
    (dict(x=torch.zeros(5, 3)), ValueError, r"x must have shape \[B, P, D\]"),
    (dict(y=torch.zeros(3, 4, 3)), ValueError, "y must have shape"),
    (dict(y=torch.zeros(2, 4, 2)), ValueError, "y must have shape"),
    (dict(y=torch.zeros(2, 4, 3).half()), TypeError, "same dtype"),
    (dict(x=torch.zeros(2, 5, 0), y=torch.zeros(2, 4, 0)), ValueError, "at least 1"),
    (dict(x_lengths=torch.tensor([5, 6])), ValueError, r"x_lengths must lie in \[0, 5\]"),
    (dict(y_lengths=torch.tensor([-1, 2])), ValueError, "y_lengths must lie"),
    (dict(x_lengths=torch.tensor([5])), ValueError, r"x_lengths must have shape \[2\]"),
    (dict(x_lengths=torch.tensor([5.0, 1.0])), TypeError, "x_lengths must hold integers"),
    (dict(norm=3), ValueError, "norm must be 1"),
    (dict(batch_reduction="max"), ValueError, "batch_reduction must be one of"),
    (dict(point_reduction="median"), ValueError, "point_reduction must be one of"),
    (dict(point_reduction=None), ValueError, "batch_reduction must be None"),
    (dict(weights=torch.tensor([1.0, -1.0])), ValueError, "weights cannot be negative"),
    (dict(weights=torch.ones(3)), ValueError, r"weights must have shape \[2\]"),
    (dict(x_normals=torch.zeros(2, 5, 3)), ValueError, "go together"),
    (dict(x_normals=torch.zeros(2, 4, 3), y_normals=torch.zeros(2, 4, 3)), ValueError, "x_normals must have shape"),
    (dict(x_normals=torch.zeros(2, 5, 3), y_normals=torch.zeros(2, 4, 3), point_reduction="max"), ValueError,
     "normals must be None"),
    (dict(single_directional=1), TypeError, "single_directional must be True or False"),
    (dict(deterministic="yes"), TypeError, "deterministic must be True or False"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input(kwargs, error, match):
    args = dict(x=torch.randn(2, 5, 3), y=torch.randn(2, 4, 3))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        chamfer_distance(**args)


def test_every_argument_combination_small(kernels):
    """Every combination of the flags on one ragged batch, fp32, against the oracle."""
    x, y, xl, yl = clouds(2, 11, 9, 3)
    xn, yn = torch.randn_like(x), torch.randn_like(y)
    w = torch.rand(2, device=x.device)
    for norm, single, weighted, normals, (pr, br) in itertools.product((1, 2), (False, True), (False, True),
                                                                       (False, True), REDUCTIONS):
        if normals and pr == "max":
            continue
        kw = dict(norm=norm, single_directional=single, weights=w if weighted else None, point_reduction=pr,
                  batch_reduction=br)
        n = (xn, yn) if normals else (None, None)
        loss, loss_n = chamfer_distance(x, y, xl, yl, *n, **kw)
        ref, ref_n = loss64(x, y, xl, yl, *n, **kw)
        close(loss, ref)
        if normals:
            close(loss_n, ref_n)
        else:
            assert loss_n is None
