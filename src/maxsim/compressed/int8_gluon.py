"""int8 tokens scored on Hopper's 8-bit tensor cores, each token's bytes loaded straight into the
wgmma's register operand (issue 54: int8 at the speed of its bytes).

An int8 corpus stores each token as 128 int8 coordinates and one fp32 scale
(:func:`maxsim.compressed.quantized.quantize_tokens`). Against a query row quantised to int8
(scale ``u_j``, :func:`maxsim.compressed.residual_lut.quantized_rows`)::

    q_j . x_t ~= u_j s_t (q~_j . x~_t)

one int8 product a pair, exact in int32. The kernel is the Gluon PQ scorer's
(:mod:`maxsim.compressed.pq_gluon`, ``INT8=True``): where PQ gathers a code's word from the
codebooks, here the word is the token's own 4 coordinates, loaded from the layout into the
A-fragment register that holds them; the same walk over documents padded to groups of 16 tokens,
the same document maxima, each token's scale applied before the max.

The layout is a copy of the corpus: tokens padded to a multiple of 16 by repeating their last,
each token's 32 words in :func:`maxsim.compressed.pq_lut.code_order` (so a thread's two words of a
slice are one 64-bit load), with their scales and each group's document. These are the scores of a
quantised query: :func:`int8_emulation` is what they equal to fp32 rounding.
"""

from __future__ import annotations

import torch

from maxsim.compressed.pq_lut import code_order
from maxsim.compressed.residual_lut import (document_range, group_documents, padded_offsets, padded_source,
                                           quantized_rows, round22, run_grid)

DIM = 128  # the kernel's width: 4 slices of 32 coordinates, 32 words a token


class Int8Layout:
    """An int8 corpus in the kernel's layout: words ``[Tp, 32]`` int32 (each token's 128 int8
    coordinates, its words in ``order``), scales ``[Tp]`` fp32, cu ``[Nd + 1]`` int64 (multiples
    of ``group``), group_doc (each group's document, -1 past the end)."""

    def __init__(self, words, scales, cu, group, order, group_doc):
        self.words, self.scales, self.cu, self.group = words, scales, cu, int(group)
        self.order, self.group_doc = order, group_doc

    @property
    def num_docs(self) -> int:
        return self.cu.numel() - 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.cu, self.group_doc))


def build_layout(values: torch.Tensor, scales: torch.Tensor, cu: torch.Tensor, *, group: int = 16,
                 chunk: int = 1 << 22) -> Int8Layout:
    """The layout of packed int8 documents (values ``[T, 128]`` int8, scales ``[T]``, ``cu [Nd + 1]``)
    on the values' device, built a chunk of rows at a time."""
    if values.dtype != torch.int8 or values.dim() != 2 or values.shape[1] != DIM:
        raise ValueError(f"the int8 scorer takes values [T, {DIM}] int8, got {values.dtype} {tuple(values.shape)}")
    device = values.device
    cu = cu.to(device=device, dtype=torch.int64)
    cu_p = padded_offsets(cu, group)
    total = int(cu_p[-1])
    order = code_order(DIM // 4).to(device)
    words = values.contiguous().view(torch.int32)  # [T, 32]: 4 coordinates a word, the first in the low byte
    out_words = torch.empty(total, DIM // 4, dtype=torch.int32, device=device)
    out_scales = torch.empty(total, dtype=torch.float32, device=device)
    for start in range(0, total, chunk):  # temporaries of one chunk, whatever the corpus's size
        stop = min(total, start + chunk)
        source = padded_source(cu, cu_p, start, stop)
        out_words[start:stop] = words[source][:, order]
        out_scales[start:stop] = scales[source].float()
    return Int8Layout(out_words, out_scales, cu_p, group, order, group_documents(cu_p, group))


def int8_scores(Q: torch.Tensor, layout: Int8Layout, *, q_mask=None, block_tokens: int = 128, waves: int = 8,
                qpb: int = 1, docs=None, maxnreg: int | None = None) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of queries ``Q [Nq, Lq <= 32, 128]`` against an :class:`Int8Layout`
    on a Hopper GPU (``docs``: ``(lo, hi)``, only documents lo..hi-1)."""
    from maxsim.compressed.pq_gluon import _pq_lut_gluon_kernel

    if Q.shape[1] > 32:
        raise ValueError(f"the int8 scorer takes queries of up to 32 tokens, got {Q.shape[1]}")
    Nq = Q.shape[0]
    cu, out = document_range(layout, Nq, docs, Q.device)
    Nd = out.shape[1]
    if Nq == 0 or Nd == 0:
        return out
    lo = 0 if docs is None else docs[0]
    q8, u, _, LQ = quantized_rows(Q, q_mask=q_mask, qpb=qpb, rows=32)
    qs = round22(u).contiguous()
    docs_per_program, n_runs = run_grid(Nd, waves, Q.device)
    _pq_lut_gluon_kernel[(n_runs * (q8.shape[0] // qpb),)](
        layout.words, cu, q8, qs, layout.words, layout.scales, layout.group_doc, out, Nd, lo, docs_per_program,
        n_runs, Nq, M=DIM // 4, LQ=LQ, QPB=qpb, BT=block_tokens, G=layout.group, PAIRS=False, ABLATE=0, INT8=True,
        num_warps=4, num_stages=1, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    return out


def int8_emulation(Q: torch.Tensor, layout: Int8Layout, *, q_mask=None) -> torch.Tensor:
    """:func:`int8_scores`' arithmetic in float64 on the CPU: the kernel must match it to fp32 rounding."""
    q8, u, _, _ = quantized_rows(Q.cpu(), q_mask=None if q_mask is None else q_mask.cpu(), rows=32)
    qs = round22(u).double()
    stored = layout.words.cpu()
    words = torch.empty_like(stored)
    words[:, layout.order.cpu()] = stored  # back to coordinate order
    x8 = words.view(torch.int8).double()  # [Tp, 128]
    scales, cu = layout.scales.cpu().double(), layout.cu.cpu()
    Nq = Q.shape[0]
    out = torch.zeros(Nq, cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            acc = torch.einsum("nld,td->ntl", q8[:Nq].double(), x8[lo:hi])  # [Nq, t, 32]
            out[:, j] = (acc * qs[:Nq, None, :] * scales[lo:hi, None]).amax(1).sum(-1)
    return out
