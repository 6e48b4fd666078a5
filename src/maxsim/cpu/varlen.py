"""Packed (varlen) MaxSim on the blocked CPU engine: only real tokens are multiplied.

Sequences come as (start, length) pairs whose invalid entries the caller has already emptied
(length 0); the caller also turns the invalid outputs into NaN (:mod:`maxsim.varlen.ops`).
"""

from __future__ import annotations

import torch

from maxsim.cpu.dense import chunk_bytes, maxsim_cpu
from maxsim.cpu.engine import GatheredPlan, rowmax_scores
from maxsim.cpu.per_document import long_documents, per_document_scores


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


def cross_per_document(q, q_start, q_len, documents, n_documents: int, item_lengths=None) -> torch.Tensor | None:
    """Scores ``[Nq, n_documents]`` fp32 of packed queries ``q [Tq, dim]`` (sequences ``q_start``,
    ``q_len`` int64 ``[Nq]``) against ``documents`` (see :func:`per_document_scores`, and for
    ``item_lengths``)."""
    rows, owner = _query_rows(q_start, q_len)
    return per_document_scores(q.index_select(0, rows).float(), owner, q_start.numel(), documents, n_documents,
                               item_lengths)
