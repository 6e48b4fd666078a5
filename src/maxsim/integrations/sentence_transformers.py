"""Drop-in maxsim for Sentence Transformers 6.2 (``sentence_transformers.util.maxsim`` and the
multi-vector scoring of ``MultiVectorEncoder`` and its losses).

    from maxsim.integrations import sentence_transformers as maxsim_st
    maxsim_st.patch()      # util.maxsim, model.similarity, the multi-vector losses now run maxsim
    maxsim_st.unpatch()

The functions below have Sentence Transformers' signatures and semantics:

- masked document tokens never win the max (maxsim's default ``mask_mode="exclude"``); the query
  mask multiplies each query token's max (0/1 values);
- with no mask, a padded 3-D tensor's all-zero rows are padding, on both sides; a list of
  ``[L_i, d]`` tensors is padded with its lengths as the mask; a bare 2-D input is a batch of one;
- a document with no real token scores ``-1e9`` (divided by the query length under
  ``length_normalize``), like Sentence Transformers' sentinel;
- output fp32, on the documents' device (``device=`` only chooses where the scoring runs);
- ``chunk_elements`` is accepted and has no effect: maxsim never materialises the similarity tensor.

``colbert_scores`` here is Sentence Transformers' (stacked ``[Q_doc, N, Ld, d]`` documents ->
``[Nq, Q_doc * N]``), not PyLate's function of the same name.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

import maxsim
from maxsim.integrations._common import PatchSet, as_compute, compute_dtype, rebind_everywhere, require_library

__all__ = [
    "maxsim",
    "maxsim_pairwise",
    "colbert_scores",
    "colbert_kd_scores",
    "colbert_scores_pairwise",
    "patch",
    "unpatch",
]

# Sentence Transformers' score for a document without any real token (before normalisation).
EMPTY_DOCUMENT_SCORE = -1e9

_maxsim = maxsim.maxsim  # the name `maxsim` below is this module's drop-in
_maxsim_varlen, _pack = maxsim.maxsim_varlen, maxsim.pack
_PATCHES = PatchSet()
# The sentence-transformers releases this drop-in was tested with: (lowest, below); patch() warns outside them.
TESTED_VERSIONS = ("6.0", "7.0")


def _to_tensor(x, name: str) -> torch.Tensor:
    """One item or a whole side as a tensor (numpy viewed, lists stacked); integer embeddings
    (quantized) are upcast to fp32, as Sentence Transformers does."""
    if isinstance(x, torch.Tensor):
        tensor = x
    elif isinstance(x, np.ndarray):
        tensor = torch.from_numpy(x)
    elif isinstance(x, (list, tuple)):
        if x and all(isinstance(item, torch.Tensor) for item in x):
            tensor = torch.stack(list(x))
        elif x and all(isinstance(item, np.ndarray) for item in x):
            tensor = torch.from_numpy(np.stack(x))
        else:
            tensor = torch.tensor(x)
    else:
        raise TypeError(f"{name} must be a tensor, a numpy array or a list; got {type(x).__name__}")
    return tensor if tensor.is_floating_point() else tensor.float()


def _canonical_mask(mask, name: str) -> torch.Tensor | None:
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    if isinstance(mask, np.ndarray):
        return torch.from_numpy(mask)
    if isinstance(mask, (list, tuple)):  # per-item masks, padded to the batch
        return torch.nn.utils.rnn.pad_sequence([_to_tensor(m, name) for m in mask], batch_first=True)
    raise TypeError(f"{name} must be a tensor, an ndarray, or a list of per-item masks; got {type(mask).__name__}")


class _Side:
    """One side of a scoring call, padded: ``embeddings [N, L, d]`` (or ``[N, K, L, d]``),
    ``mask`` bool of ``embeddings.shape[:-1]`` (True = real token), ``lengths`` for the
    MeanMaxSim divisor, and ``device`` (the inputs' own, None for numpy)."""

    def __init__(self, embeddings, mask, name: str, mask_name: str, item_ndim: int = 2) -> None:
        mask = _canonical_mask(mask, mask_name)
        self.device = _input_device(embeddings)
        self.user_mask = mask is not None
        if isinstance(embeddings, (list, tuple)):
            items = [_to_tensor(item, f"{name}[i]") for item in embeddings]
            self.count = len(items)
            if not items:
                self.embeddings, self.mask = None, None
                return
            for i, item in enumerate(items):
                if item.dim() != item_ndim:
                    raise ValueError(f"{name}[{i}] must have {item_ndim} dimensions; got shape {tuple(item.shape)}")
            lengths = torch.tensor([item.shape[0] for item in items])
            self.embeddings = torch.nn.utils.rnn.pad_sequence(items, batch_first=True)  # [N, L, d]
            positions = torch.arange(self.embeddings.shape[1])
            length_mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).to(self.embeddings.device)  # [N, L]
        else:
            tensor = _to_tensor(embeddings, name)
            if tensor.dim() == item_ndim:  # a bare single item: a batch of one
                tensor = tensor.unsqueeze(0)
                if mask is not None and mask.dim() == item_ndim - 1:
                    mask = mask.unsqueeze(0)
            if tensor.dim() != item_ndim + 1:
                raise ValueError(f"{name} must have {item_ndim + 1} dimensions; got shape {tuple(tensor.shape)}")
            self.count = tensor.shape[0]
            self.embeddings = tensor
            length_mask = None
            if self.count == 0:
                self.mask = None
                return
        if mask is not None:
            width = self.embeddings.shape[-2]
            if mask.shape[-1] != width:
                raise ValueError(f"{mask_name} covers {mask.shape[-1]} tokens, but the padded embeddings have {width}.")
            self.mask = mask.to(self.embeddings.device).expand(self.embeddings.shape[:-1])
        elif length_mask is not None:
            self.mask = length_mask
        else:  # a padded tensor without a mask: all-zero rows are padding
            self.mask = self.embeddings.any(dim=-1)

    def token_counts(self) -> torch.Tensor:
        """Real tokens per item, at least 1 (the MeanMaxSim divisor)."""
        return self.mask.bool().sum(dim=-1).clamp(min=1)


def _input_device(embeddings) -> torch.device | None:
    if isinstance(embeddings, torch.Tensor):
        return embeddings.device
    if isinstance(embeddings, (list, tuple)) and embeddings and isinstance(embeddings[0], torch.Tensor):
        return embeddings[0].device
    return None


def _score_sides(a: _Side, b: _Side, length_normalize: bool, device, pairwise: bool) -> torch.Tensor:
    """Score the padded sides: ``[Na, Nb]`` (or ``[B]`` when ``pairwise``, or ``[B, K]`` for 4-D
    documents), fp32 on the documents' device."""
    result_device = b.device or a.device or torch.device("cpu")
    scoring_device = torch.device(device) if device is not None else result_device
    q = a.embeddings.to(scoring_device)
    d = b.embeddings.to(scoring_device)
    q_mask = a.mask.to(scoring_device)
    d_mask = b.mask.to(scoring_device).bool()
    if not a.user_mask:
        q_mask = q_mask.bool()
    if pairwise:  # query i against its one document i: candidate lists of one
        d = d.unsqueeze(1)  # [B, 1, Ld, d]
        d_mask = d_mask.unsqueeze(1)  # [B, 1, Ld]
    dtype = compute_dtype(q, d)
    scores = _maxsim(as_compute(q, dtype), as_compute(d, dtype), q_mask, d_mask)  # exclude rule
    empty = ~d_mask.any(dim=-1)  # [Nb] or [B, K]
    if d.dim() == 3:
        empty = empty.unsqueeze(0)  # broadcast over the queries
    scores = scores.masked_fill(empty, EMPTY_DOCUMENT_SCORE)
    if pairwise:
        scores = scores[:, 0]
    if length_normalize:
        counts = a.token_counts().to(device=scores.device, dtype=scores.dtype)  # [Na]
        scores = scores / (counts if pairwise else counts.unsqueeze(1))
    return scores.to(result_device)


def _ragged_tensors(x) -> bool:
    """A non-empty list of ``[L_i, d]`` tensors on one device: what ``encode`` returns."""
    return (isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in x)
            and len({t.device for t in x}) == 1)


def _score_lists(a: list, b: list, length_normalize: bool, device) -> torch.Tensor:
    """``maxsim`` of two lists of tensors, packed (each side one copy, no padding, no mask):
    ``[Na, Nb]`` fp32 on the documents' device, with the padded path's rules."""
    result_device = b[0].device
    scoring_device = torch.device(device) if device is not None else result_device
    if a[0].shape[-1] != b[0].shape[-1]:
        raise ValueError(f"a and b must have the same embedding dimension; got {a[0].shape[-1]} and {b[0].shape[-1]}")
    dtype = compute_dtype(a[0], b[0])
    packed_q, cu_q, max_q = _pack([as_compute(t, dtype) for t in a])  # [Tq, d], [Na + 1]
    packed_d, cu_d, max_d = _pack([as_compute(t, dtype) for t in b])  # [Td, d], [Nb + 1]
    scores = _maxsim_varlen(packed_q.to(scoring_device), packed_d.to(scoring_device), cu_q.to(scoring_device),
                                  cu_d.to(scoring_device), max_q, max_d)  # [Na, Nb]
    doc_lengths = torch.tensor([t.shape[0] for t in b], device=scores.device)  # [Nb]
    scores = scores.masked_fill((doc_lengths == 0).unsqueeze(0), EMPTY_DOCUMENT_SCORE)
    if length_normalize:
        counts = torch.tensor([max(t.shape[0], 1) for t in a], dtype=scores.dtype, device=scores.device)  # [Na]
        scores = scores / counts.unsqueeze(1)
    return scores.to(result_device)


def maxsim(
    a: list | np.ndarray | torch.Tensor,
    b: list | np.ndarray | torch.Tensor,
    a_mask: torch.Tensor | None = None,
    b_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """``sentence_transformers.util.maxsim``: queries ``a`` x documents ``b`` -> ``[Na, Nb]`` fp32.

    ``a`` / ``b``: padded ``[N, L, d]``, a list of ``[L_i, d]``, or one ``[L, d]`` (a batch of one).
    Masks ``[N, L]`` (or ``[L]`` with a bare item, or a list of per-item masks).
    """
    if a_mask is None and b_mask is None and _ragged_tensors(a) and _ragged_tensors(b):
        return _score_lists(list(a), list(b), length_normalize, device)
    a_side = _Side(a, a_mask, "a", "a_mask")
    b_side = _Side(b, b_mask, "b", "b_mask")
    if a_side.count == 0 or b_side.count == 0:
        result_device = b_side.device or a_side.device
        return torch.zeros(a_side.count, b_side.count, dtype=torch.float32, device=result_device)
    return _score_sides(a_side, b_side, length_normalize, device, pairwise=False)


def maxsim_pairwise(
    a: list | np.ndarray | torch.Tensor,
    b: list | np.ndarray | torch.Tensor,
    a_mask: torch.Tensor | None = None,
    b_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """``sentence_transformers.util.maxsim_pairwise``: ``a[i]`` against ``b[i]`` -> ``[B]`` fp32."""
    a_side = _Side(a, a_mask, "a", "a_mask")
    b_side = _Side(b, b_mask, "b", "b_mask")
    if a_side.count != b_side.count:
        raise ValueError(
            f"`a` and `b` must hold the same number of items to score as pairs, got {a_side.count} and {b_side.count}."
        )
    if a_side.count == 0:
        return torch.zeros(0, dtype=torch.float32, device=b_side.device or a_side.device)
    return _score_sides(a_side, b_side, length_normalize, device, pairwise=True)


def colbert_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
) -> torch.Tensor:
    """``sentence_transformers.multi_vector_encoder.scoring.colbert_scores``: queries
    ``[Nq, Lq, d]`` x stacked groups ``[Q_doc, N, Ld, d]`` -> ``[Nq, Q_doc * N]`` fp32,
    query-major (column ``j * N + n`` is document ``D[j, n]``): one maxsim call over the
    flattened ``[Q_doc * N, Ld, d]`` documents."""
    documents = _to_tensor(documents_embeddings, "documents_embeddings")
    if documents.dim() != 4:
        raise ValueError(f"documents_embeddings must be [Q_doc, N, Ld, d]; got shape {tuple(documents.shape)}")
    groups, per_group, doc_len, dim = documents.shape
    flat_mask = None
    if documents_mask is not None:
        flat_mask = _canonical_mask(documents_mask, "documents_mask").reshape(groups * per_group, -1)
    return maxsim(
        _to_tensor(queries_embeddings, "queries_embeddings"),
        documents.reshape(groups * per_group, doc_len, dim),
        a_mask=queries_mask,
        b_mask=flat_mask,
        length_normalize=length_normalize,
    )


def colbert_kd_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
) -> torch.Tensor:
    """``...scoring.colbert_kd_scores``: queries ``[B, Lq, d]`` x each query's candidates
    ``[B, N, Ld, d]`` -> ``[B, N]`` fp32, in one maxsim call on the candidate layout."""
    queries = _to_tensor(queries_embeddings, "queries_embeddings")
    a_side = _Side(queries, queries_mask, "queries_embeddings", "queries_mask")
    documents = _to_tensor(documents_embeddings, "documents_embeddings")
    if documents.dim() != 4:
        raise ValueError(f"documents_embeddings must be [B, N, Ld, d]; got shape {tuple(documents.shape)}")
    b_side = _Side(documents, _canonical_mask(documents_mask, "documents_mask"), "documents_embeddings",
                   "documents_mask", item_ndim=3)
    if a_side.count != b_side.count:
        raise ValueError(f"queries_embeddings and documents_embeddings must hold as many items; got "
                         f"{a_side.count} and {b_side.count}")
    if a_side.count == 0 or documents.shape[1] == 0:
        return torch.zeros(a_side.count, documents.shape[1], dtype=torch.float32, device=documents.device)
    return _score_sides(a_side, b_side, length_normalize, None, pairwise=False)


def colbert_scores_pairwise(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
) -> torch.Tensor:
    """``...scoring.colbert_scores_pairwise``: ``maxsim_pairwise`` with the scoring keywords -> ``[B]``."""
    return maxsim_pairwise(
        queries_embeddings, documents_embeddings, a_mask=queries_mask, b_mask=documents_mask,
        length_normalize=length_normalize,
    )


# ---------------------------------------------------------------------------------------------
# patch / unpatch


def _model_method(name: str, attribute: str, replacements: dict):
    """``MultiVectorEncoder.similarity`` (or ``similarity_pairwise``) that maps the function a
    model resolved when it was loaded (``model._similarity``) to its maxsim counterpart, so models
    loaded before ``patch()`` score with maxsim too."""

    def method(self, embeddings1, embeddings2, **kwargs):
        self.similarity_fn_name  # noqa: B018 (the model resolves its function lazily)
        function = getattr(self, attribute)
        return replacements.get(function, function)(embeddings1, embeddings2, **kwargs)

    method.__name__ = name
    return method


def patch() -> None:
    """Make Sentence Transformers' multi-vector scoring run maxsim. Reaches
    ``util.similarity.maxsim`` / ``maxsim_pairwise`` and every module that re-exported them
    (``sentence_transformers.util``, ``multi_vector_encoder``), hence
    ``SimilarityFunction.to_similarity_fn`` and ``mean_maxsim``; the ColBERT scoring functions in
    ``multi_vector_encoder.scoring`` and the losses that bound them at import;
    ``MultiVectorEncoder.similarity`` / ``similarity_pairwise`` of models loaded before or after.
    Calling it again does nothing; ``unpatch()`` restores every original object."""
    if _PATCHES.active:
        return
    require_library("sentence-transformers", "sentence-transformers", TESTED_VERSIONS)
    import importlib

    from sentence_transformers.multi_vector_encoder import scoring
    from sentence_transformers.util import similarity as st_similarity

    for name in ("sentence_transformers.util", "sentence_transformers.multi_vector_encoder",
                 "sentence_transformers.multi_vector_encoder.losses",
                 "sentence_transformers.multi_vector_encoder.evaluation"):
        try:  # load the modules that bind the functions at import, so the scan below finds them
            importlib.import_module(name)
        except ImportError:
            pass
    replacements = {
        st_similarity.maxsim: maxsim,
        st_similarity.maxsim_pairwise: maxsim_pairwise,
        scoring.colbert_scores: colbert_scores,
        scoring.colbert_kd_scores: colbert_kd_scores,
        scoring.colbert_scores_pairwise: colbert_scores_pairwise,
    }
    try:
        rebind_everywhere(_PATCHES, "sentence_transformers", replacements)
        from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

        for name, attribute in (("similarity", "_similarity"), ("similarity_pairwise", "_similarity_pairwise")):
            if inspect.isfunction(inspect.getattr_static(MultiVectorEncoder, name, None)):
                _PATCHES.replace(MultiVectorEncoder, name, _model_method(name, attribute, replacements))
    except BaseException:
        _PATCHES.restore()
        raise


def unpatch() -> None:
    """Undo ``patch()``; safe to call when not patched."""
    _PATCHES.restore()


def is_patched() -> bool:
    return _PATCHES.active
