"""fp32 inputs on the 16-bit tensor cores: a two-term fp16 split (``precision="fp16x3"``).

Each fp32 value x (scaled by a power of two s) becomes hi = fp16(x s) and lo = fp16(x s - hi),
22 of fp32's 24 mantissa bits. A query token is stored as ``[hi, hi, lo]`` and a document token as
``[hi, lo, hi]`` (width 3d), so that the ordinary 16-bit kernels' one dot product of width 3d is

    q_hi . d_hi + q_hi . d_lo + q_lo . d_hi  =  (q . d) s_q s_d  (to ~2^-22, the lo . lo term dropped)

with every fp16 product exact in the fp32 accumulator. The scores are divided by s_q s_d at the
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
def _split_kernel(x_ptr, out_ptr, scale_ptr, rows, dim, stride_row,
                  DOCUMENT: tl.constexpr, NORMALIZE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """x [rows, dim] (any row stride, unit column stride) -> out [rows, 3 * dim] fp16:
    ``[hi, hi, lo]`` (queries) or ``[hi, lo, hi]`` (documents) of ``x * scale``."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    o_d = tl.arange(0, BD)  # [BD]
    m = (o_r < rows)[:, None] & (o_d < dim)[None, :]
    b_x = tl.load(x_ptr + o_r.to(tl.int64)[:, None] * stride_row + o_d[None, :], mask=m, other=0.0)
    b_x = b_x.to(tl.float32)  # [BR, BD]
    if NORMALIZE:  # same rule as the kernels' own: x / max(|x|, 1e-12)
        b_norm = tl.sqrt(tl.sum(b_x * b_x, axis=1))  # [BR]
        b_x = b_x / tl.maximum(b_norm, 1e-12)[:, None]
    b_x = b_x * tl.load(scale_ptr)
    b_hi = b_x.to(tl.float16)
    b_lo = (b_x - b_hi.to(tl.float32)).to(tl.float16)
    p_out = out_ptr + o_r.to(tl.int64)[:, None] * (3 * dim) + o_d[None, :]
    tl.store(p_out, b_hi, mask=m)
    if DOCUMENT:
        tl.store(p_out + dim, b_lo, mask=m)
        tl.store(p_out + 2 * dim, b_hi, mask=m)
    else:
        tl.store(p_out + dim, b_hi, mask=m)
        tl.store(p_out + 2 * dim, b_lo, mask=m)


def _scale_exponent(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """int32 0-d k with max|x| 2^k in [2^13, 2^14) (unit rows with ``normalize``); on the device."""
    if normalize or x.numel() == 0:
        return torch.full((), _TOP_EXPONENT - 1, dtype=torch.int32, device=x.device)
    amax = torch.linalg.vector_norm(x, ord=float("inf"))  # one read, nothing materialised
    _, exponent = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
    # A NaN or inf anywhere: no scaling (a scale from a NaN could overflow the finite rows' hi)
    return torch.where(torch.isfinite(amax), _TOP_EXPONENT - exponent, 0).to(torch.int32)


def split_fp16x3(x: torch.Tensor, document: bool, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [..., d]`` -> (fp16 ``[..., 3d]`` contiguous, int32 0-d scale exponent k): the
    split of ``x 2^k`` (rows normalised first with ``normalize``), laid out for the query side or,
    with ``document``, the document side."""
    d = x.shape[-1]
    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)  # [R, d]
    exponent = _scale_exponent(rows, normalize)
    out = torch.empty((*x.shape[:-1], 3 * d), dtype=torch.float16, device=x.device)
    n = rows.shape[0]
    if n == 0 or d == 0:
        return out, exponent
    scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=x.device), exponent)  # exact 2^k
    BD = next_pow2(d)
    BR = max(1, min(64, _ROW_ELEMENTS // BD))
    launch(_split_kernel, (triton.cdiv(n, BR),), (rows, out, scale, n, d, rows.stride(0)),
           dict(DOCUMENT=document, NORMALIZE=normalize, BR=BR, BD=BD), num_warps=4,
           num_stages=1 if interpreting() else 2)
    return out, exponent


def unscale(scores: torch.Tensor, q_exponent: torch.Tensor, d_exponent: torch.Tensor) -> torch.Tensor:
    """``scores / (2^k_q 2^k_d)`` in place (exact)."""
    return scores.mul_(torch.ldexp(torch.ones((), dtype=torch.float32, device=scores.device),
                                   -(q_exponent + d_exponent)))
