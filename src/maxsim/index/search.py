"""PLAID search over a loaded index (colbert-ai's pipeline, on maxsim's scoring).

For each query:
  1. centroid scores S = centroids @ q.T                          [C, Lq] fp32
  2. IVF probe: the top ``ncells`` centroids of every query token; candidates = union of their pids
  3. pruned approximate score (``centroid_score_threshold``): centroid scores only, tokens whose
     centroid is below the threshold for every query token dropped; keep the top ``ndocs``
  4. full approximate score (no pruning) of those; keep the top ndocs // 4
  5. exact MaxSim on the decoded residuals of those; the top k
Without a threshold (fast-plaid's settings) steps 3 and 4 are one: the top ndocs by the full
approximate score, then the top ndocs // 4 of the same scores.
"""

from __future__ import annotations

import torch

from ..compressed._inputs import check_q_mask
from ..compressed.scoring import maxsim_residual_varlen, plaid_approx_score

SETTINGS = ("colbert", "fast-plaid")
# fast-plaid's search defaults (n_ivf_probe, n_full_scores); it never prunes by threshold
FAST_PLAID_NCELLS = 8
FAST_PLAID_NDOCS = 4096


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


def _top(scores, pids, n):
    """The n best (score, pid), higher pid first among equal scores (colbert-ai's priority queue)."""
    order = torch.argsort(pids, descending=True)
    scores, pids = scores[order], pids[order]
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    return scores[order], pids[order]


def gather_documents(index, pids):
    """codes [T'], residuals [T', P] and cu_seqlens [n + 1] of the documents ``pids`` [n]."""
    pids = pids.to(index.cu_seqlens.device).long()
    starts = index.cu_seqlens[pids]  # [n]
    lengths = index.doc_lengths[pids]  # [n]
    cu = torch.zeros(pids.numel() + 1, dtype=torch.int64, device=pids.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    total = int(cu[-1])
    token = torch.arange(total, device=pids.device) - torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    token = token + torch.repeat_interleave(starts, lengths, output_size=total)  # [T'] rows in the index
    token = token.to(index.codes.device)
    return index.codes[token], index.residuals[token], cu


def _candidates(index, scores, ncells):
    """pids (sorted, unique) in the IVF lists of each query token's top ``ncells`` centroids."""
    if ncells == 1:
        cells = scores.argmax(dim=0)
    else:
        cells = scores.topk(min(ncells, scores.shape[0]), dim=0, sorted=False).indices.flatten()
    cells = torch.unique(cells).to(index.ivf_offsets.device)
    starts, stops = index.ivf_offsets[cells], index.ivf_offsets[cells + 1]
    lengths = stops - starts
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=index.ivf.device)
    offsets = torch.zeros_like(lengths)
    torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    position = torch.arange(total, device=lengths.device) - torch.repeat_interleave(offsets, lengths, output_size=total)
    position = position + torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.unique(index.ivf[position])


def search_one(index, q, k, ncells, threshold, ndocs, decode_dtype):
    """One query q [Lq, d] -> (scores [<= k] fp32, pids [<= k] int64), best first."""
    codec = index.codec
    device = q.device
    scores = codec.centroids.to(device).float() @ q.float().T  # [C, Lq]
    pids = _candidates(index, scores, ncells).to(device)
    if pids.numel() == 0:
        return torch.zeros(0, device=device), pids
    query_scores = scores.T.unsqueeze(0)  # [1, Lq, C]

    def approx(pids_, threshold_):
        codes, _, cu = gather_documents(index, pids_)
        return plaid_approx_score(q, codes.to(device), cu, codec, centroid_score_threshold=threshold_,
                                  scores=query_scores)

    approx_scores, pids = _top(approx(pids, threshold), pids, ndocs)
    if threshold is not None:
        approx_scores = approx(pids, None)
    _, pids = _top(approx_scores, pids, max(1, ndocs // 4))
    codes, residuals, cu = gather_documents(index, pids)
    exact = maxsim_residual_varlen(q, codes.to(device), residuals.to(device), cu, codec, normalize=True,
                                   decode_dtype=decode_dtype)
    order = torch.sort(exact, descending=True, stable=True).indices[:k]
    return exact[order], pids[order]


def search(index, Q, k=10, *, ncells=None, centroid_score_threshold="default", ndocs=None, settings="colbert",
           decode_dtype=None, q_mask=None):
    """PLAID search of ``index`` for Q [Nq, Lq, d] (or [Lq, d]).

    Returns (scores [Nq, k] fp32, pids [Nq, k] int64) best first ([k] each for a 2-D Q); a query
    with fewer than k candidates is padded with score -inf and pid -1. Parameters left unset take
    the named ``settings``: "colbert" = colbert-ai's defaults by k (ncells 1/2/4, threshold
    0.5/0.45/0.4, ndocs 256/1024/max(4k, 4096)); "fast-plaid" = 8 cells, 4096 approximate scores,
    no threshold. decode_dtype: fp32 (colbert-ai's CPU decode; the default for colbert-ai indexes
    on the CPU) or fp16 (colbert-ai's CUDA decode and fast-plaid's; the default otherwise).
    Masked query tokens (q_mask False) are left out of every stage.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    ncells, threshold, ndocs = resolve_settings(k, settings, ncells, centroid_score_threshold, ndocs)
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
    out_scores = torch.full((Q.shape[0], k), float("-inf"), device=Q.device)
    out_pids = torch.full((Q.shape[0], k), -1, dtype=torch.int64, device=Q.device)
    with torch.no_grad():
        for i in range(Q.shape[0]):
            q = Q[i] if q_mask is None else Q[i][q_mask[i]]
            if q.shape[0] == 0:
                continue
            scores, pids = search_one(index, q, k, ncells, threshold, ndocs, decode_dtype)
            out_scores[i, :scores.numel()] = scores
            out_pids[i, :pids.numel()] = pids.to(out_pids.device)
    if single:
        return out_scores[0], out_pids[0]
    return out_scores, out_pids


__all__ = ["search", "colbert_defaults", "resolve_settings", "gather_documents", "SETTINGS"]
