"""Drop-in maxsim for PyLate 1.6 (``pylate.scores``).

    from maxsim.integrations import pylate as maxsim_pylate
    maxsim_pylate.patch()      # pylate.scores, rank.rerank, the losses, loaded models now run maxsim
    maxsim_pylate.unpatch()    # everything back as it was

The functions below have ``pylate.scores``' signatures and semantics:

- PyLate's mask rule: a masked token's similarity is multiplied by 0 and still takes part in the
  max (``mask_mode="multiply"``); masks are bool, or int / float holding 0 and 1.
- Inputs may be tensors, numpy arrays or lists (as ``pylate.utils.convert_to_tensor`` takes them);
  float64 and integer inputs are scored in fp32.
- The result has the dtype PyLate's own scores have where they are computed: on CUDA its kernel
  backends' fp32 (for fp16 / bf16 inputs too; float64 stays float64), elsewhere its einsum's (the
  embeddings' dtype promoted with any floating mask's); on the inputs' device. Accumulation is
  fp32 whatever that dtype.
- ``backend``: ``None`` (then ``PYLATE_SCORES_BACKEND``) or ``"auto"`` run maxsim; ``"torch"``,
  ``"flash"`` and ``"lik"`` run PyLate's own backend of that name, unpatched.

This module imports PyLate only inside ``patch()`` / ``unpatch()`` and for ``backend="torch"``
etc.; the scoring functions themselves need only maxsim.
"""

from __future__ import annotations

import inspect
import os
import sys

import numpy as np
import torch

import maxsim
from maxsim.integrations._common import (PatchSet, as_compute, compute_dtype, pack_with_zero_rows, rebind_everywhere,
                                         require_library, score_ragged_pairs, scores_dtype)

__all__ = [
    "colbert_scores",
    "colbert_kd_scores",
    "colbert_scores_pairwise",
    "ColBERTScores",
    "rerank",
    "patch",
    "unpatch",
]

_BACKENDS = ("auto", "torch", "flash", "lik")
_PATCHES = PatchSet()
# The pylate releases this drop-in was tested with: (lowest, below); patch() warns outside them.
TESTED_VERSIONS = ("1.6", "1.7")
# PyLate's own functions, saved by patch(): a non-auto backend delegates to them.
_ORIGINALS: dict[str, object] = {}


def _to_tensor(x, name: str) -> torch.Tensor:
    """``pylate.utils.convert_to_tensor``'s rules: tensors pass through, numpy is viewed, lists are
    stacked (lists of arrays or of lists as float32)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, list):
        if not x:
            return torch.tensor([], dtype=torch.float32)
        if isinstance(x[0], np.ndarray):
            return torch.from_numpy(np.array(x, dtype=np.float32))
        if isinstance(x[0], list):
            return torch.tensor(x, dtype=torch.float32)
        if isinstance(x[0], torch.Tensor):
            return torch.stack(x)
        return torch.tensor(x, dtype=torch.float32)
    raise TypeError(f"{name} must be a tensor, a numpy array or a list; got {type(x).__name__}")


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        backend = os.environ.get("PYLATE_SCORES_BACKEND", "auto")
    if not isinstance(backend, str) or backend.lower() not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None; got {backend!r}")
    return backend.lower()


def _pylate_function(name: str):
    """PyLate's own (unpatched) scoring function ``name``."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    from pylate.scores import colbert as pylate_colbert

    return getattr(pylate_colbert, name)


def _result_dtype(dtype: torch.dtype, *masks: torch.Tensor | None) -> torch.dtype:
    # PyLate multiplies the einsum's scores by the masks: a floating mask promotes the result.
    dtype = dtype if dtype.is_floating_point else torch.float32
    for mask in masks:
        if mask is not None and mask.is_floating_point():
            dtype = torch.promote_types(dtype, mask.dtype)
    return dtype


def _check_ndim(tensor: torch.Tensor, ndim: int, name: str, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}; got shape {tuple(tensor.shape)}")


def _score(queries, documents, queries_mask, documents_mask, doc_layout: str) -> torch.Tensor:
    """maxsim with PyLate's multiply rule; ``doc_layout`` names the documents' expected shape."""
    q = _to_tensor(queries, "queries_embeddings")
    d = _to_tensor(documents, "documents_embeddings")
    q_mask = None if queries_mask is None else _to_tensor(queries_mask, "queries_mask")
    d_mask = None if documents_mask is None else _to_tensor(documents_mask, "documents_mask")
    _check_ndim(q, 3, "queries_embeddings", "[Nq, Lq, d]")
    _check_ndim(d, 4 if doc_layout == "candidates" else 3, "documents_embeddings",
                "[Nq, K, Ld, d]" if doc_layout == "candidates" else "[Nd, Ld, d]")
    out_dtype = scores_dtype(_result_dtype(torch.promote_types(q.dtype, d.dtype), q_mask, d_mask), q.device)
    dtype = compute_dtype(q, d)
    scores = maxsim.maxsim(as_compute(q, dtype), as_compute(d, dtype), q_mask, d_mask, mask_mode="multiply")
    return scores if scores.dtype == out_dtype else scores.to(out_dtype)


def colbert_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``pylate.scores.colbert_scores``: Q ``[Nq, Lq, d]`` x D ``[Nd, Ld, d]`` -> ``[Nq, Nd]``.

    Masks ``[Nq, Lq]`` / ``[Nd, Ld]``, PyLate's rule (masked similarity 0, still in the max).
    """
    resolved = _resolve_backend(backend)
    if resolved != "auto":
        return _pylate_function("colbert_scores")(
            queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend=resolved
        )
    return _score(queries_embeddings, documents_embeddings, queries_mask, documents_mask, "shared")


def colbert_kd_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor = None,
    documents_mask: torch.Tensor = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``pylate.scores.colbert_kd_scores``: Q ``[Nq, Lq, d]`` x D ``[Nq, K, Ld, d]`` (each query's
    own candidates) -> ``[Nq, K]``. Masks ``[Nq, Lq]`` / ``[Nq, K, Ld]``, PyLate's rule."""
    resolved = _resolve_backend(backend)
    if resolved != "auto":
        return _pylate_function("colbert_kd_scores")(
            queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend=resolved
        )
    return _score(queries_embeddings, documents_embeddings, queries_mask, documents_mask, "candidates")


def colbert_scores_pairwise(
    queries_embeddings: torch.Tensor,
    documents_embeddings: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """``pylate.scores.colbert_scores_pairwise``: query ``i`` against document ``i`` -> ``[B]``.

    Either padded tensors ``[B, Lq, d]`` / ``[B, Ld, d]`` (no masks: every row takes part, as in
    PyLate) or ragged lists of ``[L_i, d]`` tensors / arrays / lists, scored packed.
    """
    resolved = _resolve_backend(backend)
    if resolved != "auto":
        return _pylate_function("colbert_scores_pairwise")(queries_embeddings, documents_embeddings, backend=resolved)
    if len(queries_embeddings) != len(documents_embeddings):
        raise ValueError(
            "queries_embeddings and documents_embeddings must hold as many items; got "
            f"{len(queries_embeddings)} and {len(documents_embeddings)}"
        )
    if isinstance(queries_embeddings, torch.Tensor) and isinstance(documents_embeddings, torch.Tensor):
        _check_ndim(queries_embeddings, 3, "queries_embeddings", "[B, Lq, d] (or a list of [Lq_i, d])")
        _check_ndim(documents_embeddings, 3, "documents_embeddings", "[B, Ld, d] (or a list of [Ld_i, d])")
        out_dtype = scores_dtype(torch.promote_types(queries_embeddings.dtype, documents_embeddings.dtype),
                                 queries_embeddings.device)
        dtype = compute_dtype(queries_embeddings, documents_embeddings)
        # One candidate per query: D [B, 1, Ld, d] -> [B, 1].
        candidates = as_compute(documents_embeddings, dtype).unsqueeze(1)  # [B, 1, Ld, d]
        scores = maxsim.maxsim(as_compute(queries_embeddings, dtype), candidates)  # [B, 1]
        return scores[:, 0].to(out_dtype)
    queries = [_to_tensor(q, "queries_embeddings[i]") for q in queries_embeddings]
    documents = [_to_tensor(d, "documents_embeddings[i]") for d in documents_embeddings]
    if not queries:
        return torch.zeros(0, dtype=torch.float32)
    for i, (q, d) in enumerate(zip(queries, documents)):
        _check_ndim(q, 2, f"queries_embeddings[{i}]", "[Lq_i, d]")
        _check_ndim(d, 2, f"documents_embeddings[{i}]", "[Ld_i, d]")
    out_dtype = scores_dtype(torch.promote_types(queries[0].dtype, documents[0].dtype), queries[0].device)
    dtype = compute_dtype(*queries, *documents)
    scores = score_ragged_pairs([as_compute(q, dtype) for q in queries], [as_compute(d, dtype) for d in documents])
    return scores.to(out_dtype)


# Token elements (tokens x dim) packed at once by rerank(): about 1 GiB of fp32 a group of queries.
_RERANK_GROUP_ELEMENTS = 1 << 28


def _rerank_item(x, name: str) -> torch.Tensor:
    """One query's or one document's embeddings as ``[L, d]`` (``convert_to_tensor``'s rules)."""
    tensor = _to_tensor(x, name)
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [L, d]; got shape {tuple(tensor.shape)}")
    return tensor


def _rerank_group(queries, documents, device) -> list[torch.Tensor]:
    """Scores of each query against its own candidates, one packed call for the group.

    PyLate pads each query's candidates to its longest one with zero rows and takes the max over
    them all: a candidate shorter than that longest one also sees a similarity of 0. One zero row
    appended to exactly those candidates gives the same maxes with nothing else padded."""
    target = torch.device(device) if device is not None else queries[0].device
    flat, zero_row, pair_q = [], [], []
    for b, candidates in enumerate(documents):
        longest = max(candidate.shape[0] for candidate in candidates)
        flat.extend(candidates)
        zero_row.extend(candidate.shape[0] < longest for candidate in candidates)
        pair_q.extend([b] * len(candidates))
    packed_d, cu_d, max_d = pack_with_zero_rows(flat, zero_row, target)  # [Td, d], [P + 1]
    packed_q, cu_q, max_q = pack_with_zero_rows(queries, [False] * len(queries), target)  # [Tq, d], [B + 1]
    dtype = compute_dtype(packed_q, packed_d)
    out_dtype = scores_dtype(torch.promote_types(packed_q.dtype, packed_d.dtype), target)
    scores = maxsim.score_pairs_packed(
        as_compute(packed_q, dtype), as_compute(packed_d, dtype), cu_q, cu_d,
        torch.tensor(pair_q, device=target), torch.arange(len(pair_q), device=target),
        max_seqlen_q=max_q, max_seqlen_d=max_d)  # [P] fp32
    return list((scores if scores.dtype == out_dtype else scores.to(out_dtype)).split(
        [len(candidates) for candidates in documents]))


def rerank(documents_ids, queries_embeddings, documents_embeddings, device=None) -> list[list[dict]]:
    """``pylate.rank.rerank``: each query's candidates sorted by MaxSim, best first, as
    ``[[{"id": ..., "score": float}, ...], ...]``.

    ``queries_embeddings``: ``[Nq, Lq, d]``, or a list of ``[Lq_i, d]`` (one ``[Lq, d]`` is one
    query); ``documents_embeddings[i]``: query i's candidates, ``[L_j, d]`` each (tensors, arrays
    or lists); ``documents_ids[i]`` their ids. The scores are PyLate's (its zero-padding rule, its
    dtype); all queries' candidates are packed and scored in one kernel call (per group of about
    1 GiB of tokens), and sorted on the device, where PyLate loops over the queries.
    """
    if _resolve_backend(None) != "auto":
        from pylate.rank import rank as pylate_rank

        return _ORIGINALS.get("rerank", pylate_rank.rerank)(documents_ids, queries_embeddings,
                                                            documents_embeddings, device=device)
    if isinstance(queries_embeddings, (torch.Tensor, np.ndarray)) and queries_embeddings.ndim == 2:
        queries_embeddings = queries_embeddings[None]  # one query
    if isinstance(documents_embeddings, (torch.Tensor, np.ndarray)) and documents_embeddings.ndim == 2:
        documents_embeddings = documents_embeddings[None]
    queries = [_rerank_item(q, f"queries_embeddings[{i}]") for i, q in enumerate(queries_embeddings)]
    documents = [[_rerank_item(c, f"documents_embeddings[{i}][{j}]") for j, c in enumerate(candidates)]
                 for i, candidates in enumerate(documents_embeddings)]
    count = min(len(queries), len(documents), len(documents_ids))  # zip's rule, as PyLate's loop
    queries, documents, ids = queries[:count], documents[:count], list(documents_ids)[:count]
    for i, candidates in enumerate(documents):
        if not candidates:
            raise ValueError(f"query {i} has no candidate documents to rerank")
        if len(ids[i]) < len(candidates):
            raise ValueError(f"documents_ids[{i}] has {len(ids[i])} ids for {len(candidates)} candidates")
    results: list[list[dict]] = []
    start = 0
    while start < count:  # groups of queries whose candidates' tokens fit the budget
        stop, elements = start, 0
        while stop < count and (stop == start or elements < _RERANK_GROUP_ELEMENTS):
            elements += sum(c.numel() for c in documents[stop])
            stop += 1
        scores = _rerank_group(queries[start:stop], documents[start:stop], device)
        # [G, K]: -inf after each query's own candidates
        table = torch.nn.utils.rnn.pad_sequence(scores, batch_first=True, padding_value=float("-inf"))
        # stable: a candidate scored -inf stays before the -inf filling
        sorted_scores, order = torch.sort(table, dim=1, descending=True, stable=True)
        sorted_scores, order = sorted_scores.cpu().tolist(), order.cpu().tolist()
        for row, s in enumerate(scores):
            query_ids = ids[start + row]
            kept = s.numel()
            results.append([{"id": query_ids[j], "score": value}
                            for j, value in zip(order[row][:kept], sorted_scores[row][:kept])])
        start = stop
    return results


class ColBERTScores:
    """``pylate.scores.ColBERTScores``: queries ``[Nq, Lq, d]`` against stacked document groups
    ``[Q_doc, N, Ld, d]`` -> ``[Nq, Q_doc * N]``, query-major: column ``j * N + k`` is document
    ``D[j, k]`` (the positive of query ``i`` sits at column ``i * N``). One maxsim call over the
    flattened ``[Q_doc * N, Ld, d]`` documents, whose row order is that column order."""

    def __call__(
        self,
        queries_embeddings: list | np.ndarray | torch.Tensor,
        documents_embeddings: list | np.ndarray | torch.Tensor,
        queries_mask: torch.Tensor | None = None,
        documents_mask: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        documents = _to_tensor(documents_embeddings, "documents_embeddings")
        _check_ndim(documents, 4, "documents_embeddings", "[Q_doc, N, Ld, d]")
        groups, per_group, doc_len, dim = documents.shape
        flat_documents = documents.reshape(groups * per_group, doc_len, dim)  # [Q_doc * N, Ld, d]
        flat_mask = None
        if documents_mask is not None:
            documents_mask = _to_tensor(documents_mask, "documents_mask")
            flat_mask = documents_mask.reshape(groups * per_group, doc_len)  # [Q_doc * N, Ld]
        return colbert_scores(queries_embeddings, flat_documents, queries_mask, flat_mask, backend=backend)


# ---------------------------------------------------------------------------------------------
# patch / unpatch


def _model_similarity_property(original_property: property, replacements: dict) -> property:
    """A ``similarity`` property for ``pylate.models.ColBERT`` that maps the function a model
    resolved at load time (``model._similarity``) to its maxsim counterpart: models loaded before
    ``patch()`` score with maxsim too."""

    def getter(self):
        function = original_property.fget(self)
        return replacements.get(function, function)

    return property(getter, doc=original_property.__doc__)


def patch() -> None:
    """Make PyLate's scoring run maxsim. Reaches ``pylate.scores`` and ``pylate.scores.colbert``,
    every module that imported a scoring function (``pylate.rank.rank``, the losses, the
    evaluators, ``SimilarityFunction``), ``Distillation``'s default ``score_metric``,
    ``ColBERTScores`` instances (the Contrastive losses' default, made before or after), and
    ``ColBERT.similarity`` / ``similarity_pairwise`` of models loaded before or after. Calling it
    again does nothing; ``unpatch()`` restores every original object."""
    if _PATCHES.active:
        return
    require_library("pylate", "pylate", TESTED_VERSIONS)
    import importlib

    from pylate.scores import colbert as pylate_colbert

    binding_modules = ("pylate.rank", "pylate.losses", "pylate.models", "pylate.evaluation",
                       "pylate.scores.similarity_functions")
    for name in binding_modules:
        try:  # load the modules that bind the functions at import, so the scan below finds them
            importlib.import_module(name)
        except ImportError:
            pass
    from pylate.rank import rank as pylate_rank

    _ORIGINALS.update(
        colbert_scores=pylate_colbert.colbert_scores,
        colbert_kd_scores=pylate_colbert.colbert_kd_scores,
        colbert_scores_pairwise=pylate_colbert.colbert_scores_pairwise,
        rerank=pylate_rank.rerank,
    )
    replacements = {
        pylate_colbert.colbert_scores: colbert_scores,
        pylate_colbert.colbert_kd_scores: colbert_kd_scores,
        pylate_colbert.colbert_scores_pairwise: colbert_scores_pairwise,
        pylate_rank.rerank: rerank,
    }
    try:
        rebind_everywhere(_PATCHES, "pylate", replacements)
        # Instances made before patch() call the class's __call__, so patch that, not the name.
        _PATCHES.replace(pylate_colbert.ColBERTScores, "__call__", ColBERTScores.__call__)
        models = sys.modules.get("pylate.models")
        colbert_model = getattr(models, "ColBERT", None)
        if colbert_model is not None:
            for name in ("similarity", "similarity_pairwise"):
                original = inspect.getattr_static(colbert_model, name, None)
                if isinstance(original, property):
                    _PATCHES.replace(colbert_model, name, _model_similarity_property(original, replacements))
    except BaseException:
        _PATCHES.restore()
        _ORIGINALS.clear()
        raise


def unpatch() -> None:
    """Undo ``patch()``: every replaced attribute gets its original object back. Safe to call when
    not patched."""
    _PATCHES.restore()
    _ORIGINALS.clear()


def is_patched() -> bool:
    return _PATCHES.active
