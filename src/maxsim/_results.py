"""The answer of every search (``Corpus.search``, a loaded PLAID index's ``search``, the sharded
search and the server): one type, kept below both the corpus and the index layers."""

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
