"""The MaxSim contract in plain PyTorch: the tests' oracle (with tests/oracle.py's float64 loop).

CPU tensors run :mod:`maxsim.cpu` instead, the same rules on blocked GEMMs (docs/cpu.md);
``MAXSIM_BACKEND=reference`` runs this through ``maxsim.maxsim`` and the packed functions.

    score[i, j] = sum_{s : q_mask[i, s]}  max_{t : d_mask[j, t]}  <Q[i, s], D[j, t]>

Every rule of DESIGN.md section 1 is implemented here, in the simplest form that still keeps
memory bounded: the similarity tensor ``S [nq, nd, lq, Ld]`` is built one chunk at a time so
that its scratch stays under ``max_chunk_bytes`` (256 MB by default, or ``MAXSIM_REFERENCE_CHUNK_MB``)
whatever the batch. Products are computed in fp32 from the (already rounded) inputs, so this is
an fp32-accurate reference for fp16/bf16/fp32 inputs; ``dtype=torch.float64`` computes them in
float64 (one chunk of the inputs converted at a time), the reference an fp32 result is measured
against (the benchmark's error column).

Equivalent one-liner (exclude mode, no chunking)::

    S = torch.einsum("asd,btd->abst", Q.float(), D.float())
    S = S.masked_fill(~d_mask[None, :, None, :], -inf)
    best = S.max(-1).values                                   # [Nq, Nd, Lq]
    best = best.where(d_mask.any(-1)[None, :, None], 0)       # empty document -> 0
    score = best.where(q_mask[:, None, :], 0).sum(-1)         # [Nq, Nd]
"""

from __future__ import annotations

import os

import torch

from maxsim import _checks

_DEFAULT_CHUNK_MB = 256
# How many copies of one S chunk are alive at once (S, its masked copy, the max).
_LIVE_COPIES = 3
COMPUTE_DTYPES = (torch.float32, torch.float64)


def _chunk_budget_bytes(max_chunk_bytes: int | None) -> int:
    if max_chunk_bytes is not None:
        return int(max_chunk_bytes)
    return int(os.environ.get("MAXSIM_REFERENCE_CHUNK_MB", _DEFAULT_CHUNK_MB)) * 2**20


def _normalized(x: torch.Tensor) -> torch.Tensor:
    """L2-normalise the last dimension (torch.nn.functional.normalize, eps=1e-12), in x's dtype."""
    return torch.nn.functional.normalize(x, dim=-1)


def _best_per_query_token(
    q: torch.Tensor,  # [a, s, d] fp32 or float64
    docs: torch.Tensor,  # [a or 1, b, Ld, d] as q  (leading 1 = shared documents)
    d_mask: torch.Tensor | None,  # [a or 1, b, Ld] bool
    multiply: bool,
    q_mask: torch.Tensor | None,  # [a, s] bool
    want_argmax: bool,
):
    """Max over document tokens for one chunk. Returns (best [a, b, s] in q's dtype, argmax [a, b, s] or None)."""
    S = torch.einsum("asd,abtd->abst", q, docs.expand(q.shape[0], -1, -1, -1))  # [a, b, s, Ld]
    if multiply:
        # PyLate's torch path: masked similarities become 0 and still take part in the max.
        if q_mask is not None:
            S = S * q_mask[:, None, :, None].to(S.dtype)
        if d_mask is not None:
            S = S * d_mask[:, :, None, :].to(S.dtype)
    elif d_mask is not None:
        S = S.masked_fill(~d_mask[:, :, None, :], float("-inf"))
    # torch.max: NaN propagates (and its index is returned); ties go to the lowest index.
    best, arg = S.max(dim=-1)  # [a, b, s]
    if not multiply and d_mask is not None:
        # A document with no real token contributes 0 (not -inf).
        nonempty = d_mask.any(-1)[:, :, None]  # [a or 1, b, 1]
        best = torch.where(nonempty, best, torch.zeros((), dtype=best.dtype, device=best.device))
        arg = torch.where(nonempty, arg, -1)
    if q_mask is not None:
        keep = q_mask[:, None, :]  # [a, 1, s]
        if not multiply:
            best = torch.where(keep, best, torch.zeros((), dtype=best.dtype, device=best.device))
        arg = torch.where(keep, arg, -1)
    return best, (arg.to(torch.int32) if want_argmax else None)


def maxsim_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    mask_mode: str = "exclude",
    return_argmax: bool = False,
    max_chunk_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
):
    """MaxSim scores in plain PyTorch, with bounded scratch memory.

    Args:
        Q: ``[Nq, Lq, d]`` queries, or ``[Lq, d]`` for one query.
        D: ``[Nd, Ld, d]`` documents shared by all queries (cross product), ``[Nq, K, Ld, d]``
            per-query candidate lists, or ``[Ld, d]`` for one document.
        q_mask: ``[Nq, Lq]`` (``[Lq]`` for 2-D Q), True = real token. Bool or 0/1 float.
        d_mask: ``[Nd, Ld]`` / ``[Nq, K, Ld]`` / ``[Ld]``, True = real token.
        normalize: L2-normalise every token of Q and D first.
        mask_mode: ``"exclude"`` (masked doc tokens never win; masked query tokens add nothing)
            or ``"multiply"`` (PyLate: masked similarities become 0 and still take part).
        return_argmax: also return the winning document-token index per query token, int32,
            ``-1`` where the query token is masked or the document has no real token.
        max_chunk_bytes: scratch budget for one chunk of the similarity tensor.
        dtype: what the products, maxima and sums are computed and returned in: ``torch.float32``,
            or ``torch.float64`` (the reference an fp32 kernel's error is measured against).

    Returns:
        scores ``[Nq, Nd]`` (or ``[Nq, K]``; 2-D inputs drop their batch axis) in ``dtype``, and with
        ``return_argmax`` also ``argmax`` of shape ``scores.shape + (Lq,)``.
    """
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"maxsim_reference: dtype must be torch.float32 or torch.float64, got {dtype}")
    p = _checks.check_inputs(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    Q3, D4, qm, dm = p.Q, p.D, p.q_mask, p.d_mask  # [Nq, Lq, d], [Nq|1, Nd, Ld, d]
    Nq, Lq, d = Q3.shape
    Nd, Ld = D4.shape[1], D4.shape[2]
    device = Q3.device
    scores = torch.zeros(Nq, Nd, dtype=dtype, device=device)
    argmax = torch.full((Nq, Nd, Lq), -1, dtype=torch.int32, device=device) if return_argmax else None
    multiply = mask_mode == "multiply"

    if Nq and Nd and Lq and Ld:
        # Chunk sizes: queries x documents x query tokens such that S stays within budget.
        element = torch.finfo(dtype).bits // 8
        budget = max(_chunk_budget_bytes(max_chunk_bytes) // (element * _LIVE_COPIES), 1)  # elements
        per_token_row = Ld  # one (query, doc, query-token) row of S
        s_chunk = max(1, min(Lq, budget // per_token_row))
        # b is also bounded by the converted copy of the document chunk, [b, Ld, d].
        b_chunk = max(1, min(Nd, budget // (per_token_row * s_chunk), budget // (Ld * d)))
        a_chunk = max(1, min(Nq, budget // (per_token_row * s_chunk * b_chunk)))
        for a0 in range(0, Nq, a_chunk):
            a1 = min(Nq, a0 + a_chunk)
            da = slice(a0, a1) if p.candidates else slice(0, 1)
            for b0 in range(0, Nd, b_chunk):
                b1 = min(Nd, b0 + b_chunk)
                docs = D4[da, b0:b1].to(dtype)  # [a|1, b, Ld, d]
                if normalize:
                    docs = _normalized(docs)
                dmask = dm[da, b0:b1] if dm is not None else None
                for s0 in range(0, Lq, s_chunk):
                    s1 = min(Lq, s0 + s_chunk)
                    q = Q3[a0:a1, s0:s1].to(dtype)
                    if normalize:
                        q = _normalized(q)
                    qmask = qm[a0:a1, s0:s1] if qm is not None else None
                    best, arg = _best_per_query_token(q, docs, dmask, multiply, qmask, return_argmax)
                    scores[a0:a1, b0:b1] += best.sum(-1)
                    if return_argmax:
                        argmax[a0:a1, b0:b1, s0:s1] = arg

    scores = p.unbatch(scores)
    if return_argmax:
        return scores, p.unbatch(argmax)
    return scores
