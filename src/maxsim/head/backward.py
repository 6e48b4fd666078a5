"""Backward of ``maxsim_from_hidden`` through the saved argmax, in PyTorch (this stage's version).

At the argmax the score is linear in Q and in the projected tokens ``D = n(P)``, ``P = H W^T + b``
(``n`` the L2 normalisation, or the identity), so only the winning document tokens carry gradient:

    grad_Q[i, s]  = sum_j  g[i, j] * D[j, t*(i, j, s)]
    G[u]          = sum_{(i, s, j) : winner u}  g[i, j] * Q[i, s]          (u: a winning token)
    grad_P[u]     = (G[u] - (G[u] . D[u]) D[u]) / |P[u]|   (|P[u]| > 1e-12; else G[u] / 1e-12)
    grad_H[u]     = grad_P[u] @ W,   grad_W = sum_u grad_P[u]^T H[u],   grad_b = sum_u grad_P[u]

The winners' projections are recomputed from H at the argmax positions only: the unique winning
tokens ``u`` of a chunk of documents (torch.unique), their H rows gathered and projected in fp32.
G sums into a buffer ``[U, d]`` fp32 the size of the chunk's winners, by fp32 atomics
(``index_add_``; "unified": last bits vary run to run on a GPU) or by a sorted segment sum
("lowmem": bitwise deterministic). grad_H is written once per winning row in H's dtype (rows that
never win stay 0); no fp32 buffer of H's size ``[Nd * Ld, d_model]`` is ever allocated.
Documents are taken a chunk at a time so that the scratch stays within ``SCRATCH_BYTES``.
"""

from __future__ import annotations

import torch

# Scratch per chunk of documents: per-entry rows [E, d] fp32 and the winners' rows [U, d_model].
SCRATCH_BYTES = 256 * 2**20
EPS = 1e-12  # F.normalize's


def _docs_per_chunk(Nq: int, Lq: int, Ld: int, d: int, d_model: int) -> int:
    per_doc = Nq * Lq * d * 4 * 4 + min(Nq * Lq, Ld) * (d_model + d) * 4 * 3
    return max(1, SCRATCH_BYTES // max(per_doc, 1))


def head_backward(grad, Q, H, W, b, argmax, *, normalize: bool, deterministic: bool, needs=(True,) * 4):
    """Canonical ``grad [Nq, Nd]``, ``Q [Nq, Lq, d]``, ``H [Nq|1, Nd, Ld, d_model]``, ``W [d,
    d_model]``, ``b [d]`` or None, ``argmax [Nq, Nd, Lq]`` int32 (-1: no gradient) ->
    (grad_Q, grad_H, grad_W, grad_b) in the inputs' dtypes (None where ``needs`` says so, or b None)."""
    Nq, Lq, d = Q.shape
    G, Nd, Ld, d_model = H.shape
    candidates = G != 1
    device = Q.device
    grad = grad.float()
    Wf = W.float()
    bf = None if b is None else b.float()
    H_rows = H.reshape(G * Nd * Ld, d_model)  # a view when H's tokens are one strided run
    grad_Q = torch.zeros(Nq, Lq, d, dtype=torch.float32, device=device) if needs[0] else None
    grad_H = torch.zeros(G * Nd * Ld, d_model, dtype=H.dtype, device=device) if needs[1] else None
    grad_W = torch.zeros(d, d_model, dtype=torch.float32, device=device) if needs[2] else None
    grad_b = torch.zeros(d, dtype=torch.float32, device=device) if needs[3] and b is not None else None
    Qf = Q.float()
    step = _docs_per_chunk(Nq, Lq, Ld, d, d_model)
    for j0 in range(0, Nd, step):
        j1 = min(Nd, j0 + step)
        arg = argmax[:, j0:j1].long()  # [Nq, n, Lq]
        won = arg >= 0
        ii, jj, ss = won.nonzero(as_tuple=True)  # [E] each: query, document (in chunk), query token
        if ii.numel() == 0:
            continue
        group = ii if candidates else torch.zeros_like(ii)
        token = ((group * Nd + j0 + jj) * Ld) + arg[ii, jj, ss]  # [E] row of H_rows
        weight = grad[ii, j0 + jj]  # [E]
        rows, inverse, counts = torch.unique(token, return_inverse=True, return_counts=True)  # [U], [E], [U]
        H_won = H_rows[rows].float()  # [U, d_model]
        P = torch.nn.functional.linear(H_won, Wf, bf)  # [U, d]
        if normalize:
            norm = P.norm(dim=1, keepdim=True)  # [U, 1]
            D = P / norm.clamp_min(EPS)
        else:
            D = P
        if grad_Q is not None:
            # A gather: each entry's winner weighted by its score's gradient, summed over the
            # chunk's documents in a fixed order (no atomics).
            picked = torch.zeros(Nq, j1 - j0, Lq, d, dtype=torch.float32, device=device)  # [Nq, n, Lq, d]
            picked[ii, jj, ss] = weight[:, None] * D[inverse]
            grad_Q += picked.sum(1)
            del picked
        if grad_H is None and grad_W is None and grad_b is None:
            continue
        contrib = weight[:, None] * Qf[ii, ss]  # [E, d]
        if deterministic:
            order = torch.argsort(inverse, stable=True)
            G_won = torch.segment_reduce(contrib[order], "sum", lengths=counts, axis=0)  # [U, d]
        else:
            G_won = torch.zeros(rows.numel(), d, dtype=torch.float32, device=device).index_add_(0, inverse, contrib)
        if normalize:
            radial = (G_won * D).sum(dim=1, keepdim=True)
            grad_P = torch.where(norm > EPS, (G_won - radial * D) / norm.clamp_min(EPS), G_won / EPS)
        else:
            grad_P = G_won
        if grad_H is not None:
            grad_H[rows] = (grad_P @ Wf).to(H.dtype)
        if grad_W is not None:
            grad_W += grad_P.T @ H_won
        if grad_b is not None:
            grad_b += grad_P.sum(0)
    return (
        None if grad_Q is None else grad_Q.to(Q.dtype),
        None if grad_H is None else grad_H.view(G, Nd, Ld, d_model),
        None if grad_W is None else grad_W.to(W.dtype),
        None if grad_b is None else grad_b.to(b.dtype),
    )
