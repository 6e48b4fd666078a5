"""Drop-in maxsim for colpali-engine 0.3.18 (``colpali_engine.utils.maxsim`` and
``BaseVisualRetrieverProcessor.score_multi_vector``).

    from maxsim.integrations import colpali as maxsim_colpali
    maxsim_colpali.patch()      # processor.score, score_multi_vector, the Colbert* losses run maxsim
    maxsim_colpali.unpatch()

``COLPALI_SCORES_BACKEND`` keeps its meaning: ``auto`` (the default) runs maxsim, ``torch`` and
``lik`` run colpali's own path of that name (read at each call, as colpali reads it).

colpali has no masks: padding is zero rows, and a zero row takes part in the max like any other
token (its similarity is 0). The functions below keep exactly that:

- ``maxsim_inbatch`` / ``maxsim_kd``: every row of the padded tensors is a token; accumulated in
  fp32, returned in the dtype colpali's own path gives where it runs: fp32 on CUDA (its
  late-interaction-kernels backend's, for 16-bit inputs too), the einsum's (the inputs') elsewhere;
- ``score_multi_vector``: colpali pads each chunk of ``batch_size`` passages to that chunk's
  longest, so a passage shorter than its chunk's longest also "contains" zero tokens, and its
  score depends on the chunking. This is reproduced exactly, without padding: the passages are
  packed, each one shorter than its chunk's longest followed by one zero row (the same maxes),
  and scored by ``maxsim_varlen`` a group of about 64 MiB at a time. Output fp32 on the CPU, as
  colpali's.
"""

from __future__ import annotations

import os

import torch

import maxsim
from maxsim.integrations._common import (PatchSet, as_compute, compute_dtype, pack_with_zero_rows, rebind_everywhere,
                                         require_library, scores_dtype)

__all__ = ["score_multi_vector", "maxsim_inbatch", "maxsim_kd", "patch", "unpatch"]

_PATCHES = PatchSet()
# The colpali-engine releases this drop-in was tested with: (lowest, below); patch() warns outside them.
TESTED_VERSIONS = ("0.3.18", "0.4")
# Passage token elements packed for one maxsim call (64 MiB of bf16), to bound memory.
_GROUP_ELEMENTS = 1 << 25
_BACKENDS = ("auto", "torch", "lik")
# colpali's own functions, saved by patch(): COLPALI_SCORES_BACKEND=torch / lik delegates to them.
_ORIGINALS: dict[str, object] = {}


def _library_backend() -> str:
    """``COLPALI_SCORES_BACKEND``, read at each call as colpali reads it: ``auto`` (or unset) runs
    maxsim; ``torch`` and ``lik`` run colpali's own path of that name, unpatched."""
    backend = os.environ.get("COLPALI_SCORES_BACKEND", "auto").lower()
    if backend not in _BACKENDS:
        raise ValueError(f"COLPALI_SCORES_BACKEND must be one of {_BACKENDS}, got {backend!r}.")
    return backend


def _colpali_function(name: str):
    """colpali's own (unpatched) ``name``: a function of ``colpali_engine.utils.maxsim``, or
    ``score_multi_vector``."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    if name == "score_multi_vector":
        from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

        return BaseVisualRetrieverProcessor.score_multi_vector
    from colpali_engine.utils import maxsim as colpali_maxsim

    return getattr(colpali_maxsim, name)


def _check(tensor, ndim: int, name: str, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}; got shape {tuple(tensor.shape)}")


def maxsim_inbatch(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``colpali_engine.utils.maxsim.maxsim_inbatch``: zero-padded ``query [B_q, L_q, d]`` x
    ``doc [B_d, L_d, d]`` -> ``[B_q, B_d]`` (every row a token: padding scores 0 in the max)."""
    if _library_backend() != "auto":
        return _colpali_function("maxsim_inbatch")(query, doc)
    _check(query, 3, "query", "[B_q, L_q, d]")
    _check(doc, 3, "doc", "[B_d, L_d, d]")
    dtype = compute_dtype(query, doc)
    scores = maxsim.maxsim(as_compute(query, dtype), as_compute(doc, dtype))  # [B_q, B_d] fp32
    return scores.to(scores_dtype(torch.promote_types(query.dtype, doc.dtype), query.device))


def maxsim_kd(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``colpali_engine.utils.maxsim.maxsim_kd``: ``query [B, L_q, d]`` x each query's candidates
    ``doc [B, N, L_d, d]`` -> ``[B, N]``."""
    if _library_backend() != "auto":
        return _colpali_function("maxsim_kd")(query, doc)
    _check(query, 3, "query", "[B, L_q, d]")
    _check(doc, 4, "doc", "[B, N, L_d, d]")
    dtype = compute_dtype(query, doc)
    scores = maxsim.maxsim(as_compute(query, dtype), as_compute(doc, dtype))  # [B, N] fp32
    return scores.to(scores_dtype(torch.promote_types(query.dtype, doc.dtype), query.device))


def _default_device() -> str:
    # colpali's get_torch_device("auto"): cuda:0, else mps, else cpu.
    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _items(embeddings, name: str) -> list[torch.Tensor]:
    items = list(embeddings)  # a list, or the rows of a padded [N, L, d] tensor
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or item.dim() != 2:
            raise ValueError(f"{name}[{i}] must be a [L, d] tensor; got {type(item).__name__} "
                             f"{tuple(getattr(item, 'shape', ()))}")
    return items


def score_multi_vector(
    qs: torch.Tensor | list[torch.Tensor],
    ps: torch.Tensor | list[torch.Tensor],
    batch_size: int = 128,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """``BaseVisualRetrieverProcessor.score_multi_vector``: queries ``qs`` x passages ``ps`` (lists
    of ``[L_i, d]`` tensors, or padded ``[N, L, d]`` tensors) -> ``[len(qs), len(ps)]`` fp32 on the
    CPU, with colpali's per-chunk zero padding (see the module docstring). ``device`` None: cuda,
    else mps, else cpu."""
    if _library_backend() != "auto":
        return _colpali_function("score_multi_vector")(qs, ps, batch_size=batch_size, device=device)
    device = device or _default_device()
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if len(ps) == 0:
        raise ValueError("No passages provided")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    queries = _items(qs, "qs")
    passages = _items(ps, "ps")
    dtype = compute_dtype(*queries[:1], *passages[:1])
    # Zero query rows add max(0 . p) = 0 whatever the padding: the queries are packed unpadded.
    packed_q, cu_q, max_q = pack_with_zero_rows([as_compute(q, dtype) for q in queries], [False] * len(queries),
                                                device)  # [Tq, d], [Nq + 1]
    lengths = [p.shape[0] for p in passages]
    # colpali's chunks of batch_size passages, each padded to its longest: the shorter ones see a 0
    chunk_longest = [max(lengths[a : a + batch_size]) for a in range(0, len(lengths), batch_size)]
    zero_row = [n < chunk_longest[i // batch_size] for i, n in enumerate(lengths)]
    score_groups = []
    start = 0
    while start < len(passages):  # groups of about _GROUP_ELEMENTS token elements, one call each
        stop, elements = start, 0
        while stop < len(passages) and (stop == start or elements < _GROUP_ELEMENTS):
            elements += passages[stop].numel()
            stop += 1
        packed_p, cu_p, max_p = pack_with_zero_rows([as_compute(p, dtype) for p in passages[start:stop]],
                                                    zero_row[start:stop], device)  # [Tp, d], [G + 1]
        score_groups.append(maxsim.maxsim_varlen(packed_q, packed_p, cu_q, cu_p, max_q, max_p))  # [Nq, G] fp32
        start = stop
    return torch.cat(score_groups, dim=1).cpu().to(torch.float32)


# ---------------------------------------------------------------------------------------------
# patch / unpatch


def patch() -> None:
    """Make colpali's late-interaction scoring run maxsim. Reaches ``colpali_engine.utils.maxsim``
    and every module that imported its functions (``utils.processing_utils``,
    ``loss.late_interaction_losses``), and ``BaseVisualRetrieverProcessor.score_multi_vector``
    (hence every processor's ``score``). Calling it again does nothing; ``unpatch()`` restores
    every original object."""
    if _PATCHES.active:
        return
    require_library("colpali-engine", "colpali", TESTED_VERSIONS)
    from colpali_engine.loss import late_interaction_losses  # noqa: F401  (binds the functions at import)
    from colpali_engine.utils import maxsim as colpali_maxsim
    from colpali_engine.utils import processing_utils

    _ORIGINALS.update(maxsim_inbatch=colpali_maxsim.maxsim_inbatch, maxsim_kd=colpali_maxsim.maxsim_kd,
                      score_multi_vector=processing_utils.BaseVisualRetrieverProcessor.score_multi_vector)
    replacements = {
        colpali_maxsim.maxsim_inbatch: maxsim_inbatch,
        colpali_maxsim.maxsim_kd: maxsim_kd,
    }
    try:
        rebind_everywhere(_PATCHES, "colpali_engine", replacements)
        _PATCHES.replace(
            processing_utils.BaseVisualRetrieverProcessor, "score_multi_vector", staticmethod(score_multi_vector)
        )
    except BaseException:
        _PATCHES.restore()
        raise


def unpatch() -> None:
    """Undo ``patch()``; safe to call when not patched."""
    _PATCHES.restore()


def is_patched() -> bool:
    return _PATCHES.active
