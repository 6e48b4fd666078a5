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

Scope of the prototype: documents shared by all queries (``D [Nd, Ld, d]``), no masks, no
normalize, no argmax, fp16/bf16, d in {64, 128} (one K step), queries stacked SEG rows apart
(SEG = next_pow2(Lq) <= BM). The next step is to time it against forward.py on the H200
(``tests/dense/test_forward_overlap_gpu.py`` checks it; ``benchmarks/tune_forward.py`` can time it),
and only then to extend it (masks, argmax) and dispatch to it.
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

from maxsim._tuning import multiprocessors, next_pow2


@gluon.jit
def _tile_row(k, doc0, n_tiles, Ld, BN: gl.constexpr):
    """First row, in D viewed as [Nd * Ld, d], of the program's k-th (document, tile)."""
    return (doc0 + k // n_tiles) * Ld + (k % n_tiles) * BN


@gluon.jit
def _maxsim_fwd_overlap_kernel(
    q_ptr, d_desc, out_ptr,
    Nq, Nd, Lq, Ld, n_tiles, docs_per_program,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Q [Nq, Lq, BK] contiguous; d_desc: TMA descriptor of D as [Nd * Ld, BK], block [BN, BK];
    out [Nq, Nd] fp32. One program per (block of BM // SEG queries, run of documents)."""
    QPB: gl.constexpr = BM // SEG
    NEG_INF: gl.constexpr = float("-inf")
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    rows: gl.constexpr = gl.SliceLayout(1, mma_layout)  # [BM] vectors
    cols: gl.constexpr = gl.SliceLayout(0, mma_layout)  # [BN] vectors
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

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
    m_row = (q_of < Nq) & (s_of < Lq)
    b_q = gl.load(q_ptr + (q_of.to(gl.int64) * Lq + s_of)[:, None] * BK + o_k[None, :], mask=m_row[:, None], other=0.0)
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
    keep = (q_row < Nq) & (o_rr % SEG < Lq)
    o_n = gl.arange(0, BN, cols)
    o_qb = i_m * QPB + gl.arange(0, QPB, gl.SliceLayout(1, gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])))
    b_max = gl.full([BM], NEG_INF, gl.float32, rows)
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
        i_t = it % n_tiles
        b_s = gl.where((i_t * BN + o_n < Ld)[None, :], acc, NEG_INF)  # columns past Ld: the next document
        b_max = gl.maximum(b_max, gl.max(b_s, axis=1))
        if i_t == n_tiles - 1:
            j = doc0 + it // n_tiles
            b_best = gl.where(keep, b_max, 0.0)
            b_score = gl.sum(gl.convert_layout(gl.reshape(b_best, [QPB, SEG]),
                                               gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])), axis=1)
            gl.store(out_ptr + o_qb.to(gl.int64) * Nd + j, b_score, mask=o_qb < Nq)
            b_max = gl.full([BM], NEG_INF, gl.float32, rows)
        acc = acc_next
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def maxsim_forward_overlap(Q: torch.Tensor, D: torch.Tensor, *, BM: int = 128, BN: int = 64, STAGES: int = 3,
                           num_warps: int = 4, waves: int = 2) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` (the prototype's scope:
    see the module docstring). Raises ValueError outside it."""
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[0], D.shape[1]
    if D.dim() != 3 or D.shape[2] != d or Q.dtype != D.dtype or Q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("maxsim_forward_overlap: Q [Nq, Lq, d] and D [Nd, Ld, d], fp16 or bf16")
    if d not in (64, 128) or next_pow2(Lq) > BM:
        raise ValueError(f"maxsim_forward_overlap: needs d in (64, 128) and Lq <= {BM}; got d={d}, Lq={Lq}")
    Q = Q.contiguous()
    D2 = D.contiguous().view(Nd * Ld, d)
    seg = next_pow2(Lq)
    gl_dtype = gl.float16 if Q.dtype == torch.float16 else gl.bfloat16
    d_desc = TensorDescriptor.from_tensor(D2, [BN, d], gl.NVMMASharedLayout.get_default_for([BN, d], gl_dtype))
    out = torch.empty((Nq, Nd), dtype=torch.float32, device=Q.device)
    n_mblocks = triton.cdiv(Nq, BM // seg)
    slots = multiprocessors(Q.device.index or 0) * waves
    docs_per_program = max(1, triton.cdiv(Nd, max(1, slots // n_mblocks)))
    grid = (n_mblocks * triton.cdiv(Nd, docs_per_program),)
    _maxsim_fwd_overlap_kernel[grid](
        Q, d_desc, out, Nq, Nd, Lq, Ld, triton.cdiv(Ld, BN), docs_per_program,
        BM=BM, BN=BN, BK=d, SEG=seg, STAGES=STAGES, num_warps=num_warps,
    )
    return out
