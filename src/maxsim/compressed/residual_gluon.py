"""The look-up residual scorer in Gluon (Hopper): every tensor in the layout its next step wants.

Same arithmetic and stored layout as :mod:`maxsim.compressed.residual_lut` (read that module's
docstring first). The Triton version lets the compiler place tensors, and the probe measured what
that costs: the code bytes staged through shared memory once per slice, the table rows loaded in
one layout and converted, the group maxima reduced across lanes by shuffles. Here, explicitly:

- the code words are loaded straight into the registers of the wgmma's left operand (each thread
  reads the 4-byte words its fragment needs), expanded there by the byte permute, and multiplied
  with the query slices held in shared memory (``[LQ, 32]`` each, K-major);
- the int32 accumulator ``[BT, LQ]`` and the table rows gathered for it share the MMA layout, so
  the epilogue's fma / add / multiply need no data movement;
- one conversion through shared memory turns the scores into column strips (each thread ``G``
  consecutive tokens of one query row), where each group's max is in-thread;
- the group maxima of the tile (``[NG, LQ]``) go to a layout that holds a whole column per
  thread: a running max along the groups, reset where the document changes (the document of each
  group is stored with the corpus), gives every document its max; rows are then summed in-thread
  after a second small conversion, and each document's last group stores its score.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# The tiles the kernel's code-word layout is written for; a run reads ids up to 4 tiles - 2 rows
# past its end (residual_lut.TAIL_TOKENS covers the largest).
GLUON_BLOCK_TOKENS = (64, 128)
MAGIC_BITS = gl.constexpr(0x4B400000)  # bits of 1.5 * 2**23 (see residual_lut)
MAGIC = gl.constexpr(12582912.0)


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# The layouts both Gluon look-up scorers share (4 warps, one warpgroup).
@gluon.constexpr_function
def mma_layout(N):
    """The int32 accumulator [BT, N] of the wgmma (and every epilogue tensor beside it)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])


@gluon.constexpr_function
def strips_layout(G, pairs):
    """Where each group's max is taken in-thread (:func:`document_maxima`): [BT, N], G consecutive
    tokens of one column a thread; with ``pairs``, [NG, G / 2, N], a group's G / 2 row-pair maxima."""
    if pairs:
        return gl.BlockedLayout([1, G // 2, 1], [1, 1, 32], [4, 1, 1], [1, 2, 0])
    return gl.BlockedLayout([G, 1], [1, 32], [4, 1], [0, 1])


@gluon.constexpr_function
def cols_layout(NG):
    """[NG, N]: a whole column of group maxima a thread."""
    return gl.BlockedLayout([NG, 1], [1, 32], [1, 4], [0, 1])


@gluon.constexpr_function
def rows_layout(QPB, LQ):
    """[NG, QPB, LQ]: a query's rows over 4 lanes, LQ / 4 a thread (summed in-thread, then across
    the 4 lanes in two shuffles)."""
    return gl.BlockedLayout([1, 1, LQ // 4], [8 // QPB, QPB, 4], [1, 1, 4], [2, 1, 0])


@gluon.jit
def query_slices(q_ptr, q0, LQ: gl.constexpr, N: gl.constexpr):
    """The quantised queries q0.. (N rows of q_ptr's [*, LQ, 128], one byte a coordinate: int8 or
    e4m3) as four K-major slices in shared memory, [4, N, 32]: the wgmma's right operand."""
    q_blk: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # [N, 32] slice loads
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [4, N, 32], q_sl)
    o_qr = gl.arange(0, N, gl.SliceLayout(1, q_blk))
    o_qc = gl.arange(0, 32, gl.SliceLayout(0, q_blk))
    p_q = q_ptr + (q0.to(gl.int64) * LQ + o_qr)[:, None] * 128 + o_qc[None, :]
    for k in gl.static_range(4):
        q_smem.index(k).store(gl.load(p_q + k * 32))
    fence_async_shared()
    return q_smem


@gluon.jit
def _load_words(p_codes, off_w, grp: gl.constexpr):
    """A tile's code bytes of word group ``grp`` ([BT, 32] int8) in the MMA's register operand
    layout: ``p_codes`` the tile's first row (scalar), ``off_w`` the loop-invariant offsets
    ``[BT, 32]`` int32. No mask: the layout holds a tile of padding past its last token."""
    return gl.load(p_codes + (off_w + grp * 32))


@gluon.jit
def _load_ids(cid_ptr, t0, off_t, ROW0: gl.constexpr):
    """Tile t0's centroid ids [BT] int32 in the MMA's row layout, loaded a tile before the table
    rows they address, so the gather never waits on them. ROW0 (the probe's ablation): every token
    reads row 0."""
    b_cid = gl.load(cid_ptr + t0 + off_t)
    if ROW0:
        b_cid = b_cid * 0
    return b_cid


@gluon.jit
def _load_tile(codes_ptr, b_cid, inv_ptr, p_tab, t0, off_w, off_t, W: gl.constexpr, NBITS: gl.constexpr,
               LQ: gl.constexpr):
    """Tile t0's code words (two groups; 2 bits: the same one twice), table rows [BT, N] and inverse
    norms [BT] in the MMA layout; ``b_cid`` its centroid ids (:func:`_load_ids`), ``p_tab [N]``
    each column's table (its query's) at row 0. The ids are trusted: ``build_layout`` checked every
    one against the table when it built the layout."""
    w0 = _load_words(codes_ptr + t0 * W, off_w, 0)
    if NBITS == 2:
        w1 = w0
    else:
        w1 = _load_words(codes_ptr + t0 * W, off_w, 1)
    return w0, w1, gl.load(p_tab[None, :] + (b_cid * LQ)[:, None]), gl.load(inv_ptr + t0 + off_t)


@gluon.jit
def _residual_lut_gluon_kernel(
    codes_ptr, cid_ptr, inv_ptr, cu_ptr, q_ptr, qs_ptr, tab_ptr, gdoc_ptr, out_ptr,
    Nd, doc_base, num_centroids, docs_per_program, n_runs,
    Nq, NBITS: gl.constexpr, LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr, G: gl.constexpr,
    ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr, PAIRS: gl.constexpr,
    ABLATE: gl.constexpr,
):
    """QPB queries (N = QPB * LQ columns of the MMA) against a run of whole documents; out [Nq, Nd]
    fp32 (pre-zeroed: empty documents keep 0). Arguments as ``residual_lut._residual_lut_kernel``'s
    (the queries, their scales and tables padded to a multiple of QPB); ``cu_ptr`` may start at
    document ``doc_base`` of the layout (group documents count from the layout's first)."""
    N: gl.constexpr = QPB * LQ
    W: gl.constexpr = 128 * NBITS // 8
    NG: gl.constexpr = BT // G
    NEG_INF: gl.constexpr = float("-inf")
    mma: gl.constexpr = mma_layout(N)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    strips: gl.constexpr = strips_layout(G, PAIRS)
    cols: gl.constexpr = cols_layout(NG)
    rows: gl.constexpr = rows_layout(QPB, LQ)
    # The register operand's layout written out (PTX wgmma, 8-bit A: a0 = row lane/4 + 16 warp, bytes
    # 4 (lane % 4) + 0..3; a1 = row + 8; a2 = bytes + 16; a3 = both), so the loads see 4 contiguous
    # bytes a register and become 32-bit loads; converting it to a_op moves nothing.
    if BT == 128:
        w_lay: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0], [0, 16], [64, 0]],
                                                         [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                         [[16, 0], [32, 0]], [], [BT, 32])
    else:
        w_lay: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0], [0, 16]],
                                                         [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                         [[16, 0], [32, 0]], [], [BT, 32])

    pid = gl.program_id(0)
    i_run = pid % n_runs
    q0 = (pid // n_runs) * QPB  # the program's first query
    q_smem = query_slices(q_ptr, q0, LQ, N)
    o_n = gl.arange(0, N, gl.SliceLayout(0, mma))
    b_qs = gl.load(qs_ptr + q0 * LQ + o_n)  # [N]
    b_cn = -MAGIC * b_qs
    p_tab = tab_ptr + (q0 + o_n // LQ).to(gl.int64) * num_centroids * LQ + o_n % LQ  # [N]: each column's table

    j_lo = (i_run * docs_per_program).to(gl.int64)
    j_hi = gl.minimum(j_lo + docs_per_program, Nd)
    t_lo = gl.load(cu_ptr + j_lo)
    t_hi = gl.load(cu_ptr + j_hi)
    o_g = gl.arange(0, NG, gl.SliceLayout(1, cols))
    b_carry = gl.full([N], NEG_INF, gl.float32, gl.SliceLayout(0, cols))
    carry_doc = (j_lo * 0 - 3).to(gl.int32)  # the document b_carry belongs to (-3: none)

    # loop-invariant per-thread offsets; each tile adds its first row (a scalar)
    off_w = (gl.arange(0, BT, gl.SliceLayout(1, w_lay)) * W)[:, None] + gl.arange(0, 32, gl.SliceLayout(0, w_lay))[None, :]
    off_t = gl.arange(0, BT, gl.SliceLayout(1, mma))
    ROW0: gl.constexpr = ABLATE % 2 == 1
    c_a = _load_ids(cid_ptr, t_lo, off_t, ROW0)
    w0, w1, b_tab, b_inv = _load_tile(codes_ptr, c_a, inv_ptr, p_tab, t_lo, off_w, off_t, W, NBITS, LQ)
    c_b = _load_ids(cid_ptr, t_lo + BT, off_t, ROW0)
    # Two tiles an iteration, their buffers swapping roles (no register copies): tile A is scored
    # while B's bytes arrive, then B while the next A's arrive; each tile's ids arrive a tile
    # earlier still. A pair may run one tile past the run: its groups lie outside [t_lo, t_hi) and
    # change nothing (the layout's TAIL_TOKENS cover the reads ahead).
    for t0 in range(t_lo, t_hi, 2 * BT):
        n0, n1, n_tab, n_inv = _load_tile(codes_ptr, c_b, inv_ptr, p_tab, t0 + BT, off_w, off_t, W, NBITS, LQ)
        c_a = _load_ids(cid_ptr, t0 + 2 * BT, off_t, ROW0)
        b_carry, carry_doc = _score_tile(w0, w1, b_tab, b_inv, q_smem, b_qs, b_cn, gdoc_ptr, out_ptr, q0, Nq, Nd,
                                         doc_base, t0, t_hi, o_g, b_carry, carry_doc, NBITS, LQ, QPB, BT, G, ASM0,
                                         ASM1, ASM2, ASM3, mma, a_op, strips, cols, rows, PAIRS, ABLATE)
        w0, w1, b_tab, b_inv = _load_tile(codes_ptr, c_a, inv_ptr, p_tab, t0 + 2 * BT, off_w, off_t, W, NBITS, LQ)
        c_b = _load_ids(cid_ptr, t0 + 3 * BT, off_t, ROW0)
        b_carry, carry_doc = _score_tile(n0, n1, n_tab, n_inv, q_smem, b_qs, b_cn, gdoc_ptr, out_ptr, q0, Nq, Nd,
                                         doc_base, t0 + BT, t_hi, o_g, b_carry, carry_doc, NBITS, LQ, QPB, BT, G,
                                         ASM0, ASM1, ASM2, ASM3, mma, a_op, strips, cols, rows, PAIRS, ABLATE)
    if ABLATE % 4 >= 2:  # keeps the ablated walk's work alive
        o_c = gl.arange(0, N, gl.SliceLayout(0, cols))
        gl.store(out_ptr + o_c, b_carry, mask=o_c < Nd)


@gluon.jit
def _expand(w, ASM: gl.constexpr, a_op: gl.constexpr, ABLATE: gl.constexpr):
    """A slice's operand [BT, 32] int8: the code words ``w`` expanded by the byte permute ``ASM``
    (ABLATE >= 4, the probe's: the words' own bytes)."""
    if ABLATE >= 4:
        d = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=gl.int8, is_pure=True, pack=4)
    else:
        d = gl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=gl.int8, is_pure=True, pack=4)
    return gl.convert_layout(d, a_op)


@gluon.jit
def _score_tile(w0, w1, b_tab, b_inv, q_smem, b_qs, b_cn, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry,
                carry_doc, NBITS: gl.constexpr, LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr,
                G: gl.constexpr, ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr, mma: gl.constexpr,
                a_op: gl.constexpr, strips: gl.constexpr, cols: gl.constexpr, rows: gl.constexpr, PAIRS: gl.constexpr,
                ABLATE: gl.constexpr):
    """Scores tile t0 (its code words w0 / w1, table rows, inverse norms): its products, then
    :func:`_tile_scores`."""
    acc = _tile_products(w0, w1, q_smem, BT, QPB * LQ, ASM0, ASM1, ASM2, ASM3, mma, a_op, ABLATE)
    return _tile_scores(acc, b_tab, b_inv, b_qs, b_cn, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g,
                        b_carry, carry_doc, LQ, QPB, BT, G, strips, cols, rows, PAIRS, ABLATE)


@gluon.jit
def _tile_products(w0, w1, q_smem, BT: gl.constexpr, N: gl.constexpr, ASM0: gl.constexpr, ASM1: gl.constexpr,
                   ASM2: gl.constexpr, ASM3: gl.constexpr, mma: gl.constexpr, a_op: gl.constexpr,
                   ABLATE: gl.constexpr):
    """A tile's int32 products [BT, N] (biased by MAGIC_BITS) from its code words w0 / w1."""
    # The four products are issued back to back and waited for once: one tensor-core round trip a
    # tile, not four.
    acc = gl.full([BT, N], MAGIC_BITS, gl.int32, mma)
    acc = warpgroup_mma(_expand(w0, ASM0, a_op, ABLATE), q_smem.index(0).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(_expand(w0, ASM1, a_op, ABLATE), q_smem.index(1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(_expand(w1, ASM2, a_op, ABLATE), q_smem.index(2).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(_expand(w1, ASM3, a_op, ABLATE), q_smem.index(3).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _tile_scores(acc, b_tab, b_inv, b_qs, b_cn, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry,
                 carry_doc, LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr, G: gl.constexpr,
                 strips: gl.constexpr, cols: gl.constexpr, rows: gl.constexpr, PAIRS: gl.constexpr,
                 ABLATE: gl.constexpr):
    """Tile t0's products, table rows and inverse norms into scores, then :func:`document_maxima`.
    ABLATE (the probe's, meaningless scores) 2: no document maxima; 4: no expansion (the code
    words as the operand's bytes)."""
    b_f = acc.to(gl.float32, bitcast=True)  # 1.5 * 2**23 + acc
    b_s = (gl.fma(b_f, b_qs[None, :], b_cn[None, :]) + b_tab.to(gl.float32)) * b_inv[:, None]  # [BT, N]
    if ABLATE % 4 >= 2:
        b_m = gl.convert_layout(gl.max(b_s, axis=0), gl.SliceLayout(0, cols))
        return gl.maximum(b_carry, b_m), carry_doc
    return document_maxima(b_s, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry, carry_doc,
                           LQ, QPB, BT, G, strips, cols, rows, PAIRS)


@gluon.jit
def _group_documents(gdoc_ptr, t0, t_hi, o_g, G: gl.constexpr):
    """(document of each group o_g of tile t0 (-2 past the run), whether it is its document's last
    group, whether it is inside the run), in o_g's layout."""
    o_grp = t0 // G + o_g
    m_grp = t0 + o_g * G < t_hi
    b_gdoc = gl.where(m_grp, gl.load(gdoc_ptr + o_grp), -2)  # (the layout pads past its end)
    b_next = gl.where(t0 + (o_g + 1) * G < t_hi, gl.load(gdoc_ptr + o_grp + 1), -1)
    return b_gdoc, m_grp & (b_next != b_gdoc), m_grp


@gluon.jit
def document_maxima(b_s, gdoc_ptr, out_ptr, q0, Nq, Nd, doc_base, t0, t_hi, o_g, b_carry, carry_doc,
                    LQ: gl.constexpr, QPB: gl.constexpr, BT: gl.constexpr, G: gl.constexpr, strips: gl.constexpr,
                    cols: gl.constexpr, rows: gl.constexpr, PAIRS: gl.constexpr):
    """Tile t0's scores b_s [BT, N] (any layout) into document maxima: stores the score of every
    document that ends in the tile, returns the running max of the one that goes on and its
    document (-3: none). Groups of G tokens never straddle documents; ``gdoc_ptr`` the document of
    each group (the layout pads past its end). PAIRS: b_s is in the MMA layout, where rows r and
    r + 8 of a group share a thread: their max first, then half the tile through shared memory into
    ``strips`` (:func:`strips_layout` with pairs); and the groups' documents are loaded twice rather than
    converted."""
    NG: gl.constexpr = BT // G
    N: gl.constexpr = QPB * LQ
    NEG_INF: gl.constexpr = float("-inf")
    if PAIRS:
        b_h = gl.reduce(gl.reshape(b_s, [NG, 2, G // 2, N]), 1, _max_nan)  # [NG, G / 2, N]: in-thread
        b_r = gl.reduce(gl.convert_layout(b_h, strips), 1, _max_nan)  # [NG, N]: in-thread
    else:
        b_s = gl.convert_layout(b_s, strips)
        b_r = gl.reduce(gl.reshape(b_s, [NG, G, N]), 1, _max_nan)  # [NG, N]: in-thread
    b_r = gl.convert_layout(b_r, cols)  # a column a thread

    # each group's document (groups never straddle documents); the run's next group decides
    # whether the tile's last document goes on
    b_gdoc, is_end, m_grp = _group_documents(gdoc_ptr, t0, t_hi, o_g, G)
    # running max along the groups, restarting where the document changes
    prev_doc = carry_doc
    run = b_carry
    b_m = gl.full([NG, N], NEG_INF, gl.float32, cols)
    for g in gl.static_range(NG):
        sel = (o_g == g)[:, None]
        doc_g = gl.sum(gl.where(o_g == g, b_gdoc, 0), axis=0)  # in-thread: the column holds all NG
        r_g = gl.max(gl.where(sel, b_r, NEG_INF), axis=0)  # [N]
        run = gl.where(doc_g == prev_doc, _max_nan(run, r_g), r_g)
        b_m = gl.where(sel, run[None, :], b_m)
        prev_doc = doc_g
    # [NG, QPB]: each query's rows summed in-thread
    b_sc = gl.sum(gl.convert_layout(gl.reshape(b_m, [NG, QPB, LQ]), rows), axis=2)
    sc_l: gl.constexpr = gl.SliceLayout(2, rows)
    o_qb = q0 + gl.arange(0, QPB, gl.SliceLayout(0, sc_l))
    if PAIRS:  # the groups' documents loaded again where the store wants them (no conversion, no barrier)
        b_gd, b_end, _ = _group_documents(gdoc_ptr, t0, t_hi, gl.arange(0, NG, gl.SliceLayout(1, sc_l)), G)
    else:
        b_gd = gl.convert_layout(b_gdoc, gl.SliceLayout(1, sc_l))
        b_end = gl.convert_layout(is_end, gl.SliceLayout(1, sc_l))
    gl.store(out_ptr + o_qb.to(gl.int64)[None, :] * Nd + (b_gd - doc_base)[:, None], b_sc,
             mask=b_end[:, None] & (o_qb < Nq)[None, :])
    last_end = gl.sum(gl.where(o_g == NG - 1, is_end.to(gl.int32), 0), axis=0)
    last_ok = gl.sum(gl.where(o_g == NG - 1, m_grp.to(gl.int32), 0), axis=0)
    # the tile's last document goes on when the last group is inside the run and not an end
    goes_on = (last_ok > 0) & (last_end == 0)
    return gl.where(goes_on, run, NEG_INF), gl.where(goes_on, prev_doc, -3)


def gluon_scores(Q, layout, centroids, *, q_mask=None, block_tokens: int = 64, waves: int = 8, num_stages: int = 1,
                 table_dtype=torch.float16, qpb: int = 1, docs=None, pairs: bool = False, maxnreg: int | None = None,
                 ablate: int = 0):
    """:func:`maxsim.compressed.residual_lut.lut_scores` through the Gluon kernel: Q ``[Nq, Lq <=
    32, 128]`` on a Hopper GPU (each query padded to 32 rows), ``docs`` ``(lo, hi)`` or None (all);
    ``pairs``: the row-pair epilogue (:func:`document_maxima`; the sm90 table's choice from four
    queries a program); ``maxnreg``: a register cap a thread (more programs resident an SM).
    ``ablate`` (the probe's, meaningless scores; a sum of): 1 no table rows, 2 no document maxima,
    4 no expansion of the codes."""
    from maxsim.compressed.residual_lut import decoder_asm, prepare_queries
    from maxsim.tuning import multiprocessors

    Nq = Q.shape[0]
    lo, hi = (0, layout.num_docs) if docs is None else docs
    Nd = hi - lo
    out = torch.zeros(Nq, Nd, dtype=torch.float32, device=Q.device)
    if Nq == 0 or Nd == 0:
        return out
    if Q.shape[1] > 32:
        raise ValueError(f"the Gluon scorer takes queries of up to 32 tokens, got {Q.shape[1]}")
    if ablate not in range(8):
        raise ValueError(f"ablate must be 0 to 7, got {ablate!r}")
    if block_tokens not in GLUON_BLOCK_TOKENS:
        raise ValueError(f"the Gluon scorer's block_tokens must be one of {GLUON_BLOCK_TOKENS}, got {block_tokens!r}")
    q8, qs, tab, LQ = prepare_queries(Q, centroids, layout.scale, q_mask=q_mask, qpb=qpb, table_dtype=table_dtype,
                                      rows=32)
    slots = waves * multiprocessors(Q.device.index or 0)
    docs_per_program = max(1, -(-Nd // max(1, slots)))
    n_runs = -(-Nd // docs_per_program)
    per_group = 4 if layout.nbits == 2 else 2
    asms = [decoder_asm(layout.nbits, s % per_group, layout.lut) for s in range(4)]
    _residual_lut_gluon_kernel[(n_runs * (q8.shape[0] // qpb),)](
        layout.codes, layout.cid, layout.inv_norm, layout.cu[lo:hi + 1], q8, qs, tab, layout.group_doc, out,
        Nd, lo, centroids.shape[0], docs_per_program, n_runs,
        Nq, NBITS=layout.nbits, LQ=LQ, QPB=qpb, BT=block_tokens, G=layout.group,
        ASM0=asms[0], ASM1=asms[1], ASM2=asms[2], ASM3=asms[3], PAIRS=pairs, ABLATE=ablate, num_warps=4,
        num_stages=num_stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    return out
