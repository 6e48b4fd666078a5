"""Triton helpers shared by the operator families' kernels."""

import triton
import triton.language as tl


@triton.jit
def max_nan(a, b):
    """max that propagates NaN: a NaN taking part in a max makes it NaN (IEEE fmax would drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def stacked_rows(i_pid, Nq, n_chunks, BM: tl.constexpr, SEG: tl.constexpr):
    """Which query rows program ``i_pid`` owns when queries are stacked into blocks of BM rows.

    Each query takes SEG rows of a block (SEG a power of two >= its length: BM // SEG queries per
    block), or, when queries are longer than BM, one query is cut into ``n_chunks`` chunks of
    SEG = BM rows. Row blocks vary fastest in the program id, so the programs reading one run of
    documents run together and share it through L2.

    Returns (document-run index, query group, chunk, query of each row [BM], token of each row [BM]).
    """
    QPB: tl.constexpr = BM // SEG
    n_mblocks = tl.cdiv(Nq, QPB) * n_chunks
    i_m = i_pid % n_mblocks
    i_qgroup = i_m // n_chunks
    i_chunk = i_m % n_chunks
    o_r = tl.arange(0, BM)
    return i_pid // n_mblocks, i_qgroup, i_chunk, i_qgroup * QPB + o_r // SEG, i_chunk * SEG + o_r % SEG


@triton.jit
def dot_chunk(b_s, d_sq, b_q, p_q_rows, p_d_rows, o_kk, m_row, m_t, dim, d_desc, i_group, d_row0, k0,
               LOAD_Q: tl.constexpr, EVEN_K: tl.constexpr, NORMALIZE: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """b_s += Q[:, o_kk] @ D[:, o_kk]^T for one chunk of the embedding dim; returns (b_s, d_sq).
    The dense forward's step; kernels whose scores must equal maxsim.maxsim's call it too.

    With USE_TMA the document tile [BN, BK] comes through the tensor-memory accelerator from row
    ``d_row0`` of the group's flattened ``[Nd*Ld, d]`` tokens (rows past a document's end belong to
    the next one and are masked by the caller; past the group's end they read as 0)."""
    if USE_TMA:
        b_d = tl.reshape(d_desc.load([i_group, d_row0, k0]), [BN, BK])  # [BN, BK]
    elif EVEN_K:
        b_d = tl.load(p_d_rows + o_kk[None, :], mask=m_t[:, None], other=0.0)  # [BN, BK]
    else:
        b_d = tl.load(p_d_rows + o_kk[None, :], mask=m_t[:, None] & (o_kk < dim)[None, :], other=0.0)
    if LOAD_Q:
        if EVEN_K:
            b_q = tl.load(p_q_rows + o_kk[None, :], mask=m_row[:, None], other=0.0)  # [BM, BK]
        else:
            b_q = tl.load(p_q_rows + o_kk[None, :], mask=m_row[:, None] & (o_kk < dim)[None, :], other=0.0)
    if DOT_UPCAST:
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_d.to(tl.float32)), b_s, input_precision="ieee")
    else:
        b_s = tl.dot(b_q, tl.trans(b_d), b_s, input_precision=DOT_PRECISION)  # [BM, BN]
    if NORMALIZE:
        b_df = b_d.to(tl.float32)
        d_sq += tl.sum(b_df * b_df, axis=1)
    return b_s, d_sq


# ---- residual-compressed (PLAID) tokens: the bit layout is described in maxsim/compressed/forward.py
@triton.jit
def unpack_fields(b_bytes, NBITS: tl.constexpr):
    """[BN, BP] residual bytes (uint8) -> [BN, BP * 8 // NBITS] raw bit fields, one a dimension, in
    dimension order: the k-th dimension of a byte is its field at shift 8 - NBITS * (k + 1) (the
    first dimension sits in the top bits). Interleaving keeps each byte's fields in one thread."""
    if NBITS == 8:
        b_f = b_bytes
    elif NBITS == 4:
        b_f = tl.interleave(b_bytes >> 4, b_bytes & 15)
    elif NBITS == 2:
        b_f = tl.interleave(tl.interleave(b_bytes >> 6, (b_bytes >> 2) & 3),
                            tl.interleave((b_bytes >> 4) & 3, b_bytes & 3))
    else:
        b_even = tl.interleave(tl.interleave(b_bytes >> 7, (b_bytes >> 3) & 1),
                               tl.interleave((b_bytes >> 5) & 1, (b_bytes >> 1) & 1))  # dims 0, 2, 4, 6
        b_odd = tl.interleave(tl.interleave((b_bytes >> 6) & 1, (b_bytes >> 2) & 1),
                              tl.interleave((b_bytes >> 4) & 1, b_bytes & 1))  # dims 1, 3, 5, 7
        b_f = tl.interleave(b_even, b_odd)
    return b_f


@triton.jit
def decode_residual_tile(cent_ptr, res_ptr, w_ptr, o_t, m_t, num_centroids, dim, packed_dim, codes_ptr,
                 BN: tl.constexpr, BD: tl.constexpr, NBITS: tl.constexpr, NORMALIZE: tl.constexpr):
    """Tokens ``o_t [BN]`` (int64, valid where m_t) decoded: [BN, BD] in the centroid table's dtype,
    0 on padded dims and rows. A token whose code lies outside [0, num_centroids) decodes to NaN
    (its document's scores become NaN; nothing outside the table is read)."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    BP: tl.constexpr = BD // PER_BYTE
    o_d = tl.arange(0, BD)
    m_d = o_d < dim
    o_p = tl.arange(0, BP)
    b_code = tl.load(codes_ptr + o_t, mask=m_t, other=0).to(tl.int64)  # [BN]
    m_code = (b_code >= 0) & (b_code < num_centroids)
    b_code = tl.where(m_code, b_code, 0)
    m_tile = m_t[:, None] & m_d[None, :]
    b_c = tl.load(cent_ptr + b_code[:, None] * dim + o_d[None, :], mask=m_tile, other=0.0)  # [BN, BD]
    b_bytes = tl.load(res_ptr + o_t[:, None] * packed_dim + o_p[None, :],
                      mask=m_t[:, None] & (o_p < packed_dim)[None, :], other=0)  # [BN, BP] uint8
    b_f = unpack_fields(b_bytes, NBITS)  # [BN, BD]
    if NBITS == 1:  # a select is cheaper than a gather for two or four weights
        b_w = tl.where(b_f == 0, tl.load(w_ptr), tl.load(w_ptr + 1))
    elif NBITS == 2:
        b_w = tl.where(b_f < 2, tl.where(b_f == 0, tl.load(w_ptr), tl.load(w_ptr + 1)),
                       tl.where(b_f == 2, tl.load(w_ptr + 2), tl.load(w_ptr + 3)))
    else:
        b_w = tl.load(w_ptr + b_f)  # [BN, BD] from a 16- or 256-entry table (L1)
    # The sum in the decode dtype: for fp16 the same as the codec's fp32 sum rounded once to fp16
    # (fp32 holds 2 * 11 + 2 bits: rounding twice cannot differ from rounding once).
    b_x = b_c + b_w
    b_x = tl.where(m_tile, b_x, 0.0)
    if NORMALIZE:
        b_xf = b_x.to(tl.float32)
        b_norm = tl.maximum(tl.sqrt_rn(tl.sum(b_xf * b_xf, axis=1)), 1e-12)  # [BN]
        # fp16 decode: the norm rounded to fp16 first (colbert-ai's CUDA decode, the codec's)
        b_norm = b_norm.to(cent_ptr.dtype.element_ty).to(tl.float32)
        b_norm = tl.where(m_t, b_norm, 1.0)  # rows past the document: 0 / 0 would be computed there
        b_x = tl.math.div_rn(b_xf, b_norm[:, None]).to(cent_ptr.dtype.element_ty)
    return tl.where(m_code[:, None], b_x, float("nan"))
