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
from maxsim._kernels import decode_residual_tile, max_nan, stacked_rows
from maxsim._launch import launch
from maxsim.tuning import multiprocessors, next_pow2
from maxsim.varlen.forward import _NO_BOUND, _load_query_block, seq_range

# Offsets checked per step of a program's run-validity scan.
_CHECK_BLOCK = 1024


@triton.jit
def _tile_scores(b_q, p_q, m_row, d_ptr, scale_ptr, t0, t_hi, dim, Q_DTYPE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr, FP8: tl.constexpr, INT8_TO_FP16: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_UPCAST: tl.constexpr, RESIDUAL: tl.constexpr, codes_ptr, cent_ptr, w_ptr, num_centroids,
                 packed_dim, NBITS: tl.constexpr, NORMALIZE: tl.constexpr, QDOT: tl.constexpr, b_qscale):
    """S [BM, BN] fp32 = Q rows . tokens t0 : t0 + BN (rows past t_hi read as 0), scaled per token.
    RESIDUAL: the tokens are decoded on chip from their codes and residual bytes (d_ptr), one
    [BN, BK] tile with BK >= d (NUM_K == 1). QDOT: Q's rows are one-byte too (int8, or e4m3
    bytes with FP8), with row scales b_qscale [BM]: the one-byte tensor-core dot (int8 x int8 ->
    int32, exact; e4m3 x e4m3 -> fp32), then both scales."""
    o_t = t0 + tl.arange(0, BN)  # [BN]
    m_t = o_t < t_hi
    b_s = tl.zeros([BM, BN], dtype=tl.float32)
    if RESIDUAL:
        b_x = decode_residual_tile(cent_ptr, d_ptr, w_ptr, o_t.to(tl.int64), m_t, num_centroids, dim, packed_dim,
                                   codes_ptr, BN, BK, NBITS, NORMALIZE)  # [BN, BK] in Q's dtype
        if DOT_UPCAST:
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_x.to(tl.float32)), b_s, input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_x), b_s, input_precision=DOT_PRECISION)
    else:
        p_d = d_ptr + o_t.to(tl.int64)[:, None] * dim  # [BN, 1]
        o_k = tl.arange(0, BK)
        for kk in tl.static_range(NUM_K):
            o_kk = kk * BK + o_k
            if EVEN_K:
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
                b_s = tl.dot(b_qk, tl.trans(b_d), b_s, input_precision=DOT_PRECISION)
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
    Nq, Nd, Tq, Td, dim, n_chunks, docs_per_program, max_q, max_d, num_centroids, packed_dim,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, SEG: tl.constexpr,
    EVEN_K: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, CHECK_BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr, NBITS: tl.constexpr, NORMALIZE: tl.constexpr, QDOT: tl.constexpr,
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
                               cent_ptr, w_ptr, num_centroids, packed_dim, NBITS, NORMALIZE, QDOT, b_qscale)  # [BM, BN]
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
                                   cent_ptr, w_ptr, num_centroids, packed_dim, NBITS, NORMALIZE, QDOT, b_qscale)
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
    normalize)``, the tables in q's dtype (:func:`maxsim.compressed.forward.decode_tables`): each
    token decoded on chip as the codec decodes it (a code outside [0, C) makes its document NaN).
    ``config``: BM, BN, BK, num_warps, num_stages, waves (``maxsim.selection.varlen``).
    """
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    dim = q.shape[1]
    max_d = _NO_BOUND if max_d is None else max_d
    if residual is not None:
        codes, centroids, weights, nbits, normalize = residual
        tables = (codes, centroids, weights)
        residual_ints = (centroids.shape[0], d.shape[1])
        config = dict(config, BK=max(16, next_pow2(dim)))  # the decoded token whole: its norm needs every dim
    else:
        tables, residual_ints, nbits, normalize = (q, q, q), (0, 0), 1, False
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
    )
    launch(_maxsim_varlen_stream_kernel, (n_mblocks * -(-Nd // docs_per_program),), args, constexprs,
           num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out[0] if n_chunks == 1 else out.sum(0)
