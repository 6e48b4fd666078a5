"""Product-quantised tokens scored on the 8-bit tensor cores, each code's sub-vector gathered as one
32-bit word.

A PQ token (:class:`maxsim.compressed.pq.ProductQuantizer`, m sub-spaces of 4 dimensions) is the
concatenation of its m centroids ``c_i[code_i]``. Against query row ``q_j``::

    q_j . x_t = sum_i q_ji . c_i[code_ti] = sum_i (s_i q_ji) . (c_i[code_ti] / s_i)
              ~= u_j (q~_j . x~_t)

- The codebooks are quantised to int8 once per corpus, one scale ``s_i`` per sub-space
  (``c~ = round(c / s_i)``). The query's sub-block i is multiplied by ``s_i`` before its row is
  quantised (``q~_j``, scale ``u_j``), so per-sub-space scales cost the kernel nothing.
- A sub-vector's 4 int8 coordinates are one 32-bit word of the table ``[m, 256]`` int32 (32 KB at
  m 32, L1 resident): a token's m codes are m word gathers, expanded to int8 in registers and
  multiplied on the tensor cores in slices of 32 dimensions; no decoded token goes to memory.
- The documents' walk is the residual look-up scorer's (:mod:`maxsim.compressed.residual_lut`):
  documents padded to a multiple of ``G`` tokens by repeating their last token, the exact
  int32-to-float trick, one stream of BT-token tiles per program.

These are the scores of a quantised query against a quantised codebook: close to, not equal to,
``maxsim_varlen(Q, pq.decode(codes))`` (:func:`pq_lut_emulation` is what they equal to fp32
rounding). Search refines them where exact scores matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim.compressed.residual_lut import (MAGIC_BITS, document_range, group_documents, padded_chunks,
                                           padded_offsets,
                                           quantized_rows, query_rows, round22, run_grid, run_start, segment_max)

SUB_DIM = 4  # dimensions per code: one 32-bit word of int8 coordinates
PQ_LUT_DIM = 128  # the kernel's width (m 32); other shapes take the stream kernel's decode


@triton.jit
def _load_codes(codes_ptr, t0, t_hi, o_tt, M: tl.constexpr):
    """Tile t0's codes, one [BT, 8] uint8 block per 32-dimension slice (rows past t_hi: code 0)."""
    o_t = t0 + o_tt
    m_t = (o_t < t_hi)[:, None]
    p = codes_ptr + o_t.to(tl.int64)[:, None] * M + tl.arange(0, 8)[None, :]  # [BT, 8]
    return (tl.load(p, mask=m_t, other=0), tl.load(p + 8, mask=m_t, other=0), tl.load(p + 16, mask=m_t, other=0),
            tl.load(p + 24, mask=m_t, other=0))


@triton.jit
def _expand_slice(b_code, words_ptr, k: tl.constexpr):
    """Slice k's int8 coordinates [BT, 32]: the codes b_code [BT, 8] of sub-spaces 8k..8k+7, each
    gathered as one 32-bit word of the int8 table and split into its 4 bytes (low byte first)."""
    o_s = tl.arange(0, 8)
    b_w = tl.load(words_ptr + (8 * k + o_s)[None, :] * 256 + b_code.to(tl.int32))  # [BT, 8] int32
    b0 = b_w.to(tl.int8)  # integer narrowing keeps the low byte
    b1 = (b_w >> 8).to(tl.int8)
    b2 = (b_w >> 16).to(tl.int8)
    b3 = (b_w >> 24).to(tl.int8)
    # join stacks on a new last axis: join(join(b0, b2), join(b1, b3))[..., p, i] is byte 2 p + i
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [b_w.shape[0], 32])


@triton.jit
def _ablated_slice(b_code, codes_ptr, t0, t_hi, o_tt, ABLATE: tl.constexpr, M: tl.constexpr):
    """The probe's ablations ([BT, 32] int8, meaningless scores): 1, the codes themselves as the
    words (no gather, the same split); 2, the token's 32 code bytes as the slice (no gather, no split)."""
    if ABLATE == 1:
        b_w = b_code.to(tl.int32) * 0x01010101
        b0 = b_w.to(tl.int8)
        b1 = (b_w >> 8).to(tl.int8)
        b2 = (b_w >> 16).to(tl.int8)
        b3 = (b_w >> 24).to(tl.int8)
        return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [b_w.shape[0], 32])
    else:
        o_t = t0 + o_tt
        return tl.load(codes_ptr + o_t.to(tl.int64)[:, None] * M + tl.arange(0, 32)[None, :],
                       mask=(o_t < t_hi)[:, None], other=0).to(tl.int8, bitcast=True)


@triton.jit(do_not_specialize=["Nq", "Nd", "docs_per_program", "n_runs"])
def _pq_lut_kernel(
    codes_ptr,  # [Tp, M] uint8 (Tp: tokens, documents padded to multiples of G)
    cu_ptr,  # [Nd + 1] int64 offsets (multiples of G)
    q_ptr,  # [Nq_pad, LQ, DIM] int8 quantised queries (zero rows past each query)
    qs_ptr,  # [Nq_pad, LQ] fp32 row scales u_j (22 significant bits; 0 on padding rows)
    words_ptr,  # [M, 256] int32: each centroid's 4 int8 coordinates
    out_ptr,  # [Nq, Nd] fp32, zeroed (an empty document keeps its 0)
    Nq, Nd, docs_per_program, n_runs,
    M: tl.constexpr, LQ: tl.constexpr, QPB: tl.constexpr, BT: tl.constexpr, G: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """Each program: QPB queries (N = QPB * LQ columns) against a run of whole documents, walked as
    one stream of BT-token tiles (the residual scorer's walk)."""
    N: tl.constexpr = QPB * LQ
    DIM: tl.constexpr = M * 4
    pid = tl.program_id(0)
    i_run = pid % n_runs  # runs vary fastest: one query group's rows stay on chip while it runs
    q0 = (pid // n_runs) * QPB
    b_qs, b_cn, b_q0, b_q1, b_q2, b_q3 = query_rows(q_ptr, qs_ptr, q0, LQ, DIM, QPB)
    o_qb = q0 + tl.arange(0, QPB)
    m_qb = o_qb < Nq
    j_hi, t_lo, t_hi, j, lo, hi, b_carry = run_start(cu_ptr, i_run, docs_per_program, Nd, N)
    o_tt = tl.arange(0, BT)
    # The next tile's codes are loaded while this one is scored (registers as the second buffer).
    b_c0, b_c1, b_c2, b_c3 = _load_codes(codes_ptr, t_lo, t_hi, o_tt, M)
    for t0 in range(t_lo, t_hi, BT):
        n_c0, n_c1, n_c2, n_c3 = _load_codes(codes_ptr, t0 + BT, t_hi, o_tt, M)
        acc = tl.full([BT, N], MAGIC_BITS, dtype=tl.int32)
        if ABLATE != 0:
            acc = tl.dot(_ablated_slice(b_c0, codes_ptr, t0, t_hi, o_tt, ABLATE, M), b_q0, acc, out_dtype=tl.int32)
            acc = tl.dot(_ablated_slice(b_c1, codes_ptr, t0, t_hi, o_tt, ABLATE, M), b_q1, acc, out_dtype=tl.int32)
            acc = tl.dot(_ablated_slice(b_c2, codes_ptr, t0, t_hi, o_tt, ABLATE, M), b_q2, acc, out_dtype=tl.int32)
            acc = tl.dot(_ablated_slice(b_c3, codes_ptr, t0, t_hi, o_tt, ABLATE, M), b_q3, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(_expand_slice(b_c0, words_ptr, 0), b_q0, acc, out_dtype=tl.int32)
            acc = tl.dot(_expand_slice(b_c1, words_ptr, 1), b_q1, acc, out_dtype=tl.int32)
            acc = tl.dot(_expand_slice(b_c2, words_ptr, 2), b_q2, acc, out_dtype=tl.int32)
            acc = tl.dot(_expand_slice(b_c3, words_ptr, 3), b_q3, acc, out_dtype=tl.int32)
        b_f = acc.to(tl.float32, bitcast=True)  # 1.5 * 2**23 + acc, exactly
        b_s = tl.fma(b_f, b_qs[None, :], b_cn[None, :])  # [BT, N]
        j, lo, hi, b_carry = segment_max(b_s, t0, j, j_hi, lo, hi, b_carry, cu_ptr, out_ptr, o_qb, m_qb, Nd,
                                         BT, G, LQ, QPB)
        b_c0, b_c1, b_c2, b_c3 = n_c0, n_c1, n_c2, n_c3


# ---------------------------------------------------------------------- host side
def quantized_codebooks(codebooks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codebooks ``[m, 256, 4]`` float -> (words ``[m, 256]`` int32, each centroid's 4 int8
    coordinates low byte first; scales ``[m]`` fp32, one per sub-space: c ~= scale * c~)."""
    cb = codebooks.detach().float()
    amax = cb.abs().amax(dim=(1, 2))  # [m]
    scales = torch.where(amax > 0, amax / torch.full((), 127.0, device=cb.device), torch.ones_like(amax))
    c8 = torch.round(cb / scales[:, None, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [m, 256, 4]
    return c8.view(torch.int32).reshape(cb.shape[0], cb.shape[1]).contiguous(), scales


class PQLutLayout:
    """A PQ corpus in the look-up scorers' layout (built once per device, kept with the corpus).

    codes ``[Tp, m]`` uint8 and cu ``[Nd + 1]`` int64: documents padded to a multiple of ``group``
    tokens by repeating their last token, each token's codes in the stored order ``order [m]``
    (byte p holds sub-space order[p]: :func:`code_order`, which gives
    each Gluon thread its two codes of a slice in one load); group_doc ``[Tp / group + tail]``
    int32, the document of each group (-1 past the end); words ``[m, 256]`` int32 and scales
    ``[m]`` fp32 in sub-space order (:func:`quantized_codebooks`).
    """

    def __init__(self, codes, cu, words, scales, group, order, group_doc):
        self.codes, self.cu, self.words, self.scales, self.group = codes, cu, words, scales, int(group)
        self.order, self.group_doc = order, group_doc
        # the Triton scorer reads the codes as stored: the table rows in stored order
        self.stored_words = words[order.to(words.device)].contiguous()

    @property
    def num_docs(self) -> int:
        return self.cu.numel() - 1

    def to(self, device) -> "PQLutLayout":
        return PQLutLayout(self.codes.to(device), self.cu.to(device), self.words.to(device), self.scales.to(device),
                           self.group, self.order.to(device), self.group_doc.to(device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.cu, self.words, self.stored_words,
                                                          self.scales, self.group_doc))


def supports(pq) -> bool:
    """Whether the look-up scorer takes this quantizer's codes (d 128, 4 dimensions a code)."""
    return pq.sub_dim == SUB_DIM and pq.dim == PQ_LUT_DIM


def code_order(m: int = 32) -> torch.Tensor:
    """The stored order of a token's m codes ``[m]`` int64 (stored byte p holds sub-space
    ``order[p]``): sub-spaces 8k + l + 4b at 8 l + 2 k + b, so each thread of the Gluon scorer
    (:mod:`maxsim.compressed.pq_gluon`) loads its two codes of a slice at once."""
    order = torch.empty(m, dtype=torch.int64)
    for sub in range(m):
        k, j = divmod(sub, 8)
        lane, b = j % 4, j // 4
        order[8 * lane + 2 * k + b] = sub
    return order


def build_bytes(num_tokens: int, num_docs: int, m: int, *, group: int = 16, chunk: int = 1 << 22) -> int:
    """An upper bound on the device bytes :func:`build_layout` allocates."""
    padded = num_tokens + num_docs * (group - 1)
    return padded * m + num_docs * 16 + padded // group * 4 + min(chunk, padded) * (m + 5 * 8) + 256 * m * 12


def build_layout(pq, codes: torch.Tensor, cu: torch.Tensor, *, group: int = 16, chunk: int = 1 << 22) -> PQLutLayout:
    """The look-up layout of packed PQ documents (codes ``[T, m]`` uint8, ``cu [Nd + 1]``) on the
    codes' device."""
    if not supports(pq):
        raise ValueError(f"the PQ look-up scorer takes d {PQ_LUT_DIM} in codes of {SUB_DIM} dimensions, got "
                         f"d {pq.dim}, {pq.sub_dim} a code")
    device = codes.device
    cu = cu.to(device=device, dtype=torch.int64)
    cu_p = padded_offsets(cu, group)
    total = int(cu_p[-1])
    order = code_order(codes.shape[1]).to(device)
    out = torch.empty(total, codes.shape[1], dtype=torch.uint8, device=device)
    for rows, src in padded_chunks(cu, cu_p, chunk):  # temporaries of one chunk, whatever the corpus's size
        out[rows] = codes[src][:, order]
    words, scales = quantized_codebooks(pq.codebooks_on(device))
    return PQLutLayout(out, cu_p, words, scales, group, order, group_documents(cu_p, group))


def prepare_queries(Q: torch.Tensor, layout: PQLutLayout, *, q_mask=None, qpb: int = 1, rows: int | None = None,
                    stored_order: bool = False):
    """(q~ [Nq_pad, LQ, d] int8, u [Nq_pad, LQ] fp32 (22 significant bits), LQ): each sub-block of
    Q times its sub-space's scale, then each row quantised (:func:`quantized_rows`); with
    ``stored_order``, the sub-blocks in the codes' stored order (the Triton scorer's)."""
    column_scales = layout.scales.to(Q.device).repeat_interleave(SUB_DIM)  # [d]
    if stored_order:
        dims = (layout.order.to(Q.device)[:, None] * SUB_DIM + torch.arange(SUB_DIM, device=Q.device)).reshape(-1)
        Q, column_scales = Q[..., dims], column_scales[dims]
    q8, u, _, LQ = quantized_rows(Q, q_mask=q_mask, qpb=qpb, rows=rows, column_scales=column_scales)
    return q8, round22(u).contiguous(), LQ


def pq_lut_scores(Q: torch.Tensor, layout: PQLutLayout, *, q_mask=None, qpb: int = 1, block_tokens: int = 128,
                  num_warps: int = 4, num_stages: int = 3, waves: int = 4, docs=None,
                  ablate: int = 0) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of queries ``Q [Nq, Lq, 128]`` against a :class:`PQLutLayout` on
    Q's device (``docs``: ``(lo, hi)``, only documents lo..hi-1): the quantised query against the
    int8 codebooks on the 8-bit tensor cores, each code's 4 coordinates one 32-bit load split in
    registers.
    ``ablate`` (the probe's, meaningless scores): 1 no gather; 2 no gather and no split."""
    if ablate not in (0, 1, 2):
        raise ValueError(f"ablate must be 0, 1 or 2, got {ablate!r}")
    Nq = Q.shape[0]
    cu, out = document_range(layout, Nq, docs, Q.device)
    Nd = out.shape[1]
    if Nq == 0 or Nd == 0:
        return out
    q8, qs, LQ = prepare_queries(Q, layout, q_mask=q_mask, qpb=qpb, stored_order=True)
    docs_per_program, n_runs = run_grid(Nd, waves, Q.device)
    n_qgroups = q8.shape[0] // qpb
    _pq_lut_kernel[(n_runs * n_qgroups,)](
        layout.codes, cu, q8, qs, layout.stored_words, out, Nq, Nd, docs_per_program, n_runs,
        M=layout.codes.shape[1], LQ=LQ, QPB=qpb, BT=block_tokens, G=layout.group, ABLATE=ablate,
        num_warps=num_warps, num_stages=num_stages)
    return out


def pq_lut_emulation(Q: torch.Tensor, layout: PQLutLayout, *, q_mask=None) -> torch.Tensor:
    """:func:`pq_lut_scores`' arithmetic in float64 on the CPU (the same quantised query and int8
    codebooks): the kernel must match it to fp32 rounding."""
    q8, qs, LQ = prepare_queries(Q.cpu(), layout, q_mask=None if q_mask is None else q_mask.cpu())
    order, cu, words = layout.order.cpu(), layout.cu.cpu(), layout.words.cpu()
    codes = torch.empty_like(layout.codes, device="cpu", dtype=torch.int64)
    codes[:, order] = layout.codes.cpu().long()  # back to sub-space order
    m = codes.shape[1]
    c8 = words.contiguous().view(torch.int8).reshape(m, 256, SUB_DIM).double()  # [m, 256, 4]
    x8 = c8[torch.arange(m)[None, :], codes].reshape(codes.shape[0], m * SUB_DIM)  # [Tp, d]
    Nq = Q.shape[0]
    out = torch.zeros(Nq, cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            acc = torch.einsum("nld,td->ntl", q8[:Nq].double(), x8[lo:hi])  # [Nq, t, LQ]
            out[:, j] = (acc * qs[:Nq, None, :].double()).amax(1).sum(-1)
    return out
