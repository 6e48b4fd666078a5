"""Fused MaxSim on residual-compressed (PLAID) documents: one Triton kernel and its launcher.

A document token is stored as a centroid code and ``P = d * nbits / 8`` residual bytes
(:mod:`maxsim.compressed.codec`). A program owns a block of BM stacked query rows (several short
queries, or a BM-row chunk of one long query, as the dense and packed kernels stack them) and walks
a run of documents, each given by its token range ``starts[j]:ends[j]`` (packed: cu_seqlens;
padded: ``j * Ld`` and ``j * Ld + length``). Per tile of BN tokens it loads the codes ``[BN]`` and
the residual bytes ``[BN, P]``, unpacks every dimension's bit field in registers, gathers the
centroids ``[BN, d]`` (from L2: the table is shared by every program) and the bucket weights,
adds them with one rounding to the decode dtype (fp16 or fp32, as ``ResidualCodec.decode``),
optionally L2-normalises each token exactly as the codec does, and scores the tile against the
query block with a tensor-core ``tl.dot`` (fp32 accumulation): a running max (and argmax) per
query row per document, summed over each query's rows when the document ends. No decoded token
ever reaches memory.

Bit layout (codec.py): bucket bit j of dimension f is stream bit ``f * nbits + j``, and stream bit
p is bit ``7 - p % 8`` of byte ``p // 8``. For nbits in {1, 2, 4, 8} dimension f lies in byte
``f // (8 / nbits)``, as the field ``(byte >> (8 - nbits * (k + 1))) & (2**nbits - 1)`` with
``k = f % (8 / nbits)`` (a shift and a mask), whose bits are the bucket's reversed. The reversal is
folded into the weight table the kernel reads: ``weights_by_field[v] = bucket_weights[reverse(v)]``.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from maxsim import _outputs
from maxsim._dispatch import cuda_index, interpreting
from maxsim._kernels import max_nan, stacked_rows
from maxsim._launch import launch
from maxsim.tuning import multiprocessors, next_pow2


@triton.jit
def _unpack_fields(b_bytes, NBITS: tl.constexpr):
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
def _decode_tile(cent_ptr, res_ptr, w_ptr, o_t, m_t, num_centroids, dim, packed_dim, codes_ptr,
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
    b_f = _unpack_fields(b_bytes, NBITS)  # [BN, BD]
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


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "num_centroids", "n_chunks", "docs_per_program"])
def _residual_fwd_kernel(
    q_ptr, qmask_ptr, codes_ptr, res_ptr, starts_ptr, ends_ptr, cent_ptr, w_ptr, out_ptr, argmax_ptr,
    Nq, Nd, Lq, dim, packed_dim, num_centroids, n_chunks, docs_per_program,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    SEG: tl.constexpr,  # rows per query in a block: pow2 >= Lq, or BM when queries are chunked
    NBITS: tl.constexpr, HAS_QMASK: tl.constexpr, NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Q [Nq, Lq, d] (contiguous, the decode dtype) against documents j = tokens starts[j]:ends[j]
    of codes [T] / residuals [T, packed_dim]. out fp32 [n_chunks, Nq, Nd] (partial sums per query
    chunk); argmax int32 [Nq, Nd, Lq]: the winner's index inside the document, -1 where the query
    token is masked or the document empty."""
    QPB: tl.constexpr = BM // SEG  # queries per block
    NEG_INF: tl.constexpr = float("-inf")
    i_n, i_qgroup, i_chunk, o_q, o_s = stacked_rows(tl.program_id(0), Nq, n_chunks, BM, SEG)  # o_q, o_s: [BM]
    m_row = (o_q < Nq) & (o_s < Lq)
    o_d = tl.arange(0, BD)
    # The query block stays on chip for the program's lifetime.
    p_q = q_ptr + (o_q.to(tl.int64) * Lq + o_s)[:, None] * dim + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & (o_d < dim)[None, :], other=0.0)  # [BM, BD]
    m_keep = m_row
    if HAS_QMASK:
        m_keep = m_keep & (tl.load(qmask_ptr + o_q.to(tl.int64) * Lq + o_s, mask=m_row, other=0) != 0)
    o_n = tl.arange(0, BN)
    o_qb = i_qgroup * QPB + tl.arange(0, QPB)
    j0 = (i_n * docs_per_program).to(tl.int64)
    for jj in range(tl.minimum(docs_per_program, Nd - j0)):
        j = j0 + jj
        d_lo = tl.load(starts_ptr + j).to(tl.int64)
        d_hi = tl.load(ends_ptr + j).to(tl.int64)
        b_max = tl.full([BM], NEG_INF, dtype=tl.float32)
        b_arg = tl.zeros([BM], dtype=tl.int32)
        for t0 in range(d_lo, d_hi, BN):
            o_t = t0 + o_n  # [BN] token rows (int64)
            m_t = o_t < d_hi
            b_x = _decode_tile(cent_ptr, res_ptr, w_ptr, o_t, m_t, num_centroids, dim, packed_dim, codes_ptr,
                               BN, BD, NBITS, NORMALIZE)  # [BN, BD]
            b_s = tl.dot(b_q, tl.trans(b_x), input_precision=DOT_PRECISION)  # [BM, BN] fp32
            b_s = tl.where(m_t[None, :], b_s, NEG_INF)
            b_tmax = tl.reduce(b_s, 1, max_nan)  # [BM]
            if SAVE_ARGMAX:
                is_max = (b_s == b_tmax[:, None]) | (b_s != b_s)
                b_targ = tl.min(tl.where(is_max, o_n[None, :], BN), axis=1)  # first winner in the tile
                # Strict '>' keeps the earlier tile on ties; a NaN wins over any number.
                upd = (b_tmax > b_max) | ((b_tmax != b_tmax) & (b_max == b_max))
                b_arg = tl.where(upd, (t0 - d_lo).to(tl.int32) + b_targ, b_arg)
                b_max = tl.where(upd, b_tmax, b_max)
            else:
                b_max = max_nan(b_max, b_tmax)
        keep = m_keep & (d_hi > d_lo)  # an empty document contributes 0, a masked query token nothing
        b_score = tl.sum(tl.reshape(tl.where(keep, b_max, 0.0), [QPB, SEG]), axis=1)  # [QPB]
        tl.store(out_ptr + (i_chunk.to(tl.int64) * Nq + o_qb) * Nd + j, b_score, mask=o_qb < Nq)
        if SAVE_ARGMAX:
            tl.store(argmax_ptr + (o_q.to(tl.int64) * Nd + j) * Lq + o_s, tl.where(keep, b_arg, -1), mask=m_row)


# ---------------------------------------------------------------------- decode tables
def _reverse_bits(v: int, nbits: int) -> int:
    return int(f"{v:0{nbits}b}"[::-1], 2)


# id(codec.centroids) -> (a weak reference to that tensor, {(dtype, device, versions, weights): tables}).
# Keyed by id, checked by identity: tensors compare elementwise, so they cannot be dict keys.
_TABLES: dict = {}


def _tables_of(centroids: torch.Tensor) -> dict:
    key = id(centroids)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not centroids:
        entry = _TABLES[key] = (weakref.ref(centroids, lambda _ref, key=key: _TABLES.pop(key, None)), {})
    return entry[1]


def decode_tables(codec, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [C, d] in ``dtype``, weights_by_field [2**nbits] in ``dtype``) on ``device``, as the
    kernel reads them: the bucket weights indexed by the raw bit field (bit order reversed), both
    rounded to the decode dtype once, as the codec rounds them. Cached per codec tensors."""
    device = torch.device(device)
    per_codec = _tables_of(codec.centroids)
    key = (dtype, str(device), codec.centroids._version, codec.bucket_weights.data_ptr(),
           codec.bucket_weights._version, codec.nbits)
    tables = per_codec.get(key)
    if tables is None:
        per_codec.clear()  # one entry per codec tensor: a new version replaces the old
        order = torch.tensor([_reverse_bits(v, codec.nbits) for v in range(1 << codec.nbits)], dtype=torch.int64)
        weights = codec.bucket_weights.to(dtype).cpu()[order].to(device)
        centroids = codec.centroids.to(device=device, dtype=dtype).contiguous()
        tables = per_codec[key] = (centroids, weights)
    return tables


# ---------------------------------------------------------------------- launcher
def residual_forward(Q, q_mask, codes, residuals, starts, ends, centroids, weights_by_field, nbits, *,
                     config: dict, normalize: bool, save_argmax: bool):
    """Launch the fused forward on validated inputs with the tile the selection chose.

    Args:
        Q: ``[Nq, Lq, d]`` in the decode dtype (fp16 or fp32).  q_mask: bool ``[Nq, Lq]`` or None.
        codes: ``[T]`` int32 or int64.  residuals: ``[T, d * nbits / 8]`` uint8.
        starts, ends: ``[Nd]`` int64, document j is tokens ``starts[j]:ends[j]`` (inside [0, T]).
        centroids: ``[C, d]`` in Q's dtype; weights_by_field: ``[2**nbits]`` in Q's dtype
            (:func:`decode_tables`).
        config: BM, BN, num_warps, num_stages, waves (:mod:`maxsim.selection.compressed`).

    Returns:
        scores ``[Nq, Nd]`` fp32 and, with ``save_argmax``, argmax ``[Nq, Nd, Lq]`` int32 (the
        winner's index inside its document; -1 where the query token is masked or the document
        empty), else None. A document holding a code outside [0, C) scores NaN.
    """
    Nq, Lq, dim = Q.shape
    Nd = starts.numel()
    device = Q.device
    argmax = _outputs.empty((Nq, Nd, Lq), torch.int32, device) if save_argmax else None
    if Nq == 0 or Nd == 0 or Lq == 0:
        if argmax is not None:
            argmax.fill_(-1)
        return torch.zeros((Nq, Nd), dtype=torch.float32, device=device), argmax
    Q = Q.contiguous()
    codes = codes.contiguous()
    residuals = residuals.contiguous()
    qm = None if q_mask is None else q_mask.contiguous()
    BM, BN = config["BM"], config["BN"]
    seg = min(next_pow2(Lq), BM)
    n_chunks = -(-Lq // seg)
    n_mblocks = -(-Nq // (BM // seg)) * n_chunks
    slots = 1 if interpreting() else multiprocessors(cuda_index(Q)) * config.get("waves", 1)
    docs_per_program = max(1, -(-Nd // max(1, slots // n_mblocks)))
    out = _outputs.empty((Nq, Nd) if n_chunks == 1 else (n_chunks, Nq, Nd), torch.float32, device)
    args = (Q, Q if qm is None else qm, codes, residuals, starts, ends, centroids, weights_by_field, out,
            out if argmax is None else argmax,
            Nq, Nd, Lq, dim, residuals.shape[1], centroids.shape[0], n_chunks, docs_per_program)
    constexprs = dict(BM=BM, BN=BN, BD=max(16, next_pow2(dim)), SEG=seg, NBITS=nbits, HAS_QMASK=qm is not None,
                      NORMALIZE=normalize, SAVE_ARGMAX=save_argmax,
                      DOT_PRECISION="ieee" if Q.dtype == torch.float32 else "tf32")
    launch(_residual_fwd_kernel, (n_mblocks * -(-Nd // docs_per_program),), args, constexprs,
           num_warps=config["num_warps"], num_stages=config["num_stages"])
    return (out if n_chunks == 1 else out.sum(0)), argmax
