"""Packed (varlen) MaxSim on the blocked CPU engine: only real tokens are multiplied.

Sequences come as (start, length) pairs whose invalid entries the caller has already emptied
(length 0); the caller also turns the invalid outputs into NaN (:mod:`maxsim.varlen.ops`).
"""

from __future__ import annotations

import functools
import warnings
from typing import List

import torch

from maxsim.cpu.dense import chunk_bytes, maxsim_cpu
from maxsim.cpu.engine import GatheredPlan, _query_sums, _run_chunks, rowmax_scores

# Documents at least this long on average are scored one GEMM each, straight from where they lie
# (a packed tensor's rows, a list's items): no gather, no padding. Shorter packed ones go to the
# blocked engine, where a GEMM's fixed cost is shared by many documents; shorter list items are
# copied together a task at a time for one GEMM (docs/cpu.md has the measurements).
PER_DOCUMENT_MIN_MEAN = 32
# Documents per task of the per-document path: enough tasks that two cores balance.
_DOCUMENTS_PER_TASK = 256
# A document longer than this many times the query rows is multiplied as Q D^T rather than D Q^T.
_WIDE_PRODUCT = 8


def padded(x: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start[i] : start[i] + length[i]`` of ``x [T, dim]`` -> (``[N, L, dim]`` zero-padded, mask
    ``[N, L]``), L the longest length (a host read). Differentiable in x."""
    n = start.numel()
    L = int(length.max()) if n else 0
    pos = torch.arange(L, device=x.device)
    mask = pos[None, :] < length[:, None]  # [N, L]
    rows = torch.where(mask, start[:, None] + pos[None, :], 0)  # [N, L]
    if x.shape[0] == 0:
        return x.new_zeros((n, L, x.shape[1])), mask
    out = x.index_select(0, rows.reshape(-1)).view(n, L, x.shape[1])
    return torch.where(mask[..., None], out, torch.zeros((), dtype=x.dtype, device=x.device)), mask


def _query_rows(q_start: torch.Tensor, q_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed row of every real query token [R], its query [R]) for sequences (start, length)."""
    Nq = q_start.numel()
    owner = torch.repeat_interleave(torch.arange(Nq, device=q_start.device), q_len)  # [R]
    first = torch.cumsum(q_len, 0) - q_len  # [Nq] rank of each query's first row
    offset = torch.arange(owner.numel(), device=q_start.device) - first[owner]
    return q_start[owner] + offset, owner


def varlen_cpu(q, d, q_start, q_len, d_start, d_len, pair_q=None, pair_d=None, *, max_chunk_bytes=None):
    """Scores of packed ``q [Tq, dim]`` against packed ``d [Td, dim]``: ``[Nq, Nd]`` fp32 for the cross
    product, ``[P]`` for pairs (``pair_q``, ``pair_d`` int64 ``[P]``, in range). Sequences:
    int64 ``start``, ``length`` ``[N]``. Differentiable in q and d (through padding then
    :func:`maxsim.cpu.maxsim_cpu`)."""
    budget = chunk_bytes(max_chunk_bytes)
    Nq = q_start.numel()
    if torch.is_grad_enabled() and (q.requires_grad or d.requires_grad):
        Qp, qm = padded(q, q_start, q_len)
        Dp, dm = padded(d, d_start, d_len)
        if pair_q is None:
            return maxsim_cpu(Qp, Dp, qm, dm, max_chunk_bytes=budget)
        return maxsim_cpu(Qp[pair_q], Dp[pair_d][:, None], qm[pair_q], dm[pair_d][:, None],
                          max_chunk_bytes=budget)[:, 0]
    with torch.no_grad():
        if pair_q is None:
            Nd = d_start.numel()
            if long_documents(int(d_len.sum()), Nd):
                starts, lengths = d_start.tolist(), d_len.tolist()
                return cross_per_document(q, q_start, q_len, (d, starts, lengths), Nd)
            rows, owner = _query_rows(q_start, q_len)
            q_rows = q.index_select(0, rows).float()
            scores_t, _ = rowmax_scores(q_rows, owner, Nq, d, GatheredPlan(d_start, d_len), chunk_bytes=budget)
            return scores_t.t()
        out = torch.zeros(pair_q.numel(), dtype=torch.float32, device=q.device)
        order = torch.argsort(pair_q, stable=True)
        queries, counts = torch.unique_consecutive(pair_q[order], return_counts=True)
        first = 0
        for i, n in zip(queries.tolist(), counts.tolist()):  # one engine call per query: its pairs' documents
            ps = order[first:first + n]
            first += n
            s, L = int(q_start[i]), int(q_len[i])
            if L == 0:
                continue
            docs = pair_d[ps]
            scores_t, _ = rowmax_scores(q[s:s + L].float(), None, 1, d, GatheredPlan(d_start[docs], d_len[docs]),
                                        chunk_bytes=budget)
            out[ps] = scores_t[:, 0]
        return out


def long_documents(total_tokens: int, n_documents: int) -> bool:
    """Whether packed documents take the per-document path (PER_DOCUMENT_MIN_MEAN tokens a document
    or more)."""
    return n_documents > 0 and total_tokens >= PER_DOCUMENT_MIN_MEAN * n_documents


def cross_per_document(q, q_start, q_len, documents, n_documents: int) -> torch.Tensor:
    """Scores ``[Nq, n_documents]`` fp32 of packed queries ``q [Tq, dim]`` (sequences ``q_start``,
    ``q_len`` int64 ``[Nq]``) against ``documents`` (see :func:`per_document_scores`)."""
    rows, owner = _query_rows(q_start, q_len)
    return per_document_scores(q.index_select(0, rows).float(), owner, q_start.numel(), documents, n_documents)


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
                   wide: int, short: int) -> None:
    """:func:`_rowmax_into` for every item of ``docs`` into the rows of ``best``. Items shorter than
    ``short`` tokens on average are copied together (a small, cache-resident copy) for one GEMM and
    a max per item: a call an item would cost more than its products."""
    lengths = [t.shape[0] for t in docs]
    if sum(lengths) < short * len(docs):
        x = torch.cat(docs)  # [T, dim]
        x = x if x.dtype == torch.float32 else x.float()
        n = torch.tensor(lengths, dtype=torch.long)  # [B]
        m = torch.segment_reduce(torch.mm(x, q_t), "max", lengths=n, axis=0)  # [B, R]; NaN propagates
        best.copy_(torch.where((n > 0)[:, None], m, torch.zeros((), dtype=m.dtype)))  # an empty item: 0
    else:
        for j in range(len(docs)):
            _rowmax_into(best, j, docs[j], q_rows, q_t, wide)


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


def per_document_scores(q_rows: torch.Tensor, row_query: torch.Tensor, n_queries: int, documents,
                        n_documents: int) -> torch.Tensor:
    """Scores ``[n_queries, n_documents]`` fp32, one GEMM a document, from where the documents lie:
    ``documents`` is a list of ``[L_j, dim]`` tensors, or ``(d [T, dim], starts, lengths)`` packed
    rows (two lists of ints). ``q_rows [R, dim]`` fp32 every query token, ``row_query [R]`` its
    query. Max over the document's tokens (NaN propagates), sum over each query's rows; an empty
    document scores 0. Tasks of ``_DOCUMENTS_PER_TASK`` documents run on the CPU workers (one
    thread an op: these GEMMs are too small to share)."""
    q_t = q_rows.t().contiguous()  # [dim, R]
    R = q_rows.shape[0]
    best = torch.zeros(n_documents, R, dtype=torch.float32)  # [Nd, R]
    listed, packed = _document_loops()
    # Each task hands over only its own documents (TorchScript converts a list argument whole).
    if isinstance(documents, list):
        def work(task: range) -> None:
            listed(documents[task.start:task.stop], q_rows, q_t, best[task.start:task.stop], _WIDE_PRODUCT * R,
                   PER_DOCUMENT_MIN_MEAN)
    else:
        d, starts, lengths = documents

        def work(task: range) -> None:
            packed(d, starts[task.start:task.stop], lengths[task.start:task.stop], q_rows, q_t,
                   best[task.start:task.stop], _WIDE_PRODUCT * R)

    tasks = [range(a, min(n_documents, a + _DOCUMENTS_PER_TASK)) for a in range(0, n_documents, _DOCUMENTS_PER_TASK)]
    _run_chunks(work, tasks, torch.get_num_threads(), True, mode="workers")
    return _query_sums(best, row_query, n_queries).t()
