"""Refining a compressed search to exact scores (FAISS's ``IndexRefine``).

A residual, PQ or one-byte corpus ranks documents by approximate scores. ``Corpus.search(Q, k,
refine=full, refine_factor=r)`` keeps the first stage's best ``k * r`` documents per query, then
scores those again, exactly, from ``full``: a float (or int8 / fp8) corpus of the same documents,
typically loaded with ``mmap=True`` or into pinned host memory, so that it never has to fit the
device. Only the candidates' tokens are read (one gather per segment), copied to the scoring
device and scored pair by pair (:func:`maxsim.score_pairs_packed`); the answer is the exact top-k
of those candidates, best first, ties to the lower index.

The two corpora must hold the same documents in the same order (same count, same ids): the first
stage's indices address the refine corpus directly.
"""

from __future__ import annotations

import numpy as np
import torch

from maxsim._results import check_refine_factor
from maxsim.search.topk import candidate_table, check_k, merge_topk

# Candidate pairs up to which the refine's final top-k merge runs on the host (the scores come
# back anyway): at one query the merge's small kernels were a fifth of the refine stage.
HOST_MERGE_PAIRS = 1 << 15


def check_refine(corpus, refine, refine_factor) -> int:
    """The refine corpus checked against ``corpus`` (a Corpus: ``refine`` must be one of its
    class); returns the factor as an int."""
    if not isinstance(refine, type(corpus)):
        raise TypeError(f"maxsim: refine must be a maxsim.Corpus of the same documents (float16, int8, ...); got "
                        f"{type(refine).__name__}")
    check_refine_factor(refine_factor)
    if refine.encoding.has_codec:
        raise ValueError(f"maxsim: the refine corpus holds {refine.encoding} codes; refine from float16, bfloat16, "
                         "float32, int8 or fp8 tokens")
    if len(refine) != len(corpus) or refine.base_index != corpus.base_index:
        raise ValueError(f"maxsim: the refine corpus holds {len(refine)} documents, the corpus {len(corpus)}: build both "
                         "from the same documents in the same order")
    if refine.dim != corpus.dim:
        raise ValueError(f"maxsim: the refine corpus has d={refine.dim}, the corpus d={corpus.dim}")
    if not _same_ids(corpus, refine):
        raise ValueError("maxsim: the refine corpus's ids differ from the corpus's: build both from the same "
                         "documents in the same order")
    return refine_factor


def refined_search(corpus, Q, k, *, q_mask=None, refine=None, refine_factor: int = 4, device=None, **search):
    """``corpus``'s top-k ``(scores [Nq, k'], indices [Nq, k'])`` for ``Q`` (2-D: no query axis),
    refined from ``refine`` (a Corpus of the same documents, True: the one stored with ``corpus``,
    or None: not refined). ``search``: :func:`maxsim.search.stream.search_corpus`'s options."""
    from maxsim.search.stream import choose_device, search_corpus
    from maxsim.varlen.queries import packed_queries

    if refine is None:
        return search_corpus(corpus, Q, k, q_mask=q_mask, device=device, **search)
    if refine is True:
        refine = corpus.stored_refine()
        if refine is None:
            raise ValueError(f"maxsim: {corpus.name()} holds no refine tokens: build it with python -m maxsim "
                             "index ... --refine float16 (a refine/ folder beside the codes), or pass "
                             "refine=a Corpus of the same documents")
        if corpus.shard_info is not None and refine.shard_info is None:  # a shard refines from its own range
            refine = refine.shard(*corpus.shard_info[:2])
    factor = check_refine(corpus, refine, refine_factor)
    k = check_k(k)
    scores, indices = search_corpus(corpus, Q, k * factor, q_mask=q_mask, device=device, **search)
    squeeze = indices.dim() == 1
    q, _, cu_q_host, _ = packed_queries(torch.from_numpy(Q) if isinstance(Q, np.ndarray) else Q, q_mask)
    scores, indices = refine_candidates(refine, q, cu_q_host, indices[None] if squeeze else indices, k,
                                        choose_device(corpus, Q, device))
    return (scores[0], indices[0]) if squeeze else (scores, indices)


def rerank(corpus, Q, candidates, k, *, q_mask=None, device=None):
    """:meth:`Corpus.rerank`: ``(scores [Nq, k'], indices [Nq, k'])`` (2-D ``Q``: no query axis),
    the exact top-k of each query's ``candidates`` (positions, -1 = none) from ``corpus``'s tokens."""
    from maxsim.search.stream import choose_device
    from maxsim.varlen.queries import packed_queries

    if corpus.encoding.has_codec:
        raise ValueError(f"maxsim: {corpus.name()} holds {corpus.encoding} codes; rerank scores float16, bfloat16, "
                         "float32, int8 or fp8 tokens (search a compressed corpus with refine= instead)")
    k = check_k(k)
    if isinstance(Q, np.ndarray):
        Q = torch.from_numpy(Q)
    squeeze = isinstance(Q, torch.Tensor) and Q.dim() == 2
    q, _, cu_q_host, _ = packed_queries(Q, q_mask)
    if not q.is_floating_point():
        raise TypeError(f"maxsim: the queries are {q.dtype}; rerank takes float16, bfloat16 or float32 queries")
    if q.shape[1] != corpus.dim:
        raise ValueError(f"maxsim: the queries have d={q.shape[1]} but {corpus.name()} has d={corpus.dim}")
    Nq = cu_q_host.size - 1
    table = _candidate_table(candidates, Nq, squeeze, corpus)
    scores, indices = refine_candidates(corpus, q, cu_q_host, table, k, choose_device(corpus, Q, device))
    return (scores[0], indices[0]) if squeeze else (scores, indices)


def _candidate_table(candidates, num_queries: int, squeeze: bool, corpus) -> torch.Tensor:
    """Candidates as int64 ``[Nq, m]`` global positions on the host, checked (topk's table: -1
    padding, a repeat counted once); deleted documents become -1."""
    if squeeze and not isinstance(candidates, (list, tuple)):
        candidates = torch.as_tensor(candidates)
        candidates = candidates[None] if candidates.dim() == 1 else candidates
    elif squeeze:
        candidates = [candidates]
    lo = corpus.base_index
    table = candidate_table(candidates, num_queries, len(corpus), "cpu", first=lo)
    if corpus.num_deleted:
        dead = torch.from_numpy(~corpus.live)[(table - lo).clamp_min(0)] & (table >= 0)
        table = table.masked_fill(dead, -1)
    return table


def _same_ids(corpus, refine) -> bool:
    """Whether both corpora hold the same ids; remembered on ``refine`` for the same two id objects
    (a search would otherwise compare millions of ids a call)."""
    seen = getattr(refine, "_refine_ids_checked", None)
    if seen is not None and seen[0] is corpus.ids and seen[1] is refine.ids:
        return True
    same = (refine.ids == corpus.ids) if isinstance(corpus.ids, list) or isinstance(refine.ids, list) \
        else np.array_equal(np.asarray(refine.ids), np.asarray(corpus.ids))
    if same:
        refine._refine_ids_checked = (corpus.ids, refine.ids)
    return bool(same)


def _take(tensors: list, rows: list, device: torch.device) -> torch.Tensor:
    """Rows ``rows[i]`` (int64) of per-token tensor ``tensors[i]``, back to back, on ``device``.
    From host memory to a GPU, every segment's rows are gathered (threads) into one pinned buffer
    and copied once: a call's cost does not grow with the segments it touches."""
    dtype = tensors[0].dtype
    srcs = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in tensors]  # (fp8 as bytes)
    if device.type == "cuda" and all(t.device.type == "cpu" for t in srcs):
        buf = torch.empty((sum(r.size for r in rows),) + tuple(srcs[0].shape[1:]), dtype=srcs[0].dtype,
                          pin_memory=True)
        start = 0
        for src, r in zip(srcs, rows):
            torch.index_select(src, 0, torch.from_numpy(r), out=buf[start:start + r.size])
            start += r.size
        return buf.to(device, non_blocking=True).view(dtype)
    parts = [torch.index_select(src, 0, torch.from_numpy(r).to(src.device)).to(device) for src, r in zip(srcs, rows)]
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).view(dtype)


def _gather(refine, local: np.ndarray, device: torch.device):
    """(tokens [t, d] on ``device``, offsets [n + 1] int64 host) of refine documents ``local``
    (sorted, unique, in [0, len)), read from wherever the corpus lies (device, host, pinned or
    mapped): one gather of every segment it touches. One-byte tokens are dequantised on ``device``
    (values * scales, fp32), so only their bytes are copied."""
    from maxsim.compressed.quantized import dequantize_tokens

    device = torch.device(device)
    segments = refine.segments
    # local is sorted: one search splits it by segment (a corpus built slice by slice has dozens)
    firsts = np.fromiter((s.first_document for s in segments), dtype=np.int64, count=len(segments))
    bounds = np.searchsorted(local, np.append(firsts, len(refine)))  # [S + 1]
    first_token = np.empty(local.size, dtype=np.int64)  # [n] within its segment
    lengths = np.empty(local.size, dtype=np.int64)  # [n]
    hit = [j for j in range(len(segments)) if bounds[j] < bounds[j + 1]]  # segments holding candidates
    for j in hit:
        a, b = bounds[j], bounds[j + 1]
        segment_offsets = segments[j].offsets
        mine = local[a:b] - firsts[j]
        first_token[a:b] = segment_offsets[mine]
        lengths[a:b] = segment_offsets[mine + 1] - first_token[a:b]
    offsets = np.zeros(local.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows_all = np.repeat(first_token - offsets[:-1], lengths) + np.arange(int(offsets[-1]))  # [t]
    rows = [rows_all[offsets[bounds[j]]:offsets[bounds[j + 1]]] for j in hit]
    touched = [segments[j] for j in hit]
    if not touched:
        return torch.zeros(0, refine.dim, device=device), offsets
    tokens = _take([s.embeddings for s in touched], rows, device)  # [t, d]
    if touched[0].scales is not None:  # one encoding a corpus: every segment has scales, or none
        tokens = dequantize_tokens(tokens, _take([s.scales for s in touched], rows, device))
    return tokens, offsets


def refine_candidates(refine, q: torch.Tensor, cu_q_host: np.ndarray, indices: torch.Tensor, k: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k among each query's candidates.

    ``q [Tq, d]`` packed queries with host offsets ``cu_q_host [Nq + 1]``; ``indices [Nq, m]``
    int64 global document indices (-1: no candidate). Returns ``(scores [Nq, k'] fp32, indices
    [Nq, k'] int64)``, k' = min(k, m), best first, ties to the lower index.
    """
    from maxsim.varlen.ops import score_pairs_packed

    k = check_k(k)
    Nq, m = indices.shape
    indices_host = indices.cpu()
    idx = indices_host.numpy()
    valid = idx >= 0
    local = idx - refine.base_index
    docs = np.unique(local[valid])  # [n] sorted
    tokens, cu_d = _gather(refine, docs, device)
    dtype = tokens.dtype if tokens.dtype in (torch.float16, torch.bfloat16) else torch.float32
    tokens = tokens.to(dtype)
    qd = q.to(device=device, dtype=dtype)
    if docs.size == 0:  # no query has a candidate
        scores = torch.full((Nq, m), float("-inf"), dtype=torch.float32, device=device)
        return merge_topk(scores, indices.to(device), k)
    # every pair scored (a missing candidate as the first document, then dropped): no host syncs
    pos = np.searchsorted(docs, np.where(valid, local, docs[0]))  # [Nq, m]
    pairs = torch.from_numpy(np.stack([np.repeat(np.arange(Nq, dtype=np.int64), m), pos.reshape(-1)])).to(device)
    lengths_q, lengths_d = np.diff(cu_q_host), np.diff(cu_d)
    got = score_pairs_packed(qd, tokens, torch.from_numpy(cu_q_host).to(device), torch.from_numpy(cu_d).to(device),
                             pairs[0], pairs[1], int(lengths_q.max()) if lengths_q.size else 0,
                             int(lengths_d.max()))  # [Nq * m]
    # few pairs merge on the host: ~25 tiny kernels on the GPU cost more than one copy and the merge there
    at = torch.device("cpu") if Nq * m <= HOST_MERGE_PAIRS else device
    indices = indices_host if at.type == "cpu" else indices.to(at)
    scores = torch.where(indices >= 0, got.float().view(Nq, m).to(at), float("-inf"))
    scores, top = merge_topk(scores, indices, k)
    return scores.to(device), top.to(device)
