"""The PQ look-up scorer in Gluon (Hopper): the int8 codebooks in shared memory, each code's word
gathered straight into the wgmma's register operand.

Same arithmetic, layout and scores as :mod:`maxsim.compressed.pq_lut` (read that module's
docstring first). The Triton version gathers every code's 32-bit word from L1 and splits it into
bytes that go through shared memory to the tensor cores. Here:

- the quantised codebooks (``[32, 256]`` int32 words, 32 KB) are copied once per program into
  shared memory, where a gather of 32 random words costs a few bank-conflict cycles, not one L1
  tag look-up per word;
- each thread gathers exactly the words its fragment of the wgmma's left operand holds (8-bit A:
  4 consecutive K bytes a register, which is one code's 4 coordinates), so the word lands in the
  register the tensor core reads: no split, no layout conversion, no shared-memory round trip;
- the epilogue (document maxima from the groups of 16 tokens) is the residual Gluon scorer's
  (:func:`maxsim.compressed.residual_gluon.document_maxima`).

Gluon has no shared-memory gather, so the gather is one ``ld.shared`` in inline PTX, addressed from
the kernel's shared-memory base, where the table is the first and largest allocation. The kernel
checks that on entry (every thread reads its part of the table back through the same PTX) and
returns NaN scores, never wrong ones, if a compiler ever places it elsewhere.

With ``INT8`` the same kernel scores one-byte tokens (:mod:`maxsim.compressed.onebyte_gluon`): the
word a thread loads is the token's own 4 coordinates (int8, or e4m3 with ``FP8``), no table.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from maxsim.compressed.residual_gluon import (GLUON_BLOCK_TOKENS, MAGIC, MAGIC_BITS, cols_layout, document_maxima,
                                              mma_layout, query_slices, rows_layout, strips_layout)

TABLE_WORDS = gl.constexpr(32 * 256)  # m 32 sub-spaces of 256 codes, one 32-bit word each
# The table's word $1 into $0 (the table sits at the base of shared memory). As an int8 pack of 4,
# $0 is one A-operand register, its 4 coordinates; $2..$4 repeat $1.
_LOAD_WORD = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; ld.shared.b32 $0, [a]; }")


@gluon.jit
def _load_codes(codes_ptr, scale_ptr, t0, t_hi, off_c, o_row, o_t, M: gl.constexpr, INT8: gl.constexpr):
    """Tile t0's codes, one [BT, 4, 2] tensor per 32-dimension slice k: element (r, l, b) is the
    code of sub-space 8k + l + 4b of token t0 + r (rows past t_hi: 0; two codes a load). INT8: the
    codes are the token's 32-bit words, word 8k + 4b + l holding coordinates 32 k + 16 b + 4 l + 0..3,
    stored in the same order (M 32), and the fifth value is the tokens' scales [BT] in the MMA's row
    layout (``o_t``), loaded with the words a tile before the epilogue reads them (PQ: ``o_t``
    itself, a loop-carried value the compiler drops)."""
    p = codes_ptr + t0.to(gl.int64) * M + off_c
    m = (t0 + o_row) < t_hi
    scales = o_t
    if INT8:
        scales = gl.load(scale_ptr + t0 + o_t, mask=t0 + o_t < t_hi, other=0.0)
    return (gl.load(p, mask=m, other=0), gl.load(p + 2, mask=m, other=0), gl.load(p + 4, mask=m, other=0),
            gl.load(p + 6, mask=m, other=0), scales)


@gluon.jit
def _slice_operand(b_code, sub_row, zero4, a_op: gl.constexpr, BT: gl.constexpr, ABLATE: gl.constexpr,
                   INT8: gl.constexpr, FP8: gl.constexpr):
    """Slice k's left operand [BT, 32] int8 in the wgmma's register layout: each code's word
    (table row ``sub_row`` + code, ``sub_row`` [1, 4, 2] = (8k + l + 4b) * 256) gathered from shared
    memory into the register that holds its 4 coordinates. INT8: b_code is that operand already
    (FP8: its bytes are e4m3)."""
    if INT8:  # the word as the register's 4 bytes (a pack of 4 one-byte values moves nothing)
        d = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [gl.expand_dims(b_code, 3) + zero4],
                                      dtype=gl.float8e4nv if FP8 else gl.int8, is_pure=True, pack=4)
    else:
        idx = gl.expand_dims(sub_row + b_code.to(gl.int32), 3) + zero4  # [BT, 4, 2, 4]: the same index 4 times
        if ABLATE % 2 == 1:  # the probe's ablation: no gather (the index's low byte as the coordinates)
            d = idx.to(gl.int8)
        else:
            d = gl.inline_asm_elementwise(_LOAD_WORD, "=r,r,r,r,r", [idx], dtype=gl.int8, is_pure=False, pack=4)
    d = gl.reshape(gl.permute(d, (0, 2, 1, 3)), [BT, 32])  # column 16 b + 4 l + byte
    return gl.convert_layout(d, a_op)


@gluon.jit
def _tile_products(c0, c1, c2, c3, sub0, zero4, q_smem, BT: gl.constexpr, N: gl.constexpr, mma: gl.constexpr,
                   a_op: gl.constexpr, ABLATE: gl.constexpr, INT8: gl.constexpr, FP8: gl.constexpr):
    """A tile's products [BT, N] (int32 biased by MAGIC_BITS; FP8: fp32) from its codes or INT8
    tokens c0..c3 (one per slice)."""
    if FP8:  # e4m3 products accumulate in fp32
        acc = gl.zeros([BT, N], gl.float32, mma)
    else:
        acc = gl.full([BT, N], MAGIC_BITS, gl.int32, mma)
    # Issued without waiting (the next slice's gather overlaps this one's product), waited for once.
    a0 = _slice_operand(c0, sub0, zero4, a_op, BT, ABLATE, INT8, FP8)
    acc = warpgroup_mma(a0, q_smem.index(0).permute((1, 0)), acc, is_async=True)
    a1 = _slice_operand(c1, sub0 + 8 * 256, zero4, a_op, BT, ABLATE, INT8, FP8)
    acc = warpgroup_mma(a1, q_smem.index(1).permute((1, 0)), acc, is_async=True)
    a2 = _slice_operand(c2, sub0 + 16 * 256, zero4, a_op, BT, ABLATE, INT8, FP8)
    acc = warpgroup_mma(a2, q_smem.index(2).permute((1, 0)), acc, is_async=True)
    a3 = _slice_operand(c3, sub0 + 24 * 256, zero4, a_op, BT, ABLATE, INT8, FP8)
    acc = warpgroup_mma(a3, q_smem.index(3).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _tile_scores(acc, b_qs, b_cn, b_scale, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry,
                 carry_doc, LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr, G: gl.constexpr,
                 mma: gl.constexpr, strips: gl.constexpr, cols: gl.constexpr, rows: gl.constexpr,
                 PAIRS: gl.constexpr, ABLATE: gl.constexpr, INT8: gl.constexpr, FP8: gl.constexpr):
    """Tile t0's products ``acc`` into scores (INT8: times each token's scale ``b_scale`` [BT]), then
    :func:`document_maxima`."""
    if FP8:
        b_s = acc * b_qs[None, :]  # [BT, N]
    else:
        b_f = acc.to(gl.float32, bitcast=True)  # 1.5 * 2**23 + acc, exactly
        b_s = gl.fma(b_f, b_qs[None, :], b_cn[None, :])  # [BT, N]
    if INT8:  # each token's scale
        b_s = b_s * b_scale[:, None]
    if ABLATE >= 2:  # the probe's ablation: no document maxima (one running max of the columns)
        b_m = gl.convert_layout(gl.max(b_s, axis=0), gl.SliceLayout(0, cols))
        return gl.maximum(b_carry, b_m), carry_doc
    return document_maxima(b_s, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry, carry_doc,
                           LQ, QPB, BT, G, strips, cols, rows, PAIRS)


@gluon.jit
def _pq_lut_gluon_kernel(
    codes_ptr, cu_ptr, q_ptr, qs_ptr, words_ptr, scale_ptr, gdoc_ptr, out_ptr,
    Nd, doc_base, docs_per_program, n_runs, Nq,
    M: gl.constexpr, LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr, G: gl.constexpr, PAIRS: gl.constexpr,
    ABLATE: gl.constexpr, INT8: gl.constexpr, FP8: gl.constexpr,
):
    """QPB queries (N = QPB * LQ columns of the MMA) against a run of whole documents; arguments as
    ``pq_lut._pq_lut_kernel``'s, plus ``gdoc_ptr`` (each group's document, padded past the end) and
    ``doc_base`` (``cu_ptr`` may start at document doc_base of the layout). out [Nq, Nd] pre-zeroed.
    INT8: ``codes_ptr`` holds int8 tokens [Tp, 128] as [Tp, 32] int32 words in the codes' stored
    order (scales ``scale_ptr`` [Tp] fp32), each word loaded straight into its A-fragment register;
    no table (``words_ptr`` unread). FP8 (with INT8): the tokens and the query are e4m3, the products
    accumulate in fp32."""
    N: gl.constexpr = QPB * LQ
    NG: gl.constexpr = BT // G
    NEG_INF: gl.constexpr = float("-inf")
    mma: gl.constexpr = mma_layout(N)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    strips: gl.constexpr = strips_layout(G, PAIRS)
    cols: gl.constexpr = cols_layout(NG)
    rows: gl.constexpr = rows_layout(QPB, LQ)
    # [BT, 4 (l), 2 (b), 4 (byte)]: the wgmma's 8-bit A fragment (PTX: row lane / 4 + 8 i + 16 warp,
    # bytes 4 (lane % 4) + 16 b + 0..3) with its column split as (b, l, byte); a register is a word.
    if BT == 128:
        frag: gl.constexpr = gl.DistributedLinearLayout(
            [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [8, 0, 0, 0], [64, 0, 0, 0]],
            [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            [[16, 0, 0, 0], [32, 0, 0, 0]], [], [BT, 4, 2, 4])
    else:
        frag: gl.constexpr = gl.DistributedLinearLayout(
            [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [8, 0, 0, 0]],
            [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            [[16, 0, 0, 0], [32, 0, 0, 0]], [], [BT, 4, 2, 4])
    codes3: gl.constexpr = gl.SliceLayout(3, frag)  # [BT, 4, 2]: one word index a register
    tab_blk: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])

    pid = gl.program_id(0)
    i_run = pid % n_runs
    q0 = (pid // n_runs) * QPB
    o_n = gl.arange(0, N, gl.SliceLayout(0, mma))
    b_qs = gl.load(qs_ptr + q0 * LQ + o_n)  # [N]
    if INT8:
        q_smem = query_slices(q_ptr, q0, LQ, N)
    else:
        # The table first: the PTX gather addresses it from the base of shared memory.
        tab = gl.allocate_shared_memory(gl.int32, [TABLE_WORDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        o_tab = gl.arange(0, TABLE_WORDS, tab_blk)
        b_words = gl.load(words_ptr + o_tab)
        tab.store(b_words)
        q_smem = query_slices(q_ptr, q0, LQ, N)
        gl.thread_barrier()
        b_back = gl.inline_asm_elementwise(_LOAD_WORD, "=r,r", [o_tab], dtype=gl.int32, is_pure=False, pack=1)
        misplaced = gl.max((b_back != b_words).to(gl.int32), axis=0)  # 0 unless the table is elsewhere
        b_qs = gl.where(misplaced == 0, b_qs, float("nan"))
    b_cn = -MAGIC * b_qs

    # loop-invariant offsets in the fragment's layout: a token's codes, and its slice's table rows
    l_rl: gl.constexpr = gl.SliceLayout(2, codes3)  # [BT, 4]
    o_row = gl.expand_dims(gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, l_rl)), 1), 2)  # [BT, 1, 1]
    o_l = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, l_rl)), 0), 2)  # [1, 4, 1]
    o_b = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, codes3))), 0), 1)
    off_c = o_row * M + o_l * 8 + o_b  # [BT, 4, 2]: the codes are stored sub-space 8k + l + 4b at 8 l + 2 k + b
    sub0 = (o_l + 4 * o_b) * 256  # [1, 4, 2]
    zero4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, frag)))), 0), 1), 2) * 0

    j_lo = (i_run * docs_per_program).to(gl.int64)
    j_hi = gl.minimum(j_lo + docs_per_program, Nd)
    t_lo = gl.load(cu_ptr + j_lo)
    t_hi = gl.load(cu_ptr + j_hi)
    o_g = gl.arange(0, NG, gl.SliceLayout(1, cols))
    b_carry = gl.full([N], NEG_INF, gl.float32, gl.SliceLayout(0, cols))
    carry_doc = (j_lo * 0 - 3).to(gl.int32)
    o_t = gl.arange(0, BT, gl.SliceLayout(1, mma))
    c0, c1, c2, c3, c_scale = _load_codes(codes_ptr, scale_ptr, t_lo, t_hi, off_c, o_row, o_t, M, INT8)
    # Two tiles an iteration, their code buffers swapping roles (the residual Gluon scorer's walk).
    for t0 in range(t_lo, t_hi, 2 * BT):
        n0, n1, n2, n3, n_scale = _load_codes(codes_ptr, scale_ptr, t0 + BT, t_hi, off_c, o_row, o_t, M, INT8)
        acc = _tile_products(c0, c1, c2, c3, sub0, zero4, q_smem, BT, N, mma, a_op, ABLATE, INT8, FP8)
        b_carry, carry_doc = _tile_scores(acc, b_qs, b_cn, c_scale, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base,
                                          t0, t_hi, o_g, b_carry, carry_doc, LQ, QPB, BT, G, mma, strips, cols,
                                          rows, PAIRS, ABLATE, INT8, FP8)
        c0, c1, c2, c3, c_scale = _load_codes(codes_ptr, scale_ptr, t0 + 2 * BT, t_hi, off_c, o_row, o_t, M, INT8)
        acc = _tile_products(n0, n1, n2, n3, sub0, zero4, q_smem, BT, N, mma, a_op, ABLATE, INT8, FP8)
        b_carry, carry_doc = _tile_scores(acc, b_qs, b_cn, n_scale, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base,
                                          t0 + BT, t_hi, o_g, b_carry, carry_doc, LQ, QPB, BT, G, mma, strips,
                                          cols, rows, PAIRS, ABLATE, INT8, FP8)
    if ABLATE >= 2:  # keeps the ablated walk's work alive
        o_c = gl.arange(0, N, gl.SliceLayout(0, cols))
        gl.store(out_ptr + o_c, b_carry, mask=o_c < Nd)
    if not INT8:
        tab._keep_alive()  # the gathers read it behind the compiler's back: no other buffer may take its place


def run_kernel(Q, layout, quantize, codes, words, scales, *, docs=None, block_tokens: int = 128, waves: int = 8,
               qpb: int = 1, maxnreg: int | None = None, pairs: bool = False, ablate: int = 0, int8: bool = False,
               fp8: bool = False) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of Q ``[Nq, Lq <= 32, 128]`` against a padded layout (``cu``,
    ``group``, ``group_doc``; ``docs``: ``(lo, hi)`` or None, all) through :func:`_pq_lut_gluon_kernel`:
    ``quantize()`` gives the queries (q~ ``[Nq_pad, 32, 128]``, u ``[Nq_pad, 32]``, 32), ``codes``,
    ``words`` and ``scales`` the kernel's tensors (those a mode does not read: any tensor)."""
    from maxsim.compressed.residual_lut import document_range, run_grid

    if Q.shape[1] > 32:
        raise ValueError(f"the Gluon scorer takes queries of up to 32 tokens, got {Q.shape[1]}")
    if block_tokens not in GLUON_BLOCK_TOKENS:  # the tiles its fragment layout is written for
        raise ValueError(f"the Gluon scorer's block_tokens must be one of {GLUON_BLOCK_TOKENS}, got {block_tokens!r}")
    Nq = Q.shape[0]
    cu, out = document_range(layout, Nq, docs, Q.device)
    Nd = out.shape[1]
    if Nq == 0 or Nd == 0:
        return out
    q8, qs, LQ = quantize()
    docs_per_program, n_runs = run_grid(Nd, waves, Q.device)
    _pq_lut_gluon_kernel[(n_runs * (q8.shape[0] // qpb),)](
        codes, cu, q8, qs, words, scales, layout.group_doc, out, Nd, 0 if docs is None else docs[0], docs_per_program,
        n_runs, Nq, M=codes.shape[1], LQ=LQ, QPB=qpb, BT=block_tokens, G=layout.group, PAIRS=pairs, ABLATE=ablate,
        INT8=int8, FP8=fp8, num_warps=4, num_stages=1, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    return out


def gluon_scores(Q, layout, *, q_mask=None, block_tokens: int = 128, waves: int = 8, qpb: int = 1, docs=None,
                 maxnreg: int | None = None, pairs: bool = False, ablate: int = 0):
    """:func:`maxsim.compressed.pq_lut.pq_lut_scores` through the Gluon kernel: Q ``[Nq, Lq <= 32,
    128]`` on a Hopper GPU, ``layout`` a :class:`maxsim.compressed.pq_lut.PQLutLayout`; ``maxnreg``
    caps the registers a thread (more programs an SM); ``pairs``: each row pair's max before the
    tile goes through shared memory (half the bytes), two fewer conversions (the sm90 table's
    choice). ``ablate`` (the probe's, meaningless scores): 1 no gather, 2 no document maxima,
    3 neither."""
    from maxsim.compressed.pq_lut import prepare_queries

    if ablate not in (0, 1, 2, 3):
        raise ValueError(f"ablate must be 0 to 3, got {ablate!r}")
    return run_kernel(Q, layout, lambda: prepare_queries(Q, layout, q_mask=q_mask, qpb=qpb, rows=32), layout.codes,
                      layout.words, layout.words, docs=docs, block_tokens=block_tokens, waves=waves, qpb=qpb,
                      maxnreg=maxnreg, pairs=pairs, ablate=ablate)
