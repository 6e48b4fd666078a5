"""MaxSim on residual-compressed documents, and PLAID's centroid-only approximate score.

``maxsim_residual`` / ``maxsim_residual_varlen`` choose their path as every maxsim function does
(:func:`maxsim._dispatch.backend_for`; the path by :mod:`maxsim.selection.compressed`):

- Packed documents on the Triton backend, for inference (no gradient): the packed stream kernel
  decodes each tile of tokens on chip and scores it (:mod:`maxsim.compressed.forward`).
- Otherwise (padded documents, a Q that needs a gradient, the PyTorch backend; the tests'
  oracle): documents decoded a bounded chunk at a time and each chunk scored with the public
  ``maxsim.maxsim`` / ``maxsim.maxsim_varlen``, so no dense ``[Nd, Ld, d]`` corpus is ever built
  and gradients flow to Q through them.

Documents are normalised after decoding (``normalize=``); Q is used as given (ColBERT queries are
already unit vectors).
"""

from __future__ import annotations

import torch

from maxsim._dispatch import backend_for
from maxsim.dense.ops import maxsim as maxsim_dense
from maxsim.selection import compressed as _select
from maxsim.selection.common import device_of
from maxsim.varlen.ops import maxsim_varlen

from . import specs as _specs
from ._inputs import check_codec as _check_codec
from ._inputs import check_cu_seqlens, check_d_mask, check_q_mask, check_query
from ._inputs import decode_dtype as _decode_dtype
from .forward import residual_stream_forward

# Scratch budget for the decoded documents of one chunk.
_DECODE_CHUNK_BYTES = 64 << 20
# Scratch budget for one chunk of gathered centroid scores in plaid_approx_score.
_APPROX_CHUNK_BYTES = 64 << 20
# colbert-ai's and fast-plaid's score for a query token that finds no document token.
EMPTY_TOKEN_SCORE = -9999.0


def _check_call(Q, codes, residuals, codec, normalize, q_mask, codes_dim: int, codes_shape: str):
    """The checks both entry points make; returns (Q [Nq, Lq, d], q_mask [Nq, Lq] | None, 2-D Q?)."""
    _check_codec(codec)
    check_query(Q, codec.dim, "the codec")
    _check_flag("normalize", normalize)
    if not torch.is_tensor(codes) or codes.dim() != codes_dim:
        raise ValueError(f"codes must be a {codes_shape} integer tensor, got "
                         f"{tuple(codes.shape) if torch.is_tensor(codes) else type(codes).__name__}")
    codec._check_compressed(codes, residuals)
    q_mask = check_q_mask(q_mask, Q)
    if Q.dim() == 2:
        return Q.unsqueeze(0), (None if q_mask is None else q_mask.unsqueeze(0)), True
    return Q, q_mask, False


def maxsim_residual(Q, codes, residuals, codec, *, q_mask=None, d_mask=None, d_lengths=None, normalize=True,
                    decode_dtype=None):
    """MaxSim of Q against padded residual-compressed documents.

    Q [Nq, Lq, d] (or [Lq, d]); codes [Nd, Ld] int; residuals [Nd, Ld, packed_dim] uint8; the real
    tokens as ``maxsim.maxsim`` takes them: q_mask Q.shape[:-1], d_mask [Nd, Ld] (True = real) or
    d_lengths [Nd] (None = all real; a padding token's code is never read).
    Returns [Nq, Nd] fp32 ([Nd] for a 2-D Q). Empty documents score 0. decode_dtype: fp16 or fp32
    tiles (default fp16 for an fp16 Q, else fp32; Q is cast to it). Differentiable in Q.
    Documents are decoded a bounded chunk at a time and scored by ``maxsim.maxsim`` (packed
    documents, ``maxsim_residual_varlen``, are decoded on chip on the Triton backend).
    """
    Q, q_mask, single_query = _check_call(Q, codes, residuals, codec, normalize, q_mask, 2, "[Nd, Ld]")
    num_docs, doc_len = codes.shape
    device = Q.device
    dtype = _decode_dtype(Q, decode_dtype)
    real = check_d_mask(d_mask, d_lengths, (num_docs, doc_len), device)  # [Nd, Ld] bool or None
    codec = codec.to(device) if codec.device != device else codec
    Q_cast = Q.to(dtype)
    scores = []
    docs_per_chunk = max(1, _DECODE_CHUNK_BYTES // max(1, doc_len * codec.dim * dtype.itemsize))
    for start in range(0, num_docs, docs_per_chunk):
        stop = min(num_docs, start + docs_per_chunk)
        chunk_codes = codes[start:stop].to(device)
        chunk_real = None if real is None else real[start:stop]  # [n, Ld]
        if chunk_real is not None:
            chunk_codes = torch.where(chunk_real, chunk_codes, torch.zeros_like(chunk_codes))  # padding may hold junk
        D = codec.decode(chunk_codes, residuals[start:stop].to(device), normalize=normalize, dtype=dtype)
        scores.append(maxsim_dense(Q_cast, D, q_mask, chunk_real))
    out = torch.cat(scores, dim=1) if scores else torch.zeros(Q.shape[0], 0, device=device)
    return out[0] if single_query else out




def maxsim_residual_varlen(Q, codes, residuals, cu_seqlens_d, codec, *, max_seqlen_d=None, q_mask=None,
                           normalize=True, decode_dtype=None, quantize_query=False):
    """MaxSim of Q against packed residual-compressed documents.

    Q [Nq, Lq, d] (or [Lq, d]); codes [T] int; residuals [T, packed_dim] uint8; cu_seqlens_d
    [Nd + 1] (document i is tokens cu[i]:cu[i+1]). Returns [Nq, Nd] fp32 ([Nd] for a 2-D Q).
    Empty documents score 0; differentiable in Q. On the Triton backend, without a gradient, the
    packed stream kernel decodes each tile on chip (keep codes and residuals on Q's device: others
    are copied there whole); a code outside [0, C) makes its document's scores NaN there (the
    PyTorch backend raises). Otherwise documents are decoded a bounded chunk at a time.

    ``quantize_query=True`` (2- and 4-bit codes, d 128, ``normalize=True``, no gradient, Triton
    backend): the look-up scorer instead, each query token quantised to int8 and the residual
    term multiplied on the int8 tensor cores against the corpus's int8 bucket weights (its top-10
    is the decode's on real tokens; scores within a few 1e-3). It builds the look-up layout
    (:func:`lookup_layout`) for the call; a search of a stored corpus (``maxsim.Corpus``) builds it
    once and keeps it.
    """
    Q, q_mask, single_query = _check_call(Q, codes, residuals, codec, normalize, q_mask, 1, "[T]")
    cu = check_cu_seqlens(cu_seqlens_d, codes.shape[0], on_host=False)
    device = Q.device
    dtype = _decode_dtype(Q, decode_dtype)
    if not isinstance(quantize_query, bool):
        raise TypeError(f"maxsim: quantize_query must be True or False, got {quantize_query!r}")
    if quantize_query:
        choice = lookup_scorer(Q, q_mask, codec, normalize)
        if isinstance(choice, str):
            raise ValueError(f"maxsim: quantize_query=True needs the look-up scorer, which cannot run this call: "
                             f"{choice}")
        layout = lookup_layout(codec, codes.to(device), residuals.to(device), cu.to(device))
        out = lookup_scores(Q, q_mask, layout, codec, choice)
        return out[0] if single_query else out
    if backend_for(device) == "triton":
        out = _on_chip(Q, q_mask, codes, residuals, cu, codec, dtype, normalize)
        if out is not None:
            return out[0] if single_query else out
    cu = cu.cpu()  # the chunked path walks the offsets on the host
    codec = codec.to(device) if codec.device != device else codec
    num_queries, query_len, dim = Q.shape
    num_docs = cu.numel() - 1
    Q_cast = Q.to(dtype)
    if q_mask is not None:
        # a zeroed query token scores exactly 0 against every document token: "adds nothing"
        Q_cast = Q_cast * q_mask.unsqueeze(-1).to(dtype)
    q_packed = Q_cast.reshape(num_queries * query_len, dim)
    cu_q = torch.arange(num_queries + 1, device=device, dtype=torch.int64) * query_len
    lengths = cu[1:] - cu[:-1]
    if max_seqlen_d is None:
        max_seqlen_d = int(lengths.max()) if num_docs else 0
    tokens_per_chunk = max(1, _DECODE_CHUNK_BYTES // (dim * dtype.itemsize))
    scores = []
    start = 0
    while start < num_docs:
        # documents [start, stop) whose tokens fit the budget (at least one document)
        limit = int(cu[start]) + max(tokens_per_chunk, int(lengths[start]))
        stop = int(torch.searchsorted(cu, limit, right=True)) - 1
        stop = min(num_docs, max(stop, start + 1))
        lo, hi = int(cu[start]), int(cu[stop])
        D = codec.decode(codes[lo:hi].to(device), residuals[lo:hi].to(device), normalize=normalize, dtype=dtype)
        cu_chunk = (cu[start:stop + 1] - lo).to(device)
        chunk_max = int(lengths[start:stop].max())
        chunk_scores = maxsim_varlen(q_packed, D, cu_q, cu_chunk, max_seqlen_q=query_len,
                                             max_seqlen_d=chunk_max)
        scores.append(chunk_scores)
        start = stop
    out = torch.cat(scores, dim=1) if scores else torch.zeros(num_queries, 0, device=device)
    return out[0] if single_query else out


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


# ---------------------------------------------------------------------- decoded on chip
def _on_chip(Q, q_mask, codes, residuals, cu, codec, dtype, normalize):
    """Scores [Nq, Nd] from the stream kernel's on-chip decode, or None where the selection sends
    the call to the chunked path (a gradient, a call the kernel does not take)."""
    from maxsim.varlen.queries import packed_queries

    device = Q.device
    num_queries, query_len, dim = Q.shape
    needs_grad = torch.is_grad_enabled() and Q.requires_grad
    choice = _select.forward_choice(num_queries, query_len, dim, dtype, "packed", q_mask is not None, normalize,
                                    needs_grad, device_of(Q)[1])
    if choice.kernel is not _specs.FUSED_FORWARD or query_len == 0:
        return None
    q_packed, cu_q, _, max_q = packed_queries(Q.to(dtype), q_mask)  # masked query tokens left out
    if max_q == 0:
        return None
    cu_device = cu.to(device)
    return residual_stream_forward(q_packed.contiguous(), cu_q, max_q, codes.to(device), residuals.to(device),
                                   cu_device, codec, dtype, normalize, config=choice.config)


# ---------------------------------------------------------------------- the look-up scorer
def lookup_layout(codec, codes, residuals, cu):
    """The look-up scorer's layout (:class:`maxsim.compressed.residual_lut.LutLayout`) of packed
    residual documents (codes ``[T]``, residuals ``[T, P]``, ``cu [Nd + 1]``) on their device:
    codes in the decoder's order, each token's norm, documents padded to 16 tokens. Raises on a
    centroid id outside the codec's table."""
    from .residual_lut import build_layout

    return build_layout(codec, codes, residuals, cu)


def lookup_layout_bytes(codec, num_tokens: int, num_docs: int) -> int:
    """Device bytes that building the look-up layout of ``num_tokens`` tokens in ``num_docs``
    documents may take at its peak (an upper bound)."""
    from .residual_lut import build_bytes

    return build_bytes(codec, num_tokens, num_docs)


def _choice_or_why(Q, choose):
    """``choose(needs_grad, family)``'s Choice for queries Q, or why none runs (a str)."""
    if backend_for(Q.device) != "triton":
        return f"tensors on {Q.device} run the PyTorch backend"
    choice, rejected = choose(torch.is_grad_enabled() and Q.requires_grad, device_of(Q)[1])
    if choice is None:
        return "; ".join(f"{name} {why}" for name, why in rejected)
    return choice


def lookup_scorer(Q, q_mask, codec, normalize: bool = True):
    """The look-up scorer's :class:`maxsim.selection.Choice` for queries ``Q [Nq, Lq, d]`` against
    ``codec``'s codes on Q's device, or why it cannot run (a str)."""
    return _choice_or_why(Q, lambda needs_grad, family: _select.lookup_choice(
        Q.shape[0], Q.shape[1], codec.dim, codec.nbits, Q.dtype, q_mask is not None, normalize, needs_grad, family))


def lookup_scores(Q, q_mask, layout, codec, choice, docs=None):
    """Scores ``[Nq, Nd]`` fp32 of ``Q [Nq, Lq, 128]`` (``q_mask [Nq, Lq]`` or None) against a
    look-up layout on Q's device (``docs``: ``(lo, hi)``, its documents lo..hi-1; None: all), by
    the kernel ``choice`` (:func:`lookup_scorer`) names."""
    centroids = codec.centroids if codec.centroids.device == Q.device else codec.centroids.to(Q.device)
    cfg = choice.config
    if choice.kernel is _specs.LOOKUP_GLUON:
        from .residual_gluon import gluon_scores

        return gluon_scores(Q, layout, centroids, q_mask=q_mask, block_tokens=cfg["BT"], waves=cfg["waves"],
                            qpb=cfg["qpb"], pairs=cfg.get("pairs", False), maxnreg=cfg.get("maxnreg"), docs=docs)
    from .residual_lut import lut_scores

    return lut_scores(Q, layout, centroids, q_mask=q_mask, qpb=cfg["qpb"], block_tokens=cfg["BT"],
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], waves=cfg["waves"], docs=docs)


def pq_lookup_scorer(Q, q_mask, pq):
    """The PQ look-up scorer's :class:`maxsim.selection.Choice` for queries ``Q [Nq, Lq, d]``
    against ``pq``'s codes on Q's device, or why it cannot run (a str)."""
    return _choice_or_why(Q, lambda needs_grad, family: _select.pq_lookup_choice(
        Q.shape[0], Q.shape[1], pq.dim, pq.sub_dim, Q.dtype, q_mask is not None, needs_grad, family))


def pq_lookup_scores(Q, q_mask, layout, choice, docs=None):
    """Scores ``[Nq, Nd]`` fp32 of ``Q [Nq, Lq, 128]`` against a PQ look-up layout on Q's device
    (``docs``: ``(lo, hi)``, its documents lo..hi-1), with the tile ``choice`` names."""
    cfg = choice.config
    if choice.kernel is _specs.PQ_LOOKUP_GLUON:
        from .pq_gluon import gluon_scores

        return gluon_scores(Q, layout, q_mask=q_mask, block_tokens=cfg["BT"], waves=cfg["waves"], qpb=cfg["qpb"],
                            maxnreg=cfg.get("maxnreg"), pairs=cfg.get("pairs", False), docs=docs)
    from .pq_lut import pq_lut_scores

    return pq_lut_scores(Q, layout, q_mask=q_mask, qpb=cfg["qpb"], block_tokens=cfg["BT"],
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], waves=cfg["waves"], docs=docs)


def onebyte_lookup_scorer(Q, q_mask):
    """The one-byte Gluon scorer's :class:`maxsim.selection.Choice` for queries ``Q [Nq, Lq, d]``
    against an int8 / fp8 layout on Q's device, or why it cannot run (a str)."""
    return _choice_or_why(Q, lambda needs_grad, family: _select.onebyte_lookup_choice(
        Q.shape[0], Q.shape[1], Q.shape[2], Q.dtype, q_mask is not None, needs_grad, family))


def onebyte_lookup_scores(Q, q_mask, layout, choice, docs=None):
    """Scores ``[Nq, Nd]`` fp32 of ``Q [Nq, Lq, 128]`` against a one-byte layout on Q's device
    (``docs``: ``(lo, hi)``, its documents lo..hi-1), with the tile ``choice`` names."""
    from .onebyte_gluon import onebyte_scores

    cfg = choice.config
    return onebyte_scores(Q, layout, q_mask=q_mask, block_tokens=cfg["BT"], waves=cfg["waves"], qpb=cfg["qpb"],
                          maxnreg=cfg.get("maxnreg"), pairs=cfg.get("pairs", False), docs=docs)


def centroid_scores(Q, codec):
    """Q [Nq, Lq, d] -> [Nq, Lq, C] fp32 scores of every query token against every centroid."""
    centroids = codec.centroids.to(Q.device).float()
    return torch.matmul(Q.float(), centroids.T)


def plaid_approx_score(Q, codes, cu_seqlens_d, codec, *, centroid_score_threshold=None, q_mask=None,
                       scores=None):
    """PLAID's approximate score from centroid codes alone: [Nq, Nd] fp32 ([Nd] for a 2-D Q).

    For query token i and document j: max over j's tokens t of <Q_i, centroids[codes[t]]>, summed
    over i. With centroid_score_threshold, a document token whose centroid scores below the
    threshold against every token of that query is dropped (colbert-ai's pruning). A query token
    that finds no document token (empty document, or all pruned) contributes -9999, as in
    colbert-ai and fast-plaid; masked query tokens contribute 0. ``scores`` [Nq, Lq, C] may pass
    precomputed centroid scores.
    """
    _check_codec(codec)
    check_query(Q, codec.dim, "the codec")
    if not torch.is_tensor(codes) or codes.dim() != 1 or codes.dtype.is_floating_point:
        raise ValueError("codes must be a [T] integer tensor")
    cu = check_cu_seqlens(cu_seqlens_d, codes.shape[0])
    single_query = Q.dim() == 2
    q_mask = check_q_mask(q_mask, Q)
    if single_query:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    device = Q.device
    num_queries, query_len, _ = Q.shape
    num_docs = cu.numel() - 1
    if scores is None:
        scores = centroid_scores(Q, codec)  # [Nq, Lq, C]
    scores = scores.float()
    if q_mask is not None:
        scores = scores.masked_fill(~q_mask.unsqueeze(-1), float("-inf"))  # never decides keep/drop
    keep = None
    if centroid_score_threshold is not None:
        keep = scores.amax(dim=1) >= float(centroid_score_threshold)  # [Nq, C]
    rows = scores.reshape(num_queries * query_len, -1)  # [Nq*Lq, C]
    best = torch.full((num_queries * query_len, num_docs), EMPTY_TOKEN_SCORE, device=device)
    total = codes.shape[0]
    doc_of_token = torch.repeat_interleave(torch.arange(num_docs, device=device),
                                           (cu[1:] - cu[:-1]).to(device))  # [T]
    tokens_per_chunk = max(1, _APPROX_CHUNK_BYTES // (4 * max(1, num_queries * query_len)))
    for start in range(0, total, tokens_per_chunk):
        stop = min(total, start + tokens_per_chunk)
        chunk_codes = codes[start:stop].to(device).long()
        gathered = rows[:, chunk_codes]  # [Nq*Lq, n]
        if keep is not None:
            kept = keep[:, chunk_codes]  # [Nq, n]
            kept = kept.unsqueeze(1).expand(num_queries, query_len, -1).reshape(num_queries * query_len, -1)
            gathered = gathered.masked_fill(~kept, float("-inf"))
        index = doc_of_token[start:stop].unsqueeze(0).expand_as(gathered)
        best.scatter_reduce_(1, index, gathered, reduce="amax", include_self=True)
    best = best.reshape(num_queries, query_len, num_docs)
    if q_mask is not None:
        best = best.masked_fill(~q_mask.unsqueeze(-1), 0.0)
    out = best.sum(dim=1)
    return out[0] if single_query else out
