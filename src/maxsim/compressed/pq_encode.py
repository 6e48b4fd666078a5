"""PQ encoding on the GPU: each token's nearest centroid in every sub-space, one fused kernel.

The PyTorch path (:meth:`maxsim.compressed.pq.ProductQuantizer.encode` off the GPU) shortlists
centroids with a batched GEMM, takes a top-k over all 256 and decides exactly among the shortlist:
its [m, n, 256] intermediates cost far more than the arithmetic (pq32 at 1M passages: most of a
44 s build). Here a program holds BT tokens' exact squared distances to the 256 centroids of one
sub-space in registers (``[BT, 256]`` fp32), one sub-space after another, and keeps the first
index of the smallest: the brute force over all 256, with the same tie rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_CENTROIDS = 256


@triton.jit(do_not_specialize=["T"])
def _pq_encode_kernel(
    x_ptr,  # [T, M * S] float (any float dtype; row stride stride_t)
    cb_ptr,  # [M, 256, S] fp32 codebooks
    out_ptr,  # [T, M] uint8 codes
    T, stride_t,
    M: tl.constexpr, S: tl.constexpr, BT: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    m_t = o_t < T
    p_x = x_ptr + o_t.to(tl.int64) * stride_t  # [BT]
    o_c = tl.arange(0, 256)
    for sub in range(M):
        dist = tl.zeros([BT, 256], dtype=tl.float32)
        for j in tl.static_range(S):
            x_j = tl.load(p_x + sub * S + j, mask=m_t, other=0.0).to(tl.float32)  # [BT]
            c_j = tl.load(cb_ptr + (sub * 256 + o_c) * S + j)  # [256]
            diff = x_j[:, None] - c_j[None, :]
            dist += diff * diff
        best = tl.argmin(dist, axis=1, tie_break_left=True)  # [BT]: the lowest index on ties
        tl.store(out_ptr + o_t.to(tl.int64) * M + sub, best.to(tl.uint8), mask=m_t)


def pq_encode(x: torch.Tensor, codebooks: torch.Tensor, *, block_tokens: int = 32) -> torch.Tensor:
    """x ``[T, m * s]`` float (rows contiguous), codebooks ``[m, 256, s]`` on x's device -> codes
    ``[T, m]`` uint8: argmin over c of sum_j (x_j - c_j)^2 in fp32, the lowest index on ties."""
    m, num_centroids, s = codebooks.shape
    if num_centroids != NUM_CENTROIDS:
        raise ValueError(f"pq_encode takes {NUM_CENTROIDS} centroids a sub-space, got {num_centroids}")
    if x.dim() != 2 or x.shape[1] != m * s or x.stride(1) != 1:
        raise ValueError(f"pq_encode takes x [T, {m * s}] with contiguous rows, got {tuple(x.shape)}")
    T = x.shape[0]
    out = torch.empty(T, m, dtype=torch.uint8, device=x.device)
    if T:
        cb = codebooks.to(device=x.device, dtype=torch.float32).contiguous()
        _pq_encode_kernel[(triton.cdiv(T, block_tokens),)](x, cb, out, T, x.stride(0), M=m, S=s, BT=block_tokens,
                                                         num_warps=4)
    return out
