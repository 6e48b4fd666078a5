"""Warp-specialized forward for Hopper (Gluon): the tensor cores never wait for the max epilogue.

Why. In the Triton kernel (forward.py) one instruction stream issues a tile's wgmma, waits for it,
then reduces it: the tensor cores idle during every epilogue, which caps the compute-bound shapes
well short of the floor (BENCHMARKS.md). Here each program runs three partitions:

- a producer warp streams document tiles ``[BN, d]`` by TMA into a ring of STAGES slots;
- two consumer warpgroups each own a block of HALF = 128 query rows and take turns on the tensor
  cores (ping-pong): consumer 0 issues tile t's MMA, then consumer 1 issues its own, then consumer 0
  tile t+1, ... so while one warpgroup reduces its tile the other's MMA runs.

Two ways to give the consumers work (``SPLIT_DOCS``, a constexpr):
- shared documents (``SPLIT_DOCS=False``): two row blocks (m-blocks 2u and 2u+1) against the same
  document run; each tile is loaded once and read by both (many queries, or long ones);
- split documents (``SPLIT_DOCS=True``): one row block; consumer h walks half h of the program's
  document run, and the producer alternates tiles between them (one 128-row query block, e.g.
  one ColBERT query of 128 tokens against a corpus).

The query block is the wgmma's register operand by default (``Q_IN_REGS``): each MMA then reads
only the document tile from shared memory. With the argmax each tile's MMA is two of half width
(``SUB = 2``, ``WS_SUB_TILES``): the first half's epilogue overlaps the second half's MMA.

Scope: documents shared by all queries (``D [Nd, Ld, d]``), fp16/bf16, d in {64, 128} (one MMA
K-step), both mask rules (the library routes masked calls to forward.py, faster there:
``maxsim.selection.dense``), NaN propagation, the argmax (kept per thread: _thread_argmax;
where a NaN is the max, the index is some token of that document). Queries
of up to 128 tokens stack 128 // SEG to a row block; longer ones are cut into 128-row chunks whose
partial scores are summed by the launcher. Not here (forward.py serves them): normalize, candidate
lists, fp32, d > 128.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl
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

from maxsim._dispatch import cuda_index
from maxsim._launch import launch
from maxsim import _checks, _outputs
from maxsim.dense.specs import tma_rows_ready as tma_ready
from maxsim.tuning import multiprocessors, next_pow2

HALF_ROWS = 128  # query rows per consumer warpgroup (a plain int on the host: a constexpr in the
HALF = gl.constexpr(HALF_ROWS)  # launch plan's arithmetic would specialise the kernel on its results)
# Registers per thread at launch: 12 warps (two consumer warpgroups, the producer's) x 168 fit the
# 64K register file; setmaxnreg then gives the consumers 232-248 and the producer 24.
WS_MAXNREG = 168
# MMAs per tile (SUB of _consumer), without and with the argmax: with it, two half-width MMAs let
# the first half's epilogue overlap the second's MMA (measured: benchmarks/HISTORY.md).
WS_SUB_TILES = {False: 1, True: 2}


@gluon.jit
def _max_nan(a, b):
    """max that propagates NaN (as maxsim._kernels.max_nan)."""
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _argmax_combine(v1, i1, v2, i2):
    """(value, index) of the larger similarity: a NaN wins over a number, the lower index wins ties
    (whatever order the reduction visits them in)."""
    v1_nan = v1 != v1
    v2_nan = v2 != v2
    take2 = (v2 > v1) | (v2_nan & ~v1_nan) | (((v2 == v1) | (v2_nan & v1_nan)) & (i2 < i1))
    return gl.where(take2, v2, v1), gl.where(take2, i2, i1)


@gluon.jit
def _greater(v2, v1):
    """1.0 where v2 > v1 (IEEE: false for ties, -0 against +0, and any NaN), else 0.0, by FSET.BF
    into a register. As inline PTX: written as (v2 > v1).to(float), the compiler turns the tree's
    first level (constant indices) back into a predicate and a select."""
    return gl.inline_asm_elementwise("set.gt.f32.f32 $0, $1, $2;", "=r,r,r", [v2, v1],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _argmax_step(v1, i1, v2, i2):
    """_argmax_combine where every i1 < i2 (the tree of _thread_argmax, and the running best against
    a later tile), indices as fp32 (exact below 2^24): the value is the NaN-propagating max; v2 is
    taken when it is strictly greater (_greater: ties keep the lower index). The index select is an
    FMA, i1 + take * (i2 - i1). So no predicate registers (there are 7: the former predicated
    selects queued on them) and half of the work on the FMA pipe instead of the half-rate ALU one.
    The cost: where a NaN is the max, the index is that of some token of the tile, not always the
    NaN's (a NaN after a number does not win the compare); the score is NaN either way."""
    return _max_nan(v1, v2), i1 + _greater(v2, v1) * (i2 - i1)


@gluon.jit
def _thread_argmax(s, k, base, HALF: gl.constexpr, BN: gl.constexpr):
    """s [HALF, BN] similarities in the wgmma layout, k [HALF, 8, BN // 8] fp32 (k, in the view
    below), base: fp32 scalar -> (max, base + its k) [HALF, 8] for each column class j: the
    columns 8 k + j of a row. A thread of the wgmma layout holds every k of its (row, j) pairs, so
    this is all registers, no shuffles; a pairwise tree (adjacent k, the lower on the left), so the
    instructions of one level are independent. The first level writes its index as base_k + take
    (one FADD: base_k = base + k of the pair's left is one value per pair for the whole tile), the
    others by _argmax_step.

    The epilogue's instruction count per element is what the training forward pays (it runs at
    the GPU's power cap): the variants tried, their SASS counts and timings are in
    benchmarks/HISTORY.md (the training forward's argmax).
    """
    v = gl.permute(gl.reshape(s, [HALF, BN // 8, 8]), (0, 2, 1))  # [HALF, 8, BN // 8]
    a, b = gl.split(gl.reshape(v, [HALF, 8, BN // 16, 2]))  # [HALF, 8, BN // 16] even, odd k
    k_even, _ = gl.split(gl.reshape(k, [HALF, 8, BN // 16, 2]))
    take = _greater(b, a)
    v = _max_nan(a, b)
    i = (k_even + base) + take
    for lvl in gl.static_range(1, 6):
        if (BN // 16) >> lvl >= 1:  # W = (BN // 16) >> lvl pairs at this level
            a, b = gl.split(gl.reshape(v, [HALF, 8, (BN // 16) >> lvl, 2]))  # [HALF, 8, W] even, odd k
            ia, ib = gl.split(gl.reshape(i, [HALF, 8, (BN // 16) >> lvl, 2]))
            v, i = _argmax_step(a, ia, b, ib)
    return gl.reshape(v, [HALF, 8]), gl.reshape(i, [HALF, 8])


@gluon.jit
def _stream(h, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS: gl.constexpr):
    """(m-block, first document, document count) that consumer ``h`` of program ``pid`` walks."""
    if SPLIT_DOCS:
        n_units = n_mblocks
    else:
        n_units = gl.cdiv(n_mblocks, 2)
    unit = pid % n_units  # row blocks vary fastest: programs on one document run share it in L2
    doc0 = (pid // n_units) * docs_per_program
    n_docs = gl.minimum(docs_per_program, Nd - doc0)
    if SPLIT_DOCS:
        first = gl.cdiv(n_docs, 2)  # consumer 0 takes the larger half
        return unit, doc0 + h * first, first - h * (2 * first - n_docs)
    else:
        return 2 * unit + h, doc0, n_docs


@gluon.jit
def _block_rows(i_m, n_mblocks, Nq, Lq, n_chunks, SEG: gl.constexpr, layout: gl.constexpr):
    """Rows of m-block ``i_m``: (query [HALF], token [HALF], row is real [HALF], query group, chunk).
    A block stacks HALF // SEG queries (SEG = pow2 >= Lq), or is chunk ``i_chunk`` of one long query."""
    QPB: gl.constexpr = HALF // SEG
    i_qgroup = i_m // n_chunks
    i_chunk = i_m % n_chunks
    o_r = gl.arange(0, HALF, layout)
    o_q = i_qgroup * QPB + o_r // SEG
    o_s = i_chunk * SEG + o_r % SEG
    m_row = (o_q < Nq) & (o_s < Lq) & (i_m < n_mblocks)
    return o_q, o_s, m_row, i_qgroup, i_chunk


@gluon.jit
def _producer(d_desc, d_smem, ready, empty, pid, n_mblocks, Nd, Ld, n_tiles, docs_per_program,
              BN: gl.constexpr, STAGES: gl.constexpr, SPLIT_DOCS: gl.constexpr):
    """One warp: TMA loads of document tiles into the ring, a slot as soon as its readers free it.
    Ring position k holds tile k of the shared run, or (split) tile k // 2 of consumer k % 2's half."""
    _, start0, count0 = _stream(0, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS)
    _, start1, count1 = _stream(1, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS)
    n0 = count0 * n_tiles
    n1 = count1 * n_tiles
    if SPLIT_DOCS:
        total = 2 * n0
    else:
        total = n0
    for k in range(total):
        if SPLIT_DOCS:
            h = k % 2
            t = k // 2
            start = start0 + h * (start1 - start0)
            live = t < n0 - h * (n0 - n1)  # consumer 1's half may hold one document fewer
        else:
            t = k
            start = start0
            live = t < n0
        slot = k % STAGES
        # Slots start free: the first round waits on the phase before the barrier's first.
        mbarrier.wait(empty.index(slot), ((k // STAGES) & 1) ^ 1, pred=live)
        mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes, pred=live)
        # Rows past a document's end belong to the next one (masked by the consumer); past D's end
        # TMA reads zeros.
        tma.async_copy_global_to_shared(d_desc, [(start + t // n_tiles) * Ld + (t % n_tiles) * BN, 0],
                                        ready.index(slot), d_smem.index(slot), pred=live)


@gluon.jit
def _tile_update(b_s, b_qm, dmask_ptr, j, c0, o_n, Ld, o_k, b_max, r_val, r_col, b_seen,
                 HALF: gl.constexpr, NS: gl.constexpr, HAS_QMASK: gl.constexpr, HAS_DMASK: gl.constexpr,
                 MULTIPLY: gl.constexpr, SAVE_ARGMAX: gl.constexpr):
    """Folds similarities ``b_s [HALF, NS]`` (document j's tokens c0 .. c0 + NS) into the running
    state: the row max ``b_max [HALF]``, or with SAVE_ARGMAX the per-thread best ``r_val [HALF, 8]``
    of each (row, j) and its k, ``r_col`` (the column 8 k + j); ``b_seen``: any real token so far
    (HAS_DMASK). Applies the mask rule."""
    NEG_INF: gl.constexpr = float("-inf")
    o_t = c0 + o_n  # [NS] document tokens
    m_t = o_t < Ld  # columns past Ld belong to the next document
    ragged = c0 + NS > Ld
    if MULTIPLY:
        # PyLate's rule: masked similarities become 0 and still take part in the max.
        if HAS_QMASK:
            b_s = b_s * b_qm.to(gl.float32)[:, None]
        if HAS_DMASK:
            b_dm = gl.load(dmask_ptr + j.to(gl.int64) * Ld + o_t, mask=m_t, other=0) != 0
            b_s = b_s * b_dm.to(gl.float32)[None, :]
        if ragged:
            b_s = gl.where(m_t[None, :], b_s, NEG_INF)
    elif HAS_DMASK:
        b_dm = (gl.load(dmask_ptr + j.to(gl.int64) * Ld + o_t, mask=m_t, other=0) != 0) & m_t
        b_s = gl.where(b_dm[None, :], b_s, NEG_INF)
        b_seen = gl.maximum(b_seen, gl.max(b_dm.to(gl.int32), axis=0))
    elif ragged:
        # Only the ragged last tile pays for the bounds mask.
        b_s = gl.where(m_t[None, :], b_s, NEG_INF)
    if SAVE_ARGMAX:
        # (max, k of the column 8 k + j in the document) of each (row, j) in this tile
        t_val, t_k = _thread_argmax(b_s, o_k, (c0 // 8).to(gl.float32), HALF, NS)  # [HALF, 8]
        # The running best is the tree's left leaf: an earlier tile keeps ties (strict '>'), the
        # max propagates NaN. Four instructions a (row, j), against eight for a compare of both
        # NaN cases and two selects.
        r_val, r_col = _argmax_step(r_val, r_col, t_val, t_k)
    else:
        b_max = _max_nan(b_max, gl.reduce(b_s, 1, _max_nan))  # [HALF]
    return b_max, r_val, r_col, b_seen


@gluon.jit
def _consumer(h: gl.constexpr, q_smem, d_smem, ready, empty, turn,
              qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
              pid, Nq, Nd, Lq, Ld, n_chunks, n_mblocks, n_tiles, docs_per_program,
              BN: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr, SPLIT_DOCS: gl.constexpr,
              HAS_QMASK: gl.constexpr, HAS_DMASK: gl.constexpr, MULTIPLY: gl.constexpr,
              SAVE_ARGMAX: gl.constexpr, Q_IN_REGS: gl.constexpr, SUB: gl.constexpr):
    """One warpgroup: MMAs of its query block ``q_smem [HALF, d]`` against the ring's tiles, in turn
    with the other consumer, and the max epilogue: scores [n_chunks?, Nq, Nd], argmax [Nq, Nd, Lq].
    The mask rules, NaN propagation and the argmax (lowest index among ties, -1 where nothing wins)
    are those of forward.py.

    SUB = 2 cuts each tile's MMA into two of NS = BN / 2 columns, issued together: the epilogue of
    the first half runs while the tensor cores compute the second (with the argmax, 1-3 % faster:
    WS_SUB_TILES)."""
    QPB: gl.constexpr = HALF // SEG
    NEG_INF: gl.constexpr = float("-inf")
    NS: gl.constexpr = BN // SUB  # columns of one MMA
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, NS, 16])
    rows: gl.constexpr = gl.SliceLayout(1, mma_layout)  # [HALF] vectors
    cols: gl.constexpr = gl.SliceLayout(0, mma_layout)  # [NS] vectors
    per_query: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])  # [QPB, SEG]
    if SPLIT_DOCS:
        STEP: gl.constexpr = 2
        OFF: gl.constexpr = h
    else:
        STEP: gl.constexpr = 1
        OFF: gl.constexpr = 0

    i_m, start, count = _stream(h, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS)
    i_m_o, _, count_o = _stream(1 - h, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS)
    n = count * n_tiles
    active = i_m < n_mblocks  # shared documents with an odd number of m-blocks: the last has one
    # MMAs the other consumer issues (the turn protocol waits only for those)
    n_other = gl.where(i_m_o < n_mblocks, count_o * n_tiles, 0)

    o_q, o_s, m_row, i_qgroup, i_chunk = _block_rows(i_m, n_mblocks, Nq, Lq, n_chunks, SEG, rows)
    if HAS_QMASK:
        b_qm = gl.load(qmask_ptr + o_q.to(gl.int64) * Lq + o_s, mask=m_row, other=0) != 0  # [HALF]
    else:
        b_qm = m_row
    o_n = gl.arange(0, NS, cols)
    o_qb = i_qgroup * QPB + gl.arange(0, QPB, gl.SliceLayout(1, per_query))  # [QPB]
    m_qb = (o_qb < Nq) & active

    zero = gl.zeros([HALF, NS], gl.float32, mma_layout)
    if Q_IN_REGS:
        # The query block as the MMA's register operand: each MMA then reads only the document
        # tile from shared memory (at BN = 64, reading both would cap the tensor cores).
        q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2))
    else:
        q_op = q_smem
    b_max = gl.full([HALF], NEG_INF, gl.float32, rows)
    if SAVE_ARGMAX:
        # The argmax without cross-thread work per tile: seen as [HALF, NS // 8, 8] (column
        # 8 k + j), a thread of the wgmma layout holds every k of its (row, j) pairs, so the
        # reduction over k is a tree of compares in registers (no shuffles); across tiles a thread
        # keeps the best (value, k) of each of its (row, j) pairs, and the 8 j of a row are
        # reduced once per document. State: 2 x 8 registers, which lets BN = 128 fit beside the
        # accumulator (the former winning-tile method held a second [HALF, BN] tile: BN = 64).
        by_j: gl.constexpr = gl.permute(gl.reshape(zero, [HALF, NS // 8, 8]), (0, 2, 1)).type.layout
        o_k = gl.arange(0, NS // 8, gl.SliceLayout(0, gl.SliceLayout(1, by_j)))[None, None, :]
        o_k = (o_k + gl.zeros([HALF, 8, NS // 8], gl.int32, by_j)).to(gl.float32)  # [HALF, 8, NS // 8] (constants)
        # best similarity of each (row, j) in this document (-inf; the tree gives its layout), and
        # the k of its column 8 k + j
        r_val, _ = _thread_argmax(gl.full([HALF, NS], NEG_INF, gl.float32, mma_layout), o_k, 0.0, HALF, NS)
        per_j: gl.constexpr = r_val.type.layout  # [HALF, 8]
        o_j = gl.arange(0, 8, gl.SliceLayout(0, per_j))[None, :].to(gl.float32)  # [1, 8]
        r_col = gl.zeros([HALF, 8], gl.float32, per_j)
    else:
        o_k, o_j, r_val, r_col = 0, 0, b_max, b_max  # unused
    # any real token in this document so far (HAS_DMASK; reduced every tile: a [NS] vector would
    # take NS / 4 registers, which the argmax at BN = 128 does not have)
    b_seen = gl.max(gl.zeros([NS], gl.int32, cols), axis=0)

    for t in range(n):
        k = t * STEP + OFF
        slot = k % STAGES
        mbarrier.wait(ready.index(slot), (k // STAGES) & 1)
        if active:
            # Ping-pong: consumer 0 issues tile t after consumer 1 issued tile t-1; consumer 1
            # after consumer 0 issued tile t. The MMAs queue in that order on the tensor cores.
            if h == 0:
                mbarrier.wait(turn.index(0), (t - 1) & 1, pred=(t > 0) & (t <= n_other))
            else:
                mbarrier.wait(turn.index(1), t & 1, pred=t < n_other)
            tile = d_smem.index(slot)  # [BN, d]
            if SUB == 1:
                acc0 = warpgroup_mma(q_op, tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            else:
                acc0 = warpgroup_mma(q_op, tile.slice(0, NS).permute((1, 0)), zero, use_acc=False, is_async=True)
                acc1 = warpgroup_mma(q_op, tile.slice(NS, NS).permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn.index(1 - h), count=1)

            j = start + t // n_tiles  # document
            i_t = t % n_tiles  # its tile
            b_s = warpgroup_mma_wait(num_outstanding=SUB - 1, deps=(acc0,))  # [HALF, NS]
            if SUB == 1:
                mbarrier.arrive(empty.index(slot), count=1)
            b_max, r_val, r_col, b_seen = _tile_update(
                b_s, b_qm, dmask_ptr, j, i_t * BN, o_n, Ld, o_k, b_max, r_val, r_col, b_seen,
                HALF, NS, HAS_QMASK, HAS_DMASK, MULTIPLY, SAVE_ARGMAX)
            if SUB == 2:
                # A block boundary before the second wait: in one block with the first half's
                # update, ptxas issues the wait first, and then nothing overlaps. Both paths wait
                # (else ptxas serializes the MMAs); their operands differ so that they stay apart.
                if Ld > 0:
                    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
                else:
                    b_s, o_n = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, o_n))
                mbarrier.arrive(empty.index(slot), count=1)
                b_max, r_val, r_col, b_seen = _tile_update(
                    b_s, b_qm, dmask_ptr, j, i_t * BN + NS, o_n, Ld, o_k, b_max, r_val, r_col, b_seen,
                    HALF, NS, HAS_QMASK, HAS_DMASK, MULTIPLY, SAVE_ARGMAX)

            if i_t == n_tiles - 1:
                # Document j is complete: one max per query token, one sum per query.
                if SAVE_ARGMAX:
                    b_max, b_idx = gl.reduce((r_val, r_col * 8.0 + o_j), 1, _argmax_combine)  # [HALF]
                    b_max = gl.convert_layout(b_max, rows)
                    b_idx = gl.convert_layout(b_idx.to(gl.int32), rows)
                m_keep = m_row
                if HAS_QMASK and not MULTIPLY:
                    m_keep = m_keep & b_qm
                if HAS_DMASK and not MULTIPLY:
                    m_keep = m_keep & (b_seen > 0)  # an empty document scores 0
                b_best = gl.where(m_keep, b_max, 0.0)
                b_score = gl.sum(gl.convert_layout(gl.reshape(b_best, [QPB, SEG]), per_query), axis=1)  # [QPB]
                gl.store(out_ptr + (i_chunk.to(gl.int64) * Nq + o_qb) * Nd + j, b_score, mask=m_qb)
                if SAVE_ARGMAX:
                    m_arg = m_row
                    if HAS_QMASK:
                        m_arg = m_arg & b_qm
                    if HAS_DMASK and not MULTIPLY:
                        m_arg = m_arg & (b_seen > 0)
                    b_idx = gl.where(m_arg, b_idx, -1)
                    gl.store(argmax_ptr + (o_q.to(gl.int64) * Nd + j) * Lq + o_s, b_idx, mask=m_row)
                    r_val = gl.full([HALF, 8], NEG_INF, gl.float32, per_j)
                    r_col = gl.zeros([HALF, 8], gl.float32, per_j)
                b_seen = gl.max(gl.zeros([NS], gl.int32, cols), axis=0)
                b_max = gl.full([HALF], NEG_INF, gl.float32, rows)
        else:
            mbarrier.arrive(empty.index(slot), count=1)


# Sizes vary call to call: no value specialisation (as forward.py's kernel).
@gluon.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld", "n_chunks", "n_mblocks", "docs_per_program"])
def _maxsim_fwd_ws_kernel(
    q_ptr, d_desc, qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
    Nq, Nd, Lq, Ld, n_chunks, n_mblocks, docs_per_program,
    stride_qn, stride_ql,  # Q [Nq, Lq, d], unit stride on d
    BN: gl.constexpr, BK: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr, SPLIT_DOCS: gl.constexpr,
    HAS_QMASK: gl.constexpr, HAS_DMASK: gl.constexpr, MULTIPLY: gl.constexpr, SAVE_ARGMAX: gl.constexpr,
    Q_IN_REGS: gl.constexpr, SUB: gl.constexpr,
    num_warps: gl.constexpr,
):
    """d_desc: TMA descriptor of D as [Nd * Ld, BK], block [BN, BK]; masks bool [Nq, Lq] and
    [Nd, Ld] contiguous; out [n_chunks, Nq, Nd] (or [Nq, Nd]) fp32; argmax [Nq, Nd, Lq] int32.
    The default partition (num_warps = 4) is consumer 0."""
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(Ld, BN)

    # The query blocks, loaded once into shared memory (written by threads, read by wgmma: fence,
    # then barrier). With split documents both consumers read the one block (the freed 32 KB
    # deepen the ring).
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    q_dtype: gl.constexpr = q_ptr.dtype.element_ty
    N_QBLOCKS: gl.constexpr = 1 if SPLIT_DOCS else 2
    q_smem = gl.allocate_shared_memory(q_dtype, [N_QBLOCKS, HALF, BK],
                                       gl.NVMMASharedLayout.get_default_for([HALF, BK], q_dtype))
    o_k = gl.arange(0, BK, gl.SliceLayout(0, load_layout))
    for h in gl.static_range(N_QBLOCKS):
        i_m, _, _ = _stream(h, pid, n_mblocks, Nd, docs_per_program, SPLIT_DOCS)
        o_q, o_s, m_row, _, _ = _block_rows(i_m, n_mblocks, Nq, Lq, n_chunks, SEG, gl.SliceLayout(1, load_layout))
        p_q = q_ptr + o_q.to(gl.int64)[:, None] * stride_qn + o_s[:, None] * stride_ql + o_k[None, :]
        q_smem.index(h).store(gl.load(p_q, mask=m_row[:, None], other=0.0))  # [HALF, BK]
    fence_async_shared()
    gl.thread_barrier()

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BN, BK], d_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1 if SPLIT_DOCS else 2)  # its readers
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)

    # (The argument tuples are written out: a tuple built by concatenation turns constexprs into
    # tensors.)
    gl.warp_specialize([
        (_consumer, (0, q_smem.index(0), d_smem, ready, empty, turn, qmask_ptr, dmask_ptr, out_ptr, argmax_ptr,
                     pid, Nq, Nd, Lq, Ld, n_chunks, n_mblocks, n_tiles, docs_per_program,
                     BN, SEG, STAGES, SPLIT_DOCS, HAS_QMASK, HAS_DMASK, MULTIPLY, SAVE_ARGMAX, Q_IN_REGS, SUB)),
        (_consumer, (1, q_smem.index(0 if SPLIT_DOCS else 1), d_smem, ready, empty, turn, qmask_ptr, dmask_ptr,
                     out_ptr, argmax_ptr, pid, Nq, Nd, Lq, Ld, n_chunks, n_mblocks, n_tiles, docs_per_program,
                     BN, SEG, STAGES, SPLIT_DOCS, HAS_QMASK, HAS_DMASK, MULTIPLY, SAVE_ARGMAX, Q_IN_REGS, SUB)),
        (_producer, (d_desc, d_smem, ready, empty, pid, n_mblocks, Nd, Ld, n_tiles, docs_per_program,
                     BN, STAGES, SPLIT_DOCS)),
    ], [4, 1], [232, 24])  # registers: consumer 1 and the producer (the kernel runs at maxnreg=168)


def ws_plan(Nq: int, Nd: int, Lq: int, split_docs: bool | None, n_sms: int):
    """(SEG, chunks, m-blocks, split_docs, documents per program, programs) of one launch: about one
    program per multiprocessor (a program holds ~200 KB of shared memory)."""
    seg = min(next_pow2(Lq), HALF_ROWS)
    n_chunks = -(-Lq // seg)
    n_mblocks = -(-Nq // (HALF_ROWS // seg)) * n_chunks
    if split_docs is None:
        split_docs = n_mblocks == 1  # one row block: its two consumers split the documents
    units = n_mblocks if split_docs else -(-n_mblocks // 2)
    docs_per_program = max(1, -(-Nd // max(1, n_sms // units)))
    return seg, n_chunks, n_mblocks, split_docs, docs_per_program, units * -(-Nd // docs_per_program)


@functools.lru_cache(maxsize=16)
def _tile_layout(BN: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of a document tile [BN, d] (the TMA box and the MMA's operand)."""
    return gl.NVMMASharedLayout.get_default_for([BN, d], gl.float16 if dtype == torch.float16 else gl.bfloat16)


def maxsim_forward_ws(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                      d_mask: torch.Tensor | None = None, *, multiply: bool = False, save_argmax: bool = False,
                      BN: int = 128, STAGES: int = 4, split_docs: bool | None = None, q_in_regs: bool = True,
                      sub_tiles: int | None = None,
                      argmax_out: torch.Tensor | None = None, keep_plan: bool = False):
    """Scores ``[Nq, Nd]`` fp32 (and with ``save_argmax`` the int32 argmax ``[Nq, Nd, Lq]``, written
    into ``argmax_out`` when given) of ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` (fp16/bf16, d in
    {64, 128}, :func:`tma_ready`; a D that is not is copied), masks ``[Nq, Lq]`` / ``[Nd, Ld]`` (bool, or
    numbers: a value other than 0/1 makes its sequence's scores NaN):
    the contract of ``maxsim.maxsim`` within this kernel's scope (module docstring). BN: document
    tokens per tile (128).
    STAGES: the ring's depth. split_docs: None splits when there is one row block. q_in_regs: the
    query block as the MMA's register operand. sub_tiles: MMAs per tile, 1 or 2 (None:
    ``WS_SUB_TILES``). Raises ValueError outside the scope.
    keep_plan: return ``(scores, argmax, plan)``, plan a :class:`WarpSpecializedPlan` of this launch
    (None where it cannot replay: masks, a copied input, Triton's ordinary launch path)."""
    if Q.dim() != 3 or D.dim() != 3 or D.shape[2] != Q.shape[2] or Q.dtype != D.dtype \
            or Q.dtype not in (torch.float16, torch.bfloat16) or Q.shape[2] not in (64, 128):
        raise ValueError("maxsim_forward_ws: Q [Nq, Lq, d] and D [Nd, Ld, d], fp16 or bf16, d in (64, 128)")
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[0], D.shape[1]
    seg, n_chunks, n_mblocks, split_docs, docs_per_program, n_programs = ws_plan(
        Nq, Nd, Lq, split_docs, multiprocessors(cuda_index(Q)))
    if split_docs and STAGES % 2:
        raise ValueError("maxsim_forward_ws: split documents need an even STAGES (a slot per consumer parity)")
    d_ready = tma_ready(D)
    in_place = Q.stride(-1) == 1 and d_ready  # (no copy: a plan may replay this launch)
    Q = Q if Q.stride(-1) == 1 else Q.contiguous()
    D = D if d_ready else D.contiguous()
    # A number mask (an attention mask) becomes bool here; a value other than 0/1 makes its
    # sequence's scores NaN, as the Triton kernel flags it.
    q_bad = d_bad = None
    if q_mask is not None and q_mask.dtype != torch.bool:
        q_mask, q_bad = _checks.bool_mask_and_invalid(q_mask)  # [Nq, Lq], [Nq]
    if d_mask is not None and d_mask.dtype != torch.bool:
        d_mask, d_bad = _checks.bool_mask_and_invalid(d_mask)  # [Nd, Ld], [Nd]
    qm = q_mask.contiguous() if q_mask is not None else None
    dm = d_mask.contiguous() if d_mask is not None else None
    # D as TMA rows [Nd * Ld, d], box [BN, d]
    desc_args = ([Nd * Ld, d], [D.stride(1), 1], [BN, d], _tile_layout(BN, d, Q.dtype))
    d_desc = TensorDescriptor(D, *desc_args)
    out = _outputs.empty((Nq, Nd) if n_chunks == 1 else (n_chunks, Nq, Nd), torch.float32, Q.device)
    argmax = None
    if save_argmax:
        argmax = argmax_out if argmax_out is not None else _outputs.empty((Nq, Nd, Lq), torch.int32, Q.device)
    # Through the thin launch path (maxsim._launch): Gluon's own per-call binding costs more host
    # time than a small call's GPU time.
    ints = (Nq, Nd, Lq, Ld, n_chunks, n_mblocks, docs_per_program, Q.stride(0), Q.stride(1))
    replay = launch(
        _maxsim_fwd_ws_kernel, (n_programs,),
        (Q, d_desc, qm if qm is not None else Q, dm if dm is not None else Q, out,
         argmax if argmax is not None else out, *ints),
        dict(BN=BN, BK=d, SEG=seg, STAGES=STAGES, SPLIT_DOCS=split_docs,
             HAS_QMASK=qm is not None, HAS_DMASK=dm is not None, MULTIPLY=multiply, SAVE_ARGMAX=save_argmax,
             Q_IN_REGS=q_in_regs, SUB=sub_tiles or WS_SUB_TILES[save_argmax], num_warps=4),
        num_warps=4, maxnreg=WS_MAXNREG,
    )
    scores = _checks.nan_where_invalid(out if n_chunks == 1 else out.sum(0), q_bad, d_bad, 3, 3)
    if not keep_plan:
        return scores, argmax
    plan = None
    if replay is not None and in_place and qm is None and dm is None:
        plan = WarpSpecializedPlan(replay, ints, tuple(out.shape), tuple(argmax.shape) if save_argmax else None,
                                   desc_args)
    return scores, argmax, plan


class WarpSpecializedPlan:
    """One kept launch of the kernel (no masks, inputs read in place): ``plan(Q, D, q_mask, d_mask)``
    on tensors of the same signature (shapes, strides, dtypes, alignment; masks None) makes new
    outputs and a new TMA descriptor and replays the compiled kernel with the same integers, so a
    repeated call skips the checks, the launch plan arithmetic and the launch key. Q and D may be
    any views of the kept layout (e.g. ``[Lq, d]`` for one query): only their addresses are used.
    Returns (scores [Nq, Nd], argmax [Nq, Nd, Lq] or None)."""

    __slots__ = ("replay", "ints", "out_shape", "argmax_shape", "desc_args")

    def __init__(self, replay, ints, out_shape, argmax_shape, desc_args):
        self.replay, self.ints, self.out_shape, self.argmax_shape = replay, ints, out_shape, argmax_shape
        self.desc_args = desc_args  # the TMA descriptor's shape, strides, box and layout: D's new address only

    def __call__(self, Q, D, q_mask=None, d_mask=None):
        out = _outputs.empty(self.out_shape, torch.float32, Q.device)
        argmax = None if self.argmax_shape is None else _outputs.empty(self.argmax_shape, torch.int32, Q.device)
        d_desc = TensorDescriptor(D, *self.desc_args)
        self.replay((Q, d_desc, Q, Q, out, out if argmax is None else argmax, *self.ints))
        return (out if len(self.out_shape) == 2 else out.sum(0)), argmax
