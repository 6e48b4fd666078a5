"""GPU tier: maxsim.chamfer_distance at real shapes against float64 (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from maxsim.chamfer import chamfer_distance

pytestmark = pytest.mark.gpu


def nearest64(src: torch.Tensor, tgt: torch.Tensor, norm: int = 2, chunk: int = 2048):
    """float64 nearest-neighbour distances [S] of src [S, D] in tgt [T, D], on the GPU, chunked,
    by direct differences (no matmul cancellation)."""
    tgt = tgt.double()
    out = torch.empty(src.shape[0], dtype=torch.float64, device=src.device)
    for s0 in range(0, src.shape[0], chunk):
        s = src[s0:s0 + chunk].double()
        if norm == 1:
            d = torch.cdist(s, tgt, p=1)
        else:
            d = torch.cdist(s, tgt, compute_mode="donot_use_mm_for_euclid_dist") ** 2
        out[s0:s0 + chunk] = d.min(1).values
    return out


def check_cloud(dist, idx, src, tgt, norm, rtol):
    ref = nearest64(src, tgt, norm)
    won = src.double() - tgt.double()[idx]
    won = won.abs().sum(-1) if norm == 1 else (won ** 2).sum(-1)
    scale = ref.abs().max()
    assert float(((dist.double() - ref).abs() / scale).max()) <= rtol
    assert float(((won - ref) / scale).max()) <= rtol  # each index a nearest neighbour up to rounding


@pytest.mark.parametrize("norm", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_of_16k_clouds(norm, dtype):
    torch.manual_seed(0)
    x = torch.rand(8, 16384, 3, device="cuda").to(dtype)
    y = torch.rand(8, 16384, 3, device="cuda").to(dtype)
    dist, _, (ix, iy) = chamfer_distance(x, y, point_reduction=None, batch_reduction=None, norm=norm,
                                         return_indices=True)
    for b in (0, 7):
        check_cloud(dist[0][b], ix[b], x[b], y[b], norm, 1e-6)
        check_cloud(dist[1][b], iy[b], y[b], x[b], norm, 1e-6)


def test_one_pair_of_100k_points():
    torch.manual_seed(0)
    x = torch.rand(1, 100_000, 3, device="cuda")
    y = torch.rand(1, 100_000, 3, device="cuda")
    dist, _, (ix, iy) = chamfer_distance(x, y, point_reduction=None, batch_reduction=None, return_indices=True)
    check_cloud(dist[0][0], ix[0], x[0], y[0], 2, 1e-6)
    check_cloud(dist[1][0], iy[0], y[0], x[0], 2, 1e-6)
    loss, _ = chamfer_distance(x, y)
    expected = dist[0].double().mean() + dist[1].double().mean()
    assert abs(float(loss) - float(expected)) <= 1e-5 * float(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dot_kernel_wide_points(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 4096, 128, device="cuda").to(dtype)
    y = torch.randn(4, 3000, 128, device="cuda").to(dtype)
    dist, _, (ix, iy) = chamfer_distance(x, y, point_reduction=None, batch_reduction=None, return_indices=True)
    check_cloud(dist[0][1], ix[1], x[1], y[1], 2, 1e-5)
    check_cloud(dist[1][3], iy[3], y[3], x[3], 2, 1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_at_16k(deterministic):
    torch.manual_seed(0)
    x = torch.rand(2, 16384, 3, device="cuda")
    y = torch.rand(2, 12000, 3, device="cuda")
    xl = torch.tensor([16384, 9000], device="cuda")
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss, _, (ix, iy) = chamfer_distance(xs, ys, xl, None, return_indices=True, deterministic=deterministic)
    loss.backward()
    # float64 autograd of the same loss with the winners fixed to the kernel's indices
    x64, y64 = x.double().requires_grad_(), y.double().requires_grad_()
    terms = 0
    for b in range(2):
        n = int(xl[b])
        dx = ((x64[b, :n] - y64[b][ix[b, :n]]) ** 2).sum(-1).mean()
        dy = ((y64[b] - x64[b][iy[b]]) ** 2).sum(-1).mean()
        terms = terms + dx + dy
    (terms / 2).backward()
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(ys.grad.double(), y64.grad, rtol=1e-4, atol=1e-9)
    if deterministic:
        xs2, ys2 = x.clone().requires_grad_(), y.clone().requires_grad_()
        chamfer_distance(xs2, ys2, xl, None, deterministic=True)[0].backward()
        assert torch.equal(xs.grad, xs2.grad) and torch.equal(ys.grad, ys2.grad)
