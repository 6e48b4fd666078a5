"""One-byte tokens (int8 or fp8 e4m3) scored on Hopper's 8-bit tensor cores, each token's bytes
loaded straight into the wgmma's register operand (issue 54: one-byte corpora at the speed of
their bytes).

A one-byte corpus stores each token as 128 int8 or e4m3 coordinates and one fp32 scale
(:func:`maxsim.compressed.quantized.quantize_tokens`). Against a query row quantised the same way
(scale ``u_j``)::

    q_j . x_t ~= u_j s_t (q~_j . x~_t)

one 8-bit product a pair: int8 exact in int32; e4m3 accumulated in fp32 by the tensor cores.
The kernel is the Gluon PQ scorer's (:mod:`maxsim.compressed.pq_gluon`, ``INT8=True``): where PQ
gathers a code's word from the codebooks, here the word is the token's own 4 coordinates, loaded
from the layout into the A-fragment register that holds them; the same walk over documents padded
to groups of 16 tokens, the same document maxima, each token's scale applied before the max.

The layout is a copy of the corpus: tokens padded to a multiple of 16 by repeating their last,
each token's 32 words in :func:`maxsim.compressed.pq_lut.code_order` (so a thread's two words of a
slice are one 64-bit load), with their scales and each group's document. These are the scores of a
quantised query: :func:`onebyte_emulation` is what they equal to fp32 rounding.
"""

from __future__ import annotations

import torch

from maxsim.compressed.pq_lut import code_order
from maxsim.compressed.quantized import quantize_tokens
from maxsim.compressed.residual_lut import group_documents, padded_chunks, padded_offsets, quantized_rows, round22

DIM = 128  # the kernel's width: 4 slices of 32 coordinates, 32 words a token


class OneByteLayout:
    """A one-byte corpus in the kernel's layout: words ``[Tp, 32]`` int32 (each token's 128 int8 or
    e4m3 coordinates, its words in ``order``; ``fp8`` says which), scales ``[Tp]`` fp32, cu
    ``[Nd + 1]`` int64 (multiples of ``group``), group_doc (each group's document, -1 past the end)."""

    def __init__(self, words, scales, cu, group, order, group_doc, fp8):
        self.words, self.scales, self.cu, self.group = words, scales, cu, int(group)
        self.order, self.group_doc, self.fp8 = order, group_doc, bool(fp8)

    @property
    def num_docs(self) -> int:
        return self.cu.numel() - 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.cu, self.group_doc))


def build_layout(values: torch.Tensor, scales: torch.Tensor, cu: torch.Tensor, *, group: int = 16,
                 chunk: int = 1 << 22) -> OneByteLayout:
    """The layout of packed one-byte documents (values ``[T, 128]`` int8 or float8_e4m3fn, scales
    ``[T]``, ``cu [Nd + 1]``) on the values' device, built a chunk of rows at a time."""
    if values.dtype not in (torch.int8, torch.float8_e4m3fn) or values.dim() != 2 or values.shape[1] != DIM:
        raise ValueError(f"the one-byte scorer takes values [T, {DIM}] int8 or float8_e4m3fn, got {values.dtype} "
                         f"{tuple(values.shape)}")
    device = values.device
    cu = cu.to(device=device, dtype=torch.int64)
    cu_p = padded_offsets(cu, group)
    total = int(cu_p[-1])
    order = code_order(DIM // 4).to(device)
    words = values.contiguous().view(torch.int32)  # [T, 32]: 4 coordinates a word, the first in the low byte
    out_words = torch.empty(total, DIM // 4, dtype=torch.int32, device=device)
    out_scales = torch.empty(total, dtype=torch.float32, device=device)
    for rows, src in padded_chunks(cu, cu_p, chunk):  # temporaries of one chunk, whatever the corpus's size
        out_words[rows] = words[src][:, order]
        out_scales[rows] = scales[src].float()
    return OneByteLayout(out_words, out_scales, cu_p, group, order, group_documents(cu_p, group),
                         values.dtype == torch.float8_e4m3fn)


def quantized_queries(Q: torch.Tensor, layout: OneByteLayout, *, q_mask=None, qpb: int = 1):
    """(q~ [Nq_pad, 32, 128] int8 or e4m3 as the layout's tokens, u [Nq_pad, 32] fp32 (22 significant
    bits), 32): each query row quantised with one scale (0 on masked and padding rows)."""
    if not layout.fp8:
        q8, u, _, LQ = quantized_rows(Q, q_mask=q_mask, qpb=qpb, rows=32)
        return q8, round22(u).contiguous(), LQ
    Nq, Lq, dim = Q.shape
    q = torch.zeros(-(-Nq // qpb) * qpb, 32, dim, dtype=torch.float32, device=Q.device)
    q[:Nq, :Lq] = Q.float()
    if q_mask is not None:
        q[:Nq, :Lq] *= q_mask.to(device=Q.device, dtype=torch.float32)[..., None]
    q8, u = quantize_tokens(q, "fp8_e4m3")
    return q8.contiguous(), round22(u).contiguous(), 32


def onebyte_scores(Q: torch.Tensor, layout: OneByteLayout, *, q_mask=None, block_tokens: int = 128, waves: int = 8,
                   qpb: int = 1, docs=None, maxnreg: int | None = None, pairs: bool = False,
                   ablate: int = 0) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of queries ``Q [Nq, Lq <= 32, 128]`` against a :class:`OneByteLayout`
    on a Hopper GPU (``docs``: ``(lo, hi)``, only documents lo..hi-1); ``pairs``, ``maxnreg``:
    :func:`maxsim.compressed.pq_gluon.gluon_scores`'; ``ablate`` 2 (the probe's, meaningless
    scores): no document maxima."""
    if ablate not in (0, 2):
        raise ValueError(f"ablate must be 0 or 2, got {ablate!r}")
    from maxsim.compressed.pq_gluon import run_kernel

    return run_kernel(Q, layout, lambda: quantized_queries(Q, layout, q_mask=q_mask, qpb=qpb), layout.words,
                      layout.words, layout.scales, docs=docs, block_tokens=block_tokens, waves=waves, qpb=qpb,
                      maxnreg=maxnreg, pairs=pairs, ablate=ablate, int8=True, fp8=layout.fp8)


def onebyte_emulation(Q: torch.Tensor, layout: OneByteLayout, *, q_mask=None, absolute: bool = False) -> torch.Tensor:
    """:func:`onebyte_scores`' arithmetic in float64 on the CPU: the kernel must match it to fp32
    rounding (int8), or to the tensor cores' fp32 accumulation of e4m3 products (fp8). ``absolute``:
    the same with every product's absolute value (what bounds an accumulation's error)."""
    q8, qs, _ = quantized_queries(Q.cpu(), layout, q_mask=None if q_mask is None else q_mask.cpu())
    qs = qs.double()
    stored = layout.words.cpu()
    words = torch.empty_like(stored)
    words[:, layout.order.cpu()] = stored  # back to coordinate order
    x8 = words.view(torch.float8_e4m3fn if layout.fp8 else torch.int8).double()  # [Tp, 128]
    scales, cu = layout.scales.cpu().double(), layout.cu.cpu()
    Nq = Q.shape[0]
    out = torch.zeros(Nq, cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            q, x = (q8[:Nq].double().abs(), x8[lo:hi].abs()) if absolute else (q8[:Nq].double(), x8[lo:hi])
            acc = torch.einsum("nld,td->ntl", q, x)  # [Nq, t, 32]
            out[:, j] = (acc * qs[:Nq, None, :] * scales[lo:hi, None]).amax(1).sum(-1)
    return out
