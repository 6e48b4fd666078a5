"""Fused document head + MaxSim forward: one Triton kernel and its launcher.

ColBERT-style models end with ``D = normalize(H @ W.T + b)``. This kernel never writes D: a program
owns a block of BM stacked query rows (as the dense forward stacks them) and walks a run of
documents in tiles of BN tokens. Each hidden-state tile ``H [BN, d_model]`` is projected on chip,
a K-loop over d_model of tensor-core dots against chunks of W with fp32 accumulation, transposed
as ``D^T [BD, BN] = W [BD, BKM] @ H^T [BKM, BN]`` so that it feeds the scoring dot as its second
operand without a register transpose; the bias is added, each token L2-normalised in fp32, the
tile cast to the input dtype (the scoring dot then runs at the tensor cores' 16-bit rate, with one
rounding of D where the unfused path stores D in that dtype), then scored against the query block
with a running max (and argmax) per query row, exactly as the dense kernel folds them.

Every query row block that reads a tile projects it again: the selection layer
(:mod:`maxsim.selection.head`) sends calls with many row blocks to "project once, then score".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from maxsim import _outputs
from maxsim._dispatch import cuda_index, interpreting
from maxsim._kernels import max_nan, stacked_rows
from maxsim._launch import launch
from maxsim.head.specs import HeadConfig
from maxsim.tuning import multiprocessors, next_pow2


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld", "n_chunks", "docs_per_program", "stride_dmq", "stride_dmn"])
def _head_fwd_kernel(
    q_ptr, h_ptr, w_ptr, b_ptr, qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
    Nq, Nd, Lq, Ld, dim, d_model,
    n_chunks, docs_per_program,
    stride_qn, stride_ql,  # Q [Nq, Lq, d], unit stride on d
    stride_hq, stride_hn, stride_hl,  # H [Nq|1, Nd, Ld, d_model]; stride_hq == 0 when documents are shared
    stride_wd,  # W [d, d_model], unit stride on d_model
    stride_dmq, stride_dmn,  # d_mask [Nq|1, Nd, Ld], unit stride on Ld
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BKM: tl.constexpr, NUM_KM: tl.constexpr,
    SEG: tl.constexpr,  # rows per query in a block: pow2 >= Lq, or BM when queries are chunked
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, HAS_BIAS: tl.constexpr, MULTIPLY: tl.constexpr,
    NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr, EVEN_KM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # Triton's interpreter computes bf16 dots wrongly: upcast there
):
    QPB: tl.constexpr = BM // SEG  # queries per block
    NEG_INF: tl.constexpr = float("-inf")
    i_n, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, n_chunks, BM, SEG)  # o_q, o_s: [BM]
    m_row = (o_q < Nq) & (o_s < Lq)  # [BM]
    o_d = tl.arange(0, BD)
    m_d = o_d < dim  # [BD]
    # The query block stays on chip for the program's lifetime.
    p_q = q_ptr + o_q.to(tl.int64)[:, None] * stride_qn + o_s[:, None] * stride_ql + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    if HAS_QMASK:
        b_qm = tl.load(qmask_ptr + o_q.to(tl.int64) * Lq + o_s, mask=m_row, other=0) != 0  # [BM]
    else:
        b_qm = m_row
    if HAS_BIAS:
        b_bias = tl.load(b_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]

    o_km = tl.arange(0, BKM)
    p_w = w_ptr + o_d.to(tl.int64)[:, None] * stride_wd + o_km[None, :]  # [BD, BKM] (chunk 0)
    n_tiles = tl.cdiv(Ld, BN)
    doc0 = i_n * docs_per_program
    n_docs = tl.minimum(docs_per_program, Nd - doc0)
    p_h_base = h_ptr + i_qgroup.to(tl.int64) * stride_hq  # documents of this query (candidates) or all
    p_dm_base = dmask_ptr + i_qgroup.to(tl.int64) * stride_dmq
    o_n = tl.arange(0, BN)

    b_max = tl.full([BM], NEG_INF, dtype=tl.float32)  # running max per query row
    if SAVE_ARGMAX:
        b_arg = tl.zeros([BM], dtype=tl.int32)  # document token where b_max was reached
    if HAS_DMASK:
        b_seen = tl.zeros([BN], dtype=tl.int32)  # any real token in this document so far

    for it in range(0, n_docs * n_tiles):
        j = doc0 + it // n_tiles
        i_t = it % n_tiles
        o_t = i_t * BN + o_n  # [BN] document tokens
        m_t = o_t < Ld
        p_h = p_h_base + j.to(tl.int64) * stride_hn + o_t.to(tl.int64)[:, None] * stride_hl + o_km[None, :]

        # D^T = W @ H^T for this tile, fp32 accumulation over d_model.
        b_dt = tl.zeros([BD, BN], dtype=tl.float32)
        for kk in range(NUM_KM):
            k0 = kk * BKM
            if EVEN_KM:
                b_h = tl.load(p_h + k0, mask=m_t[:, None], other=0.0)  # [BN, BKM]
                b_w = tl.load(p_w + k0, mask=m_d[:, None], other=0.0)  # [BD, BKM]
            else:
                m_k = (k0 + o_km) < d_model
                b_h = tl.load(p_h + k0, mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_w = tl.load(p_w + k0, mask=m_d[:, None] & m_k[None, :], other=0.0)
            if DOT_UPCAST:
                b_dt = tl.dot(b_w.to(tl.float32), tl.trans(b_h.to(tl.float32)), b_dt, input_precision="ieee")
            else:
                b_dt = tl.dot(b_w, tl.trans(b_h), b_dt, input_precision=DOT_PRECISION)  # [BD, BN]
        if HAS_BIAS:
            b_dt = b_dt + b_bias[:, None]
        if NORMALIZE:
            # F.normalize's rule: x / max(|x|, 1e-12); padded dims hold 0 and add nothing.
            b_dt = b_dt * (1.0 / tl.maximum(tl.sqrt(tl.sum(b_dt * b_dt, axis=0)), 1e-12))[None, :]
        b_dt = b_dt.to(q_ptr.dtype.element_ty)  # the input dtype: one rounding, as a stored D has
        if DOT_UPCAST:
            b_s = tl.dot(b_q.to(tl.float32), b_dt.to(tl.float32), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, b_dt, input_precision=DOT_PRECISION)  # [BM, BN] fp32

        if MULTIPLY:
            # PyLate's rule: masked similarities become 0 and still take part in the max.
            if HAS_QMASK:
                b_s = b_s * b_qm.to(tl.float32)[:, None]
            if HAS_DMASK:
                b_dm = tl.load(p_dm_base + j.to(tl.int64) * stride_dmn + o_t, mask=m_t, other=0)  # [BN]
                b_s = b_s * (b_dm != 0).to(tl.float32)[None, :]
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)
        elif HAS_DMASK:
            b_dm = tl.load(p_dm_base + j.to(tl.int64) * stride_dmn + o_t, mask=m_t, other=0) != 0  # [BN]
            b_s = tl.where(b_dm[None, :], b_s, NEG_INF)
            b_seen = b_seen | b_dm.to(tl.int32)
        else:
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)

        b_tmax = tl.reduce(b_s, 1, max_nan)  # [BM]
        if SAVE_ARGMAX:
            # Strict '>' keeps the earliest tile on ties; a NaN wins over any number; within the
            # tile the lowest column holding the max (or the first NaN).
            is_max = (b_s == b_tmax[:, None]) | (b_s != b_s)
            b_col = tl.min(tl.where(is_max, o_n[None, :], BN), axis=1)  # [BM]
            upd = (b_tmax > b_max) | ((b_tmax != b_tmax) & (b_max == b_max))
            b_arg = tl.where(upd, i_t * BN + tl.minimum(b_col, BN - 1), b_arg)
            b_max = tl.where(upd, b_tmax, b_max)
        else:
            b_max = max_nan(b_max, b_tmax)

        if i_t == n_tiles - 1:
            # Document j is complete: one max per query token, one sum per query.
            m_keep = m_row
            if HAS_QMASK and not MULTIPLY:
                m_keep = m_keep & b_qm
            if HAS_DMASK and not MULTIPLY:
                m_keep = m_keep & (tl.max(b_seen, axis=0) > 0)  # empty document -> 0
            b_best = tl.where(m_keep, b_max, 0.0)
            b_score = tl.sum(tl.reshape(b_best, [QPB, SEG]), axis=1)  # [QPB]
            o_qb = i_qgroup * QPB + tl.arange(0, QPB)
            tl.store(out_ptr + (i_chunk.to(tl.int64) * Nq + o_qb) * Nd + j, b_score, mask=o_qb < Nq)
            if SAVE_ARGMAX:
                m_arg = m_row
                if HAS_QMASK:
                    m_arg = m_arg & b_qm
                if HAS_DMASK and not MULTIPLY:
                    m_arg = m_arg & (tl.max(b_seen, axis=0) > 0)
                b_idx = tl.where(m_arg, b_arg, -1)
                tl.store(argmax_ptr + (o_q.to(tl.int64) * Nd + j) * Lq + o_s, b_idx, mask=m_row)
                b_arg = tl.zeros([BM], dtype=tl.int32)
            b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
            if HAS_DMASK:
                b_seen = tl.zeros([BN], dtype=tl.int32)


@functools.lru_cache(maxsize=4096)
def grid_plan(Nq: int, Nd: int, Lq: int, BM: int, waves: int, candidates: bool, device_index: int):
    """(SEG, query chunks, documents per program, programs, query row blocks) for one launch.

    SEG rows per query: short queries stack BM // SEG to a block (cross product only: candidate
    lists are not shared); long ones split into chunks of BM rows. Programs are sized so that about
    ``waves`` run per multiprocessor, each walking a run of documents."""
    seg = BM if candidates else min(next_pow2(max(Lq, 1)), BM)
    n_chunks = -(-Lq // seg)
    n_mblocks = -(-Nq // (BM // seg)) * n_chunks
    slots = 1 if device_index < 0 else multiprocessors(device_index) * waves
    docs_per_program = max(1, -(-Nd // max(1, slots // n_mblocks)))
    return seg, n_chunks, docs_per_program, n_mblocks * -(-Nd // docs_per_program), n_mblocks


def head_forward(Q, H, W, b, q_mask, d_mask, *, config: HeadConfig, normalize: bool, multiply: bool,
                 save_argmax: bool):
    """Launch the fused forward on canonical, validated inputs with the tile the selection chose.

    Args:
        Q: ``[Nq, Lq, d]``.  H: ``[Nq|1, Nd, Ld, d_model]`` (leading 1 = documents shared).
        W: ``[d, d_model]``.  b: ``[d]`` or None.  q_mask: bool ``[Nq, Lq]`` or None.
        d_mask: bool ``[Nq|1, Nd, Ld]`` or None.  Q, H, W (and b) share one dtype.

    Returns:
        scores ``[Nq, Nd]`` fp32 and, with ``save_argmax``, argmax ``[Nq, Nd, Lq]`` int32 (-1 where
        the query token is masked or the document has no real token), else None.
    """
    Nq, Lq, d = Q.shape
    Nd, Ld, d_model = H.shape[1], H.shape[2], H.shape[3]
    argmax = _outputs.empty((Nq, Nd, Lq), torch.int32, Q.device) if save_argmax else None
    if Nq == 0 or Nd == 0 or Lq == 0 or Ld == 0:
        if argmax is not None:
            argmax.fill_(-1)  # empty sets contribute 0; there is no token to point at
        return torch.zeros((Nq, Nd), dtype=torch.float32, device=Q.device), argmax
    # Any strides but a unit one on the last dim (one copy otherwise).
    Q = Q if Q.stride(-1) == 1 else Q.contiguous()
    H = H if H.stride(-1) == 1 else H.contiguous()
    W = W if W.stride(-1) == 1 else W.contiguous()
    b = None if b is None else b.contiguous()
    qm = None if q_mask is None else q_mask.contiguous()
    dm = None if d_mask is None else (d_mask if d_mask.stride(-1) == 1 else d_mask.contiguous())
    interpret = interpreting()
    device_index = -1 if interpret else cuda_index(Q)
    candidates = H.shape[0] != 1
    seg, n_chunks, docs_per_program, n_programs, _ = grid_plan(Nq, Nd, Lq, config.BM, config.waves, candidates,
                                                               device_index)
    out = _outputs.empty((Nq, Nd) if n_chunks == 1 else (n_chunks, Nq, Nd), torch.float32, Q.device)
    BD = max(16, next_pow2(d))
    BKM = min(config.BKM, max(16, next_pow2(d_model)))
    args = (
        Q, H, W, Q if b is None else b, Q if qm is None else qm, Q if dm is None else dm, out,
        out if argmax is None else argmax,
        Nq, Nd, Lq, Ld, d, d_model, n_chunks, docs_per_program,
        Q.stride(0), Q.stride(1),
        H.stride(0) if candidates else 0, H.stride(1), H.stride(2),
        W.stride(0),
        (dm.stride(0) if dm.shape[0] != 1 else 0) if dm is not None else 0,
        dm.stride(1) if dm is not None else 0,
    )
    constexprs = dict(
        BM=config.BM, BN=config.BN, BD=BD, BKM=BKM, NUM_KM=-(-d_model // BKM), SEG=seg,
        HAS_QMASK=qm is not None, HAS_DMASK=dm is not None, HAS_BIAS=b is not None, MULTIPLY=multiply,
        NORMALIZE=normalize, SAVE_ARGMAX=argmax is not None, EVEN_KM=(d_model % BKM == 0),
        DOT_PRECISION="ieee" if Q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and Q.dtype == torch.bfloat16,
    )
    launch(_head_fwd_kernel, (n_programs,), args, constexprs, num_warps=config.num_warps,
           num_stages=config.num_stages)
    return (out if n_chunks == 1 else out.sum(0)), argmax
