"""PROTOTYPE (not wired into maxsim.maxsim, not yet run on a GPU): the cross-product forward with the
tensor cores and the max epilogue overlapped, written in Gluon (Triton's lower-level dialect).

Why. In the Triton kernel (forward.py) every tile's ``tl.dot`` is followed by
``wgmma.wait_group 0`` and only then by the max epilogue, so within a program the tensor cores
idle while the CUDA cores reduce, and the compute-bound shapes stop at 65-74 % of the floor
(BENCHMARKS.md). Skewing the loop by hand does not change that (Triton 3.6 still waits at once),
and ``tl.range(warp_specialize=True)`` has no effect on sm_90. Gluon exposes the asynchrony:

    MMA(tile t+1) issued async  ->  wait until only it is in flight  ->  epilogue(tile t)

so the epilogue of one tile runs while the next tile's wgmma executes. Document tiles arrive by TMA
into a ring of STAGES shared-memory slots; the query block is loaded once per program.

Scope of the prototype: documents shared by all queries (``D [Nd, Ld, d]``), both mask rules,
the argmax (winning-tile method, as in forward.py), fp16/bf16, d in {64, 128} (one K step),
queries stacked SEG rows apart (SEG = next_pow2(Lq) <= BM). Not yet: normalize, candidate lists,
NaN propagation. The next step is to time it against forward.py on the H200
(``tests/dense/test_forward_overlap_gpu.py`` checks it; ``benchmarks/tune_forward.py`` can time it),
and only then to dispatch the compute-bound regime to it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from maxsim._tuning import next_pow2
from maxsim.dense.forward import _grid_plan


@gluon.jit
def _tile_row(k, doc0, n_tiles, Ld, BN: gl.constexpr):
    """First row, in D viewed as [Nd * Ld, d], of the program's k-th (document, tile)."""
    return (doc0 + k // n_tiles) * Ld + (k % n_tiles) * BN


@gluon.jit
def _maxsim_fwd_overlap_kernel(
    q_ptr, d_desc, qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
    Nq, Nd, Lq, Ld, n_tiles, docs_per_program,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr,
    HAS_QMASK: gl.constexpr, HAS_DMASK: gl.constexpr, MULTIPLY: gl.constexpr, SAVE_ARGMAX: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Q [Nq, Lq, BK] contiguous; d_desc: TMA descriptor of D as [Nd * Ld, BK], block [BN, BK];
    masks bool [Nq, Lq] and [Nd, Ld] contiguous; out [Nq, Nd] fp32; argmax [Nq, Nd, Lq] int32.
    One program per (block of BM // SEG queries, run of documents). The mask rules and the argmax
    (lowest index among ties, -1 where nothing wins) are those of forward.py."""
    QPB: gl.constexpr = BM // SEG
    NEG_INF: gl.constexpr = float("-inf")
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    rows: gl.constexpr = gl.SliceLayout(1, mma_layout)  # [BM] vectors
    cols: gl.constexpr = gl.SliceLayout(0, mma_layout)  # [BN] vectors
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    per_query: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])  # [QPB, SEG]

    pid = gl.program_id(0)
    n_mblocks = gl.cdiv(Nq, QPB)
    i_m = pid % n_mblocks
    doc0 = (pid // n_mblocks) * docs_per_program
    n_docs = gl.minimum(docs_per_program, Nd - doc0)
    n = n_docs * n_tiles

    # The query block, loaded once: row r is token r % SEG of query i_m * QPB + r // SEG.
    o_r = gl.arange(0, BM, gl.SliceLayout(1, load_layout))
    o_k = gl.arange(0, BK, gl.SliceLayout(0, load_layout))
    q_of = i_m * QPB + o_r // SEG
    s_of = o_r % SEG
    m_load = (q_of < Nq) & (s_of < Lq)
    b_q = gl.load(q_ptr + (q_of.to(gl.int64) * Lq + s_of)[:, None] * BK + o_k[None, :], mask=m_load[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(b_q.dtype, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], b_q.dtype),
                                       value=b_q)
    # Written by the threads (generic proxy), read by wgmma (async proxy): fence, then barrier.
    fence_async_shared()
    gl.thread_barrier()

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BN, BK], d_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.expect(bars.index(s), d_desc.block_type.nbytes, pred=s < n)
        tma.async_copy_global_to_shared(d_desc, [_tile_row(s, doc0, n_tiles, Ld, BN), 0], bars.index(s),
                                        d_smem.index(s), pred=s < n)

    zero = gl.zeros([BM, BN], gl.float32, mma_layout)
    mbarrier.wait(bars.index(0), phase=0)
    acc = warpgroup_mma(q_smem, d_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)

    o_rr = gl.arange(0, BM, rows)
    q_row = i_m * QPB + o_rr // SEG  # [BM] query of each row
    s_row = o_rr % SEG  # [BM] its token
    m_row = (q_row < Nq) & (s_row < Lq)
    if HAS_QMASK:
        b_qm = gl.load(qmask_ptr + q_row.to(gl.int64) * Lq + s_row, mask=m_row, other=0) != 0  # [BM]
    else:
        b_qm = m_row
    o_n = gl.arange(0, BN, cols)
    o_qb = i_m * QPB + gl.arange(0, QPB, gl.SliceLayout(1, per_query))
    b_max = gl.full([BM], NEG_INF, gl.float32, rows)
    if SAVE_ARGMAX:
        b_arg = gl.zeros([BM], gl.int32, rows)  # tile where b_max was reached
        b_wintile = gl.full([BM, BN], NEG_INF, gl.float32, mma_layout)  # that tile's similarities
    if HAS_DMASK:
        b_seen = gl.zeros([BN], gl.int32, cols)  # any real token in this document so far
    for it in range(0, n):
        # 1. The next tile's MMA goes out first (a tile past the end reads a stale slot: discarded).
        nxt = it + 1
        slot_n = nxt % STAGES
        mbarrier.wait(bars.index(slot_n), phase=(nxt // STAGES) & 1, pred=nxt < n)
        acc_next = warpgroup_mma(q_smem, d_smem.index(slot_n).permute((1, 0)), zero, use_acc=False, is_async=True)
        # 2. This tile's MMA is done once only the next one is in flight; its slot can be refilled.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        slot = it % STAGES
        ref = it + STAGES
        mbarrier.expect(bars.index(slot), d_desc.block_type.nbytes, pred=ref < n)
        tma.async_copy_global_to_shared(d_desc, [_tile_row(ref, doc0, n_tiles, Ld, BN), 0], bars.index(slot),
                                        d_smem.index(slot), pred=ref < n)
        # 3. The epilogue of this tile runs while the next tile's MMA executes.
        j = doc0 + it // n_tiles
        i_t = it % n_tiles
        o_t = i_t * BN + o_n
        m_t = o_t < Ld  # columns past Ld belong to the next document
        b_s = acc
        if MULTIPLY:
            # PyLate's rule: masked similarities become 0 and still take part in the max.
            if HAS_QMASK:
                b_s = b_s * b_qm.to(gl.float32)[:, None]
            if HAS_DMASK:
                b_dm = gl.load(dmask_ptr + j.to(gl.int64) * Ld + o_t, mask=m_t, other=0) != 0
                b_s = b_s * b_dm.to(gl.float32)[None, :]
            b_s = gl.where(m_t[None, :], b_s, NEG_INF)
        elif HAS_DMASK:
            b_dm = (gl.load(dmask_ptr + j.to(gl.int64) * Ld + o_t, mask=m_t, other=0) != 0) & m_t
            b_s = gl.where(b_dm[None, :], b_s, NEG_INF)
            b_seen = b_seen | b_dm.to(gl.int32)
        else:
            b_s = gl.where(m_t[None, :], b_s, NEG_INF)
        b_tmax = gl.max(b_s, axis=1)  # [BM]
        if SAVE_ARGMAX:
            upd = b_tmax > b_max  # strict: the earliest tile keeps ties
            b_wintile = gl.where(upd[:, None], b_s, b_wintile)
            b_arg = gl.where(upd, i_t, b_arg)
            b_max = gl.where(upd, b_tmax, b_max)
        else:
            b_max = gl.maximum(b_max, b_tmax)
        if i_t == n_tiles - 1:
            # Document j is complete: one max per query token, one sum per query.
            m_keep = m_row
            if HAS_QMASK and not MULTIPLY:
                m_keep = m_keep & b_qm
            if HAS_DMASK and not MULTIPLY:
                m_keep = m_keep & (gl.max(b_seen, axis=0) > 0)  # an empty document scores 0
            b_best = gl.where(m_keep, b_max, 0.0)
            b_score = gl.sum(gl.convert_layout(gl.reshape(b_best, [QPB, SEG]), per_query), axis=1)
            gl.store(out_ptr + o_qb.to(gl.int64) * Nd + j, b_score, mask=o_qb < Nq)
            if SAVE_ARGMAX:
                # The first column of the winning tile that holds the max.
                is_max = b_wintile == b_max[:, None]
                b_col = gl.min(gl.where(is_max, o_n[None, :], BN), axis=1)
                b_idx = b_arg * BN + gl.minimum(b_col, BN - 1)
                m_arg = m_row
                if HAS_QMASK:
                    m_arg = m_arg & b_qm
                if HAS_DMASK and not MULTIPLY:
                    m_arg = m_arg & (gl.max(b_seen, axis=0) > 0)
                b_idx = gl.where(m_arg, b_idx, -1)
                gl.store(argmax_ptr + (q_row.to(gl.int64) * Nd + j) * Lq + s_row, b_idx, mask=m_row)
                b_arg = gl.zeros([BM], gl.int32, rows)
            if HAS_DMASK:
                b_seen = gl.zeros([BN], gl.int32, cols)
            b_max = gl.full([BM], NEG_INF, gl.float32, rows)
        acc = acc_next
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def maxsim_forward_overlap(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                           d_mask: torch.Tensor | None = None, *, multiply: bool = False, save_argmax: bool = False,
                           BM: int = 128, BN: int = 64, STAGES: int = 3, num_warps: int = 4,
                           waves: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``[Nq, Nd]`` fp32 (and with ``save_argmax`` the int32 argmax ``[Nq, Nd, Lq]``) of
    ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]``, masks bool ``[Nq, Lq]`` / ``[Nd, Ld]``: the contract
    of ``maxsim.maxsim`` within the prototype's scope (module docstring; NaN inputs are not yet
    propagated). Raises ValueError outside it."""
    if Q.dim() != 3 or D.dim() != 3 or D.shape[2] != Q.shape[2] or Q.dtype != D.dtype \
            or Q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("maxsim_forward_overlap: Q [Nq, Lq, d] and D [Nd, Ld, d], fp16 or bf16")
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[0], D.shape[1]
    if d not in (64, 128) or next_pow2(Lq) > BM:
        raise ValueError(f"maxsim_forward_overlap: needs d in (64, 128) and Lq <= {BM}; got d={d}, Lq={Lq}")
    Q = Q.contiguous()
    D2 = D.contiguous().view(Nd * Ld, d)
    qm = q_mask.to(torch.bool).contiguous() if q_mask is not None else None
    dm = d_mask.to(torch.bool).contiguous() if d_mask is not None else None
    gl_dtype = gl.float16 if Q.dtype == torch.float16 else gl.bfloat16
    d_desc = TensorDescriptor.from_tensor(D2, [BN, d], gl.NVMMASharedLayout.get_default_for([BN, d], gl_dtype))
    out = torch.empty((Nq, Nd), dtype=torch.float32, device=Q.device)
    argmax = torch.empty((Nq, Nd, Lq), dtype=torch.int32, device=Q.device) if save_argmax else None
    device_index = Q.device.index if Q.device.index is not None else torch.cuda.current_device()
    seg, _, docs_per_program, n_programs = _grid_plan(Nq, Nd, Lq, BM, waves, False, device_index)
    _maxsim_fwd_overlap_kernel[(n_programs,)](
        Q, d_desc, qm if qm is not None else Q, dm if dm is not None else Q, out,
        argmax if argmax is not None else out,
        Nq, Nd, Lq, Ld, triton.cdiv(Ld, BN), docs_per_program,
        BM=BM, BN=BN, BK=d, SEG=seg, STAGES=STAGES,
        HAS_QMASK=qm is not None, HAS_DMASK=dm is not None, MULTIPLY=multiply, SAVE_ARGMAX=save_argmax,
        num_warps=num_warps,
    )
    return out, argmax
