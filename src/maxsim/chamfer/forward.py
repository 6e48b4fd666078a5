"""Chamfer forward: the nearest neighbour of every point in the other cloud, both directions.

For clouds ``x [B, N, D]`` and ``y [B, M, D]`` (the first ``x_len[b]`` / ``y_len[b]`` points of
each cloud are real) one launch writes

    dist_x[b, i] = min_{j < y_len[b]} dist(x[b, i], y[b, j]),   idx_x[b, i] = its argmin
    dist_y[b, j] = min_{i < x_len[b]} dist(y[b, j], x[b, i]),   idx_y[b, j] = its argmin

with ``dist`` the squared Euclidean distance (norm 2) or the L1 distance (norm 1). A program owns
BM points of one cloud and streams the other cloud in tiles of BN points; the distance tile never
leaves the chip. The running min and the tile where it was reached are kept per (row, column) of
the tile (three instructions a pair) and reduced to one value and one index per row at the end,
ties to the lowest index. Padded points (beyond a cloud's length) and points whose other cloud is
empty get distance 0 and index -1.

Two ways to compute a tile's distances (the selection layer picks, :mod:`maxsim.selection.chamfer`):

- ``DOT=False`` (direct): per coordinate, ``x_k - y_k`` in fp32, squared (norm 2) or absolute
  (norm 1), summed over the D coordinates. 2 D instructions a pair and no cancellation: the fp32
  result is within a few ulps of the exact distance of the input values. The only way for norm 1,
  which is not a dot product.
- ``DOT=True`` (norm 2): ``|x|^2 + |y|^2 - 2 x.y`` with ``x.y`` from ``tl.dot`` (tensor cores for
  16-bit inputs, IEEE fp32 products for fp32), clamped at 0. For wide points, where the dot's
  cost per pair is lower; its absolute error is a few ulps of ``|x|^2 + |y|^2``.

NaN: a distance that is NaN wins the min (NaN propagates, at its lowest index). Checking every
pair for NaN costs two more instructions a pair, so the launcher flags each pair of clouds that
holds a non-finite coordinate (one pass over the inputs) and only those walk the NaN-aware loop.
The others have no NaN test, and no bounds test a pair either: the direct kernel reads the
points past a cloud as +inf (infinitely far), the dot kernel walks whole tiles, then the ragged
last one with bounds. The hot loop is the distance and the running min alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim import _outputs
from maxsim._dispatch import interpreting
from maxsim._launch import launch

INF = float("inf")
# The direct kernel unrolls up to this many coordinates and loops beyond: unrolled, the 130
# coordinates of a wide L1 call took minutes to compile for sm_90.
_UNROLL_MAX_D = 16


@triton.jit
def _min_nan(a, b):
    """min that propagates NaN (a NaN taking part makes it NaN)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add_coordinate(b_d, p_xk, p_yk, m_src, m_t, NORM: tl.constexpr, MASKED: tl.constexpr):
    """One coordinate of the direct kernel: b_d [BM, BN] += |x_k - y_k| (norm 1) or its square.
    Unless MASKED, a target point past the cloud reads +inf: its distance is inf and never wins,
    so the pairs need no bounds test (finite clouds only: inf - inf would be NaN)."""
    b_xk = tl.load(p_xk, mask=m_src, other=0.0).to(tl.float32)  # [BM] (loop-invariant: hoisted)
    if MASKED:
        b_yk = tl.load(p_yk, mask=m_t, other=0.0).to(tl.float32)  # [BN]
    else:
        b_yk = tl.load(p_yk, mask=m_t, other=float("inf")).to(tl.float32)  # [BN]
    b_diff = b_xk[:, None] - b_yk[None, :]  # [BM, BN]
    if NORM == 1:
        b_d += tl.abs(b_diff)
    else:
        b_d += b_diff * b_diff
    return b_d


@triton.jit
def _walk(b_best, b_tile, t_first, t_stop, p_tgt, stride_t, tgt_len, p_rows, m_src, b_src_block, src_sq,
          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
          NORM: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
          UNROLL_D: tl.constexpr, MASKED: tl.constexpr, NAN_AWARE: tl.constexpr):
    """Target tiles t_first..t_stop - 1 into the running min b_best [BM, BN] and the tile where it
    was reached b_tile [BM, BN]. MASKED: tiles that may run past tgt_len get a bounds test on
    every pair (unless MASKED, the dot kernel walks whole tiles only, the direct kernel any tile:
    its loads make the points past the cloud infinitely far); NAN_AWARE: a NaN distance wins and
    stays (two more instructions a pair, so only clouds holding a non-finite coordinate walk this
    way)."""
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    for i_t in range(t_first, t_stop):
        o_t = i_t * BN + o_n  # [BN] target points
        m_t = o_t < tgt_len
        p_cols = p_tgt + o_t.to(tl.int64) * stride_t  # [BN]
        if DOT:
            b_s = tl.zeros([BM, BN], dtype=tl.float32)
            tgt_sq = tl.zeros([BN], dtype=tl.float32)
            for kk in tl.static_range(NUM_K):
                o_kk = kk * BK + o_k
                m_k = (o_kk < D)[None, :]
                if MASKED:
                    b_tgt = tl.load(p_cols[:, None] + o_kk[None, :], mask=m_t[:, None] & m_k, other=0.0)  # [BN, BK]
                else:
                    b_tgt = tl.load(p_cols[:, None] + o_kk[None, :], mask=m_k, other=0.0)  # [BN, BK]
                if NUM_K == 1:
                    b_a = b_src_block
                else:
                    b_a = tl.load(p_rows[:, None] + o_kk[None, :], mask=m_src[:, None] & m_k, other=0.0)
                if DOT_UPCAST:
                    b_s = tl.dot(b_a.to(tl.float32), tl.trans(b_tgt.to(tl.float32)), b_s, input_precision="ieee")
                else:
                    b_s = tl.dot(b_a, tl.trans(b_tgt), b_s, input_precision=DOT_PRECISION)  # [BM, BN]
                b_tgtf = b_tgt.to(tl.float32)
                tgt_sq += tl.sum(b_tgtf * b_tgtf, axis=1)
            b_raw = src_sq[:, None] + (tgt_sq[None, :] - 2.0 * b_s)
            b_d = tl.maximum(b_raw, 0.0)  # [BM, BN]
            if NAN_AWARE:  # (maximum drops a NaN: put it back)
                b_d = tl.where(b_raw != b_raw, b_raw, b_d)
        else:
            b_d = tl.zeros([BM, BN], dtype=tl.float32)
            if UNROLL_D:
                for k in tl.static_range(D):
                    b_d = _add_coordinate(b_d, p_rows + k, p_cols + k, m_src, m_t, NORM, MASKED)
            else:
                for k in range(D):
                    b_d = _add_coordinate(b_d, p_rows + k, p_cols + k, m_src, m_t, NORM, MASKED)
        if MASKED:
            b_d = tl.where(m_t[None, :], b_d, float("inf"))
        if NAN_AWARE:  # a NaN wins and stays (strict '<' keeps the earliest tile on ties)
            upd = (b_d < b_best) | ((b_d != b_d) & (b_best == b_best))
        else:
            upd = b_d < b_best
        b_best = tl.where(upd, b_d, b_best)
        b_tile = tl.where(upd, i_t, b_tile)
    return b_best, b_tile


@triton.jit(do_not_specialize=["N", "M", "n_blocks_x", "stride_xb", "stride_yb"])
def _chamfer_fwd_kernel(
    x_ptr, y_ptr, xlen_ptr, ylen_ptr, bad_ptr,
    dist_x_ptr, idx_x_ptr, dist_y_ptr, idx_y_ptr,
    N, M, n_blocks_x,
    stride_xb, stride_xn,  # x [B, N, D], unit stride on D
    stride_yb, stride_ym,  # y [B, M, D], unit stride on D
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
    NORM: tl.constexpr, DOT: tl.constexpr, BOTH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # Triton's interpreter computes bf16 dots wrongly: upcast there
    UNROLL_D: tl.constexpr,  # the direct kernel's coordinates unrolled (few) or a loop
):
    """Program (i_blk, b): rows i_blk * BM.. of x against y (i_blk < n_blocks_x), else rows of y
    against x (BOTH). bad_ptr [B] bool: whether either cloud of pair b holds a non-finite
    coordinate. Writes dist [BM] fp32 and idx [BM] int32 for its rows."""
    i_blk = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    x_len = tl.load(xlen_ptr + i_b).to(tl.int32)
    y_len = tl.load(ylen_ptr + i_b).to(tl.int32)
    # Direction: the source cloud's rows against the target cloud's tiles.
    if i_blk < n_blocks_x:
        p_src = x_ptr + i_b * stride_xb
        p_tgt = y_ptr + i_b * stride_yb
        stride_s = stride_xn
        stride_t = stride_ym
        src_len = x_len
        tgt_len = y_len
        p_dist = dist_x_ptr + i_b * N
        p_idx = idx_x_ptr + i_b * N
        src_size = N
        row0 = i_blk * BM
    else:
        p_src = y_ptr + i_b * stride_yb
        p_tgt = x_ptr + i_b * stride_xb
        stride_s = stride_ym
        stride_t = stride_xn
        src_len = y_len
        tgt_len = x_len
        p_dist = dist_y_ptr + i_b * M
        p_idx = idx_y_ptr + i_b * M
        src_size = M
        row0 = (i_blk - n_blocks_x) * BM
    o_m = row0 + tl.arange(0, BM)  # [BM] source points
    m_src = o_m < src_len
    p_rows = p_src + o_m.to(tl.int64) * stride_s  # [BM]
    o_k = tl.arange(0, BK)

    src_sq = tl.zeros([BM], dtype=tl.float32)  # the dot's squared norms, once per program
    b_src_block = src_sq  # the dot's source block when it is one BK wide (stays on chip)
    if DOT:
        for kq in tl.static_range(NUM_K):
            o_kk = kq * BK + o_k
            b_src = tl.load(p_rows[:, None] + o_kk[None, :], mask=m_src[:, None] & (o_kk < D)[None, :], other=0.0)
            b_srcf = b_src.to(tl.float32)  # [BM, BK]
            src_sq += tl.sum(b_srcf * b_srcf, axis=1)
            b_src_block = b_src

    b_best = tl.full([BM, BN], float("inf"), dtype=tl.float32)
    b_tile = tl.zeros([BM, BN], dtype=tl.int32)  # tile index where b_best was reached
    n_tiles = tl.cdiv(tgt_len, BN)
    if tl.load(bad_ptr + i_b) != 0:  # (rare) every tile bounds-checked and NaN-aware
        b_best, b_tile = _walk(b_best, b_tile, 0, n_tiles, p_tgt, stride_t, tgt_len, p_rows, m_src, b_src_block,
                               src_sq, D, BM, BN, BK, NUM_K, NORM, DOT, DOT_PRECISION, DOT_UPCAST, UNROLL_D,
                               True, True)
    elif not DOT:  # every tile, the points past the cloud read as infinitely far
        b_best, b_tile = _walk(b_best, b_tile, 0, n_tiles, p_tgt, stride_t, tgt_len, p_rows, m_src, b_src_block,
                               src_sq, D, BM, BN, BK, NUM_K, NORM, DOT, DOT_PRECISION, DOT_UPCAST, UNROLL_D,
                               False, False)
    else:  # whole tiles with no bounds, then the ragged last one
        n_whole = tgt_len // BN
        b_best, b_tile = _walk(b_best, b_tile, 0, n_whole, p_tgt, stride_t, tgt_len, p_rows, m_src, b_src_block,
                               src_sq, D, BM, BN, BK, NUM_K, NORM, DOT, DOT_PRECISION, DOT_UPCAST, UNROLL_D,
                               False, False)
        b_best, b_tile = _walk(b_best, b_tile, n_whole, n_tiles, p_tgt, stride_t, tgt_len, p_rows, m_src,
                               b_src_block, src_sq, D, BM, BN, BK, NUM_K, NORM, DOT, DOT_PRECISION, DOT_UPCAST,
                               UNROLL_D, True, False)

    b_min = tl.reduce(b_best, 1, _min_nan)  # [BM]
    is_min = (b_best == b_min[:, None]) | (b_best != b_best)
    o_n = tl.arange(0, BN)
    b_idx = tl.min(tl.where(is_min, b_tile * BN + o_n[None, :], 2147483647), axis=1)  # lowest index among ties
    m_found = m_src & (tgt_len > 0)
    m_out = o_m < src_size  # padded rows too: they read 0 and -1
    tl.store(p_dist + o_m, tl.where(m_found, b_min, 0.0), mask=m_out)
    tl.store(p_idx + o_m, tl.where(m_found, b_idx, -1), mask=m_out)


def chamfer_forward(x: torch.Tensor, y: torch.Tensor, x_len: torch.Tensor, y_len: torch.Tensor, *, norm: int,
                    both: bool, config: dict, dot: bool):
    """Launch the forward on validated inputs with the tile the selection chose.

    Args:
        x: ``[B, N, D]``, y: ``[B, M, D]`` (same dtype, any strides; a unit stride on D is made).
        x_len, y_len: ``[B]`` int64 on the same device, ``0 <= len <= N`` (resp. M).
        norm: 1 or 2.  both: also the y -> x direction.  dot: the tl.dot kernel (norm 2).
        config: ``BM, BN, BK, num_warps, num_stages``.

    Returns:
        ``dist_x [B, N]`` fp32, ``idx_x [B, N]`` int32, and ``dist_y [B, M]``, ``idx_y [B, M]``
        (None unless ``both``).
    """
    B, N, D = x.shape
    M = y.shape[1]
    dist_x = _outputs.empty((B, N), torch.float32, x.device)
    idx_x = _outputs.empty((B, N), torch.int32, x.device)
    dist_y = _outputs.empty((B, M), torch.float32, x.device) if both else None
    idx_y = _outputs.empty((B, M), torch.int32, x.device) if both else None
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    BM, BN, BK = config["BM"], config["BN"], config.get("BK", 16)
    n_blocks_x = triton.cdiv(N, BM)
    n_blocks = n_blocks_x + (triton.cdiv(M, BM) if both else 0)
    if B == 0 or n_blocks == 0:
        return dist_x, idx_x, dist_y, idx_y
    # [B] bool: a non-finite coordinate anywhere in either cloud (the NaN-aware walk's price is
    # paid by those pairs alone, and the hot loop carries no per-tile check)
    bad = ~(torch.isfinite(x).flatten(1).all(1) & torch.isfinite(y).flatten(1).all(1))
    args = (x, y, x_len, y_len, bad, dist_x, idx_x, dist_x if dist_y is None else dist_y,
            idx_x if idx_y is None else idx_y, N, M, n_blocks_x, x.stride(0), x.stride(1), y.stride(0), y.stride(1))
    constexprs = dict(D=D, BM=BM, BN=BN, BK=BK, NUM_K=-(-D // BK), NORM=norm, DOT=dot, BOTH=both,
                      DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                      DOT_UPCAST=interpreting() and x.dtype == torch.bfloat16,
                      UNROLL_D=D <= _UNROLL_MAX_D)
    launch(_chamfer_fwd_kernel, (n_blocks, B), args, constexprs, num_warps=config["num_warps"],
           num_stages=config["num_stages"])
    return dist_x, idx_x, dist_y, idx_y
