"""An independent float64 oracle of the MaxSim contract, written pair by pair for clarity.

It shares no code with ``maxsim.reference``: a test that compares the two checks the rules twice.
"""

from __future__ import annotations

import torch


def oracle(Q, D, q_mask=None, d_mask=None, *, normalize=False, mask_mode="exclude"):
    """Scores and argmax in float64 for 3-D Q ``[Nq, Lq, d]`` and D ``[Nd, Ld, d]`` or ``[Nq, K, Ld, d]``.

    Returns (scores ``[Nq, Nd]`` float64, argmax ``[Nq, Nd, Lq]`` int64 with -1 for no winner).
    """
    Nq, Lq, _ = Q.shape
    cand = D.dim() == 4
    Nd, Ld = D.shape[-3], D.shape[-2]
    scores = torch.zeros(Nq, Nd, dtype=torch.float64)
    argmax = torch.full((Nq, Nd, Lq), -1, dtype=torch.int64)
    Q = Q.double().cpu()
    D = D.double().cpu()
    if normalize:
        Q, D = _unit(Q), _unit(D)
    for i in range(Nq):
        for j in range(Nd):
            doc = D[i, j] if cand else D[j]  # [Ld, d]
            dm = (d_mask[i, j] if cand else d_mask[j]).cpu() if d_mask is not None else torch.ones(Ld, dtype=torch.bool)
            total = torch.zeros((), dtype=torch.float64)
            for s in range(Lq):
                q_real = bool(q_mask[i, s]) if q_mask is not None else True
                # Row by row, not a matvec: BLAS may round equal rows differently, which breaks ties.
                sims = (doc * Q[i, s]).sum(-1)  # [Ld]
                if mask_mode == "multiply":
                    sims = sims * dm.double() * float(q_real)
                    if Ld == 0:
                        continue
                    best = sims.max()
                    total = total + best
                    if q_real:
                        argmax[i, j, s] = _first_argmax(sims)
                    continue
                if not q_real or not bool(dm.any()):
                    continue
                real = sims[dm]
                best = real.max()
                total = total + best
                argmax[i, j, s] = int(torch.nonzero(dm).flatten()[_first_argmax(real)])
            scores[i, j] = total
    return scores, argmax


def _first_argmax(v: torch.Tensor) -> int:
    """Lowest index of the maximum; a NaN counts as the maximum."""
    nan = torch.isnan(v)
    if bool(nan.any()):
        return int(torch.nonzero(nan).flatten()[0])
    return int(torch.nonzero(v == v.max()).flatten()[0])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| over finite entries (NaNs must match; checked separately)."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN pattern differs"
    fin = ~torch.isnan(ref)
    if not bool(fin.any()):
        return 0.0
    scale = ref[fin].abs().max().clamp_min(1e-30)
    return float((out[fin] - ref[fin]).abs().max() / scale)


def torch_dtype_err(Q, D, ref64: torch.Tensor, q_mask=None, d_mask=None) -> float:
    """The error of the plain PyTorch computation in the input dtype (the tolerance yardstick)."""
    if D.dim() == 3:
        S = torch.einsum("asd,btd->abst", Q.cpu(), D.cpu())
    else:
        S = torch.einsum("asd,abtd->abst", Q.cpu(), D.cpu())
    S = S.float()
    if d_mask is not None:
        dm = d_mask.cpu()[None, :, None, :] if D.dim() == 3 else d_mask.cpu()[:, :, None, :]
        S = S.masked_fill(~dm, float("-inf"))
    best = S.max(-1).values if S.shape[-1] else torch.zeros(S.shape[:-1])
    best = torch.where(torch.isinf(best) & (best < 0), torch.zeros_like(best), best)
    if q_mask is not None:
        best = best * q_mask.cpu()[:, None, :]
    return rel_err(best.sum(-1).to(Q.dtype).float(), ref64)


def winner_grads(Q, D, argmax, *, normalize=False, seed=0):
    """float64 gradients of ``sum(g * scores)`` (``g`` as in :func:`grad_step`) with the winners
    fixed to ``argmax`` ``[Nq, Nd, Lq]`` (-1: the token adds nothing), exclude mode. A kernel's
    gradients must match these exactly up to rounding, whatever way it broke near-ties; that the
    winners are maxima is checked with :func:`winner_gap`. Returns (grad_Q, grad_D) on the CPU."""
    Q = Q.detach().double().cpu().requires_grad_()
    D = D.detach().double().cpu().requires_grad_()
    Qn, Dn = (_unit(Q), _unit(D)) if normalize else (Q, D)
    sims = _sims_at(Qn, Dn, argmax.cpu().long())  # [Nq, Nd, Lq]
    scores = sims.sum(-1)
    g = torch.randn(scores.shape, generator=torch.Generator().manual_seed(seed)).double()
    (scores * g).sum().backward()
    return Q.grad, D.grad


def winner_gap(Q, D, argmax, ref_argmax, *, normalize=False) -> float:
    """max over tokens of (similarity at ``ref_argmax`` - similarity at ``argmax``) / max|sim|,
    float64: 0 when both pick maxima, tiny for a near-tie broken the other way."""
    Q, D = Q.detach().double().cpu(), D.detach().double().cpu()
    if normalize:
        Q, D = _unit(Q), _unit(D)
    a, r = _sims_at(Q, D, argmax.cpu().long()), _sims_at(Q, D, ref_argmax.cpu().long())
    return float((r - a).abs().max() / r.abs().max().clamp_min(1e-30))


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _sims_at(Q, D, argmax):
    """<Q[i, s], D[(i,) j, argmax[i, j, s]]> as [Nq, Nd, Lq]; 0 where argmax is -1."""
    Nq, Nd, Lq = argmax.shape
    docs = D if D.dim() == 4 else D.expand(Nq, *D.shape)  # [Nq, Nd, Ld, d]
    idx = argmax.clamp_min(0)[..., None].expand(Nq, Nd, Lq, D.shape[-1])
    winners = torch.gather(docs, 2, idx)  # [Nq, Nd, Lq, d]
    sims = (Q[:, None] * winners).sum(-1)
    return torch.where(argmax >= 0, sims, torch.zeros((), dtype=sims.dtype))


def grad_step(fn, Q, D, q_mask=None, d_mask=None, seed=0, **kw):
    """Scores and gradients of ``sum(g * fn(Q, D, ...))`` for a seeded random ``g`` (drawn on the
    CPU, so every device sees the same one). Returns (scores, grad_Q, grad_D)."""
    Q = Q.detach().clone().requires_grad_()
    D = D.detach().clone().requires_grad_()
    out = fn(Q, D, q_mask, d_mask, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * g).sum().backward()
    return out.detach(), Q.grad, D.grad


def loop_maxsim(Q, docs, q_mask=None):
    """Independent oracle for ragged documents: per (query, document) a float64 max then sum, query
    by query and document by document; empty documents 0. Q [Nq, Lq, d], docs a list of [L, d]."""
    out = torch.zeros(Q.shape[0], len(docs), dtype=torch.float64)
    for i in range(Q.shape[0]):
        q = Q[i].double() if q_mask is None else Q[i][q_mask[i]].double()
        for j, d in enumerate(docs):
            if d.shape[0] and q.shape[0]:
                out[i, j] = (q @ d.double().T).max(dim=1).values.sum()
    return out.float()
