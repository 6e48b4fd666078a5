"""PLAID search over a loaded index (colbert-ai's pipeline, on maxsim's scoring), every query of a
batch through stages 1-4 at once and through the exact stage one at a time:

  1. centroid scores S = Q @ centroids.T                              [Nq, Lq, C] fp32
  2. IVF probe: the top ``ncells`` centroids of every real query token; each query's candidates
     are the union of their pids: (query, pid) pairs                 [P]
  3. pruned approximate score (``centroid_score_threshold``): centroid scores only, document
     tokens whose centroid is below the threshold for every token of that query dropped; each
     query keeps its top ``ndocs`` pairs
  4. full approximate score (no pruning) of those; each query keeps its top ndocs // 4
  5. exact MaxSim of those pairs on their decoded residuals, query by query through the fused
     scorer, which decodes each tile on chip; each query's top k
Without a threshold (fast-plaid's settings) steps 3 and 4 are one: the top ndocs by the full
approximate score, then the top ndocs // 4 of the same scores. Ties go to the higher pid in the
approximate stages (colbert-ai's priority queue) and keep that order in the exact one.

Work is bounded by ``_PAIR_TOKENS``: the approximate stage's PyTorch path walks the pairs in chunks
of at most that many document tokens; the exact stage holds one query's documents at a time.
"""

from __future__ import annotations

import torch

from maxsim._results import SearchResult, check_refine_factor
from maxsim.search.changes import ids_at

from ..compressed._inputs import check_q_mask
from ..compressed.scoring import EMPTY_TOKEN_SCORE, maxsim_residual_varlen
from .approx import approx_scores_fused

SETTINGS = ("colbert", "fast-plaid")
# fast-plaid's search defaults (n_ivf_probe, n_full_scores); it never prunes by threshold
FAST_PLAID_NCELLS = 8
FAST_PLAID_NDOCS = 4096
# Document tokens a chunk of (query, pid) pairs holds in the approximate and exact stages: bounds
# the gathered centroid scores ([tokens, Lq] fp32) and the decoded tokens ([tokens, d]).
_PAIR_TOKENS = 1 << 20


def colbert_defaults(k: int):
    """colbert-ai's Searcher defaults by k: (ncells, centroid_score_threshold, ndocs)."""
    if k <= 10:
        return 1, 0.5, 256
    if k <= 100:
        return 2, 0.45, 1024
    return 4, 0.4, max(k * 4, 4096)


def resolve_settings(k, settings="colbert", ncells=None, centroid_score_threshold="default", ndocs=None):
    """Fill unset search parameters from the named settings: -> (ncells, threshold or None, ndocs)."""
    if settings not in SETTINGS:
        raise ValueError(f"settings must be one of {SETTINGS}, got {settings!r}")
    if settings == "colbert":
        default_ncells, default_threshold, default_ndocs = colbert_defaults(k)
    else:
        default_ncells, default_threshold, default_ndocs = FAST_PLAID_NCELLS, None, FAST_PLAID_NDOCS
    ncells = default_ncells if ncells is None else ncells
    threshold = default_threshold if isinstance(centroid_score_threshold, str) and \
        centroid_score_threshold == "default" else centroid_score_threshold
    ndocs = default_ndocs if ndocs is None else ndocs
    for name, value in (("ncells", ncells), ("ndocs", ndocs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if threshold is not None and not isinstance(threshold, (int, float)):
        raise TypeError(f"centroid_score_threshold must be a number or None, got {type(threshold).__name__}")
    return ncells, threshold, ndocs


def gather_documents(index, pids):
    """codes [T'], residuals [T', P] and cu_seqlens [n + 1] of the documents ``pids`` [n]."""
    rows, cu = _token_rows(index, pids.to(index.cu_seqlens.device).long())
    rows = rows.to(index.codes.device)
    return index.codes[rows], index.residuals[rows], cu


def _token_rows(index, pids):
    """The index rows [T'] of documents ``pids`` [n] (on the index's device) back to back, and
    their cu_seqlens [n + 1]."""
    starts = index.cu_seqlens[pids]  # [n]
    lengths = index.doc_lengths[pids]  # [n]
    cu = torch.zeros(pids.numel() + 1, dtype=torch.int64, device=pids.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    total = int(cu[-1])
    token = torch.arange(total, device=pids.device) - torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return token + torch.repeat_interleave(starts, lengths, output_size=total), cu


def _candidate_pairs(index, S, real, ncells):
    """(query [P], pid [P]) int64 on S's device, sorted by query then pid: every pid in the IVF
    lists of each real query token's top ``ncells`` centroids. S [Nq, Lq, C], real [Nq, Lq]."""
    num_queries, _, num_centroids = S.shape
    if ncells == 1:
        cells = S.argmax(dim=-1, keepdim=True)  # [Nq, Lq, 1]
    else:
        cells = S.topk(min(ncells, num_centroids), dim=-1, sorted=False).indices  # [Nq, Lq, n]
    query = torch.arange(num_queries, device=S.device).view(-1, 1, 1).expand_as(cells)
    valid = real.unsqueeze(-1).expand_as(cells)
    keys = torch.unique(query[valid] * num_centroids + cells[valid])  # (query, cell), each once
    where = index.ivf_offsets.device
    query_of_cell, cell = (keys // num_centroids).to(where), (keys % num_centroids).to(where)
    starts, lengths = index.ivf_offsets[cell], index.ivf_lengths[cell].long()
    total = int(lengths.sum())
    offsets = torch.zeros_like(lengths)
    torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    position = torch.arange(total, device=where) - torch.repeat_interleave(offsets, lengths, output_size=total)
    position = position + torch.repeat_interleave(starts, lengths, output_size=total)
    pair_query = torch.repeat_interleave(query_of_cell, lengths, output_size=total)
    num_docs = len(index)
    pairs = torch.unique(pair_query * num_docs + index.ivf[position].long()).to(S.device)
    return pairs // num_docs, pairs % num_docs


def _chunks(lengths):
    """[start, stop) ranges of consecutive pairs whose documents hold at most _PAIR_TOKENS tokens
    (at least one pair each). lengths: [P] int64 on the host."""
    cumulative = torch.cumsum(lengths, 0)
    bounds, start = [], 0
    while start < lengths.numel():
        base = int(cumulative[start - 1]) if start else 0
        stop = int(torch.searchsorted(cumulative, base + _PAIR_TOKENS, right=True))
        stop = max(stop, start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def _approx_scores(index, S, real, query, pids, threshold):
    """PLAID's centroid-only score of each pair [P] fp32: per real query token the max over the
    document's tokens of its centroid's score (tokens below ``threshold`` for every token of that
    query dropped; -9999 where none is left), summed over the query's real tokens."""
    S = S.masked_fill(~real.unsqueeze(-1), float("-inf"))  # a masked token never decides keep / drop
    keep = None if threshold is None else S.amax(dim=1) >= float(threshold)  # [Nq, C]
    by_code = S.transpose(1, 2).contiguous()  # [Nq, C, Lq]: a token's Lq scores in one contiguous row
    fused = approx_scores_fused(by_code, keep, index.codes, index.cu_seqlens[:-1], index.doc_lengths, query, pids,
                                real)
    if fused is not None:
        return fused
    where = index.cu_seqlens.device
    lengths = index.doc_lengths[pids.to(where)].cpu()
    out = torch.empty(pids.numel(), dtype=torch.float32, device=S.device)
    for start, stop in _chunks(lengths):
        rows, cu = _token_rows(index, pids[start:stop].to(where))
        codes = index.codes[rows.to(index.codes.device)].to(S.device).long()  # [T]
        counts = (cu[1:] - cu[:-1]).to(S.device)
        pair_of_token = torch.repeat_interleave(torch.arange(stop - start, device=S.device), counts,
                                                output_size=codes.numel())  # [T]
        token_query = query[start:stop][pair_of_token]  # [T]
        gathered = by_code[token_query, codes]  # [T, Lq]
        if keep is not None:
            gathered = gathered.masked_fill(~keep[token_query, codes].unsqueeze(-1), float("-inf"))
        best = torch.full((stop - start, S.shape[1]), EMPTY_TOKEN_SCORE, device=S.device)
        best.scatter_reduce_(0, pair_of_token.unsqueeze(-1).expand_as(gathered), gathered, reduce="amax",
                             include_self=True)
        out[start:stop] = best.masked_fill(~real[query[start:stop]], 0.0).sum(dim=1)
    return out


def _best_per_query(query, scores, pids, n, num_queries):
    """Positions (into the pairs) of each query's n best pairs, by score then the higher pid,
    grouped by query in that order."""
    order = torch.argsort(pids, descending=True, stable=True)
    order = order[torch.sort(scores[order], descending=True, stable=True).indices]
    order = order[torch.sort(query[order], stable=True).indices]
    grouped = query[order]
    first = torch.searchsorted(grouped, torch.arange(num_queries, device=grouped.device))
    rank = torch.arange(grouped.numel(), device=grouped.device) - first[grouped]
    return order[rank < n]


def _exact_scores(index, q, cu_q, query, pids, decode_dtype):
    """MaxSim of each pair [P] fp32 on its document's decoded residuals (normalised as colbert-ai
    does). q [Tq, d] packed real query tokens, cu_q [Nq + 1]; query / pids [P] grouped by query.

    One query at a time: its documents are gathered and scored by the fused residual scorer, which
    decodes each tile on chip and stores nothing. Queries of a batch rarely share candidates, so
    decoding a document once for all of them saved nothing, and writing the decoded tokens out for
    a pair scorer made a batch of 32 slower than its queries one by one (BENCHMARKS.md, PLAID at 10M).
    """
    codec = index.codec.to(q.device) if index.codec.device != q.device else index.codec
    num_queries = cu_q.numel() - 1
    bounds = torch.searchsorted(query, torch.arange(num_queries + 1, device=query.device)).tolist()
    token_bounds = cu_q.tolist()
    out = torch.empty(pids.numel(), dtype=torch.float32, device=q.device)
    for i in range(num_queries):
        first, last = bounds[i], bounds[i + 1]
        if first == last:
            continue
        codes, residuals, cu_d = gather_documents(index, pids[first:last])  # each pid once per query
        out[first:last] = maxsim_residual_varlen(q[token_bounds[i]:token_bounds[i + 1]], codes.to(q.device),
                                                 residuals.to(q.device), cu_d.to(q.device), codec,
                                                 decode_dtype=decode_dtype)  # [last - first]
    return out


def _search_batch(index, Q, real, k, ncells, threshold, ndocs, decode_dtype, allowed=None):
    """(scores [Nq, k] fp32, pids [Nq, k] int64) for Q [Nq, Lq, d] with real tokens ``real``;
    ``allowed`` (bool [N] or None): the only passages that may be candidates."""
    num_queries = Q.shape[0]
    device = Q.device
    out_scores = torch.full((num_queries, k), float("-inf"), device=device)
    out_pids = torch.full((num_queries, k), -1, dtype=torch.int64, device=device)
    S = Q.float() @ index.codec.centroids.to(device).float().T  # [Nq, Lq, C]
    query, pids = _candidate_pairs(index, S, real, ncells)
    if allowed is not None:
        keep = allowed[pids.to(allowed.device)].to(pids.device)
        query, pids = query[keep], pids[keep]
    if pids.numel() == 0:
        return out_scores, out_pids
    approx = _approx_scores(index, S, real, query, pids, threshold)
    kept = _best_per_query(query, approx, pids, ndocs, num_queries)
    query, pids, approx = query[kept], pids[kept], approx[kept]
    if threshold is not None:
        approx = _approx_scores(index, S, real, query, pids, None)
    kept = _best_per_query(query, approx, pids, max(1, ndocs // 4), num_queries)
    query, pids = query[kept], pids[kept]
    lengths = real.sum(dim=1)  # [Nq] real tokens a query
    q = Q[real].to(decode_dtype)  # [Tq, d]: real tokens only, packed
    cu_q = torch.zeros(num_queries + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=cu_q[1:])
    exact = _exact_scores(index, q, cu_q, query, pids, decode_dtype)
    # the top k of each query; equal exact scores keep the approximate order
    order = torch.sort(exact, descending=True, stable=True).indices
    order = order[torch.sort(query[order], stable=True).indices]
    grouped = query[order]
    rank = torch.arange(grouped.numel(), device=device) - \
        torch.searchsorted(grouped, torch.arange(num_queries, device=device))[grouped]
    top = order[rank < k]
    out_scores[query[top], rank[rank < k]] = exact[top]
    out_pids[query[top], rank[rank < k]] = pids[top]
    return out_scores, out_pids


def search(index, Q, k=10, *, q_mask=None, subset=None, refine=None, refine_factor=4, ncells=None,
           centroid_score_threshold="default", ndocs=None, settings="colbert", decode_dtype=None):
    """PLAID search of ``index`` for Q [Nq, Lq, d] (or [Lq, d]) -> ``SearchResult(scores [Nq, k]
    fp32, indices [Nq, k] int64, ids)``, best first; the ids are the passage ids (the positions),
    and a query with fewer than k candidates is padded with score -inf and -1.

    ``q_mask``, ``subset`` and ``refine`` mean what they mean in ``Corpus.search``: masked query
    tokens (False) are left out of every stage; ``subset`` (passage ids, one set for every query)
    limits the candidates to those documents; ``refine`` (a ``maxsim.Corpus`` of the same
    documents in the same order, float or int8 / fp8) rescores the exact stage's best
    ``k * refine_factor`` passages from its tokens (``Corpus.rerank``). Parameters left unset take
    the named ``settings``: "colbert" = colbert-ai's defaults by k (by ``k * refine_factor`` with
    ``refine``, the candidates the first stage hands on) (ncells 1/2/4, threshold
    0.5/0.45/0.4, ndocs 256/1024/max(4k, 4096)); "fast-plaid" = 8 cells, 4096 approximate scores,
    no threshold. decode_dtype: fp32 (colbert-ai's CPU decode; the default for colbert-ai indexes
    on the CPU) or fp16 (colbert-ai's CUDA decode and fast-plaid's; the default otherwise).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    factor = _check_refine(index, refine, refine_factor)
    # the named settings for the candidates the first stage must hand on (k x refine_factor), so
    # that its exact stage keeps at least that many (colbert-ai's k-10 defaults keep 64)
    ncells, threshold, ndocs = resolve_settings(k * factor, settings, ncells, centroid_score_threshold, ndocs)
    if not torch.is_tensor(Q) or not Q.is_floating_point() or Q.dim() not in (2, 3) \
            or Q.shape[-1] != index.codec.dim:
        raise ValueError(f"Q must be a floating-point tensor [Nq, Lq, {index.codec.dim}] or "
                         f"[Lq, {index.codec.dim}], got {tuple(Q.shape) if torch.is_tensor(Q) else type(Q).__name__}")
    q_mask = check_q_mask(q_mask, Q)
    single = Q.dim() == 2
    if single:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if decode_dtype is None:
        on_cpu_colbert = index.format == "colbert" and Q.device.type == "cpu"
        decode_dtype = torch.float32 if on_cpu_colbert else torch.float16
    real = torch.ones(Q.shape[:2], dtype=torch.bool, device=Q.device) if q_mask is None else q_mask.to(Q.device)
    allowed = _subset_mask(index, subset)
    with torch.no_grad():
        out_scores, out_pids = _search_batch(index, Q, real, k * factor, ncells, threshold, ndocs, decode_dtype,
                                             allowed)
    if refine is not None:
        out_scores, out_pids, _ = refine.rerank(Q, out_pids, k, q_mask=real, device=Q.device)
    ids = out_pids.cpu() if index.ids is None else ids_at(index.ids, out_pids.cpu().numpy())
    if single:
        out_scores, out_pids, ids = out_scores[0], out_pids[0], ids[0]
    return SearchResult(out_scores, out_pids, ids)


def _check_refine(index, refine, refine_factor) -> int:
    """The candidates kept a result: ``refine_factor`` when a refine corpus is given, else 1."""
    if refine is None:
        return 1
    if refine is True:
        raise ValueError("a PLAID index stores no refine tokens: pass refine=a maxsim.Corpus of the same "
                         "documents in the same order (float16 or int8)")
    if not callable(getattr(refine, "rerank", None)):
        raise TypeError(f"refine must be a maxsim.Corpus of the index's documents; got {type(refine).__name__}")
    if len(refine) != len(index):
        raise ValueError(f"the refine corpus holds {len(refine)} documents, the index {len(index)}: build it from "
                         "the same documents in the same order")
    return check_refine_factor(refine_factor)


def _subset_mask(index, subset):
    """``subset`` (passage ids: a list, array or tensor of ints) as a bool [N] mask on the index's
    device; ids the index does not hold match nothing. None -> None."""
    if subset is None:
        return None
    ids = torch.as_tensor(subset.cpu() if torch.is_tensor(subset) else subset)
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() > 1:
        raise TypeError("subset must be a 1-D list, array or tensor of passage ids (ints)")
    ids = ids.long().reshape(-1)
    ids = ids[(ids >= 0) & (ids < len(index))]
    allowed = torch.zeros(len(index), dtype=torch.bool)
    allowed[ids] = True
    return allowed.to(index.cu_seqlens.device)


__all__ = ["search", "colbert_defaults", "resolve_settings", "gather_documents", "SETTINGS"]
