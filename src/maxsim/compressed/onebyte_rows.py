"""int8 tokens scored with the tokens as the tensor-core product's rows (a probe, issue 54 point 3).

The one-byte stream kernel (:mod:`maxsim.varlen.stream`) puts a query's 32 rows on the product's
M side, which Hopper's wgmma (M >= 64 a warpgroup) cannot take whole. Here, as in the look-up
scorers (:mod:`maxsim.compressed.residual_lut`), a tile of BT document tokens is M and the
quantised query rows are N: ``S[t, j] = s_t u_j (v_t . q~_j)``, the int8 product exact in int32,
no padding (each document's max is taken over its own rows: ``G = 1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim.compressed.residual_lut import (MAGIC_BITS, quantized_rows, query_rows, round22, run_grid, run_start,
                                           segment_max)


@triton.jit
def _load_rows(values_ptr, scale_ptr, t0, t_hi, o_tt, DIM: tl.constexpr):
    """Tile t0's int8 rows as four [BT, 32] slices and their scales [BT] (rows past t_hi: 0)."""
    o_t = t0 + o_tt
    m_t = o_t < t_hi
    p = values_ptr + o_t.to(tl.int64)[:, None] * DIM + tl.arange(0, 32)[None, :]  # [BT, 32]
    m = m_t[:, None]
    return (tl.load(p, mask=m, other=0), tl.load(p + 32, mask=m, other=0), tl.load(p + 64, mask=m, other=0),
            tl.load(p + 96, mask=m, other=0), tl.load(scale_ptr + o_t, mask=m_t, other=0.0))


@triton.jit(do_not_specialize=["Nq", "Nd", "docs_per_program", "n_runs"])
def _int8_rows_kernel(values_ptr, scale_ptr, cu_ptr, q_ptr, qs_ptr, out_ptr, Nq, Nd, docs_per_program, n_runs,
                      LQ: tl.constexpr, QPB: tl.constexpr, BT: tl.constexpr):
    N: tl.constexpr = QPB * LQ
    DIM: tl.constexpr = 128
    pid = tl.program_id(0)
    i_run = pid % n_runs
    q0 = (pid // n_runs) * QPB
    b_qs, b_cn, b_q0, b_q1, b_q2, b_q3 = query_rows(q_ptr, qs_ptr, q0, LQ, DIM, QPB)
    o_qb = q0 + tl.arange(0, QPB)
    m_qb = o_qb < Nq
    j_hi, t_lo, t_hi, j, lo, hi, b_carry = run_start(cu_ptr, i_run, docs_per_program, Nd, N)
    o_tt = tl.arange(0, BT)
    b_v0, b_v1, b_v2, b_v3, b_sc = _load_rows(values_ptr, scale_ptr, t_lo, t_hi, o_tt, DIM)
    for t0 in range(t_lo, t_hi, BT):
        n_v0, n_v1, n_v2, n_v3, n_sc = _load_rows(values_ptr, scale_ptr, t0 + BT, t_hi, o_tt, DIM)
        acc = tl.full([BT, N], MAGIC_BITS, dtype=tl.int32)
        acc = tl.dot(b_v0, b_q0, acc, out_dtype=tl.int32)
        acc = tl.dot(b_v1, b_q1, acc, out_dtype=tl.int32)
        acc = tl.dot(b_v2, b_q2, acc, out_dtype=tl.int32)
        acc = tl.dot(b_v3, b_q3, acc, out_dtype=tl.int32)
        b_s = tl.fma(acc.to(tl.float32, bitcast=True), b_qs[None, :], b_cn[None, :]) * b_sc[:, None]  # [BT, N]
        j, lo, hi, b_carry = segment_max(b_s, t0, j, j_hi, lo, hi, b_carry, cu_ptr, out_ptr, o_qb, m_qb, Nd,
                                         BT, 1, LQ, QPB)
        b_v0, b_v1, b_v2, b_v3, b_sc = n_v0, n_v1, n_v2, n_v3, n_sc


def int8_rows_scores(Q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, cu: torch.Tensor, *,
                     q_mask=None, qpb: int = 1, block_tokens: int = 128, num_warps: int = 4, num_stages: int = 3,
                     waves: int = 4) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of ``Q [Nq, Lq, 128]`` against packed int8 tokens ``values [T, 128]``
    with fp32 ``scales [T]`` (``cu [Nd + 1]`` int64), all on Q's device; the query quantised per
    row. Empty documents score 0."""
    if values.dtype != torch.int8 or values.shape[1] != 128:
        raise ValueError("int8_rows_scores takes int8 tokens of d 128")
    Nq, Nd = Q.shape[0], cu.numel() - 1
    out = torch.zeros(Nq, Nd, dtype=torch.float32, device=Q.device)
    if Nq == 0 or Nd == 0:
        return out
    q8, u, _, LQ = quantized_rows(Q, q_mask=q_mask, qpb=qpb)
    docs_per_program, n_runs = run_grid(Nd, waves, Q.device)
    _int8_rows_kernel[(n_runs * (q8.shape[0] // qpb),)](
        values, scales.float().contiguous(), cu, q8, round22(u).contiguous(), out, Nq, Nd, docs_per_program, n_runs,
        LQ=LQ, QPB=qpb, BT=block_tokens, num_warps=num_warps, num_stages=num_stages)
    return out


def int8_rows_emulation(Q, values, scales, cu, *, q_mask=None) -> torch.Tensor:
    """:func:`int8_rows_scores`' arithmetic in float64 on the CPU."""
    q8, u, _, LQ = quantized_rows(Q.cpu(), q_mask=None if q_mask is None else q_mask.cpu())
    qs = round22(u).double()
    v, s, cu = values.cpu().double(), scales.cpu().double(), cu.cpu()
    out = torch.zeros(Q.shape[0], cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            acc = torch.einsum("nld,td->ntl", q8[:Q.shape[0]].double(), v[lo:hi])
            out[:, j] = (acc * qs[:Q.shape[0], None, :] * s[None, lo:hi, None]).amax(1).sum(-1)
    return out


__all__ = ["int8_rows_scores", "int8_rows_emulation"]
