"""Fused MaxSim over packed (ragged) sequences: one Triton kernel and its launcher.

Sequences are packed back to back, FlashAttention-style: q ``[Tq, d]`` with ``cu_seqlens_q
[Nq + 1]`` (query i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``), likewise d. A program owns a
chunk of BM query rows and walks a run of (query, document) pairs, streaming only the document's
real tokens: work is proportional to the real tokens, not to the longest sequence. The cross
product is the implicit pair list ``p -> (p % Nq, p // Nq)``; ``score_pairs_packed`` reads pairs
from two index arrays.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from maxsim._dispatch import interpreting
from maxsim._launch import launch
from maxsim._tuning import multiprocessors, next_pow2


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def pair_of(p, pq_ptr, pd_ptr, Nq, Nd, CROSS: tl.constexpr):
    """(query, document, valid) of pair p. CROSS: query-fastest order, p -> (p % Nq, p // Nq), so
    a program's run of pairs re-reads one document for successive queries (from L1/L2) and each
    document comes from HBM about once. A bad index gives valid=False (and index 0), never a fault."""
    if CROSS:
        i = p % Nq
        j = p // Nq
    else:
        i = tl.load(pq_ptr + p)
        j = tl.load(pd_ptr + p)
    ok = (i >= 0) & (i < Nq) & (j >= 0) & (j < Nd)
    return tl.where(ok, i, 0), tl.where(ok, j, 0), ok


@triton.jit(do_not_specialize=["Nq", "Nd", "P", "Tq", "Td", "n_chunks", "pairs_per_program", "max_q"])
def _maxsim_varlen_fwd_kernel(
    q_ptr, d_ptr, cuq_ptr, cud_ptr, pq_ptr, pd_ptr, out_ptr, arg_ptr,
    Nq, Nd, P, Tq, Td, dim, n_chunks, pairs_per_program, max_q,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
    CROSS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr,
):
    """q [Tq, d], d [Td, d] (unit stride on d, rows contiguous); cu_seqlens int64 [N + 1];
    pairs int64 [P] (unless CROSS); out fp32 [n_chunks, P]: one partial score per query chunk;
    with SAVE_ARGMAX, argmax int32 [P, max_q]: the winning token's index inside its document,
    -1 past the query's end or for an empty document."""
    NEG_INF: tl.constexpr = float("-inf")
    i_pid = tl.program_id(0)
    i_chunk = i_pid % n_chunks
    p0 = ((i_pid // n_chunks) * pairs_per_program).to(tl.int64)
    o_r = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    for pp in range(0, tl.minimum(pairs_per_program, P - p0)):
        p = p0 + pp  # int64
        i, j, ok = pair_of(p, pq_ptr, pd_ptr, Nq, Nd, CROSS)
        q_lo = tl.load(cuq_ptr + i)
        q_hi = tl.minimum(tl.load(cuq_ptr + i + 1), Tq)
        d_lo = tl.load(cud_ptr + j)
        d_hi = tl.minimum(tl.load(cud_ptr + j + 1), Td)
        o_qrow = q_lo + i_chunk * BM + o_r  # [BM] packed query rows
        m_row = o_qrow < q_hi
        p_q = q_ptr + o_qrow.to(tl.int64)[:, None] * dim  # [BM, 1]
        b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
        b_arg = tl.zeros([BM], dtype=tl.int32)
        for t0 in range(d_lo, d_hi, BN):
            o_t = t0 + o_n  # [BN] packed document rows
            m_t = o_t < d_hi
            p_d = d_ptr + o_t.to(tl.int64)[:, None] * dim  # [BN, 1]
            b_s = tl.zeros([BM, BN], dtype=tl.float32)
            for kk in range(NUM_K):
                o_kk = kk * BK + o_k
                m_k = o_kk < dim
                if EVEN_K:
                    b_q = tl.load(p_q + o_kk[None, :], mask=m_row[:, None], other=0.0)
                    b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None], other=0.0)
                else:
                    b_q = tl.load(p_q + o_kk[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
                    b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
                if DOT_UPCAST:
                    b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_d.to(tl.float32)), b_s, input_precision="ieee")
                else:
                    b_s = tl.dot(b_q, tl.trans(b_d), b_s, input_precision=DOT_PRECISION)
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)
            if SAVE_ARGMAX:
                b_tmax = tl.reduce(b_s, 1, _max_nan)  # [BM]
                is_max = (b_s == b_tmax[:, None]) | (b_s != b_s)
                b_targ = tl.min(tl.where(is_max, o_n[None, :], BN), axis=1)  # first winner in the tile
                # Strict '>' keeps the earlier tile on ties; a NaN wins over any number.
                upd = (b_tmax > b_max) | ((b_tmax != b_tmax) & (b_max == b_max))
                b_arg = tl.where(upd, (t0 - d_lo).to(tl.int32) + b_targ, b_arg)
                b_max = tl.where(upd, b_tmax, b_max)
            else:
                b_max = _max_nan(b_max, tl.reduce(b_s, 1, _max_nan))
        # Empty document (max stays -inf) or rows past the query's end contribute 0.
        keep = m_row & (d_hi > d_lo)
        score = tl.sum(tl.where(keep, b_max, 0.0), axis=0)
        score = tl.where(ok, score, float("nan"))
        tl.store(out_ptr + i_chunk.to(tl.int64) * P + p, score)
        if SAVE_ARGMAX:
            o_s = i_chunk * BM + o_r
            tl.store(arg_ptr + p * max_q + o_s, tl.where(keep & ok, b_arg, -1), mask=o_s < max_q)


@functools.lru_cache(maxsize=256)
def _varlen_config(max_q: int, d: int, dtype: torch.dtype, interpret: bool):
    """(BM, BN, BK, num_warps, num_stages): a query chunk of up to 128 rows, 64-token tiles."""
    BM = min(128, max(16, next_pow2(max_q)))
    wide = dtype == torch.float32
    BK = min(64 if wide else 128, max(16, next_pow2(d)))
    BN = 32 if wide else 64
    if interpret:
        return min(BM, 32), min(BN, 32), BK, 4, 1
    return BM, BN, BK, 4 if BM <= 64 else 8, 3


def varlen_forward(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    max_q: int,
    pair_q: torch.Tensor | None = None,
    pair_d: torch.Tensor | None = None,
    save_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores for the cross product (``pair_q`` None) -> ``[Nq, Nd]``, or for pairs -> ``[P]``.

    q ``[Tq, dim]``, d ``[Td, dim]`` contiguous; cu_q ``[Nq + 1]``, cu_d ``[Nd + 1]`` int64 on the
    same device; ``max_q`` bounds every query's length (it sets the number of query chunks).
    With ``save_argmax`` also returns argmax ``[P, max_q]`` int32 in pair order (cross product:
    pair p = query p % Nq, document p // Nq), else None.
    """
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    cross = pair_q is None
    P = Nq * Nd if cross else pair_q.numel()
    dim = q.shape[1]
    argmax = torch.full((P, max_q), -1, dtype=torch.int32, device=q.device) if save_argmax else None
    if P == 0 or max_q == 0:
        shape = (Nq, Nd) if cross else (P,)
        return torch.zeros(shape, dtype=torch.float32, device=q.device), argmax
    interpret = interpreting()
    BM, BN, BK, num_warps, num_stages = _varlen_config(max_q, dim, q.dtype, interpret)
    n_chunks = -(-max_q // BM)
    slots = 1 if interpret else multiprocessors(q.device.index if q.device.index is not None else torch.cuda.current_device()) * 4
    pairs_per_program = max(1, -(-P * n_chunks // slots))
    n_programs = n_chunks * -(-P // pairs_per_program)
    out = torch.empty((n_chunks, P), dtype=torch.float32, device=q.device)
    pq = pair_q if pair_q is not None else cu_q  # any tensor when unused
    pd = pair_d if pair_d is not None else cu_d
    args = (q, d, cu_q, cu_d, pq, pd, out, argmax if argmax is not None else out,
            Nq, Nd, P, q.shape[0], d.shape[0], dim, n_chunks, pairs_per_program, max_q)
    constexprs = dict(
        BM=BM, BN=BN, BK=BK, NUM_K=-(-dim // BK), CROSS=cross, EVEN_K=dim % BK == 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and q.dtype == torch.bfloat16, SAVE_ARGMAX=save_argmax,
    )
    launch(_maxsim_varlen_fwd_kernel, (n_programs,), args, _VALUE_SPECIALIZED, constexprs,
           num_warps=num_warps, num_stages=num_stages)
    scores = out[0] if n_chunks == 1 else out.sum(0)
    return (scores.view(Nd, Nq).t().contiguous() if cross else scores), argmax


# Tensors, then sizes Triton does not specialise, then dim (specialised), then sizes again.
_VALUE_SPECIALIZED = (False,) * 8 + (False,) * 5 + (True,) + (False, False, False)
