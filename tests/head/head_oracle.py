"""A float64 oracle of maxsim_from_hidden, the unfused path written out with einsum (shares no
code with maxsim): project, normalise, similarity tensor, masks, max, sum; autograd through it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def oracle64(Q, H, W, b=None, q_mask=None, d_mask=None, *, normalize=True, mask_mode="exclude"):
    """float64 scores ``[Nq, Nd]`` for 3-D Q and 3-D / 4-D H (differentiable in its float64 inputs)."""
    # On the CPU in float64 (.cpu() keeps the graph: gradients flow back to the callers' tensors).
    Q, H, W = Q.cpu().double(), H.cpu().double(), W.cpu().double()
    D = F.linear(H, W, None if b is None else b.cpu().double())
    if normalize:
        D = F.normalize(D, dim=-1)
    cand = H.dim() == 4
    S = torch.einsum("isd,ijtd->ijst" if cand else "isd,jtd->ijst", Q, D)  # [Nq, Nd, Lq, Ld]
    Nq, Nd, Lq, Ld = S.shape
    qm = torch.ones(Nq, Lq, dtype=torch.bool) if q_mask is None else q_mask.cpu().bool()
    dm = torch.ones(D.shape[:-1], dtype=torch.bool) if d_mask is None else d_mask.cpu().bool()
    dm4 = (dm if cand else dm[None].expand(Nq, -1, -1))[:, :, None, :]  # [Nq, Nd, 1, Ld]
    if Ld == 0:
        return S.new_zeros(Nq, Nd)
    if mask_mode == "multiply":
        S = S * qm[:, None, :, None].double() * dm4.double()
        return S.max(-1).values.sum(-1)
    S = S.masked_fill(~dm4, float("-inf"))
    best = S.max(-1).values  # [Nq, Nd, Lq]
    keep = dm4.any(-1) & qm[:, None, :]
    return torch.where(keep, best, torch.zeros((), dtype=best.dtype)).sum(-1)


def oracle_grads(Q, H, W, b, q_mask, d_mask, grad, **kw):
    """(scores, grad_Q, grad_H, grad_W, grad_b) in float64 for the loss ``(scores * grad).sum()``."""
    leaves = [t.detach().cpu().double().requires_grad_(True) if t is not None else None for t in (Q, H, W, b)]
    scores = oracle64(*leaves, q_mask, d_mask, **kw)
    (scores * grad.cpu().double()).sum().backward()
    return (scores.detach(), *[None if t is None else t.grad for t in leaves])


def rel_err(x, ref) -> float:
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0
