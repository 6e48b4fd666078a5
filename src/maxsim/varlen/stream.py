"""Packed documents as one token stream: the cross-product forward for inference.

The per-document kernel (:mod:`maxsim.varlen.forward`) walks each document in tiles of BN tokens,
so a 40-token document in a 64-token tile wastes most of the tile's lanes and every document pays
a loop's start-up. Here a program owns a run of whole documents and walks their tokens back to back
in tiles of BN rows: one contiguous read, no token read twice. A tile holds the end of one
document, any number of whole ones and the start of the next; the max over each document's columns
is a segmented max, and a document that continues into the next tile carries its partial max
(``[BM]``) across.

The tokens can be stored in Q's dtype or quantised to one byte a dimension with one fp32 scale a
token (int8 or fp8 e4m3, :mod:`maxsim.compressed.quantized`): the tile is widened to Q's dtype on
chip and each column of the product is multiplied by its token's scale, which is exact algebra
(``q . (s v) = s (q . v)``) and one rounding fewer than dequantising first.

No argmax (training takes the per-document kernel). Offsets are checked per program on the device:
a program whose offsets decrease or leave the data scores its documents with the per-document loop,
which makes each invalid document NaN, so no host read is needed and no wrong number is possible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._dispatch import cuda_index, interpreting
from maxsim._kernels import max_nan, mma, stacked_rows
from maxsim._launch import launch
from maxsim.tuning import multiprocessors, next_pow2
from maxsim.varlen.forward import _NO_BOUND, _load_query_block, seq_range

# Offsets checked per step of a program's run-validity scan.
_CHECK_BLOCK = 1024


@triton.jit
def _query_plane(p_q, m_row, k: tl.constexpr, packed_dim, BP: tl.constexpr):
    """Plane k of the query rows (q in plane order: columns k * P : (k + 1) * P): [BM, BP]."""
    o_p = tl.arange(0, BP)
    return tl.load(p_q + k * packed_dim + o_p[None, :], mask=m_row[:, None] & (o_p < packed_dim)[None, :], other=0.0)


@triton.jit
def _residual_plane(b_s, d_sq, b_qk, k: tl.constexpr, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS: tl.constexpr,
                    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Adds plane k of a tile of residual tokens to S: the field at shift 8 - NBITS (k + 1) of each
    byte ([BN, BP]), its bucket weight plus the centroids' same dimensions (p_c: [BN, BP] pointers
    to plane 0 of each token's centroid, in plane order), times the query's plane k. d_sq gathers
    the decoded tokens' squares: [BN, BP] per column for fp32 tokens, else the Gram matrix
    [BN, BN] whose diagonal holds the squared norms."""
    b_f = (b_bytes >> (8 - NBITS * (k + 1))) & ((1 << NBITS) - 1)  # [BN, BP] raw fields
    if NBITS == 1:  # a select is cheaper than a gather for two or four weights
        b_w = tl.where(b_f == 0, tl.load(w_ptr), tl.load(w_ptr + 1))
    elif NBITS == 2:
        b_w = tl.where(b_f < 2, tl.where(b_f == 0, tl.load(w_ptr), tl.load(w_ptr + 1)),
                       tl.where(b_f == 2, tl.load(w_ptr + 2), tl.load(w_ptr + 3)))
    else:
        b_w = tl.load(w_ptr + b_f.to(tl.int32))  # from a 16- or 256-entry table (L1)
    b_c = tl.load(p_c + k * packed_dim, mask=m_tile, other=0.0)  # [BN, BP]
    # The sum in the decode dtype: for fp16 the same as the codec's fp32 sum rounded once to fp16
    # (fp32 holds 2 * 11 + 2 bits: rounding twice cannot differ from rounding once).
    b_x = tl.where(m_tile, b_c + b_w, 0.0)
    if NORMALIZE:
        if b_x.dtype == tl.float32:
            d_sq += b_x * b_x  # [BN, BP]: summed over the columns once, after the last plane
        else:
            # 16-bit tokens: the squares on the tensor cores (X X^T, exact products, fp32 sums),
            # whose diagonal the caller takes: widening every element to fp32 costs more.
            d_sq = tl.dot(b_x, tl.trans(b_x), d_sq)  # [BN, BN]
    b_s = mma(b_s, b_qk, b_x, DOT_PRECISION)
    return b_s, d_sq


@triton.jit
def _residual_scores(b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_q7, d_ptr, codes_ptr, cent_ptr, w_ptr, o_t, m_t,
                     num_centroids, dim, packed_dim, BM: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
                     NBITS: tl.constexpr, NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """S [BM, BN] fp32 of the query rows (planes b_q0.. [BM, BP], 8 / NBITS of them) against residual
    tokens o_t [BN] (valid where m_t), decoded plane by plane (maxsim/compressed/forward.py). A
    token whose code lies outside [0, num_centroids) scores NaN; nothing outside the table is read."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    o_t = o_t.to(tl.int64)
    o_p = tl.arange(0, BP)
    m_tile = m_t[:, None] & (o_p < packed_dim)[None, :]
    b_code = tl.load(codes_ptr + o_t, mask=m_t, other=0).to(tl.int64)  # [BN]
    m_code = (b_code >= 0) & (b_code < num_centroids)
    p_c = cent_ptr + tl.where(m_code, b_code, 0)[:, None] * dim + o_p[None, :]  # [BN, BP]
    b_bytes = tl.load(d_ptr + o_t[:, None] * packed_dim + o_p[None, :], mask=m_tile, other=0)  # [BN, BP] uint8
    b_s = tl.zeros([BM, BN], dtype=tl.float32)
    WIDE: tl.constexpr = cent_ptr.dtype.element_ty == tl.float32
    if WIDE:
        d_sq = tl.zeros([BN, BP], dtype=tl.float32)  # the squares, per column
    else:
        d_sq = tl.zeros([BN, BN], dtype=tl.float32)  # the Gram matrix of the tile's tokens
    b_s, d_sq = _residual_plane(b_s, d_sq, b_q0, 0, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                DOT_PRECISION)
    if PER_BYTE >= 2:
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q1, 1, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
    if PER_BYTE >= 4:
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q2, 2, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q3, 3, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
    if PER_BYTE == 8:
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q4, 4, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q5, 5, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q6, 6, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
        b_s, d_sq = _residual_plane(b_s, d_sq, b_q7, 7, b_bytes, p_c, m_tile, packed_dim, w_ptr, NBITS, NORMALIZE,
                                    DOT_PRECISION)
    if NORMALIZE:
        if WIDE:
            b_sq = tl.sum(d_sq, axis=1)  # [BN]
        else:
            o_n = tl.arange(0, BN)
            b_sq = tl.sum(tl.where(o_n[:, None] == o_n[None, :], d_sq, 0.0), axis=1)  # [BN]: the diagonal
        b_norm = tl.maximum(tl.sqrt_rn(b_sq), 1e-12)  # [BN]
        # fp16 decode: the norm rounded to fp16 first (colbert-ai's CUDA decode, the codec's)
        b_norm = b_norm.to(cent_ptr.dtype.element_ty).to(tl.float32)
        b_norm = tl.where(m_t, b_norm, 1.0)  # rows past the document: their scores are 0 and stay 0
        b_s = b_s * (1.0 / b_norm)[None, :]
    return tl.where(m_code[None, :], b_s, float("nan"))


@triton.jit
def _tile_scores(b_q, p_q, m_row, d_ptr, scale_ptr, t0, t_hi, dim, Q_DTYPE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr, FP8: tl.constexpr, INT8_TO_FP16: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_UPCAST: tl.constexpr, RESIDUAL: tl.constexpr, codes_ptr, cent_ptr, w_ptr, num_centroids,
                 packed_dim, NBITS: tl.constexpr, NORMALIZE: tl.constexpr, QDOT: tl.constexpr, b_qscale,
                 b_planes, BP: tl.constexpr, PQ_SUB: tl.constexpr):
    """S [BM, BN] fp32 = Q rows . tokens t0 : t0 + BN (rows past t_hi read as 0), scaled per token.
    PQ_SUB > 0: product-quantised tokens, d_ptr their codes [Td, dim / PQ_SUB] uint8 and cent_ptr
    the codebooks [m, 256, PQ_SUB] in Q's dtype: each dimension looked up on chip (code of its
    sub-space, then that centroid's coordinate; the tables stay in L1 / L2).
    RESIDUAL: the tokens are decoded on chip from their codes and residual bytes (d_ptr), plane by
    plane against the query planes b_planes (a tuple of 8 [BM, BP] tiles, 8 / NBITS of them read).
    QDOT: Q's rows are one-byte too (int8, or e4m3
    bytes with FP8), with row scales b_qscale [BM]: the one-byte tensor-core dot (int8 x int8 ->
    int32, exact; e4m3 x e4m3 -> fp32), then both scales."""
    o_t = t0 + tl.arange(0, BN)  # [BN]
    m_t = o_t < t_hi
    b_s = tl.zeros([BM, BN], dtype=tl.float32)
    if RESIDUAL:
        b_s = _residual_scores(b_planes[0], b_planes[1], b_planes[2], b_planes[3], b_planes[4], b_planes[5],
                               b_planes[6], b_planes[7], d_ptr, codes_ptr, cent_ptr, w_ptr, o_t, m_t, num_centroids,
                               dim, packed_dim, BM, BN, BP, NBITS, NORMALIZE, DOT_PRECISION)
    else:
        if PQ_SUB > 0:
            p_d = d_ptr + o_t.to(tl.int64)[:, None] * (dim // PQ_SUB)  # [BN, 1]: a token's m codes
        else:
            p_d = d_ptr + o_t.to(tl.int64)[:, None] * dim  # [BN, 1]
        o_k = tl.arange(0, BK)
        for kk in tl.static_range(NUM_K):
            o_kk = kk * BK + o_k
            if PQ_SUB > 0:  # dimension f: centroid code[f // s] of sub-space f // s, its coordinate f % s
                m_d = m_t[:, None] & (o_kk < dim)[None, :]
                b_code = tl.load(p_d + (o_kk // PQ_SUB)[None, :], mask=m_d, other=0).to(tl.int32)  # [BN, BK]
                p_cb = cent_ptr + ((o_kk // PQ_SUB)[None, :] * 256 + b_code) * PQ_SUB + (o_kk % PQ_SUB)[None, :]
                b_d = tl.load(p_cb, mask=m_d, other=0.0)  # [BN, BK] in Q's dtype
            elif EVEN_K:
                b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None], other=0)  # [BN, BK]
            else:
                b_d = tl.load(p_d + o_kk[None, :], mask=m_t[:, None] & (o_kk < dim)[None, :], other=0)
            if NUM_K > 1:
                b_qk = tl.load(p_q + o_kk[None, :], mask=m_row[:, None] & (o_kk < dim)[None, :], other=0)
            else:
                b_qk = b_q
            if FP8:  # e4m3 codes travel as their bytes (masked loads fill byte 0, +0.0)
                b_d = b_d.to(tl.float8e4nv, bitcast=True)
                if QDOT:
                    b_qk = b_qk.to(tl.float8e4nv, bitcast=True)
            if DOT_UPCAST:  # the interpreter (its bf16 and fp8 dots are wrong): the same exact products in fp32
                b_s = tl.dot(b_qk.to(tl.float32), tl.trans(b_d.to(tl.float32)), b_s, input_precision="ieee")
            elif QDOT and FP8:
                b_s = tl.dot(b_qk, tl.trans(b_d), b_s)
            elif QDOT:  # |sum| <= 127 * 127 * d: exact in int32, and in fp32 for d <= 1040
                b_s += tl.dot(b_qk, tl.trans(b_d), out_dtype=tl.int32).to(tl.float32)
            else:
                if INT8_TO_FP16:
                    # x + 1152 has fp16 bits 0x6480 + x (exponent of 1024, x + 128 in the mantissa):
                    # integer adds and one fp16 subtraction instead of int-to-float conversions, which
                    # run at a fraction of the ALU rate. Exact for every int8.
                    b_d = (b_d.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
                else:
                    b_d = b_d.to(Q_DTYPE)  # one-byte codes widen exactly (int8, e4m3 fit fp16 and bf16)
                b_s = mma(b_s, b_qk, b_d, DOT_PRECISION)
        if QDOT:
            b_s = b_s * b_qscale[:, None]
    if SCALED:
        b_scale = tl.load(scale_ptr + o_t, mask=m_t, other=0.0)  # [BN] fp32
        b_s = b_s * b_scale[None, :]
    return b_s


@triton.jit
def _range_max(b_s, t0, lo, hi, BN: tl.constexpr):
    """[BM]: max over the tile's columns that hold tokens lo:hi (-inf where none does)."""
    o_t = t0 + tl.arange(0, BN)
    inside = (o_t >= lo) & (o_t < hi)
    return tl.reduce(tl.where(inside[None, :], b_s, float("-inf")), 1, max_nan)


@triton.jit
def _store_score(out_ptr, b_max, keep, ok, j, i_chunk, o_qb, Nq, Nd, QPB: tl.constexpr, SEG: tl.constexpr):
    b_score = tl.sum(tl.reshape(tl.where(keep, b_max, 0.0), [QPB, SEG]), axis=1)  # [QPB]
    b_score = tl.where(ok, b_score, float("nan"))
    tl.store(out_ptr + (i_chunk.to(tl.int64) * Nq + o_qb) * Nd + j, b_score, mask=o_qb < Nq)


@triton.jit(do_not_specialize=["Nq", "Nd", "Tq", "Td", "n_chunks", "docs_per_program", "max_q", "max_d",
                               "num_centroids"])
def _maxsim_varlen_stream_kernel(
    q_ptr, d_ptr, scale_ptr, qscale_ptr, cuq_ptr, cud_ptr, out_ptr,  # qscale_ptr: QDOT's [Tq] fp32 row scales
    codes_ptr, cent_ptr, w_ptr,  # RESIDUAL: codes [Td], centroids [C, d] and field weights, in Q's dtype
    # (PQ_SUB > 0: cent_ptr the codebooks [m, 256, PQ_SUB] in Q's dtype, d_ptr the codes [Td, m])
    Nq, Nd, Tq, Td, dim, n_chunks, docs_per_program, max_q, max_d, num_centroids, packed_dim,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, SEG: tl.constexpr,
    EVEN_K: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, CHECK_BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr, NBITS: tl.constexpr, NORMALIZE: tl.constexpr, QDOT: tl.constexpr, BP: tl.constexpr,
    PQ_SUB: tl.constexpr,
):
    """Every packed query against every packed document. out fp32 [n_chunks, Nq, Nd] (partial sums
    per query chunk). A score whose query or document is invalid (see seq_range) is NaN."""
    QPB: tl.constexpr = BM // SEG  # queries per block
    NEG_INF: tl.constexpr = float("-inf")
    Q_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    INT8_TO_FP16: tl.constexpr = (d_ptr.dtype.element_ty == tl.int8) and (Q_DTYPE == tl.float16) and not RESIDUAL \
        and not QDOT
    i_n, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, n_chunks, BM, SEG)  # o_q, o_s: [BM]
    m_q = o_q < Nq
    q_lo, q_hi, q_ok = seq_range(tl.load(cuq_ptr + o_q, mask=m_q, other=0),
                                 tl.load(cuq_ptr + o_q + 1, mask=m_q, other=0), Tq, max_q)  # [BM] each
    m_row = m_q & (q_lo + o_s < q_hi)
    b_qok = tl.min(tl.reshape(q_ok.to(tl.int32), [QPB, SEG]), axis=1) > 0  # [QPB]
    p_q = q_ptr + (q_lo + o_s).to(tl.int64)[:, None] * dim  # [BM, 1]
    b_q = _load_query_block(p_q, m_row, dim, BK, NUM_K, EVEN_K)
    if QDOT:
        b_qscale = tl.load(qscale_ptr + q_lo + o_s, mask=m_row, other=0.0)  # [BM] fp32
    else:
        b_qscale = tl.zeros([BM], dtype=tl.float32)  # (unused)
    if RESIDUAL:  # q in plane order (maxsim/compressed/forward.py): its 8 / NBITS planes, [BM, BP] each
        PER_BYTE: tl.constexpr = 8 // NBITS
        b_planes = (_query_plane(p_q, m_row, 0, packed_dim, BP), _query_plane(p_q, m_row, 1 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 2 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 3 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 4 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 5 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 6 % PER_BYTE, packed_dim, BP),
                    _query_plane(p_q, m_row, 7 % PER_BYTE, packed_dim, BP))
    else:
        b_planes = (b_q, b_q, b_q, b_q, b_q, b_q, b_q, b_q)  # (unused)
    o_qb = i_qgroup * QPB + tl.arange(0, QPB)

    j_lo = (i_n * docs_per_program).to(tl.int64)
    j_hi = tl.minimum(j_lo + docs_per_program, Nd)
    # The run's offsets, checked on the device: inside the data, never decreasing, each document
    # within max_d. Only then is the run one stream.
    t_lo = tl.load(cud_ptr + j_lo)
    t_hi = tl.load(cud_ptr + j_hi)
    n_bad = tl.zeros([CHECK_BLOCK], dtype=tl.int32)
    for c0 in range(j_lo, j_hi, CHECK_BLOCK):
        o_j = c0 + tl.arange(0, CHECK_BLOCK)
        m_j = o_j < j_hi
        lo = tl.load(cud_ptr + o_j, mask=m_j, other=0)
        hi = tl.load(cud_ptr + o_j + 1, mask=m_j, other=0)
        n_bad += (m_j & ((hi < lo) | (lo < 0) | (hi > Td) | (hi - lo > max_d))).to(tl.int32)
    run_ok = tl.sum(n_bad, axis=0) == 0

    if run_ok:  # one stream: each tile's documents in turn, the one running on carried
        j = j_lo  # the first document not yet scored
        b_carry = tl.full([BM], NEG_INF, dtype=tl.float32)  # partial max of document j from earlier tiles
        lo = t_lo
        hi = tl.load(cud_ptr + j + 1, mask=j < j_hi, other=0)
        for t0 in range(t_lo, t_hi, BN):
            t1 = t0 + BN
            b_s = _tile_scores(b_q, p_q, m_row, d_ptr, scale_ptr, t0, t_hi, dim, Q_DTYPE, BM, BN, BK, NUM_K,
                               EVEN_K, SCALED, FP8, INT8_TO_FP16, DOT_PRECISION, DOT_UPCAST, RESIDUAL, codes_ptr,
                               cent_ptr, w_ptr, num_centroids, packed_dim, NBITS, NORMALIZE, QDOT, b_qscale,
                               b_planes, BP, PQ_SUB)  # [BM, BN]
            while (j < j_hi) & (hi <= t1):  # every document that ends in this tile
                hi_next = tl.load(cud_ptr + j + 2, mask=j + 1 < j_hi, other=0)  # in flight during the max
                b_max = max_nan(_range_max(b_s, t0, lo, hi, BN), b_carry)
                _store_score(out_ptr, b_max, m_row & (hi > lo), b_qok, j, i_chunk, o_qb, Nq, Nd, QPB, SEG)
                b_carry = tl.full([BM], NEG_INF, dtype=tl.float32)
                j += 1
                lo = hi
                hi = hi_next
            if j < j_hi:  # document j runs on past this tile
                b_carry = max_nan(b_carry, _range_max(b_s, t0, lo, hi, BN))
        while j < j_hi:  # empty documents after the last token
            _store_score(out_ptr, b_carry, m_row & (hi > lo), b_qok, j, i_chunk, o_qb, Nq, Nd, QPB, SEG)
            j += 1
            lo = hi
            hi = tl.load(cud_ptr + j + 1, mask=j < j_hi, other=0)
    else:
        for j in range(j_lo, j_hi):  # one document at a time; each invalid one NaN
            d_lo, d_hi, d_ok = seq_range(tl.load(cud_ptr + j), tl.load(cud_ptr + j + 1), Td, max_d)
            b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
            for t0 in range(d_lo, d_hi, BN):
                b_s = _tile_scores(b_q, p_q, m_row, d_ptr, scale_ptr, t0, d_hi, dim, Q_DTYPE, BM, BN, BK, NUM_K,
                                   EVEN_K, SCALED, FP8, INT8_TO_FP16, DOT_PRECISION, DOT_UPCAST, RESIDUAL, codes_ptr,
                                   cent_ptr, w_ptr, num_centroids, packed_dim, NBITS, NORMALIZE, QDOT, b_qscale,
                                   b_planes, BP, PQ_SUB)
                b_max = max_nan(b_max, _range_max(b_s, t0, d_lo, d_hi, BN))
            _store_score(out_ptr, b_max, m_row & (d_hi > d_lo), b_qok & d_ok, j, i_chunk, o_qb, Nq, Nd, QPB, SEG)


def stream_forward(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    max_q: int,
    *,
    config: dict,
    scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
    residual: tuple | None = None,
    codebooks: torch.Tensor | None = None,
    max_d: int | None = None,
    precision: str = "ieee",
) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of every packed query against every packed document.

    q ``[Tq, dim]`` (fp16 / bf16 / fp32) and d ``[Td, dim]`` contiguous: d in q's dtype, or int8 /
    float8_e4m3fn codes with ``scales [Td]`` fp32 (token t reads as ``d[t] * scales[t]``).
    cu_q ``[Nq + 1]``, cu_d ``[Nd + 1]`` int64 on q's device; ``max_q`` bounds every query's
    length, ``max_d`` (None: no bound) every document's. A score whose query or document lies
    outside the data or passes its bound is NaN; an empty document scores 0.
    ``query_scales``: q is one-byte too (the same format as d, with ``query_scales [Tq]`` fp32):
    the one-byte tensor-core dot, ``(sq sd) (q . v)``.
    ``residual``: PLAID tokens instead: d is the residual bytes ``[Td, d * nbits / 8]`` uint8 and
    ``residual = (codes [Td] int32/int64, centroids [C, dim], weights_by_field [2**nbits], nbits,
    normalize)``, the tables in q's dtype (:func:`maxsim.compressed.forward.decode_tables`), q and
    the centroids in plane order (:func:`maxsim.compressed.forward.to_planes`): each token decoded
    on chip as the codec decodes it (a code outside [0, C) makes its document NaN).
    ``codebooks``: product-quantised tokens instead: d is their codes ``[Td, m]`` uint8 and
    ``codebooks [m, 256, dim / m]`` in q's dtype, contiguous: each token decoded on chip (its
    coordinates looked up) and scored as the decoded token would be.
    ``config``: BM, BN, BK, num_warps, num_stages, waves (``maxsim.selection.varlen``).
    """
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    dim = q.shape[1]
    max_d = _NO_BOUND if max_d is None else max_d
    if residual is not None:
        codes, centroids, weights, nbits, normalize = residual
        tables = (codes, centroids, weights)
        residual_ints = (centroids.shape[0], d.shape[1])
        config = dict(config, BK=16)  # (the query is read as planes instead)
    elif codebooks is not None:
        tables, residual_ints, nbits, normalize = (q, codebooks, q), (0, 0), 1, False
    else:
        tables, residual_ints, nbits, normalize = (q, q, q), (0, 0), 1, False
    pq_sub = codebooks.shape[2] if codebooks is not None else 0
    if query_scales is not None:  # the one-byte tensor-core dot takes K >= 32 (masked past dim)
        config = dict(config, BK=max(32, config["BK"]))
    interpret = interpreting()
    BM, BN, BK = config["BM"], config["BN"], config["BK"]
    seg = min(next_pow2(max(max_q, 1)), BM)
    n_chunks = -(-max(max_q, 1) // seg)
    n_mblocks = -(-Nq // (BM // seg)) * n_chunks
    slots = 1 if interpret else config.get("waves", 8) * multiprocessors(cuda_index(q))
    docs_per_program = max(1, -(-Nd // max(1, slots // max(1, n_mblocks))))
    out = torch.empty((n_chunks, Nq, Nd), dtype=torch.float32, device=q.device)
    if Nq == 0 or Nd == 0:
        return out.sum(0)
    fp8 = d.dtype == torch.float8_e4m3fn
    if fp8:
        d = d.view(torch.uint8)
        if query_scales is not None:
            q = q.view(torch.uint8)
    args = (q, d, out if scales is None else scales, out if query_scales is None else query_scales, cu_q, cu_d, out,
            *tables,
            Nq, Nd, q.shape[0], d.shape[0], dim, n_chunks, docs_per_program, max_q, max_d, *residual_ints)
    constexprs = dict(
        BM=BM, BN=BN, BK=BK, NUM_K=-(-dim // BK), SEG=seg, EVEN_K=dim % BK == 0, SCALED=scales is not None,
        FP8=fp8, DOT_PRECISION=precision if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and (q.dtype == torch.bfloat16 or query_scales is not None),
        CHECK_BLOCK=_CHECK_BLOCK if not interpret else 16,
        RESIDUAL=residual is not None, NBITS=nbits, NORMALIZE=normalize, QDOT=query_scales is not None,
        BP=max(16, next_pow2(residual_ints[1])), PQ_SUB=pq_sub,
    )
    launch(_maxsim_varlen_stream_kernel, (n_mblocks * -(-Nd // docs_per_program),), args, constexprs,
           num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out[0] if n_chunks == 1 else out.sum(0)
