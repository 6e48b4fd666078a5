"""``maxsim.maxsim`` on CPU tensors: the contract of :mod:`maxsim.reference` on the blocked engine
(:mod:`maxsim.cpu.engine`), with a gather-based backward.

- Masked query tokens (mask_mode "exclude") are dropped before the GEMM; masked document tokens
  are dropped too (:class:`~maxsim.cpu.engine.GatheredPlan`): only real tokens are multiplied.
- mask_mode "multiply" multiplies the masks into each chunk of S, as PyLate does (a NaN or inf in
  a masked token still reaches the max, exactly as in the reference).
- Candidate lists ``[Nq, K, Ld, d]`` run one query at a time against its own K documents.
- Gradients: an ``autograd.Function`` whose forward keeps only the argmax ``[Nq, Nd, Lq]`` and
  whose backward gathers the winners, chunked over documents (never the similarity tensor).
"""

from __future__ import annotations

import os

import torch

from maxsim import _checks
from maxsim.cpu.engine import DEFAULT_CHUNK_BYTES, GatheredPlan, UniformPlan, rowmax_scores
from maxsim.cpu.per_document import long_documents, per_document_scores

# Scratch of one backward chunk (the gathered winners [Nq, b, Lq, d] fp32).
_BACKWARD_CHUNK_BYTES = 64 * 2**20


def chunk_bytes(max_chunk_bytes: int | None) -> int:
    """The engine's chunk budget: the argument, else ``MAXSIM_CPU_CHUNK_KB``, else the default."""
    if max_chunk_bytes is not None:
        return max(1, int(max_chunk_bytes))
    env = os.environ.get("MAXSIM_CPU_CHUNK_KB")
    return int(env) * 1024 if env else DEFAULT_CHUNK_BYTES


def _score_one_set(Qf, docs, qm, dm, multiply, normalize, want_argmax, budget):
    """Queries ``Qf [n, Lq, d]`` fp32 against one document set ``docs [Nd, Ld, d]`` (any dtype).
    Returns scores ``[n, Nd]`` and argmax ``[n, Nd, Lq]`` int32 (or None)."""
    n, Lq, d = Qf.shape
    Nd, Ld = docs.shape[0], docs.shape[1]
    tokens = docs.reshape(Nd * Ld, d)
    rows = Qf.reshape(n * Lq, d)
    row_ids = row_query = q_mul = None
    if multiply:
        # PyLate's rule: every token takes part, masked similarities multiplied by 0.
        plan = UniformPlan(Nd, Ld, None if dm is None else dm.float())
        q_mul = None if qm is None else qm.reshape(-1).float()
    else:
        if qm is not None:
            row_ids = torch.nonzero(qm.reshape(-1)).flatten()  # [R] real query tokens only
            rows = rows.index_select(0, row_ids)
            row_query = row_ids // Lq
        lengths = None if dm is None else dm.sum(-1)  # [Nd]
        prefix = dm is None or torch.equal(dm, torch.arange(Ld, device=dm.device)[None, :] < lengths[:, None])
        if prefix and not (want_argmax or normalize) and docs.device.type == "cpu":
            # Long documents, each a prefix of its row: one GEMM each, straight from the rows.
            lens = [Ld] * Nd if lengths is None else lengths.tolist()
            if long_documents(sum(lens), Nd):
                return per_document_scores(rows, row_query, n, (tokens, list(range(0, Nd * Ld, Ld)), lens), Nd), None
        if dm is None:
            plan = UniformPlan(Nd, Ld)
        else:
            plan = GatheredPlan(torch.arange(Nd, device=docs.device) * Ld, lengths, None if prefix else dm)
    scores_t, arg_t = rowmax_scores(rows, row_query, n, tokens, plan, normalize=normalize,
                                    want_argmax=want_argmax, q_mul_mask=q_mul, chunk_bytes=budget)
    scores = scores_t.t()
    if not want_argmax:
        return scores, None
    if row_ids is not None:
        full = torch.full((Nd, n * Lq), -1, dtype=torch.int32, device=Qf.device)
        full[:, row_ids] = arg_t
        arg_t = full
    argmax = arg_t.view(Nd, n, Lq).permute(1, 0, 2)
    if multiply and qm is not None:
        argmax = torch.where(qm[:, None, :], argmax, -1)  # a masked query token has no winner
    return scores, argmax


def forward(p: _checks.Prepared, *, normalize: bool, multiply: bool, want_argmax: bool, budget: int):
    """Canonical inputs (``p.Q [Nq, Lq, d]``, ``p.D [Nq|1, Nd, Ld, d]``) -> scores ``[Nq, Nd]``
    fp32, argmax ``[Nq, Nd, Lq]`` int32 or None."""
    Q3, D4, qm, dm = p.Q, p.D, p.q_mask, p.d_mask
    Nq, Lq, d = Q3.shape
    Nd, Ld = D4.shape[1], D4.shape[2]
    device = Q3.device
    if multiply and qm is None and dm is None:
        multiply = False  # the same rule without masks
    scores = torch.zeros(Nq, Nd, dtype=torch.float32, device=device)
    argmax = torch.full((Nq, Nd, Lq), -1, dtype=torch.int32, device=device) if want_argmax else None
    if not (Nq and Nd and Lq and Ld):
        return scores, argmax
    Qf = Q3.float()
    if normalize:
        Qf = torch.nn.functional.normalize(Qf, dim=-1)
    if not p.candidates:
        s, a = _score_one_set(Qf, D4[0], qm, None if dm is None else dm[0], multiply, normalize, want_argmax, budget)
        scores.copy_(s)
        if want_argmax:
            argmax.copy_(a)
        return scores, argmax
    for i in range(Nq):  # candidate lists: each query against its own documents
        s, a = _score_one_set(Qf[i:i + 1], D4[i], None if qm is None else qm[i:i + 1],
                              None if dm is None else dm[i], multiply, normalize, want_argmax, budget)
        scores[i] = s[0]
        if want_argmax:
            argmax[i] = a[0]
    return scores, argmax


def backward(grad: torch.Tensor, Q3: torch.Tensor, D4: torch.Tensor, argmax: torch.Tensor, candidates: bool):
    """Subgradient at the argmax. grad ``[Nq, Nd]``, Q3 ``[Nq, Lq, d]``, D4 ``[Nq|1, Nd, Ld, d]``,
    argmax ``[Nq, Nd, Lq]`` int32 (-1: no gradient) -> (grad_Q3 fp32, grad_D4 fp32)."""
    Nq, Lq, d = Q3.shape
    Nd, Ld = D4.shape[1], D4.shape[2]
    g = grad.float()
    gQ = torch.zeros(Nq, Lq, d, dtype=torch.float32, device=Q3.device)
    gD = torch.zeros(D4.shape, dtype=torch.float32, device=D4.device)
    if not (Nq and Nd and Lq and Ld):
        return gQ, gD
    Qf = Q3.float()
    gD_flat = gD.view(-1, d)
    b = max(1, _BACKWARD_CHUNK_BYTES // max(1, 4 * Nq * Lq * d))
    for j0 in range(0, Nd, b):
        j1 = min(Nd, j0 + b)
        win = argmax[:, j0:j1].long()  # [Nq, b, Lq]
        valid = win >= 0
        doc = torch.arange(j0, j1, device=Q3.device)[None, :, None]  # [1, b, 1]
        if candidates:
            doc = doc + torch.arange(Nq, device=Q3.device)[:, None, None] * Nd
        flat = (doc * Ld + win.clamp_min(0)).reshape(-1)  # [Nq * b * Lq] rows of D4 viewed [-1, d]
        weight = g[:, j0:j1, None].expand_as(win)  # [Nq, b, Lq]
        winners = D4.reshape(-1, d).index_select(0, flat).float().view(Nq, j1 - j0, Lq, d)
        # torch.where, not a product with the mask: a non-winning NaN token must not leak in.
        gQ += torch.where(valid[..., None], weight[..., None] * winners, 0.0).sum(1)
        sel = valid.reshape(-1)
        contrib = (weight[..., None] * Qf[:, None, :, :]).reshape(-1, d)
        gD_flat.index_add_(0, flat[sel], contrib[sel])
    return gQ, gD


class _CpuMaxSim(torch.autograd.Function):
    """Differentiable forward in Q3 ``[Nq, Lq, d]`` and D4 ``[Nq|1, Nd, Ld, d]`` (normalisation,
    when asked, is applied before, through autograd)."""

    @staticmethod
    def forward(ctx, Q3, D4, p, multiply, budget):
        scores, argmax = forward(p, normalize=False, multiply=multiply, want_argmax=True, budget=budget)
        flowing = argmax
        if multiply and p.d_mask is not None:
            # PyLate's rule: a masked winner (similarity forced to 0) passes no gradient.
            dm = p.d_mask.expand(Q3.shape[0], -1, -1)  # [Nq, Nd, Ld]
            winner_real = torch.gather(dm, 2, argmax.clamp_min(0).long())
            flowing = torch.where(winner_real, argmax, -1)
        ctx.candidates = p.candidates
        ctx.save_for_backward(Q3, D4, flowing)
        ctx.mark_non_differentiable(argmax)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        Q3, D4, argmax = ctx.saved_tensors
        gQ, gD = backward(grad_scores, Q3, D4, argmax, ctx.candidates)
        gD = gD.expand(D4.shape) if gD.shape != D4.shape else gD
        return gQ.to(Q3.dtype), gD.to(D4.dtype), None, None, None


def maxsim_cpu(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    mask_mode: str = "exclude",
    return_argmax: bool = False,
    max_chunk_bytes: int | None = None,
):
    """MaxSim scores on the blocked CPU engine: same arguments, rules and results as
    :func:`maxsim.reference.maxsim_reference` (``max_chunk_bytes``: the size of one chunk of S and
    its document rows, about a core's L2 by default; ``MAXSIM_CPU_CHUNK_KB`` overrides).
    Runs on any device (it is plain PyTorch); CPU tensors are what it is built for."""
    p = _checks.check_inputs(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    multiply = mask_mode == "multiply"
    budget = chunk_bytes(max_chunk_bytes)
    needs_grad = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if needs_grad:
        Q3, D4 = p.Q, p.D
        if normalize:
            Q3 = torch.nn.functional.normalize(Q3.float(), dim=-1)
            D4 = torch.nn.functional.normalize(D4.float(), dim=-1)
        p = _checks.Prepared(Q3, D4, p.q_mask, p.d_mask, p.candidates, p.squeeze_q, p.squeeze_d)
        scores, argmax = _CpuMaxSim.apply(Q3, D4, p, multiply, budget)
    else:
        scores, argmax = forward(p, normalize=normalize, multiply=multiply, want_argmax=return_argmax, budget=budget)
    scores = p.unbatch(scores)
    if return_argmax:
        return scores, p.unbatch(argmax)
    return scores
