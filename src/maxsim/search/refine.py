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

from maxsim.search.topk import check_k, merge_topk

MAX_REFINE_FACTOR = 1 << 16


def check_refine(corpus, refine, refine_factor) -> int:
    """The refine corpus checked against ``corpus``; returns the factor as an int."""
    from maxsim.search.corpus import Corpus

    if not isinstance(refine, Corpus):
        raise TypeError(f"maxsim: refine must be a maxsim.Corpus of the same documents (float16, int8, ...); got "
                        f"{type(refine).__name__}")
    if isinstance(refine_factor, bool) or not isinstance(refine_factor, int) or not 1 <= refine_factor <= MAX_REFINE_FACTOR:
        raise ValueError(f"maxsim: refine_factor must be an int in [1, {MAX_REFINE_FACTOR}] (candidates kept per "
                         f"result: k * refine_factor); got {refine_factor!r}")
    if refine.is_compressed:
        raise ValueError(f"maxsim: the refine corpus holds {refine.encoding} codes; refine from float16, bfloat16, "
                         "float32, int8 or fp8 tokens")
    if len(refine) != len(corpus) or refine.base_index != corpus.base_index:
        raise ValueError(f"maxsim: the refine corpus holds {len(refine)} documents, the corpus {len(corpus)}: build both "
                         "from the same documents in the same order")
    if refine.dim != corpus.dim:
        raise ValueError(f"maxsim: the refine corpus has d={refine.dim}, the corpus d={corpus.dim}")
    same_ids = (refine.ids == corpus.ids) if isinstance(corpus.ids, list) or isinstance(refine.ids, list) \
        else np.array_equal(np.asarray(refine.ids), np.asarray(corpus.ids))
    if not same_ids:
        raise ValueError("maxsim: the refine corpus's ids differ from the corpus's: build both from the same "
                         "documents in the same order")
    return refine_factor


def _gather(refine, local: np.ndarray):
    """(tokens [t, d] float, offsets [n + 1] int64 host) of refine documents ``local`` (sorted,
    unique, in [0, len)), read from wherever the corpus lies (device, host, pinned or mapped):
    one gather per segment it touches. One-byte tokens are dequantised (values * scales, fp32)."""
    from maxsim.compressed.quantized import dequantize_tokens
    from maxsim.search.corpus import _rows

    parts, lengths = [], []
    for s in refine.segments:
        mine = local[(local >= s.first_document) & (local < s.first_document + s.num_documents)] - s.first_document
        if mine.size == 0:
            continue
        starts, n = s.offsets[mine], s.offsets[mine + 1] - s.offsets[mine]
        rows = np.repeat(starts - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(int(n.sum()))
        tokens = _rows(s.embeddings, rows)
        parts.append(tokens if s.scales is None else dequantize_tokens(tokens, _rows(s.scales, rows)))
        lengths.append(n)
    offsets = np.zeros(len(local) + 1, dtype=np.int64)
    np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64), out=offsets[1:])
    return torch.cat(parts) if parts else torch.zeros(0, refine.dim), offsets


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
    idx = indices.cpu().numpy()
    valid = idx >= 0
    local = idx - refine.base_index
    docs = np.unique(local[valid])  # [n] sorted
    tokens, cu_d = _gather(refine, docs)
    dtype = tokens.dtype if tokens.dtype in (torch.float16, torch.bfloat16) else torch.float32
    tokens = tokens.to(device=device, dtype=dtype, non_blocking=True)
    qd = q.to(device=device, dtype=dtype)
    pos = np.searchsorted(docs, np.where(valid, local, docs[0] if docs.size else 0))  # [Nq, m]
    pair_q = torch.arange(Nq, device=device).repeat_interleave(m)
    pair_d = torch.from_numpy(pos.reshape(-1).astype(np.int64)).to(device)
    ok = torch.from_numpy(valid.reshape(-1)).to(device)
    scores = torch.full((Nq * m,), float("-inf"), dtype=torch.float32, device=device)
    if docs.size and ok.any():
        lengths_q = np.diff(cu_q_host)
        lengths_d = np.diff(cu_d)
        got = score_pairs_packed(qd, tokens, torch.from_numpy(cu_q_host).to(device), torch.from_numpy(cu_d).to(device),
                                 pair_q[ok], pair_d[ok], int(lengths_q.max()) if lengths_q.size else 0,
                                 int(lengths_d.max()) if lengths_d.size else 0)
        scores[ok] = got.float()
    return merge_topk(scores.view(Nq, m), indices.to(device), k)
