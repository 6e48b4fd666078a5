"""fp32 inputs on the 16-bit tensor cores: a two-term fp16 split (``precision="fp16x3"``).

Each fp32 value x (scaled by a power of two s) becomes hi = fp16(x s) and lo = fp16(x s - hi),
22 of fp32's 24 mantissa bits. A query token is stored as ``[hi, lo, hi]`` and a document token as
``[lo, hi, hi]`` (width 3d), so that the ordinary 16-bit kernels' one dot product of width 3d is

    q_hi . d_lo + q_lo . d_hi + q_hi . d_hi  =  (q . d) s_q s_d  (to ~2^-22, the lo . lo term dropped)

with every fp16 product exact in the fp32 accumulator. The small terms come first: the kernels
sum the width in order and the tensor cores' accumulator truncates at each k-step, so only the
hi . hi steps truncate at the score's magnitude. The scores are divided by s_q s_d at the
end (exact: powers of two), and the argmax is the same token. The scale puts each tensor's largest
magnitude in [2^13, 2^14): far from fp16's overflow (65504), and the lo terms of all but the
smallest values stay normal numbers. With ``normalize`` the rows are L2-normalised here, in fp32
(the kernels then see unit rows and need not normalise).

Everything stays on the device: the scale is read by the kernel from a 0-d tensor, no host
synchronisation. The copy costs 6 bytes a value (3 fp16), so the selection takes this path where the
product, not the read, sets the time (many query rows share each document token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._dispatch import interpreting
from maxsim._launch import launch
from maxsim.tuning.rules import next_pow2

# The scaled tensor's largest magnitude lands in [2^(TOP-1), 2^TOP).
_TOP_EXPONENT = 14
_ROW_ELEMENTS = 8192  # values a program splits per step (registers): BR rows x BD columns


@triton.jit
def _pow2(k):
    """2^k for int32 k in [-126, 127], exact: the fp32 with that exponent field."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _abs_max_bits_kernel(x_ptr, out_ptr, rows, dim, stride_row, BR: tl.constexpr, BD: tl.constexpr):
    """x [rows, dim] -> atomic max of |x|'s bit patterns into the zeroed int32 ``out``. For
    non-negative fp32 the bit patterns order as the values do, and a NaN's lies above inf's."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    o_d = tl.arange(0, BD)  # [BD]
    m = (o_r < rows)[:, None] & (o_d < dim)[None, :]
    b_x = tl.load(x_ptr + o_r.to(tl.int64)[:, None] * stride_row + o_d[None, :], mask=m, other=0.0)
    b_bits = tl.abs(b_x.to(tl.float32)).to(tl.int32, bitcast=True)  # [BR, BD]
    tl.atomic_max(out_ptr, tl.max(tl.max(b_bits, axis=1), axis=0))


@triton.jit
def _split_kernel(x_ptr, out_ptr, abs_max_bits_ptr, exponent_ptr, rows, dim, stride_row,
                  DOCUMENT: tl.constexpr, NORMALIZE: tl.constexpr, TOP: tl.constexpr,
                  BR: tl.constexpr, BD: tl.constexpr):
    """x [rows, dim] (any row stride, unit column stride) -> out [rows, 3 * dim] fp16:
    ``[hi, lo, hi]`` (queries) or ``[lo, hi, hi]`` (documents) of ``x 2^k``, k written to
    ``exponent`` (from the largest magnitude's bits; TOP - 1 for unit rows)."""
    if NORMALIZE:
        k = tl.full((), TOP - 1, tl.int32)
    else:
        bits = tl.load(abs_max_bits_ptr)
        # frexp's exponent of the largest magnitude (m 2^e, m in [0.5, 1)); 0 / subnormal: clamped
        k = tl.minimum(TOP - (((bits >> 23) & 0xFF) - 126), 126)
        k = tl.where(bits >= 0x7F800000, 0, k)  # NaN or inf: no scaling (it could overflow the finite rows)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    o_d = tl.arange(0, BD)  # [BD]
    m = (o_r < rows)[:, None] & (o_d < dim)[None, :]
    b_x = tl.load(x_ptr + o_r.to(tl.int64)[:, None] * stride_row + o_d[None, :], mask=m, other=0.0)
    b_x = b_x.to(tl.float32)  # [BR, BD]
    if NORMALIZE:  # same rule as the kernels' own: x / max(|x|, 1e-12)
        b_norm = tl.sqrt(tl.sum(b_x * b_x, axis=1))  # [BR]
        b_x = b_x / tl.maximum(b_norm, 1e-12)[:, None]
    b_x = b_x * _pow2(k)
    b_hi = b_x.to(tl.float16)
    b_lo = (b_x - b_hi.to(tl.float32)).to(tl.float16)
    p_out = out_ptr + o_r.to(tl.int64)[:, None] * (3 * dim) + o_d[None, :]
    if DOCUMENT:
        tl.store(p_out, b_lo, mask=m)
        tl.store(p_out + dim, b_hi, mask=m)
    else:
        tl.store(p_out, b_hi, mask=m)
        tl.store(p_out + dim, b_lo, mask=m)
    tl.store(p_out + 2 * dim, b_hi, mask=m)
    if tl.program_id(0) == 0:
        tl.store(exponent_ptr, k)


@triton.jit
def _unscale_kernel(s_ptr, n, q_exponent_ptr, d_exponent_ptr, BLOCK: tl.constexpr):
    """s [n] *= 2^-k_q 2^-k_d, in place: two exact factors (their product may not be an fp32)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_s = tl.load(s_ptr + o, mask=o < n)
    b_s = b_s * _pow2(-tl.load(q_exponent_ptr)) * _pow2(-tl.load(d_exponent_ptr))
    tl.store(s_ptr + o, b_s, mask=o < n)


def _tile(d: int) -> tuple[int, int]:
    BD = next_pow2(d)
    return max(1, min(64, _ROW_ELEMENTS // BD)), BD


def split_fp16x3(x: torch.Tensor, document: bool, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [..., d]`` -> (fp16 ``[..., 3d]`` contiguous, int32 0-d scale exponent k): the
    split of ``x 2^k`` (rows normalised first with ``normalize``), laid out for the query side or,
    with ``document``, the document side. Two launches (one with ``normalize``) and a zeroed
    word: the call is often host-bound (a training step's loss), so no torch ops besides."""
    d = x.shape[-1]
    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)  # [R, d]
    out = torch.empty((*x.shape[:-1], 3 * d), dtype=torch.float16, device=x.device)
    n = rows.shape[0]
    if n == 0 or d == 0:
        return out, torch.full((), _TOP_EXPONENT - 1, dtype=torch.int32, device=x.device)
    words = torch.zeros(1 if normalize else 2, dtype=torch.int32, device=x.device)  # [k, (|x| max bits)]
    BR, BD = _tile(d)
    grid = (triton.cdiv(n, BR),)
    stages = 1 if interpreting() else 2
    if not normalize:
        launch(_abs_max_bits_kernel, grid, (rows, words[1:], n, d, rows.stride(0)), dict(BR=BR, BD=BD),
               num_warps=4, num_stages=stages)
    launch(_split_kernel, grid, (rows, out, words[1:] if not normalize else words, words[:1], n, d, rows.stride(0)),
           dict(DOCUMENT=document, NORMALIZE=normalize, TOP=_TOP_EXPONENT, BR=BR, BD=BD), num_warps=4,
           num_stages=stages)
    return out, words[0]


def unscale(scores: torch.Tensor, q_exponent: torch.Tensor, d_exponent: torch.Tensor) -> torch.Tensor:
    """``scores / (2^k_q 2^k_d)`` in place (exact), one launch; ``scores`` contiguous fp32."""
    n = scores.numel()
    if n:
        BLOCK = 1024
        launch(_unscale_kernel, (triton.cdiv(n, BLOCK),), (scores, n, q_exponent, d_exponent), dict(BLOCK=BLOCK),
               num_warps=4, num_stages=1)
    return scores
