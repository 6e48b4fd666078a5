"""Triton helpers shared by the operator families' kernels."""

import triton
import triton.language as tl

from maxsim._dispatch import interpreting

# The dtype of the row sums that scale fp16x3's document tiles (mma): bf16 on the GPU (fp32's range,
# half the conversions); fp32 under Triton's interpreter, whose bf16 tensor-core dot is wrong.
_ROW_SUM_DTYPE = tl.constexpr(tl.float32 if interpreting() else tl.bfloat16)


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
def _row_pow2(b_x):
    """Per row of fp32 ``b_x [R, K]``: (2^k, 2^-k) with the row's largest magnitude times 2^k in
    [2^13, 2^14), built from exponent bits (exact; a zero row gets 2^126, a NaN/inf row 2^-115)."""
    b_amax = tl.max(tl.abs(b_x), axis=1)  # [R]
    b_e = (b_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row max
    b_k = tl.minimum(267 - b_e, 253)  # biased exponent of the scale: 2^(140 - e)
    return (b_k << 23).to(tl.float32, bitcast=True), ((254 - b_k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split16(b_xf, up):
    """fp32 ``b_xf [R, K]`` times ``up [R]``, as fp16 ``(hi, lo)``: hi + lo holds 22 of its bits."""
    b_xf = b_xf * up[:, None]
    b_h = b_xf.to(tl.float16)
    return b_h, (b_xf - b_h.to(tl.float32)).to(tl.float16)


@triton.jit
def mma(b_s, b_q, b_d, DOT_PRECISION: tl.constexpr):
    """``b_s + b_q @ b_d^T`` ([BM, BK] x [BN, BK] -> [BM, BN] fp32) with the product the selection
    resolved: a Triton ``input_precision``, or "fp16x3" for fp32 tiles: each row scaled by a power
    of two and split into fp16 hi + lo, three fp16 tensor-core products (hi.lo + lo.hi + hi.hi, the
    lo.lo term below fp32's rounding), the partial sum unscaled exactly (maxsim._split's idea, on chip).
    The two small products go first: the tensor cores' accumulator truncates at each k-step, so only
    hi.hi's steps then truncate at the score's magnitude (docs/kernels.md).

    A block of fewer than 64 query rows against 64 or more document tokens is computed transposed,
    document tokens as the product's rows: that is wgmma's shape (M >= 64), whose register operand
    takes the split document tile where it was made. Each document row's scale then comes from its
    L1 norm (at least its largest magnitude) summed on the tensor cores, not from a max across the
    row, which would pin the tile to the load's layout and send the split through shared memory."""
    if DOT_PRECISION == "fp16x3":
        b_qf = b_q.to(tl.float32)
        b_df = b_d.to(tl.float32)
        q_up, q_down = _row_pow2(b_qf)  # [BM]
        b_qh, b_ql = _split16(b_qf, q_up)  # [BM, BK] x 2
        if b_q.shape[0] < 64 and b_d.shape[0] >= 64:
            ones = tl.full([b_df.shape[1], 16], 1.0, tl.float32).to(_ROW_SUM_DTYPE)
            d_up, d_down = _row_pow2(tl.dot(tl.abs(b_df).to(_ROW_SUM_DTYPE), ones))  # [BN], from [BN, 16] sums
            b_dh, b_dl = _split16(b_df, d_up)  # [BN, BK] x 2
            b_p = tl.dot(b_dh, tl.trans(b_ql))
            b_p = tl.dot(b_dl, tl.trans(b_qh), b_p)
            b_p = tl.dot(b_dh, tl.trans(b_qh), b_p)  # [BN, BM], scaled by d_up q_up
            return b_s + tl.trans(b_p * d_down[:, None] * q_down[None, :])
        else:
            d_up, d_down = _row_pow2(b_df)  # [BN]
            b_dh, b_dl = _split16(b_df, d_up)
            b_p = tl.dot(b_qh, tl.trans(b_dl))
            b_p = tl.dot(b_ql, tl.trans(b_dh), b_p)
            b_p = tl.dot(b_qh, tl.trans(b_dh), b_p)  # [BM, BN], scaled by q_up d_up
            return b_s + b_p * q_down[:, None] * d_down[None, :]
    else:
        return tl.dot(b_q, tl.trans(b_d), b_s, input_precision=DOT_PRECISION)


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
        b_s = mma(b_s, b_q, b_d, DOT_PRECISION)  # [BM, BN]
    if NORMALIZE:
        b_df = b_d.to(tl.float32)
        d_sq += tl.sum(b_df * b_df, axis=1)
    return b_s, d_sq
