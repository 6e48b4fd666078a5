"""Fused MaxSim forward over padded tensors: one Triton kernel and its launcher.

The cross product is one GEMM ``[Nq*Lq, d] x [d, Nd*Ld]`` whose epilogue is a max over each
document's Ld columns and a sum over each query's Lq rows. A program owns one block of BM query
rows (several short queries stacked, or a BM-row chunk of one long query) and a run of documents.
It streams each document's tokens in tiles of BN through a tensor-core ``tl.dot`` and folds them
into a running elementwise max ``[BM, BN]``; when a document ends it reduces that to one max per
query token, sums each query's rows and writes one score per (query, document). The similarity
tensor never leaves the chip, and every document tile read serves all BM rows.

The loop over (document, tile) pairs is flattened into one loop so that Triton's software pipeline
keeps loads in flight across document boundaries; the per-document epilogue is a branch inside it.
With a document mask (exclusion rule) the kernel walks instead one document at a time, each only up
to its last real token, read from the mask row on the device: padding is neither loaded nor
multiplied, and no length crosses to the host.

On Hopper, compute-bound calls on big corpora run the warp-specialized Gluon kernel of
forward_ws.py instead (:mod:`maxsim.selection.dense` decides): there a producer warp and two
consumer warpgroups overlap the max epilogue with the tensor cores, which this kernel's single
instruction stream cannot. This module's launcher runs whichever the selection chose.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from maxsim import _outputs
from maxsim._dispatch import cuda_index, interpreting
from maxsim._kernels import dot_chunk, max_nan, stacked_rows
from maxsim._launch import launch
from maxsim.tuning import multiprocessors, next_pow2
from maxsim.tuning.configs import ForwardConfig


@triton.jit
def _fold_tile(b_max, b_arg, b_wintile, b_seen, b_dbad, j, i_t,
               b_q, b_qm, p_q_rows, m_row, o_k, o_n, dim, Ld, p_d_base, stride_dn, stride_dl,
               p_dm_base, stride_dmn, d_desc, i_dgroup,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
               HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, MULTIPLY: tl.constexpr,
               NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr, EVEN_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, ROW_MAX: tl.constexpr,
               USE_TMA: tl.constexpr, DMASK_VALUES: tl.constexpr):
    """Fold tile ``i_t`` of document ``j`` (tokens ``i_t*BN + [0, BN)``) into the running max
    state; returns it (b_max, b_arg, b_wintile, b_seen, b_dbad: see the kernel)."""
    NEG_INF: tl.constexpr = float("-inf")
    o_t = i_t * BN + o_n  # [BN] document tokens
    m_t = o_t < Ld
    p_d_rows = p_d_base + j.to(tl.int64) * stride_dn + o_t[:, None] * stride_dl  # [BN, 1]
    if HAS_DMASK:
        b_dv = tl.load(p_dm_base + j.to(tl.int64) * stride_dmn + o_t, mask=m_t, other=0)  # [BN]
        b_dm = b_dv != 0
        # Masked tokens are never read (a masked row loads as 0 without touching memory), except
        # under PyLate's rule, where a masked token's NaN or inf still reaches the max.
        m_load = m_t if USE_TMA or MULTIPLY else m_t & b_dm
    else:
        m_load = m_t

    b_s = tl.zeros([BM, BN], dtype=tl.float32)
    d_sq = tl.zeros([BN], dtype=tl.float32)  # squared norms of the tile's tokens (normalize)
    if NUM_K == 1:
        # One dot against the query block that stays on chip (no inner loop, so the
        # software pipeline runs over the (document, tile) loop itself).
        b_s, d_sq = dot_chunk(b_s, d_sq, b_q, p_q_rows, p_d_rows, o_k, m_row, m_load, dim,
                               d_desc, i_dgroup, j * Ld + i_t * BN, 0,
                               False, EVEN_K, NORMALIZE, DOT_PRECISION, DOT_UPCAST, USE_TMA, BN, BK)
    else:
        # Wide embeddings: a K-loop streaming [BM, BK] and [BN, BK] chunks (query from L2).
        for kk in range(NUM_K):
            b_s, d_sq = dot_chunk(b_s, d_sq, b_s, p_q_rows, p_d_rows, kk * BK + o_k, m_row, m_load, dim,
                                   d_desc, i_dgroup, j * Ld + i_t * BN, kk * BK,
                                   True, EVEN_K, NORMALIZE, DOT_PRECISION, DOT_UPCAST, USE_TMA, BN, BK)
    if NORMALIZE:
        b_s = b_s * (1.0 / tl.maximum(tl.sqrt(d_sq), 1e-12))[None, :]

    if MULTIPLY:
        # PyLate's rule: masked similarities become 0 and still take part in the max.
        if HAS_QMASK:
            b_s = b_s * b_qm.to(tl.float32)[:, None]
        if HAS_DMASK:
            if DMASK_VALUES:
                b_dbad = b_dbad | (b_dm & (b_dv != 1)).to(tl.int32)
            b_s = b_s * b_dm.to(tl.float32)[None, :]
        if (i_t + 1) * BN > Ld:
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)
    elif HAS_DMASK:
        if DMASK_VALUES:
            b_dbad = b_dbad | (b_dm & (b_dv != 1)).to(tl.int32)
        b_s = tl.where(b_dm[None, :], b_s, NEG_INF)
        b_seen = b_seen | b_dm.to(tl.int32)
    elif (i_t + 1) * BN > Ld:
        # Only the ragged last tile pays for the bounds mask.
        b_s = tl.where(m_t[None, :], b_s, NEG_INF)

    # Strict '>' keeps the earliest tile on ties; a NaN wins over any number.
    if not ROW_MAX and SAVE_ARGMAX:
        upd = (b_s > b_max) | ((b_s != b_s) & (b_max == b_max))
        b_max = tl.where(upd, b_s, b_max)
        b_arg = tl.where(upd, i_t, b_arg)
    elif not ROW_MAX:
        b_max = max_nan(b_max, b_s)
    elif SAVE_ARGMAX:
        b_tmax = tl.reduce(b_s, 1, max_nan)  # [BM]
        upd = (b_tmax > b_max) | ((b_tmax != b_tmax) & (b_max == b_max))
        b_wintile = tl.where(upd[:, None], b_s, b_wintile)
        b_arg = tl.where(upd, i_t, b_arg)
        b_max = tl.where(upd, b_tmax, b_max)
    else:
        b_max = max_nan(b_max, tl.reduce(b_s, 1, max_nan))
    return b_max, b_arg, b_wintile, b_seen, b_dbad


@triton.jit
def _finish_doc(b_max, b_arg, b_wintile, b_seen, b_dbad, doc_real, j,
                out_ptr, argmax_ptr, i_chunk, i_qgroup, o_q, o_s, o_n, m_row, b_qm, b_qbad, q_inv_norm,
                Nq, Nd, Lq, Ld, p_dm_base, stride_dmn,
                BM: tl.constexpr, BN: tl.constexpr, SEG: tl.constexpr,
                HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, MULTIPLY: tl.constexpr,
                NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr, ROW_MAX: tl.constexpr,
                FLOWING: tl.constexpr, QMASK_VALUES: tl.constexpr, DMASK_VALUES: tl.constexpr):
    """Document ``j`` is complete: one max per query token, one sum per query, stored (with the
    argmax); returns the state reset for the next document. ``doc_real``: whether the document has
    a real token (the walk's own count, or ``b_seen``'s when None)."""
    NEG_INF: tl.constexpr = float("-inf")
    QPB: tl.constexpr = BM // SEG
    if ROW_MAX:
        b_rowmax = b_max
    else:
        b_rowmax = tl.reduce(b_max, 1, max_nan)  # [BM]
    b_best = b_rowmax
    if NORMALIZE:
        b_best = b_best * q_inv_norm  # a positive scale commutes with the max
    if doc_real is None:
        doc_real = tl.max(b_seen, axis=0) > 0
    m_keep = m_row
    if HAS_QMASK and not MULTIPLY:
        m_keep = m_keep & b_qm
    if HAS_DMASK and not MULTIPLY:
        m_keep = m_keep & doc_real  # empty document -> 0
    b_best = tl.where(m_keep, b_best, 0.0)
    b_score = tl.sum(tl.reshape(b_best, [QPB, SEG]), axis=1)  # [QPB]
    if QMASK_VALUES:
        b_score = tl.where(tl.max(tl.reshape(b_qbad, [QPB, SEG]), axis=1) > 0, float("nan"), b_score)
    if DMASK_VALUES:
        b_score = tl.where(tl.max(b_dbad, axis=0) > 0, float("nan"), b_score)
    o_qb = i_qgroup * QPB + tl.arange(0, QPB)
    p_out = out_ptr + (i_chunk.to(tl.int64) * Nq + o_qb) * Nd + j
    tl.store(p_out, b_score, mask=o_qb < Nq)
    if SAVE_ARGMAX:
        if ROW_MAX:
            # The first column of the winning tile that holds the max (NaN wins). A row
            # with no finite winner finds none (BN): it is masked to -1 below.
            is_max = (b_wintile == b_rowmax[:, None]) | (b_wintile != b_wintile)
            b_col = tl.min(tl.where(is_max, o_n[None, :], BN), axis=1)  # [BM]
            b_idx = b_arg * BN + tl.minimum(b_col, BN - 1)
        else:
            is_max = (b_max == b_rowmax[:, None]) | (b_max != b_max)
            o_tok = b_arg * BN + o_n[None, :]
            b_idx = tl.min(tl.where(is_max, o_tok, 2147483647), axis=1)  # lowest index among ties
        m_arg = m_row
        if HAS_QMASK:
            m_arg = m_arg & b_qm
        if HAS_DMASK and not MULTIPLY:
            m_arg = m_arg & doc_real
        if FLOWING and HAS_DMASK and MULTIPLY:
            # PyLate's rule: a masked winner (its similarity forced to 0) passes no gradient
            m_win = m_arg & (b_idx >= 0) & (b_idx < Ld)
            b_win = tl.load(p_dm_base + j.to(tl.int64) * stride_dmn + b_idx, mask=m_win, other=0)
            m_arg = m_win & (b_win != 0)
        b_idx = tl.where(m_arg, b_idx, -1)
        p_arg = argmax_ptr + (o_q.to(tl.int64) * Nd + j) * Lq + o_s
        tl.store(p_arg, b_idx, mask=m_row)
    if ROW_MAX:
        b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
    else:
        b_max = tl.full([BM, BN], NEG_INF, dtype=tl.float32)
    if SAVE_ARGMAX:
        b_arg = tl.zeros_like(b_arg)
    if HAS_DMASK:
        b_seen = tl.zeros_like(b_seen)
    if DMASK_VALUES:
        b_dbad = tl.zeros_like(b_dbad)
    return b_max, b_arg, b_wintile, b_seen, b_dbad


@triton.jit
def _mask_row(p_dm_row, n, live, MASK_LANES: tl.constexpr):
    """Loads the first ``min(n, MASK_LANES)`` values of a document's mask row (nothing when not
    ``live``), for :func:`_doc_extent`: a load that can be issued a document ahead of its use."""
    o_l = tl.arange(0, MASK_LANES)
    return tl.load(p_dm_row + o_l, mask=(o_l < n) & live, other=0)  # [MASK_LANES]


@triton.jit
def _extent_of(b_v, MASK_LANES: tl.constexpr):
    """One past the last nonzero value of a mask row piece (0 when it has none)."""
    o_l = tl.arange(0, MASK_LANES)
    return tl.max(tl.where(b_v != 0, o_l + 1, 0), axis=0)


@triton.jit
def _doc_extent(b_first, p_dm_row, Ld, MASK_LANES: tl.constexpr):
    """One past the last real token of a document (0 for one with none), from its first
    ``MASK_LANES`` mask values ``b_first`` and, for longer documents, the rest read here."""
    extent = _extent_of(b_first, MASK_LANES)
    for c in range(MASK_LANES, Ld, MASK_LANES):
        e = _extent_of(_mask_row(p_dm_row + c, Ld - c, True, MASK_LANES), MASK_LANES)
        extent = tl.where(e > 0, c + e, extent)
    return extent


# Sizes vary call to call: no value specialisation (Triton would compile again for 1 or multiples
# of 16), nor for the mask strides (= Ld, read a byte at a time). The embedding strides stay
# specialised: their divisibility by 16 gives 16-byte loads.
@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld", "n_chunks", "docs_per_program", "stride_dmq", "stride_dmn"])
def _maxsim_fwd_kernel(
    q_ptr, d_ptr, d_desc,  # d_desc: a TMA descriptor of D as [Nq|1, Nd*Ld, d] (USE_TMA), else unused
    qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
    Nq, Nd, Lq, Ld, dim,
    n_chunks, docs_per_program,
    stride_qn, stride_ql,  # Q [Nq, Lq, d], unit stride on d
    stride_dq, stride_dn, stride_dl,  # D [Nq|1, Nd, Ld, d]; stride_dq == 0 when documents are shared
    stride_dmq, stride_dmn,  # d_mask [Nq|1, Nd, Ld], unit stride on Ld
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
    SEG: tl.constexpr,  # rows per query in a block: pow2 >= Lq, or BM when queries are chunked
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, MULTIPLY: tl.constexpr,
    NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # Triton's interpreter computes bf16 dots wrongly: upcast there
    ROW_MAX: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLOWING: tl.constexpr,  # SAVE_ARGMAX for the backward: a masked winner (MULTIPLY) is -1, no gradient
    QMASK_VALUES: tl.constexpr,  # a number q_mask: a value other than 0/1 makes its query's scores NaN
    DMASK_VALUES: tl.constexpr,  # the same for a number d_mask and its document's scores
    MASK_LANES: tl.constexpr,  # > 0: walk each document only up to its last real token (d_mask,
                               # exclusion), reading its mask row this many tokens at a time
):
    NEG_INF: tl.constexpr = float("-inf")
    i_n, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, n_chunks, BM, SEG)  # o_q, o_s: [BM]
    m_row = (o_q < Nq) & (o_s < Lq)  # [BM]
    p_q_rows = q_ptr + o_q.to(tl.int64)[:, None] * stride_qn + o_s[:, None] * stride_ql  # [BM, 1]

    b_qbad = tl.zeros([BM], dtype=tl.int32)  # query rows holding a value other than 0/1 (QMASK_VALUES)
    if HAS_QMASK:
        b_qv = tl.load(qmask_ptr + o_q.to(tl.int64) * Lq + o_s, mask=m_row, other=0)  # [BM]
        b_qm = b_qv != 0
        if QMASK_VALUES:
            b_qbad = (b_qm & (b_qv != 1)).to(tl.int32)
    else:
        b_qm = m_row
    o_k = tl.arange(0, BK)
    b_q = tl.zeros([BM, BK], dtype=q_ptr.dtype.element_ty)  # the resident query block (NUM_K == 1)
    if NUM_K == 1:
        # The whole query block stays on chip for the program's lifetime.
        if EVEN_K:
            b_q = tl.load(p_q_rows + o_k[None, :], mask=m_row[:, None], other=0.0)  # [BM, BK]
        else:
            b_q = tl.load(p_q_rows + o_k[None, :], mask=m_row[:, None] & (o_k < dim)[None, :], other=0.0)
    q_inv_norm = tl.full([BM], 1.0, dtype=tl.float32)
    if NORMALIZE:
        q_sq = tl.zeros([BM], dtype=tl.float32)
        for kq in tl.static_range(NUM_K):
            o_kk = kq * BK + o_k
            b_qk = tl.load(p_q_rows + o_kk[None, :], mask=m_row[:, None] & (o_kk < dim)[None, :], other=0.0)
            q_sq += tl.sum(b_qk.to(tl.float32) * b_qk.to(tl.float32), axis=1)
        q_inv_norm = 1.0 / tl.maximum(tl.sqrt(q_sq), 1e-12)  # [BM]

    n_tiles = tl.cdiv(Ld, BN)
    doc0 = i_n * docs_per_program
    n_docs = tl.minimum(docs_per_program, Nd - doc0)
    p_d_base = d_ptr + i_qgroup.to(tl.int64) * stride_dq  # documents of this query (candidates) or all
    i_dgroup = tl.where(stride_dq != 0, i_qgroup, 0)  # the same, as the TMA descriptor's first coordinate
    p_dm_base = dmask_ptr + i_qgroup.to(tl.int64) * stride_dmq
    o_n = tl.arange(0, BN)

    # Running max: per (row, column) folded elementwise (one max per element, reduced across
    # columns once per document) or, with ROW_MAX, reduced to one value per row after every tile
    # (half the registers, so wider tiles fit). The argmax with ROW_MAX keeps the winning tile's
    # similarities and finds the column in it once per document, not once per tile: the per-tile
    # cost is one select per element. State a variant does not use stays a small placeholder.
    if ROW_MAX:
        b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
        b_arg = tl.zeros([BM], dtype=tl.int32)  # tile where b_max was reached
        if SAVE_ARGMAX:
            b_wintile = tl.full([BM, BN], NEG_INF, dtype=tl.float32)  # that tile's similarities
        else:
            b_wintile = tl.zeros([BM], dtype=tl.float32)
    else:
        b_max = tl.full([BM, BN], NEG_INF, dtype=tl.float32)
        if SAVE_ARGMAX:
            b_arg = tl.zeros([BM, BN], dtype=tl.int32)  # tile index where b_max was reached
        else:
            b_arg = tl.zeros([BM], dtype=tl.int32)
        b_wintile = tl.zeros([BM], dtype=tl.float32)
    b_seen = tl.zeros([BN], dtype=tl.int32)  # any real token in this document so far (HAS_DMASK)
    b_dbad = tl.zeros([BN], dtype=tl.int32)  # any value other than 0/1 in it so far (DMASK_VALUES)

    if MASK_LANES > 0:
        # One document at a time, each walked only up to its last real token: padding past it is
        # never loaded nor multiplied. The start of the next document's mask row is loaded a
        # document ahead, so its latency hides behind this one's tiles.
        b_next = _mask_row(p_dm_base + doc0.to(tl.int64) * stride_dmn, Ld, n_docs > 0, MASK_LANES)
        for jj in range(0, n_docs):
            j = doc0 + jj
            n_real = tl.cdiv(_doc_extent(b_next, p_dm_base + j.to(tl.int64) * stride_dmn, Ld, MASK_LANES), BN)
            b_next = _mask_row(p_dm_base + (j + 1).to(tl.int64) * stride_dmn, Ld, jj + 1 < n_docs, MASK_LANES)
            for i_t in range(0, n_real):
                b_max, b_arg, b_wintile, b_seen, b_dbad = _fold_tile(
                    b_max, b_arg, b_wintile, b_seen, b_dbad, j, i_t,
                    b_q, b_qm, p_q_rows, m_row, o_k, o_n, dim, Ld, p_d_base, stride_dn, stride_dl,
                    p_dm_base, stride_dmn, d_desc, i_dgroup,
                    BM, BN, BK, NUM_K, HAS_QMASK, HAS_DMASK, MULTIPLY, NORMALIZE, SAVE_ARGMAX, EVEN_K,
                    DOT_PRECISION, DOT_UPCAST, ROW_MAX, USE_TMA, DMASK_VALUES)
            # The walk's own tile count says whether the document has a real token. (It must be
            # used here: Triton 3.6 drops a loop-carried value whose only use is an inner loop's
            # bound, and the next document's count would then be the first one's.)
            b_max, b_arg, b_wintile, b_seen, b_dbad = _finish_doc(
                b_max, b_arg, b_wintile, b_seen, b_dbad, n_real > 0, j,
                out_ptr, argmax_ptr, i_chunk, i_qgroup, o_q, o_s, o_n, m_row, b_qm, b_qbad, q_inv_norm,
                Nq, Nd, Lq, Ld, p_dm_base, stride_dmn,
                BM, BN, SEG, HAS_QMASK, HAS_DMASK, MULTIPLY, NORMALIZE, SAVE_ARGMAX, ROW_MAX,
                FLOWING, QMASK_VALUES, DMASK_VALUES)
    else:
        # The (document, tile) pairs as one flat loop, so that Triton's software pipeline keeps
        # loads in flight across document boundaries.
        for it in range(0, n_docs * n_tiles):
            j = doc0 + it // n_tiles
            i_t = it % n_tiles
            b_max, b_arg, b_wintile, b_seen, b_dbad = _fold_tile(
                b_max, b_arg, b_wintile, b_seen, b_dbad, j, i_t,
                b_q, b_qm, p_q_rows, m_row, o_k, o_n, dim, Ld, p_d_base, stride_dn, stride_dl,
                p_dm_base, stride_dmn, d_desc, i_dgroup,
                BM, BN, BK, NUM_K, HAS_QMASK, HAS_DMASK, MULTIPLY, NORMALIZE, SAVE_ARGMAX, EVEN_K,
                DOT_PRECISION, DOT_UPCAST, ROW_MAX, USE_TMA, DMASK_VALUES)
            if i_t == n_tiles - 1:
                b_max, b_arg, b_wintile, b_seen, b_dbad = _finish_doc(
                    b_max, b_arg, b_wintile, b_seen, b_dbad, None, j,
                    out_ptr, argmax_ptr, i_chunk, i_qgroup, o_q, o_s, o_n, m_row, b_qm, b_qbad, q_inv_norm,
                    Nq, Nd, Lq, Ld, p_dm_base, stride_dmn,
                    BM, BN, SEG, HAS_QMASK, HAS_DMASK, MULTIPLY, NORMALIZE, SAVE_ARGMAX, ROW_MAX,
                    FLOWING, QMASK_VALUES, DMASK_VALUES)


def maxsim_forward(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None,
    d_mask: torch.Tensor | None,
    *,
    config: ForwardConfig,
    warp_specialized: bool = False,
    normalize: bool = False,
    multiply: bool = False,
    save_argmax: int = 0,
    precision: str = "ieee",
    plan_key=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the fused forward on canonical, validated inputs, with the kernel and tile the
    selection layer chose (:func:`maxsim.selection.dense.forward_plan`).

    Args:
        Q: ``[Nq, Lq, d]``.  D: ``[Nq|1, Nd, Ld, d]`` (leading 1 = documents shared by all queries).
        q_mask: ``[Nq, Lq]`` or None.  d_mask: ``[Nq|1, Nd, Ld]`` or None. Bool, or numbers (an
            attention mask): nonzero is a real token, and a value other than 0 and 1 makes that
            query's / document's scores NaN (checked in the kernel: no host synchronisation).
        config: the tile.  warp_specialized: run forward_ws.py's Gluon kernel instead of this
            module's (the selection checked that it can run the call).
        multiply: PyLate's mask rule instead of exclusion.
        save_argmax: also return the winning document token per query token: 1 (or True) the
            winner, 2 the winner the backward routes through (with ``multiply`` and ``d_mask``, a
            masked winner, whose similarity was forced to 0, is -1: no gradient).
        precision: fp32 inputs' products: ``"ieee"``, ``"tf32x3"`` or ``"tf32"`` (Triton's
            ``input_precision``; the selection resolved it). 16-bit inputs ignore it.
        plan_key: the caller's key of this call's signature (see :func:`plan_for`): a launch that
            runs on the thin path, with no copy of an input, is kept as that key's plan.

    Returns:
        scores ``[Nq, Nd]`` fp32 and, with ``save_argmax``, argmax ``[Nq, Nd, Lq]`` int32
        (-1 where the query token is masked or the document has no real token).
    """
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    argmax = None
    if save_argmax:
        argmax = _outputs.empty((Nq, Nd, Lq), torch.int32, Q.device)
    if Nq == 0 or Nd == 0 or Lq == 0 or Ld == 0:
        # Empty sets contribute 0; there is no token to point at.
        if argmax is not None:
            argmax.fill_(-1)
        return torch.zeros((Nq, Nd), dtype=torch.float32, device=Q.device), argmax

    # The kernel takes any strides but a unit stride on d (one copy otherwise; no plan then).
    if Q.stride(-1) != 1 or D.stride(-1) != 1 or (q_mask is not None and not q_mask.is_contiguous()) or \
            (d_mask is not None and d_mask.stride(-1) != 1):
        plan_key = None
    Q = Q if Q.stride(-1) == 1 else Q.contiguous()
    D = D if D.stride(-1) == 1 else D.contiguous()
    qm = q_mask.contiguous() if q_mask is not None else None
    dm = None
    if d_mask is not None:
        dm = d_mask if d_mask.stride(-1) == 1 else d_mask.contiguous()
    interpret = interpreting()
    device_index = -1 if interpret else cuda_index(Q)
    return _launch_forward(Q, D, qm, dm, argmax, config, warp_specialized, multiply, normalize, interpret,
                           device_index, plan_key, precision, flowing=save_argmax == 2), argmax


def _launch_forward(Q, D, qm, dm, argmax, cfg, warp_specialized, multiply, normalize, interpret, device_index,
                    plan_key=None, precision="ieee", flowing=False):
    """One launch of the forward kernel with configuration ``cfg``; returns the scores [Nq, Nd].
    With ``plan_key``, a launch that went through the thin path is kept as that key's plan."""
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    candidates = D.shape[0] != 1
    if warp_specialized:  # (unmasked calls only, per the selection: no masked winner to flag)
        from maxsim.dense import forward_ws  # (Gluon: imported only where the selection chose it)

        scores, _, plan = forward_ws.maxsim_forward_ws(
            Q, D[0], qm, None if dm is None else dm[0], multiply=multiply, save_argmax=argmax is not None,
            BN=cfg.BN, STAGES=cfg.num_stages, argmax_out=argmax, keep_plan=True)
        if plan_key is not None and plan is not None:
            _keep_plan(plan_key, plan)
        return scores
    seg, n_chunks, docs_per_program, n_programs = _grid_plan(Nq, Nd, Lq, cfg.BM, cfg.waves, candidates, device_index)
    # One partial score per query chunk ([n_chunks, Nq, Nd], summed below) unless there is one chunk.
    out = _outputs.empty((Nq, Nd) if n_chunks == 1 else (n_chunks, Nq, Nd), torch.float32, Q.device)
    use_tma = cfg.tma and _tma_ready(D, cfg)
    desc_layout = _descriptor_layout(D, cfg) if use_tma else None
    d_desc = TensorDescriptor(D, *desc_layout) if use_tma else D  # any pointer when unused
    ints = (  # fixed by the call's shapes and strides: a launch plan keeps them
        Nq, Nd, Lq, Ld, d,
        n_chunks, docs_per_program,
        Q.stride(0), Q.stride(1),
        D.stride(0) if candidates else 0, D.stride(1), D.stride(2),
        (dm.stride(0) if dm.shape[0] != 1 else 0) if dm is not None else 0,
        dm.stride(1) if dm is not None else 0,
    )
    args = (*_tensor_args(Q, D, d_desc, qm, dm, out, argmax), *ints)
    constexprs = _constexprs(cfg, d, seg, qm is not None, dm is not None, multiply, normalize, argmax is not None,
                             Q.dtype, interpret, use_tma, precision, flowing and argmax is not None,
                             qm is not None and qm.dtype != torch.bool, dm is not None and dm.dtype != torch.bool,
                             _mask_lanes(dm is not None, multiply, cfg.flat_walk))
    replay = launch(_maxsim_fwd_kernel, (n_programs,), args, constexprs,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan_key is not None and replay is not None:
        _keep_plan(plan_key, _ForwardPlan(replay, ints, tuple(out.shape), n_chunks,
                                          tuple(argmax.shape) if argmax is not None else None, desc_layout))
    return out if n_chunks == 1 else out.sum(0)


def _keep_plan(plan_key, plan) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[plan_key] = plan


def _tensor_args(Q, D, d_desc, qm, dm, out, argmax) -> tuple:
    """The kernel's leading tensor arguments; an absent mask or argmax passes any pointer."""
    return (Q, D, d_desc, Q if qm is None else qm, Q if dm is None else dm, out, out if argmax is None else argmax)


# Launch plans of recent call signatures: a repeated call (a server's traffic) skips validation,
# the tile rule, the grid plan and the launch key, and replays the compiled kernel on its new
# tensors. The caller owns the key: it must fix every launch argument but the tensors' addresses
# (shapes, strides, dtypes, devices, alignment mod 16, flags); maxsim.maxsim's inference path
# builds one (dense/ops.py).
_PLANS: dict = {}
_MAX_PLANS = 256


def plan_for(plan_key):
    """The launch plan kept for ``plan_key``, or None: ``plan(Q, D, q_mask, d_mask)`` (tensors of
    that signature, in any layout with the same data) returns (scores [Nq, Nd], argmax | None).
    A :class:`_ForwardPlan` (this file's kernel) or a ``forward_ws.WarpSpecializedPlan``."""
    return _PLANS.get(plan_key)


class _ForwardPlan:
    """One signature's launch: new outputs (and TMA descriptor), the same integers and kernel."""

    __slots__ = ("replay", "ints", "out_shape", "n_chunks", "argmax_shape", "desc_layout")

    def __init__(self, replay, ints, out_shape, n_chunks, argmax_shape, desc_layout):
        self.replay, self.ints, self.out_shape, self.n_chunks = replay, ints, out_shape, n_chunks
        self.argmax_shape, self.desc_layout = argmax_shape, desc_layout

    def __call__(self, Q, D, qm, dm):
        out = _outputs.empty(self.out_shape, torch.float32, Q.device)
        argmax = None if self.argmax_shape is None else _outputs.empty(self.argmax_shape, torch.int32, Q.device)
        d_desc = D if self.desc_layout is None else TensorDescriptor(D, *self.desc_layout)
        self.replay((*_tensor_args(Q, D, d_desc, qm, dm, out, argmax), *self.ints))
        return (out if self.n_chunks == 1 else out.sum(0)), argmax


@functools.lru_cache(maxsize=1024)
def _constexprs(cfg: ForwardConfig, d: int, seg: int, has_qmask: bool, has_dmask: bool, multiply: bool,
                normalize: bool, save_argmax: bool, dtype: torch.dtype, interpret: bool, use_tma: bool,
                precision: str = "ieee", flowing: bool = False, qmask_values: bool = False,
                dmask_values: bool = False, mask_lanes: int = 0) -> dict:
    """The kernel's constexprs for one variant (cached: built once, not on every call; read-only).
    ``mask_lanes``: :func:`_mask_lanes`, 0 for the flat walk."""
    return dict(
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_K=-(-d // cfg.BK), SEG=seg,
        HAS_QMASK=has_qmask, HAS_DMASK=has_dmask, MULTIPLY=multiply,
        NORMALIZE=normalize, SAVE_ARGMAX=save_argmax, EVEN_K=(d % cfg.BK == 0),
        DOT_PRECISION=precision if dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and dtype == torch.bfloat16,
        ROW_MAX=cfg.row_max, USE_TMA=use_tma, FLOWING=flowing,
        QMASK_VALUES=qmask_values, DMASK_VALUES=dmask_values,
        MASK_LANES=mask_lanes,
    )


# Tokens of a mask row the padding-skipping walk reads at once (the next document's first ones
# stay in registers while the current document's tiles run; longer rows are read in more pieces).
# One width for every length, so that the compiled variant does not depend on Ld.
MASK_ROW_LANES = 512


def _mask_lanes(has_dmask: bool, multiply: bool, flat_walk: bool = False) -> int:
    """``MASK_ROW_LANES`` for the walk that stops at each document's last real token, or 0 for the
    flat walk over every tile: without a document mask there is no padding, under PyLate's rule
    (``multiply``) a masked token still takes part in the max, and a tile may ask for the flat walk
    (``ForwardConfig.flat_walk``)."""
    return MASK_ROW_LANES if has_dmask and not multiply and not flat_walk else 0


def _tma_ready(D: torch.Tensor, cfg: ForwardConfig) -> bool:
    """Whether D's tiles can come through TMA: 16-bit or fp32 elements, each query group's tokens
    one strided run of rows ``[Nd*Ld, d]`` (stride_dn == Ld * stride_dl) with 16-byte aligned rows,
    and row coordinates that fit int32. Anything else takes the pointer path (same results)."""
    G, Nd, Ld, d = D.shape
    per_16_bytes = 16 // D.element_size()
    return (
        D.element_size() in (2, 4)
        and (Nd == 1 or D.stride(1) == Ld * D.stride(2))
        and D.stride(2) % per_16_bytes == 0 and (G == 1 or D.stride(0) % per_16_bytes == 0)
        and D.data_ptr() % 16 == 0 and Nd * Ld + cfg.BN < 2**31
    )


def _descriptor_layout(D: torch.Tensor, cfg: ForwardConfig) -> tuple:
    """(shape, strides, box) of D's TMA descriptor: D as ``[G, Nd*Ld, d]`` loaded in ``[1, BN, BK]``
    boxes (G = 1 when the documents are shared; out-of-range rows and dims read as 0)."""
    G, Nd, Ld, d = D.shape
    group_stride = D.stride(0) if G > 1 else Nd * Ld * D.stride(2)
    return [G, Nd * Ld, d], [group_stride, D.stride(2), 1], [1, cfg.BN, cfg.BK]


@functools.lru_cache(maxsize=4096)
def _grid_plan(Nq: int, Nd: int, Lq: int, BM: int, waves: int, candidates: bool, device_index: int):
    """(SEG, query chunks, documents per program, programs) for one launch.

    SEG rows per query: short queries stack BM // SEG to a block (cross product only: candidate
    lists are not shared); long ones split into chunks of BM rows. Programs are sized so that
    about ``waves`` run per multiprocessor, each walking a run of documents.
    """
    seg = BM if candidates else min(next_pow2(Lq), BM)
    n_chunks = -(-Lq // seg)
    n_mblocks = -(-Nq // (BM // seg)) * n_chunks
    slots = 1 if device_index < 0 else multiprocessors(device_index) * waves
    docs_per_program = max(1, -(-Nd // max(1, slots // n_mblocks)))
    return seg, n_chunks, docs_per_program, n_mblocks * -(-Nd // docs_per_program)
