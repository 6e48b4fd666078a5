"""Fused top-k MaxSim over padded documents: the score matrix ``[Nq, Nd]`` is never written.

The kernel is the dense Triton forward's (src/maxsim/dense/forward.py) main loop with another
epilogue. A program owns one block of BM stacked query rows (BM // SEG queries) and a run of
documents; each time a document's tiles are done it has one score per query of its block. Instead
of storing that score, it offers it to a per-query buffer of KB slots held in registers: the
program's best (score, document) pairs so far, each as one int64 key that orders by score
descending, then document index ascending (:func:`maxsim.search.topk.order_keys`'s key, built the
same way on the chip). A program writes its KB keys and scores once, at the end, into candidates
``[Nq, runs, KB]``; one ``torch.topk`` over each query's ``runs * KB`` keys then gives the exact
answer (keys are unique, so there is a single right one). Scratch is ``12 * Nq * runs * KB`` bytes,
independent of Nd (``runs`` follows the GPU's multiprocessor count, not the corpus).

Exactness: the scores are computed with the tile (BM, BN, BK, SEG, row_max) that the dense
selection gives ``maxsim.maxsim`` for the same call, through the same sequence of tl operations
(dot, mask, normalise, max, masked sum over SEG rows), so they are the scores ``maxsim.maxsim``
returns, bit for bit. :mod:`maxsim.selection.search` runs this kernel only where that holds (the
dense selection chose its Triton kernel, and each query fits one row block).

Insertion costs one vector compare per document; a query's buffer changes only when a score beats
its current floor (the smallest key held), which after the first KB documents of a run is rare for
a typical corpus, so the buffer's reductions run on few documents.
"""

from __future__ import annotations

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

# The key of an empty slot: below every real key (topk.INVALID_KEY).
EMPTY_KEY = -(2**63)
# Document indices must fit the kernel's int32 document counter.
MAX_FUSED_DOCUMENTS = 2**31 - 1


@triton.jit
def _order_key(b_score, j):
    """int64 keys of scores ``b_score`` [QPB] of document ``j``: larger = better, ties to the lower
    index. As topk.order_keys: -0.0 counts as +0.0, every NaN as one positive NaN above +inf."""
    b_s = tl.where(b_score == 0.0, 0.0, b_score)  # -0.0 -> +0.0
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_bits = tl.where(b_score != b_score, 0x7FC00000, b_bits)
    b_ordered = tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)  # monotone in the float
    return b_ordered.to(tl.int64) * 4294967296 + (4294967295 - j.to(tl.int64))


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld", "n_runs", "docs_per_program", "stride_dmn"])
def _maxsim_topk_kernel(
    q_ptr, d_ptr, d_desc,  # d_desc: a TMA descriptor of D as [1, Nd*Ld, d] (USE_TMA), else unused
    qmask_ptr, dmask_ptr, keys_ptr, scores_ptr,
    Nq, Nd, Lq, Ld, dim,
    n_runs, docs_per_program,
    stride_qn, stride_ql,  # Q [Nq, Lq, d], unit stride on d
    stride_dn, stride_dl,  # D [Nd, Ld, d] (shared by every query)
    stride_dmn,  # d_mask [Nd, Ld], unit stride on Ld
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr,
    SEG: tl.constexpr,  # rows per query in a block: pow2 >= Lq (a query never spans two blocks)
    KB: tl.constexpr,  # top-k slots per query of a program (pow2 >= k)
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, MULTIPLY: tl.constexpr,
    NORMALIZE: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # Triton's interpreter computes bf16 dots wrongly: upcast there
    ROW_MAX: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """keys / scores [Nq, n_runs, KB]: each program's best KB (key, score) pairs per query of its
    block over its run of documents; slots it did not fill hold EMPTY_KEY."""
    QPB: tl.constexpr = BM // SEG  # queries per block
    NEG_INF: tl.constexpr = float("-inf")
    i_run, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, 1, BM, SEG)  # o_q, o_s: [BM]
    m_row = (o_q < Nq) & (o_s < Lq)  # [BM]
    p_q_rows = q_ptr + o_q.to(tl.int64)[:, None] * stride_qn + o_s[:, None] * stride_ql  # [BM, 1]

    if HAS_QMASK:
        b_qm = tl.load(qmask_ptr + o_q.to(tl.int64) * Lq + o_s, mask=m_row, other=0) != 0  # [BM]
    else:
        b_qm = m_row
    o_k = tl.arange(0, BK)
    if NUM_K == 1:
        if EVEN_K:
            b_q = tl.load(p_q_rows + o_k[None, :], mask=m_row[:, None], other=0.0)  # [BM, BK]
        else:
            b_q = tl.load(p_q_rows + o_k[None, :], mask=m_row[:, None] & (o_k < dim)[None, :], other=0.0)
    if NORMALIZE:
        q_sq = tl.zeros([BM], dtype=tl.float32)
        for kq in tl.static_range(NUM_K):
            o_kk = kq * BK + o_k
            b_qk = tl.load(p_q_rows + o_kk[None, :], mask=m_row[:, None] & (o_kk < dim)[None, :], other=0.0)
            q_sq += tl.sum(b_qk.to(tl.float32) * b_qk.to(tl.float32), axis=1)
        q_inv_norm = 1.0 / tl.maximum(tl.sqrt(q_sq), 1e-12)  # [BM]

    n_tiles = tl.cdiv(Ld, BN)
    doc0 = i_run * docs_per_program
    n_docs = tl.minimum(docs_per_program, Nd - doc0)
    o_n = tl.arange(0, BN)

    ELEMENTWISE: tl.constexpr = not ROW_MAX
    if ELEMENTWISE:
        b_max = tl.full([BM, BN], NEG_INF, dtype=tl.float32)
    else:
        b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
    if HAS_DMASK:
        b_seen = tl.zeros([BN], dtype=tl.int32)  # any real token in this document so far

    # The program's top-k per query: KB keys and their scores, and the floor (smallest key held).
    o_slot = tl.arange(0, KB)
    b_keys = tl.full([QPB, KB], -9223372036854775808, dtype=tl.int64)  # [QPB, KB]
    b_vals = tl.zeros([QPB, KB], dtype=tl.float32)  # [QPB, KB]
    b_floor = tl.full([QPB], -9223372036854775808, dtype=tl.int64)  # [QPB]

    for it in range(0, n_docs * n_tiles):
        j = doc0 + it // n_tiles
        i_t = it % n_tiles
        o_t = i_t * BN + o_n  # [BN] document tokens
        m_t = o_t < Ld
        p_d_rows = d_ptr + j.to(tl.int64) * stride_dn + o_t[:, None] * stride_dl  # [BN, 1]

        b_s = tl.zeros([BM, BN], dtype=tl.float32)
        d_sq = tl.zeros([BN], dtype=tl.float32)
        if NUM_K == 1:
            b_s, d_sq = dot_chunk(b_s, d_sq, b_q, p_q_rows, p_d_rows, o_k, m_row, m_t, dim,
                                   d_desc, 0, j * Ld + i_t * BN, 0,
                                   False, EVEN_K, NORMALIZE, DOT_PRECISION, DOT_UPCAST, USE_TMA, BN, BK)
        else:
            for kk in range(NUM_K):
                b_s, d_sq = dot_chunk(b_s, d_sq, b_s, p_q_rows, p_d_rows, kk * BK + o_k, m_row, m_t, dim,
                                       d_desc, 0, j * Ld + i_t * BN, kk * BK,
                                       True, EVEN_K, NORMALIZE, DOT_PRECISION, DOT_UPCAST, USE_TMA, BN, BK)
        if NORMALIZE:
            b_s = b_s * (1.0 / tl.maximum(tl.sqrt(d_sq), 1e-12))[None, :]

        if MULTIPLY:
            if HAS_QMASK:
                b_s = b_s * b_qm.to(tl.float32)[:, None]
            if HAS_DMASK:
                b_dm = tl.load(dmask_ptr + j.to(tl.int64) * stride_dmn + o_t, mask=m_t, other=0)  # [BN]
                b_s = b_s * (b_dm != 0).to(tl.float32)[None, :]
            if (i_t + 1) * BN > Ld:
                b_s = tl.where(m_t[None, :], b_s, NEG_INF)
        elif HAS_DMASK:
            b_dm = tl.load(dmask_ptr + j.to(tl.int64) * stride_dmn + o_t, mask=m_t, other=0) != 0  # [BN]
            b_s = tl.where(b_dm[None, :], b_s, NEG_INF)
            b_seen = b_seen | b_dm.to(tl.int32)
        elif (i_t + 1) * BN > Ld:
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)

        if ELEMENTWISE:
            b_max = max_nan(b_max, b_s)
        else:
            b_max = max_nan(b_max, tl.reduce(b_s, 1, max_nan))

        if i_t == n_tiles - 1:
            # Document j is complete: one max per query token, one sum per query (as the dense
            # forward's epilogue), then offered to the top-k instead of stored.
            if ELEMENTWISE:
                b_rowmax = tl.reduce(b_max, 1, max_nan)  # [BM]
            else:
                b_rowmax = b_max
            b_best = b_rowmax
            if NORMALIZE:
                b_best = b_best * q_inv_norm
            m_keep = m_row
            if HAS_QMASK and not MULTIPLY:
                m_keep = m_keep & b_qm
            if HAS_DMASK and not MULTIPLY:
                m_keep = m_keep & (tl.max(b_seen, axis=0) > 0)  # empty document -> 0
            b_best = tl.where(m_keep, b_best, 0.0)
            b_score = tl.sum(tl.reshape(b_best, [QPB, SEG]), axis=1)  # [QPB]

            b_key = _order_key(b_score, j)  # [QPB]
            m_ins = b_key > b_floor  # [QPB]
            if tl.max(m_ins.to(tl.int32), axis=0) > 0:
                # Replace each inserting query's floor slot (the first, among empty slots).
                m_floor = b_keys == b_floor[:, None]  # [QPB, KB]
                b_slot = tl.min(tl.where(m_floor, o_slot[None, :], KB), axis=1)  # [QPB]
                m_put = (o_slot[None, :] == b_slot[:, None]) & m_ins[:, None]  # [QPB, KB]
                b_keys = tl.where(m_put, b_key[:, None], b_keys)
                b_vals = tl.where(m_put, b_score[:, None], b_vals)
                b_floor = tl.min(b_keys, axis=1)

            if ELEMENTWISE:
                b_max = tl.full([BM, BN], NEG_INF, dtype=tl.float32)
            else:
                b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
            if HAS_DMASK:
                b_seen = tl.zeros([BN], dtype=tl.int32)

    o_qb = i_qgroup * QPB + tl.arange(0, QPB)  # [QPB]
    o_out = (o_qb.to(tl.int64)[:, None] * n_runs + i_run) * KB + o_slot[None, :]  # [QPB, KB]
    m_out = (o_qb < Nq)[:, None]
    tl.store(keys_ptr + o_out, b_keys, mask=m_out)
    tl.store(scores_ptr + o_out, b_vals, mask=m_out)


# ---------------------------------------------------------------------------------------------
# launcher


def topk_slots(k: int) -> int:
    """KB: the per-query slots of a program's buffer for top-``k`` (a power of two >= k, >= 16)."""
    return max(16, next_pow2(k))


def run_plan(Nq: int, Nd: int, Lq: int, BM: int, KB: int, waves: int, device_index: int,
             doc_runs: int | None = None) -> tuple[int, int, int, int]:
    """(SEG, runs, documents per program, programs) of one launch.

    Queries stack BM // SEG to a block (SEG = next_pow2(Lq) <= BM: the selection guarantees it).
    About ``waves`` programs run per multiprocessor; a run holds at least KB documents where the
    corpus allows, so the candidates (runs * KB per query) never outnumber the documents by more
    than one run's slots. ``doc_runs`` forces the number of runs (tests: several programs per
    query in the interpreter, which would otherwise run one).
    """
    seg = min(next_pow2(Lq), BM)
    n_mblocks = -(-Nq // (BM // seg))
    if doc_runs is None:
        slots = 1 if device_index < 0 else multiprocessors(device_index) * waves
        doc_runs = min(max(1, slots // n_mblocks), max(1, Nd // KB))
    doc_runs = max(1, min(int(doc_runs), Nd))
    docs_per_program = -(-Nd // doc_runs)
    runs = -(-Nd // docs_per_program)
    return seg, runs, docs_per_program, n_mblocks * runs


def scratch_bytes(Nq: int, runs: int, KB: int) -> int:
    """Bytes of the candidates a launch writes (int64 keys + fp32 scores)."""
    return 12 * Nq * runs * KB


def fused_topk(Q: torch.Tensor, D: torch.Tensor, k: int, q_mask: torch.Tensor | None, d_mask: torch.Tensor | None,
               *, config: ForwardConfig, normalize: bool = False, multiply: bool = False,
               doc_runs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``maxsim.maxsim(Q, D, q_mask, d_mask)`` per query, with the tile ``config`` the
    selection chose (:func:`maxsim.selection.search.topk_choice`), on validated inputs.

    Args:
        Q: ``[Nq, Lq, d]`` fp16/bf16/fp32 with ``next_pow2(Lq) <= config.BM``.
        D: ``[Nd, Ld, d]`` (documents shared by every query), same dtype and d.
        k: >= 1, at most the selection's slot limit.  q_mask: bool ``[Nq, Lq]`` or None.
        d_mask: bool ``[Nd, Ld]`` or None.  multiply: PyLate's mask rule instead of exclusion.
        doc_runs: force the number of document runs (programs per query block); tests only.

    Returns:
        ``(scores [Nq, k'] fp32, indices [Nq, k'] int64)``, k' = min(k, Nd), sorted by score
        descending, ties by the lower index; NaN first.
    """
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[0], D.shape[1]
    take = min(k, Nd)
    if Nq == 0 or Nd == 0 or Lq == 0 or Ld == 0:
        # Every score is 0 (empty sets contribute 0): the first k' documents, in index order.
        scores = torch.zeros((Nq, take), dtype=torch.float32, device=Q.device)
        indices = torch.arange(take, device=Q.device, dtype=torch.int64).expand(Nq, take).contiguous()
        return scores, indices
    if Nd > MAX_FUSED_DOCUMENTS:
        raise ValueError(f"maxsim: the fused top-k takes at most {MAX_FUSED_DOCUMENTS} documents; got {Nd}")
    Q = Q if Q.stride(-1) == 1 else Q.contiguous()
    D = D if D.stride(-1) == 1 else D.contiguous()
    qm = q_mask.contiguous() if q_mask is not None else None
    dm = None
    if d_mask is not None:
        dm = d_mask if d_mask.stride(-1) == 1 else d_mask.contiguous()
    interpret = interpreting()
    device_index = -1 if interpret else cuda_index(Q)
    KB = topk_slots(k)
    seg, runs, docs_per_program, n_programs = run_plan(Nq, Nd, Lq, config.BM, KB, config.waves, device_index,
                                                       doc_runs)
    keys = _outputs.empty((Nq, runs, KB), torch.int64, Q.device)  # [Nq, runs, KB]
    cand_scores = _outputs.empty((Nq, runs, KB), torch.float32, Q.device)  # [Nq, runs, KB]
    use_tma = config.tma and _tma_ready(D, config)
    d_desc = TensorDescriptor(D[None], *_descriptor_layout(D, config)) if use_tma else D  # any pointer when unused
    args = (
        Q, D, d_desc, Q if qm is None else qm, Q if dm is None else dm, keys, cand_scores,
        Nq, Nd, Lq, Ld, d,
        runs, docs_per_program,
        Q.stride(0), Q.stride(1),
        D.stride(0), D.stride(1),
        dm.stride(0) if dm is not None else 0,
    )
    constexprs = dict(
        BM=config.BM, BN=config.BN, BK=config.BK, NUM_K=-(-d // config.BK), SEG=seg, KB=KB,
        HAS_QMASK=qm is not None, HAS_DMASK=dm is not None, MULTIPLY=multiply,
        NORMALIZE=normalize, EVEN_K=(d % config.BK == 0),
        DOT_PRECISION="ieee" if Q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and Q.dtype == torch.bfloat16,
        ROW_MAX=config.row_max, USE_TMA=use_tma,
    )
    launch(_maxsim_topk_kernel, (n_programs,), args, constexprs, num_warps=config.num_warps,
           num_stages=config.num_stages)
    return merge_candidates(keys.view(Nq, runs * KB), cand_scores.view(Nq, runs * KB), take)


def merge_candidates(keys: torch.Tensor, scores: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The second pass: the best ``take`` of each query's candidates ``keys`` int64 ``[Nq, m]``
    (unique but for EMPTY_KEY slots, of which at least ``take`` are beaten by real keys) and their
    ``scores`` -> ``(scores [Nq, take] fp32, indices [Nq, take] int64)``, sorted best first."""
    best, pos = torch.topk(keys, take, dim=1)  # [Nq, take]: unique keys, one right answer
    indices = (2**32 - 1) - (best & (2**32 - 1))
    return torch.gather(scores, 1, pos), indices


def _tma_ready(D: torch.Tensor, config: ForwardConfig) -> bool:
    """Whether D's tiles can come through TMA (as the dense forward decides it): 16-bit elements,
    the tokens one strided run of rows ``[Nd*Ld, d]``, 16-byte aligned rows, int32 coordinates."""
    Nd, Ld, d = D.shape
    return (D.element_size() == 2 and (Nd == 1 or D.stride(0) == Ld * D.stride(1)) and D.stride(1) % 8 == 0
            and D.data_ptr() % 16 == 0 and Nd * Ld + config.BN < 2**31)


def _descriptor_layout(D: torch.Tensor, config: ForwardConfig) -> tuple:
    """(shape, strides, box) of D's TMA descriptor: D as ``[1, Nd*Ld, d]`` in ``[1, BN, BK]`` boxes."""
    Nd, Ld, d = D.shape
    return [1, Nd * Ld, d], [Nd * Ld * D.stride(1), D.stride(1), 1], [1, config.BN, config.BK]
