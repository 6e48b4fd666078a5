"""What every search shares (``Corpus.search``, a loaded PLAID index's ``search``, the sharded
search and the server): the answer's type and the refine factor's check, kept below both the
corpus and the index layers."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SearchResult(NamedTuple):
    """``scores [Nq, k] fp32``, ``indices [Nq, k] int64`` (positions in the corpus or index; -1
    where a query has fewer than k answers), ``ids``: the documents' ids, an int64 tensor
    ``[Nq, k]`` for int ids (a PLAID index's ids are its passage ids, the positions) or a list of
    Nq lists of str. A 2-D query drops the query axis of all three."""

    scores: torch.Tensor
    indices: torch.Tensor
    ids: object


MAX_REFINE_FACTOR = 1 << 16


def check_refine_factor(refine_factor) -> int:
    """Candidates kept a result (``k * refine_factor``), checked."""
    if isinstance(refine_factor, bool) or not isinstance(refine_factor, int) or not 1 <= refine_factor <= MAX_REFINE_FACTOR:
        raise ValueError(f"maxsim: refine_factor must be an int in [1, {MAX_REFINE_FACTOR}] (candidates kept per "
                         f"result: k * refine_factor); got {refine_factor!r}")
    return refine_factor
