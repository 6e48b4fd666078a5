"""Fused MaxSim over packed (ragged) sequences: two Triton kernels and their launcher.

Sequences are packed back to back, FlashAttention-style: q ``[Tq, d]`` with ``cu_seqlens_q
[Nq + 1]`` (query i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``), likewise d. Only a document's
real tokens are streamed: work is proportional to the real tokens, not to the longest sequence.

- Cross product: like the dense kernel, a program stacks several queries (each padded to SEG rows
  inside the block, a power of two >= the longest query) or a chunk of one long query into BM rows,
  and walks a run of documents: every document tile read serves all of them.
- Pair lists (``score_pairs_packed``): a program owns a chunk of one pair's query rows and walks a
  run of pairs.
Both share the per-document loop, :func:`_doc_rowmax`. The argmax, when saved, is ``[P, max_q]``
in pair order; for the cross product pair p is query ``p % Nq`` against document ``p // Nq``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from maxsim._checks import pairs_valid, sequences_valid
from maxsim._dispatch import cuda_index, interpreting
from maxsim._kernels import max_nan, mma, stacked_rows
from maxsim._launch import launch
from maxsim.tuning import multiprocessors, next_pow2

# max_d when the caller gives no document bound (an int32 kernel argument).
_NO_BOUND = 2**31 - 1


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


@triton.jit
def seq_range(lo, hi, total, max_len):
    """(lo, hi, ok) of a packed sequence, rows lo:hi as cu_seqlens gives them. ok: it lies inside
    the data (0 <= lo <= hi <= total) and is at most max_len long; an invalid one comes back empty
    (0, 0), so nothing outside the data is ever read, and its outputs are NaN."""
    ok = (lo >= 0) & (hi >= lo) & (hi <= total) & (hi - lo <= max_len)
    return tl.where(ok, lo, 0), tl.where(ok, hi, 0), ok


@triton.jit
def _doc_rowmax(b_q, p_q, m_row, d_ptr, d_lo, d_hi, dim,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
                EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                SAVE_ARGMAX: tl.constexpr):
    """Max over one packed document (rows d_lo:d_hi) for each of the BM query rows.

    b_q [BM, BK] is the resident query block when NUM_K == 1 (else chunks are read from p_q).
    Returns (max [BM] fp32, argmax [BM] int32: the winner's index inside the document, lowest on
    ties, a NaN winning). An empty document leaves max at -inf.
    """
    NEG_INF: tl.constexpr = float("-inf")
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
    b_arg = tl.zeros([BM], dtype=tl.int32)
    for t0 in range(d_lo, d_hi, BN):
        o_t = t0 + o_n  # [BN] packed document rows
        m_t = o_t < d_hi
        p_d = d_ptr + o_t.to(tl.int64)[:, None] * dim  # [BN, 1]
        b_s = tl.zeros([BM, BN], dtype=tl.float32)
        for kk in range(NUM_K):
            o_kk = kk * BK + o_k
            if EVEN_K:
                b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None], other=0.0)  # [BN, BK]
            else:
                b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None] & (o_kk < dim)[None, :], other=0.0)
            if NUM_K > 1:  # wide d: this chunk of the query rows (a new name: b_q is not loop-carried)
                b_qk = tl.load(p_q + o_kk[None, :], mask=m_row[:, None] & (o_kk < dim)[None, :], other=0.0)
            else:
                b_qk = b_q
            if DOT_UPCAST:
                b_s = tl.dot(b_qk.to(tl.float32), tl.trans(b_d.to(tl.float32)), b_s, input_precision="ieee")
            else:
                b_s = mma(b_s, b_qk, b_d, DOT_PRECISION)
        b_s = tl.where(m_t[None, :], b_s, NEG_INF)
        b_tmax = tl.reduce(b_s, 1, max_nan)  # [BM]
        if SAVE_ARGMAX:
            is_max = (b_s == b_tmax[:, None]) | (b_s != b_s)
            b_targ = tl.min(tl.where(is_max, o_n[None, :], BN), axis=1)  # first winner in the tile
            # Strict '>' keeps the earlier tile on ties; a NaN wins over any number.
            upd = (b_tmax > b_max) | ((b_tmax != b_tmax) & (b_max == b_max))
            b_arg = tl.where(upd, (t0 - d_lo).to(tl.int32) + b_targ, b_arg)
            b_max = tl.where(upd, b_tmax, b_max)
        else:
            b_max = max_nan(b_max, b_tmax)
    return b_max, b_arg


@triton.jit
def _load_query_block(p_q, m_row, dim, BK: tl.constexpr, NUM_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BM, BK] query block that stays on chip when d fits one chunk (else a placeholder)."""
    o_k = tl.arange(0, BK)
    if NUM_K == 1:
        if EVEN_K:
            b_q = tl.load(p_q + o_k[None, :], mask=m_row[:, None], other=0.0)
        else:
            b_q = tl.load(p_q + o_k[None, :], mask=m_row[:, None] & (o_k < dim)[None, :], other=0.0)
    else:
        b_q = tl.zeros([1, BK], dtype=p_q.dtype.element_ty)
    return b_q


@triton.jit(do_not_specialize=["Nq", "Nd", "Tq", "Td", "n_chunks", "docs_per_program", "max_q", "max_d"])
def _maxsim_varlen_cross_kernel(
    q_ptr, d_ptr, cuq_ptr, cud_ptr, out_ptr, arg_ptr,
    Nq, Nd, Tq, Td, dim, n_chunks, docs_per_program, max_q, max_d,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, SEG: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
):
    """Every packed query against every packed document. out fp32 [n_chunks, Nq, Nd] (partial
    sums per query chunk); argmax int32 [Nd * Nq, max_q] (pair p = j * Nq + i). A score whose query
    or document is invalid (see seq_range) is NaN, its argmax -1."""
    QPB: tl.constexpr = BM // SEG  # queries per block
    i_n, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, n_chunks, BM, SEG)  # o_q, o_s: [BM]
    m_q = o_q < Nq
    q_lo, q_hi, q_ok = seq_range(tl.load(cuq_ptr + o_q, mask=m_q, other=0),
                                 tl.load(cuq_ptr + o_q + 1, mask=m_q, other=0), Tq, max_q)  # [BM] each
    m_row = m_q & (q_lo + o_s < q_hi)
    # [QPB]: the rows of one query share its validity.
    b_qok = tl.min(tl.reshape(q_ok.to(tl.int32), [QPB, SEG]), axis=1) > 0
    p_q = q_ptr + (q_lo + o_s).to(tl.int64)[:, None] * dim  # [BM, 1]
    b_q = _load_query_block(p_q, m_row, dim, BK, NUM_K, EVEN_K)
    o_qb = i_qgroup * QPB + tl.arange(0, QPB)
    j0 = (i_n * docs_per_program).to(tl.int64)
    for jj in range(0, tl.minimum(docs_per_program, Nd - j0)):
        j = j0 + jj
        d_lo, d_hi, d_ok = seq_range(tl.load(cud_ptr + j), tl.load(cud_ptr + j + 1), Td, max_d)
        b_max, b_arg = _doc_rowmax(b_q, p_q, m_row, d_ptr, d_lo, d_hi, dim, BM, BN, BK, NUM_K, EVEN_K,
                                   DOT_PRECISION, DOT_UPCAST, SAVE_ARGMAX)
        keep = m_row & (d_hi > d_lo)  # an empty document contributes 0
        b_score = tl.sum(tl.reshape(tl.where(keep, b_max, 0.0), [QPB, SEG]), axis=1)  # [QPB]
        b_score = tl.where(b_qok & d_ok, b_score, float("nan"))
        tl.store(out_ptr + (i_chunk.to(tl.int64) * Nq + o_qb) * Nd + j, b_score, mask=o_qb < Nq)
        if SAVE_ARGMAX:
            p_arg = arg_ptr + (j * Nq + o_q) * max_q + o_s
            tl.store(p_arg, tl.where(keep, b_arg, -1), mask=m_q & (o_s < max_q))


@triton.jit(do_not_specialize=["Nq", "Nd", "P", "Tq", "Td", "n_chunks", "pairs_per_program", "max_q", "max_d"])
def _maxsim_pairs_kernel(
    q_ptr, d_ptr, cuq_ptr, cud_ptr, pq_ptr, pd_ptr, out_ptr, arg_ptr,
    Nq, Nd, P, Tq, Td, dim, n_chunks, pairs_per_program, max_q, max_d,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
):
    """Listed pairs. pairs int64 [P]; out fp32 [n_chunks, P]; argmax int32 [P, max_q]. A pair
    with an index out of range, or an invalid query or document (see seq_range), scores NaN and
    passes no gradient (never a fault)."""
    i_pid = tl.program_id(0)
    i_chunk = i_pid % n_chunks
    p0 = ((i_pid // n_chunks) * pairs_per_program).to(tl.int64)
    o_s = i_chunk * BM + tl.arange(0, BM)  # [BM] tokens of the pair's query
    for pp in range(0, tl.minimum(pairs_per_program, P - p0)):
        p = p0 + pp  # int64
        i, j, ok = pair_of(p, pq_ptr, pd_ptr, Nq, Nd, False)
        q_lo, q_hi, q_ok = seq_range(tl.load(cuq_ptr + i), tl.load(cuq_ptr + i + 1), Tq, max_q)
        d_lo, d_hi, d_ok = seq_range(tl.load(cud_ptr + j), tl.load(cud_ptr + j + 1), Td, max_d)
        ok = ok & q_ok & d_ok
        m_row = q_lo + o_s < q_hi
        p_q = q_ptr + (q_lo + o_s).to(tl.int64)[:, None] * dim  # [BM, 1]
        b_q = _load_query_block(p_q, m_row, dim, BK, NUM_K, EVEN_K)
        b_max, b_arg = _doc_rowmax(b_q, p_q, m_row, d_ptr, d_lo, d_hi, dim, BM, BN, BK, NUM_K, EVEN_K,
                                   DOT_PRECISION, DOT_UPCAST, SAVE_ARGMAX)
        keep = m_row & (d_hi > d_lo)
        score = tl.where(ok, tl.sum(tl.where(keep, b_max, 0.0), axis=0), float("nan"))
        tl.store(out_ptr + i_chunk.to(tl.int64) * P + p, score)
        if SAVE_ARGMAX:
            tl.store(arg_ptr + p * max_q + o_s, tl.where(keep & ok, b_arg, -1), mask=o_s < max_q)


def varlen_forward(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    max_q: int,
    pair_q: torch.Tensor | None = None,
    pair_d: torch.Tensor | None = None,
    save_argmax: bool = False,
    *,
    config: dict,
    max_d: int | None = None,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores for the cross product (``pair_q`` None) -> ``[Nq, Nd]``, or for pairs -> ``[P]``.

    q ``[Tq, dim]``, d ``[Td, dim]`` contiguous; cu_q ``[Nq + 1]``, cu_d ``[Nd + 1]`` int64 on the
    same device; ``max_q`` bounds every query's length (it sets the number of query chunks), ``max_d``
    (None: no bound) every document's. An output whose query or document lies outside the data or
    passes its bound, or whose pair index is out of range, is NaN (argmax -1).
    ``config``: the tile (BM, BN, BK, num_warps, num_stages) from ``maxsim.selection.varlen``;
    ``precision``: fp32 inputs' products (``"ieee"`` / ``"tf32x3"`` / ``"tf32"``, resolved by the selection).
    With ``save_argmax`` also returns argmax ``[P, max_q]`` int32 in pair order (cross product:
    pair p = query p % Nq, document p // Nq), else None.
    """
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    cross = pair_q is None
    P = Nq * Nd if cross else pair_q.numel()
    dim = q.shape[1]
    argmax = torch.full((P, max_q), -1, dtype=torch.int32, device=q.device) if save_argmax else None
    max_d = _NO_BOUND if max_d is None else max_d
    if P == 0 or max_q == 0:
        # Nothing to multiply: every valid query is empty. No host read: the rule, on the device.
        q_ok = sequences_valid(cu_q, q.shape[0], max_q)
        d_ok = sequences_valid(cu_d, d.shape[0], max_d)
        ok = q_ok[:, None] & d_ok[None, :] if cross else pairs_valid(pair_q, pair_d, q_ok, d_ok)
        return torch.where(ok, 0.0, float("nan")).to(torch.float32), argmax
    interpret = interpreting()
    slots = 1 if interpret else 2 * multiprocessors(cuda_index(q))
    seg_q = next_pow2(max_q)
    BM, BN, BK = config["BM"], config["BN"], config["BK"]
    num_warps, num_stages = config["num_warps"], config["num_stages"]
    seg = min(seg_q, BM)
    n_chunks = -(-max_q // seg)
    arg = argmax if argmax is not None else cu_q  # any tensor when unused
    constexprs = dict(
        BM=BM, BN=BN, BK=BK, NUM_K=-(-dim // BK), EVEN_K=dim % BK == 0,
        DOT_PRECISION=precision if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and q.dtype == torch.bfloat16, SAVE_ARGMAX=save_argmax,
    )
    if cross:
        n_mblocks = -(-Nq // (BM // seg)) * n_chunks
        docs_per_program = max(1, -(-Nd // max(1, slots // n_mblocks)))
        out = torch.empty((n_chunks, Nq, Nd), dtype=torch.float32, device=q.device)
        args = (q, d, cu_q, cu_d, out, arg, Nq, Nd, q.shape[0], d.shape[0], dim, n_chunks, docs_per_program, max_q,
                max_d)
        launch(_maxsim_varlen_cross_kernel, (n_mblocks * -(-Nd // docs_per_program),), args,
               dict(constexprs, SEG=seg), num_warps=num_warps, num_stages=num_stages)
    else:
        pairs_per_program = max(1, -(-P * n_chunks // slots))
        out = torch.empty((n_chunks, P), dtype=torch.float32, device=q.device)
        args = (q, d, cu_q, cu_d, pair_q, pair_d, out, arg,
                Nq, Nd, P, q.shape[0], d.shape[0], dim, n_chunks, pairs_per_program, max_q, max_d)
        launch(_maxsim_pairs_kernel, (n_chunks * -(-P // pairs_per_program),), args,
               constexprs, num_warps=num_warps, num_stages=num_stages)
    return (out[0] if n_chunks == 1 else out.sum(0)), argmax
