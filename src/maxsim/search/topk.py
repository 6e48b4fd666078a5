"""Exact top-k MaxSim search: the best ``k`` documents per query without the ``[Nq, Nd]`` matrix.

    scores, indices = maxsim.search.topk(Q, D, k)      # [Nq, k] fp32, [Nq, k] int64

The answer is exactly ``torch.topk(maxsim(Q, D), k)`` with ties broken by the lower document index,
sorted best first. One path computes it: a fixed-size chunk of documents is scored with
``maxsim.maxsim`` (padded layout) or ``maxsim.maxsim_varlen`` (packed layout), and its best ``k``
are merged into a running top-k. Scratch memory is O(Nq * (k + chunk)), independent of Nd.

Exact ties across chunks: every (score, document index) pair is turned into one int64 key that
orders by score descending, then index ascending (see :func:`order_keys`). Keys are unique, so
``torch.topk`` on them has a single right answer however the documents were chunked, sharded or
gathered, and the running merge is exact.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from maxsim.dense.ops import maxsim as maxsim_dense
from maxsim.varlen.ops import maxsim_varlen, score_pairs_packed
from maxsim.varlen.packing import pack
from maxsim.varlen.queries import _as_tensor, _bool_mask, _check_offsets, packed_queries

# Index values fit in the low 32 bits of a key; 2**32 - 1 is reserved (it is the sentinel's).
MAX_DOCUMENTS = 2**32 - 1
_LOW_MASK = 2**32 - 1
# The key of "no document" (a padded candidate slot): below every real key.
INVALID_KEY = -(2**63)
# Scratch bytes per element of a chunk's score matrix: fp32 scores, the int64 keys and the
# temporaries of building them (kept in one place so the budget below means bytes).
SCRATCH_BYTES_PER_SCORE = 40
# A kernel call over fewer document tokens than this uses other tiles (maxsim's corpus classes):
# chunks stay at or above it so that a chunk's scores are computed like the whole corpus's.
MIN_CHUNK_TOKENS = 2**18


def choose_chunk_documents(num_queries: int, num_documents: int, k: int, tokens_per_document: float,
                           device: torch.device, scratch_bytes: int | None = None) -> int:
    """Documents per chunk of the chunked scorer (the one place this is decided).

    The chunk's score scratch (``num_queries x chunk`` elements, SCRATCH_BYTES_PER_SCORE each)
    stays within ``scratch_bytes`` (default 1 GiB on CUDA, 256 MiB on the CPU); a chunk holds at
    least ``k`` documents and, on CUDA, at least MIN_CHUNK_TOKENS document tokens when the corpus
    has that many. Chunks are balanced (equal sizes up to one document), so the last chunk is not
    a small remainder that the kernels would tile differently.
    """
    if num_documents <= 0:
        return 1
    if scratch_bytes is None:
        scratch_bytes = 2**30 if torch.device(device).type == "cuda" else 2**28
    per_document = SCRATCH_BYTES_PER_SCORE * max(num_queries, 1)
    chunk = max(1, int(scratch_bytes) // per_document, k)
    if torch.device(device).type == "cuda" and tokens_per_document > 0:
        chunk = max(chunk, math.ceil(MIN_CHUNK_TOKENS / tokens_per_document))
    chunk = min(chunk, num_documents)
    num_chunks = math.ceil(num_documents / chunk)
    return math.ceil(num_documents / num_chunks)


# ---------------------------------------------------------------------------------------------
# keys and the running merge


def order_keys(scores: torch.Tensor, indices: torch.Tensor | int) -> torch.Tensor:
    """int64 keys ordering (score desc, index asc): larger key = better; unique per index.

    ``scores`` fp32 ``[...]``; ``indices`` int64 of the same shape (or an int base: column j is
    document ``base + j``), each in ``[0, MAX_DOCUMENTS)``; an index of -1 gets INVALID_KEY.
    The fp32 bits are mapped to a monotone int32 (negative floats flip their magnitude bits);
    -0.0 counts as +0.0 and every NaN as the largest value, as torch.topk and torch.sort do.
    """
    s = scores.float() + 0.0  # -0.0 + 0.0 = +0.0
    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")).abs(), s)  # one positive NaN
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # [...] monotone in the float
    if isinstance(indices, int):
        columns = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
        low = (_LOW_MASK - indices) - columns  # [c]
        return ordered * 2**32 + low
    keys = ordered * 2**32 + (_LOW_MASK - indices)
    return torch.where(indices < 0, torch.full_like(keys, INVALID_KEY), keys)


def indices_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """The document index of each key (-1 for INVALID_KEY)."""
    index = _LOW_MASK - (keys & _LOW_MASK)
    return torch.where(keys == INVALID_KEY, torch.full_like(index, -1), index)


class RunningTopK:
    """The best ``k`` (score, index) pairs seen so far for ``num_queries`` queries.

    ``update`` takes a chunk's scores; ``result`` returns ``(scores [Nq, k'] fp32, indices [Nq, k']
    int64)`` sorted by (score desc, index asc), k' = min(k, documents seen). Slots for which no
    valid document was seen (per-query candidate lists) hold index -1 and score -inf.
    """

    def __init__(self, num_queries: int, k: int, device: torch.device):
        self.k = int(k)
        self.keys = torch.empty(num_queries, 0, dtype=torch.int64, device=device)  # [Nq, <= k]
        self.scores = torch.empty(num_queries, 0, dtype=torch.float32, device=device)  # [Nq, <= k]

    def update(self, scores: torch.Tensor, indices: torch.Tensor | int) -> None:
        """``scores`` fp32 ``[Nq, c]``; ``indices`` int64 ``[Nq, c]`` or an int base (column j is
        document base + j)."""
        if scores.shape[1] == 0:
            return
        keys = order_keys(scores, indices)  # [Nq, c]
        take = min(self.k, keys.shape[1])
        keys, pos = torch.topk(keys, take, dim=1)  # [Nq, take]: unique keys, one right answer
        chunk_scores = torch.gather(scores.float(), 1, pos)
        self.merge(keys, chunk_scores)

    def merge(self, keys: torch.Tensor, scores: torch.Tensor) -> None:
        """Merge already-keyed pairs ``[Nq, m]`` into the running top-k."""
        all_keys = torch.cat([self.keys, keys.to(self.keys.device)], 1)  # [Nq, <= 2k]
        all_scores = torch.cat([self.scores, scores.to(self.scores.device, torch.float32)], 1)
        take = min(self.k, all_keys.shape[1])
        self.keys, pos = torch.topk(all_keys, take, dim=1)
        self.scores = torch.gather(all_scores, 1, pos)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices_from_keys(self.keys)
        scores = torch.where(indices < 0, torch.full_like(self.scores, float("-inf")), self.scores)
        return scores, indices


def merge_topk(scores: torch.Tensor, indices: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of gathered pairs: ``scores`` fp32 ``[Nq, m]`` and global ``indices`` int64
    ``[Nq, m]`` (-1 = none) -> best ``min(k, m)`` by (score desc, index asc)."""
    running = RunningTopK(scores.shape[0], k, scores.device)
    running.merge(order_keys(scores, indices), scores)
    return running.result()


# ---------------------------------------------------------------------------------------------
# inputs


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"maxsim: k must be an int; got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"maxsim: k must be at least 1; got {k}")
    return int(k)


def _check_pair(q: torch.Tensor, d: torch.Tensor, d_name: str = "D") -> None:
    if q.dtype != d.dtype:
        raise TypeError(f"maxsim: Q is {q.dtype} but {d_name} is {d.dtype}; they must match")
    if q.shape[-1] != d.shape[-1]:
        raise ValueError(f"maxsim: Q has d={q.shape[-1]} but {d_name} has d={d.shape[-1]}; they must match")
    if q.device != d.device:
        raise ValueError(f"maxsim: Q is on {q.device} but {d_name} is on {d.device}")


def candidate_table(candidates, num_queries: int, num_documents: int, device, first: int = 0) -> torch.Tensor:
    """Per-query candidate lists (indices ``first .. first + num_documents - 1``) -> int64 ``[Nq,
    K]`` on ``device``, -1 = no candidate, each row's duplicates removed (a candidate is a
    document, counted once)."""
    if isinstance(candidates, (list, tuple)):
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in candidates]
        if len(rows) != num_queries:
            raise ValueError(f"maxsim: candidates must have one list per query ({num_queries}); got {len(rows)}")
        width = max((r.size for r in rows), default=0)
        table = np.full((num_queries, width), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            table[i, : r.size] = r
        candidates = torch.from_numpy(table)
    candidates = _as_tensor("candidates", candidates)
    if candidates.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"maxsim: candidates must hold integer document indices; got {candidates.dtype}")
    if candidates.dim() != 2 or candidates.shape[0] != num_queries:
        raise ValueError(f"maxsim: candidates must be [Nq={num_queries}, K]; got {list(candidates.shape)}")
    candidates = candidates.to(device=device, dtype=torch.int64)
    if candidates.numel():
        outside = (candidates < first) & (candidates != -1) | (candidates >= first + num_documents)
        if bool(outside.any()):
            lo, hi = int(candidates.min()), int(candidates.max())
            raise ValueError(f"maxsim: candidates must hold indices in {first}..{first + num_documents - 1} (or -1 "
                             f"for none); got values in [{lo}, {hi}]")
        ordered, _ = torch.sort(candidates, dim=1)
        repeated = torch.zeros_like(ordered, dtype=torch.bool)
        repeated[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        candidates = torch.where(repeated, torch.full_like(ordered, -1), ordered)
    return candidates


# ---------------------------------------------------------------------------------------------
# the chunked scorer


def _chunked(running: RunningTopK, num_documents: int, chunk: int,
             score_chunk: Callable[[int, int], torch.Tensor]) -> None:
    for start in range(0, num_documents, chunk):
        stop = min(num_documents, start + chunk)
        running.update(score_chunk(start, stop), start)


def topk(Q, D, k, q_mask=None, d_mask=None, *, cu_seqlens_q=None, cu_seqlens_d=None, candidates=None,
         normalize: bool = False, mask_mode: str = "exclude", chunk_documents: int | None = None,
         scratch_bytes: int | None = None):
    """The best ``k`` documents of ``D`` for each query of ``Q``, exactly.

    Layouts:
        padded: ``Q [Nq, Lq, d]`` (or ``[Lq, d]``), ``D [Nd, Ld, d]``, optional masks (True = real
            token); scores are ``maxsim.maxsim(Q, D, q_mask, d_mask, normalize=, mask_mode=)``.
        packed: ``D`` a list of ``[L_j, d]`` tensors, or ``[Td, d]`` with ``cu_seqlens_d [Nd + 1]``;
            ``Q`` padded (with ``q_mask``), a list, or packed with ``cu_seqlens_q``; scores are
            ``maxsim.maxsim_varlen`` (the exclude rule; no ``normalize``/``multiply`` there).

    Args:
        k: how many documents per query (>= 1). ``k > Nd`` returns all Nd, sorted.
        candidates: optional per-query candidates (PyLate's ``subset``; ``Corpus.rerank``'s
            argument): int ``[Nq, K]`` document indices or a list of Nq lists; -1 pads a short
            list; a repeated index counts once.
            Only candidates are ranked; ``k`` is then capped at K, and a query with fewer than
            ``k`` candidates gets index -1 and score -inf in its remaining slots.
        chunk_documents: documents scored per chunk (default: :func:`choose_chunk_documents`).
        scratch_bytes: the score-scratch budget given to :func:`choose_chunk_documents`.

    Returns:
        ``(scores [Nq, k'] fp32, indices [Nq, k'] int64)``, k' = min(k, Nd) (or min(k, K)), sorted
        by score descending, ties by the lower document index: ``torch.topk(maxsim(Q, D), k)``
        with that tie rule. A NaN score ranks first (as in torch.topk). 2-D ``Q`` drops the query
        axis. On the CPU a score can differ from one ``maxsim`` call in its last bit: BLAS rounds
        a dot product by the shape of the chunk it is part of.
    """
    k = check_k(k)
    packed = isinstance(D, (list, tuple)) or cu_seqlens_d is not None
    if packed:
        if normalize or mask_mode != "exclude":
            raise ValueError("maxsim: the packed layout scores with maxsim_varlen: normalize=False and "
                             "mask_mode='exclude' only (normalize the embeddings beforehand)")
        if d_mask is not None:
            raise ValueError("maxsim: d_mask is for padded D; a packed D has no padding")
        squeeze = not isinstance(Q, (list, tuple)) and cu_seqlens_q is None and _as_tensor("Q", Q).dim() == 2
        if isinstance(D, (list, tuple)):
            if cu_seqlens_d is not None:
                raise ValueError("maxsim: pass either a list of documents or packed D with cu_seqlens_d, not both")
            d, cu_d, _ = pack([_as_tensor("D", x) for x in D])
        else:
            d = _as_tensor("D", D)
            if d.dim() != 2:
                raise ValueError(f"maxsim: packed D must be [total_tokens, d]; got {list(d.shape)}")
            cu_d = _as_tensor("cu_seqlens_d", cu_seqlens_d)
        q, cu_q, cu_q_host, max_q = packed_queries(Q, q_mask, cu_seqlens_q)
        _check_pair(q, d)
        scores, indices = topk_packed(q, cu_q, max_q, d, cu_d.cpu().numpy().astype(np.int64), k, candidates=candidates,
                                      chunk_documents=chunk_documents, scratch_bytes=scratch_bytes)
    else:
        if cu_seqlens_q is not None:
            raise ValueError("maxsim: cu_seqlens_q is for the packed layout; give cu_seqlens_d (or a list) for D too")
        Q, D = _as_tensor("Q", Q), _as_tensor("D", D)
        squeeze = Q.dim() == 2
        if squeeze:
            Q = Q[None]
            q_mask = None if q_mask is None else _as_tensor("q_mask", q_mask)[None]
        if Q.dim() != 3:
            raise ValueError(f"maxsim: padded Q must be [Nq, Lq, d] or [Lq, d]; got {list(Q.shape)}")
        if D.dim() != 3:
            raise ValueError(f"maxsim: padded D must be [Nd, Ld, d]; got {list(D.shape)} "
                             "(for packed documents give cu_seqlens_d or a list)")
        _check_pair(Q, D)
        _check_options(normalize, mask_mode, Q)
        q_mask = _bool_mask("q_mask", q_mask, Q.shape[:2], Q.device)
        d_mask = _bool_mask("d_mask", d_mask, D.shape[:2], D.device)
        scores, indices = _topk_padded(Q, D, k, q_mask, d_mask, candidates, normalize, mask_mode,
                                       chunk_documents, scratch_bytes)
    if squeeze:
        return scores[0], indices[0]
    return scores, indices


def _check_options(normalize, mask_mode: str, Q: torch.Tensor) -> None:
    """The padded layout's options, checked up front: a call that scores no chunk (no documents,
    no candidates) must refuse what ``maxsim.maxsim`` would."""
    if mask_mode not in ("exclude", "multiply"):
        raise ValueError(f"maxsim: mask_mode must be 'exclude' or 'multiply'; got {mask_mode!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"maxsim: normalize must be True or False; got {normalize!r}")
    if Q.shape[-1] == 0:
        raise ValueError(f"maxsim: the embedding dim d must be at least 1; got Q {list(Q.shape)}")


def _topk_padded(Q, D, k, q_mask, d_mask, candidates, normalize, mask_mode, chunk_documents, scratch_bytes):
    Nq, Nd, Ld = Q.shape[0], D.shape[0], D.shape[1]
    options = dict(normalize=normalize, mask_mode=mask_mode)
    if candidates is None:
        _check_size(Nd)
        chunk = chunk_documents or choose_chunk_documents(Nq, Nd, k, Ld, D.device, scratch_bytes)
        running = RunningTopK(Nq, k, Q.device)

        def score(start, stop):
            mask = None if d_mask is None else d_mask[start:stop]
            return maxsim_dense(Q, D[start:stop], q_mask, mask, **options)  # [Nq, c]

        _chunked(running, Nd, _check_chunk(chunk), score)
        return running.result()

    candidates = candidate_table(candidates, Nq, Nd, D.device)  # [Nq, K]
    K = candidates.shape[1]
    running = RunningTopK(Nq, k, Q.device)
    # Candidate lists are gathered ([Nq, c, Ld, d]): the chunk also bounds that copy.
    gathered_budget = scratch_bytes or (2**30 if D.device.type == "cuda" else 2**28)
    per_column = max(1, Nq * Ld * D.shape[2] * D.element_size() + SCRATCH_BYTES_PER_SCORE * Nq)
    chunk = chunk_documents or max(1, min(K, gathered_budget // per_column))
    for start in range(0, K, _check_chunk(chunk)):
        cols = candidates[:, start:start + chunk]  # [Nq, c]
        safe = cols.clamp_min(0)
        docs = D[safe]  # [Nq, c, Ld, d]
        mask = None if d_mask is None else d_mask[safe]
        scores = maxsim_dense(Q, docs, q_mask, mask, **options)  # [Nq, c]
        running.update(scores, cols)
    return running.result()


def topk_packed(q, cu_q, max_q, d, cu_d_host: np.ndarray, k, *, candidates=None, chunk_documents=None,
                scratch_bytes=None, running: RunningTopK | None = None, base_index: int = 0):
    """Top-k over a packed corpus ``d [Td, d]`` with host offsets ``cu_d_host [Nd + 1]`` (int64).

    ``q [Tq, d]`` / ``cu_q [Nq + 1]`` (on q's device) / ``max_q``: packed queries. With
    ``running`` the chunks are merged into it (document j counts as ``base_index + j``) and
    ``None`` is returned; otherwise ``(scores, indices)``.
    """
    _check_offsets("cu_seqlens_d", cu_d_host, d.shape[0])
    Nq, Nd = cu_q.numel() - 1, cu_d_host.size - 1
    own = running is None
    if own:
        running = RunningTopK(Nq, k, q.device)
    if candidates is not None:
        if not own or base_index:
            raise ValueError("maxsim: candidates need the whole corpus in one call")
        _score_candidates_packed(running, q, cu_q, max_q, d, cu_d_host, candidates, chunk_documents, scratch_bytes)
        return running.result()
    _check_size(base_index + Nd)
    lengths = np.diff(cu_d_host)
    tokens_per_doc = float(lengths.mean()) if Nd else 0.0
    chunk = chunk_documents or choose_chunk_documents(Nq, Nd, k, tokens_per_doc, d.device, scratch_bytes)
    cu_d = torch.from_numpy(cu_d_host).to(d.device)  # once, not once per chunk
    max_d = int(lengths.max()) if Nd else 0

    def score(start, stop):
        return score_packed_chunk(q, cu_q, max_q, d, cu_d_host, start, stop, cu_d=cu_d, max_d=max_d)

    for start in range(0, Nd, _check_chunk(chunk)):
        stop = min(Nd, start + chunk)
        running.update(score(start, stop), base_index + start)
    return running.result() if own else None


def chunk_offsets(cu_d: torch.Tensor, start: int, stop: int, t0: int) -> torch.Tensor:
    """Offsets ``[c + 1]`` of documents ``start:stop`` from ``cu_d`` (on the scoring device),
    relative to their first token ``t0``: a view when ``t0`` is 0, one small op otherwise."""
    return cu_d[start:stop + 1] - t0 if t0 else cu_d[start:stop + 1]


def score_packed_chunk(q, cu_q, max_q, d, cu_d_host: np.ndarray, start: int, stop: int, token_base: int = 0, *,
                       cu_d: torch.Tensor, max_d: int) -> torch.Tensor:
    """Scores ``[Nq, stop - start]`` of documents ``start:stop`` of a packed corpus whose rows
    ``cu_d_host[start] - token_base ...`` are in ``d`` (token_base: the first row ``d`` holds).
    ``cu_d``: the same offsets on d's device, ``max_d``: a bound on the documents' lengths; the call
    does no host work proportional to the documents."""
    t0, t1 = int(cu_d_host[start]), int(cu_d_host[stop])
    chunk = d[t0 - token_base:t1 - token_base]  # [tokens, d] view
    return maxsim_varlen(q, chunk, cu_q, chunk_offsets(cu_d, start, stop, t0), max_q, max_d)  # [Nq, c]


def score_quantized_chunk(queries, values, scales, cu_d_host: np.ndarray, start: int, stop: int, token_base: int = 0,
                          *, cu_d: torch.Tensor, max_d: int) -> torch.Tensor:
    """Scores ``[Nq, stop - start]`` fp32 of documents ``start:stop`` of a one-byte corpus whose
    scales were checked: ``queries`` a list of Nq ``[L_i, d]`` float tensors, or the form
    ``maxsim.compressed.quantized.prepare_queries`` gives for the stream kernel; ``values [t, d]``
    int8 / float8_e4m3fn and ``scales [t]`` fp32 whose rows ``cu_d_host[start] - token_base ...``
    are the chunk's tokens. ``cu_d``: the offsets on the values' device, ``max_d`` a bound on the
    documents' lengths. Prepared queries go to the stream kernel on the bytes with no host read;
    a list to ``maxsim_quantized_varlen`` (the stream kernel or dequantised chunks)."""
    from maxsim.compressed.quantized import maxsim_quantized_varlen, score_checked_tokens  # (maxsim.search loads first)

    t0, t1 = int(cu_d_host[start]), int(cu_d_host[stop])
    cu = chunk_offsets(cu_d, start, stop, t0)
    rows = slice(t0 - token_base, t1 - token_base)
    if isinstance(queries, tuple):
        return score_checked_tokens(queries, values[rows], scales[rows], cu, max_d)  # [Nq, c]
    return maxsim_quantized_varlen(queries, values[rows], scales[rows], cu)  # [Nq, c]


def _score_candidates_packed(running, q, cu_q, max_q, d, cu_d_host, candidates, chunk_documents, scratch_bytes):
    Nq, Nd = cu_q.numel() - 1, cu_d_host.size - 1
    candidates = candidate_table(candidates, Nq, Nd, q.device)  # [Nq, K]
    K = candidates.shape[1]
    budget = scratch_bytes or (2**30 if q.device.type == "cuda" else 2**28)
    chunk = chunk_documents or max(1, min(K, budget // (SCRATCH_BYTES_PER_SCORE * max(Nq, 1))))
    cu_d = torch.from_numpy(cu_d_host).to(d.device)
    max_d = int(np.diff(cu_d_host).max()) if Nd else 0
    rows = torch.arange(Nq, device=q.device, dtype=torch.int64)
    for start in range(0, K, _check_chunk(chunk)):
        cols = candidates[:, start:start + chunk]  # [Nq, c]
        valid = cols >= 0
        scores = torch.zeros(cols.shape, dtype=torch.float32, device=q.device)
        if bool(valid.any()):
            pair_q = rows[:, None].expand_as(cols)[valid]
            pair_d = cols[valid]
            scores[valid] = score_pairs_packed(q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d)
        running.update(scores, cols)


def _check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"maxsim: chunk_documents must be a positive int; got {chunk!r}")
    return int(chunk)


def _check_size(num_documents: int) -> None:
    if num_documents >= MAX_DOCUMENTS:
        raise ValueError(f"maxsim: top-k supports fewer than {MAX_DOCUMENTS} documents; got {num_documents}")


def exhaustive_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: a stable descending sort of a full ``[Nq, Nd]`` score matrix, first ``k``
    (for tests and benchmarks; O(Nq * Nd) memory)."""
    values, order = torch.sort(scores, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


__all__: Sequence[str] = ["topk", "RunningTopK", "merge_topk", "order_keys", "choose_chunk_documents",
                          "exhaustive_topk"]
