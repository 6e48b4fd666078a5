"""The CPU backend's per-document path: one GEMM a document, read from where it lies (a list's
items, packed rows, or a padded tensor's rows), no gather and no padding (docs/cpu.md)."""

from __future__ import annotations

import functools
import warnings
from typing import List

import torch

from maxsim.cpu.engine import STOP, _query_sums, _run_chunks

# Documents at least this long on average are scored one GEMM each, straight from where they lie
# (a packed tensor's rows, a list's items, a padded tensor's rows under prefix masks): no gather,
# no padding. Shorter packed or padded ones go to the blocked engine, where a GEMM's fixed cost is
# shared by many documents; a task of shorter list items is copied together for one GEMM
# (docs/cpu.md has the measurements).
PER_DOCUMENT_MIN_MEAN = 32
# Documents per task of the per-document path: about four tasks a CPU worker so that they balance,
# within these bounds (a task's fixed cost, a list handed to TorchScript and one copy of short items,
# is shared by more documents in bigger tasks).
_TASK_DOCUMENTS = (64, 1024)
# A document longer than this many times the query rows is multiplied as Q D^T rather than D Q^T.
_WIDE_PRODUCT = 8


def long_documents(total_tokens: int, n_documents: int) -> bool:
    """Whether packed or padded documents take the per-document path (PER_DOCUMENT_MIN_MEAN real
    tokens a document or more on average; list items always do)."""
    return n_documents > 0 and total_tokens >= PER_DOCUMENT_MIN_MEAN * n_documents


def _rowmax_into(best: torch.Tensor, j: int, tokens: torch.Tensor, q_rows: torch.Tensor, q_t: torch.Tensor,
                 wide: int) -> None:
    """best[j] = the max over document ``tokens [L, dim]`` of each query row's products."""
    if tokens.shape[0] > 0:
        if tokens.dtype != torch.float32:
            tokens = tokens.float()
        if tokens.shape[0] > wide:  # a long document (a page): [R, L], BLAS's better orientation there
            torch.amax(torch.mm(q_rows, tokens.t()), 1, out=best[j])
        else:
            torch.amax(torch.mm(tokens, q_t), 0, out=best[j])  # [L, R]


def _rowmax_listed(docs: List[torch.Tensor], q_rows: torch.Tensor, q_t: torch.Tensor, best: torch.Tensor,
                   wide: int) -> None:
    """:func:`_rowmax_into` for every item of ``docs`` into the rows of ``best``."""
    for j in range(len(docs)):
        _rowmax_into(best, j, docs[j], q_rows, q_t, wide)


def _rowmax_short(docs: List[torch.Tensor], lengths: List[int], q_t: torch.Tensor, best: torch.Tensor) -> None:
    """best[j] = each query row's max over item j's tokens, for items too short to pay a GEMM
    each: copied together (a small, cache-resident copy) for one GEMM and a max per item. A few
    ops a task, each releasing the GIL. NaN propagates; an empty item keeps 0."""
    x = torch.cat(docs)  # [T, dim]
    x = x if x.dtype == torch.float32 else x.float()
    owner = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(lengths, dtype=torch.long))  # [T]
    products = torch.mm(x, q_t)  # [T, R]
    best.zero_().scatter_reduce_(0, owner[:, None].expand(-1, products.shape[1]), products, "amax",
                                 include_self=False)


def _rowmax_packed(d: torch.Tensor, starts: List[int], lengths: List[int], q_rows: torch.Tensor,
                   q_t: torch.Tensor, best: torch.Tensor, wide: int) -> None:
    """:func:`_rowmax_into` for the packed documents at rows ``starts[j]``, ``lengths[j]`` of d."""
    for j in range(len(starts)):
        _rowmax_into(best, j, d.narrow(0, starts[j], lengths[j]), q_rows, q_t, wide)


@functools.cache
def _document_loops():
    """The two loops compiled by TorchScript where it is available: the per-document loop then runs
    without the Python interpreter (a few microseconds an op less, which is most of a short
    document's time) and with the GIL released, so the CPU workers run side by side. Where
    TorchScript is gone (it is deprecated), the same functions run as Python."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(_rowmax_listed), torch.jit.script(_rowmax_packed)
    except Exception:  # noqa: BLE001 (any failure to compile leaves the Python loops, same results)
        return _rowmax_listed, _rowmax_packed


def _task_size(n_documents: int, workers: int) -> int:
    """Documents a task: about four tasks a worker, within ``_TASK_DOCUMENTS``."""
    low, high = _TASK_DOCUMENTS
    return min(high, max(low, n_documents // (4 * max(1, workers))))


def _shape_lengths(items) -> list[int]:
    """Each ``[L_j, dim]`` item's ``L_j``, for lists checked before the call."""
    return [item.shape[0] for item in items]


def per_document_scores(q_rows: torch.Tensor, row_query: torch.Tensor, n_queries: int, documents,
                        n_documents: int, item_lengths=None) -> torch.Tensor | None:
    """Scores ``[n_queries, n_documents]`` fp32, one GEMM a document, from where the documents lie:
    ``documents`` is a list of ``[L_j, dim]`` tensors, or ``(d [T, dim], starts, lengths)`` packed
    rows (two lists of ints). ``q_rows [R, dim]`` fp32 every query token, ``row_query [R]`` its
    query. Max over the document's tokens (NaN propagates), sum over each query's rows; an empty
    document scores 0. Tasks of documents (:func:`_task_size`) run on the CPU workers (one thread
    an op: these GEMMs are too small to share); a task of list items shorter than
    ``PER_DOCUMENT_MIN_MEAN`` tokens on average is one GEMM over their copy (:func:`_rowmax_short`).

    ``item_lengths(items) -> list[int]`` (for a list) is called on each task's items by the thread
    that then scores them (the caller checks the items there). Where it returns
    :data:`maxsim.cpu.engine.STOP` the call returns None. Left None, each item's token count is read
    unchecked from its shape (for lists checked beforehand)."""
    if item_lengths is None:
        item_lengths = _shape_lengths
    q_t = q_rows.t().contiguous()  # [dim, R]
    R = q_rows.shape[0]
    best = torch.zeros(n_documents, R, dtype=torch.float32)  # [Nd, R]
    listed, packed = _document_loops()
    # Each task hands over only its own documents (TorchScript converts a list argument whole).
    if isinstance(documents, list):
        # no_grad on the worker itself: the caller's no_grad does not reach the pool's threads, and
        # a list scored under it may hold items that require grad
        @torch.no_grad()
        def work(task: range):
            items, rows = documents[task.start:task.stop], best[task.start:task.stop]
            # Checked by the thread that scores them: a few hundred microseconds of Python a task
            # between ops that release the GIL, so neither thread waits long for it.
            lengths = item_lengths(items)
            if lengths is STOP:
                return STOP
            if sum(lengths) < PER_DOCUMENT_MIN_MEAN * len(lengths):
                _rowmax_short(items, lengths, q_t, rows)
            else:
                listed(items, q_rows, q_t, rows, _WIDE_PRODUCT * R)
    else:
        d, starts, lengths = documents

        def work(task: range) -> None:
            packed(d, starts[task.start:task.stop], lengths[task.start:task.stop], q_rows, q_t,
                   best[task.start:task.stop], _WIDE_PRODUCT * R)

    workers = torch.get_num_threads()
    size = _task_size(n_documents, workers)
    tasks = [range(a, min(n_documents, a + size)) for a in range(0, n_documents, size)]
    if _run_chunks(work, tasks, workers, True, mode="workers") is None:
        return None
    return _query_sums(best, row_query, n_queries).t()
