"""The Chamfer nearest-neighbour contract in plain PyTorch: the CPU backend and the tests' oracle
(with an independent float64 computation in the tests).

Chunked over source points so that the distance scratch stays under ``MAXSIM_REFERENCE_CHUNK_MB``
(default 256 MB). Distances are per-coordinate differences in fp32 (no ``|x|^2 + |y|^2 - 2 x.y``
cancellation), so fp32 results are as exact as the kernels'. Differentiable: the winners are found
without gradients, then the distances are recomputed from the winners with autograd.
"""

from __future__ import annotations

import os

import torch


def _chunk_rows(targets: int, dims: int) -> int:
    budget = int(float(os.environ.get("MAXSIM_REFERENCE_CHUNK_MB", "256")) * 2**20)
    return max(1, budget // max(1, 4 * targets * max(dims, 1) * 2))


def nearest(src: torch.Tensor, tgt: torch.Tensor, src_len: torch.Tensor, tgt_len: torch.Tensor, norm: int):
    """Nearest neighbour in ``tgt [B, T, D]`` of every point of ``src [B, S, D]``.

    Returns ``(dist [B, S] fp32, idx [B, S] int64)``: the distance (squared L2 for norm 2, L1 for
    norm 1) and the lowest index of the min (a NaN distance wins); 0 and -1 for padded source
    points and for points whose target cloud is empty. Not differentiable (see :func:`distances`).
    """
    B, S, D = src.shape
    T = tgt.shape[1]
    dist = torch.zeros(B, S, dtype=torch.float32, device=src.device)
    idx = torch.full((B, S), -1, dtype=torch.int64, device=src.device)
    step = _chunk_rows(T, D)
    with torch.no_grad():
        for b in range(B):
            ns, nt = int(src_len[b]), int(tgt_len[b])
            if ns == 0 or nt == 0:
                continue
            t = tgt[b, :nt].float()  # [nt, D]
            for s0 in range(0, ns, step):
                s = src[b, s0:min(ns, s0 + step)].float()  # [cs, D]
                diff = s[:, None, :] - t[None, :, :]  # [cs, nt, D]
                d = diff.abs().sum(-1) if norm == 1 else (diff * diff).sum(-1)  # [cs, nt]
                best = d.amin(-1)
                nan_row = torch.isnan(d).any(-1)
                best = torch.where(nan_row, torch.full_like(best, float("nan")), best)
                hit = (d == best[:, None]) | (torch.isnan(d) & nan_row[:, None])
                col = torch.arange(nt, device=d.device).expand_as(d)
                first = torch.where(hit, col, nt).amin(-1)  # lowest index among ties
                dist[b, s0:s0 + s.shape[0]] = best
                idx[b, s0:s0 + s.shape[0]] = first
    return dist, idx


def distances(src: torch.Tensor, tgt: torch.Tensor, idx: torch.Tensor, norm: int) -> torch.Tensor:
    """``dist(src[b, s], tgt[b, idx[b, s]])`` as ``[B, S]`` fp32 with autograd (0 where idx is -1)."""
    B, S, D = src.shape
    if tgt.shape[1] == 0 or S == 0:
        return src.float().sum(-1) * 0.0
    winners = torch.gather(tgt.float(), 1, idx.clamp_min(0)[..., None].expand(B, S, D))  # [B, S, D]
    diff = src.float() - winners
    d = diff.abs().sum(-1) if norm == 1 else (diff * diff).sum(-1)
    return torch.where(idx >= 0, d, torch.zeros((), dtype=d.dtype, device=d.device))


def chamfer_nn_reference(x, y, x_len, y_len, norm: int, both: bool):
    """``(dist_x [B, N], idx_x [B, N], dist_y [B, M] | None, idx_y [B, M] | None)``, as the
    kernels return them (indices int64 here), distances differentiable in x and y."""
    _, idx_x = nearest(x, y, x_len, y_len, norm)
    dist_x = distances(x, y, idx_x, norm)
    if not both:
        return dist_x, idx_x, None, None
    _, idx_y = nearest(y, x, y_len, x_len, norm)
    return dist_x, idx_x, distances(y, x, idx_y, norm), idx_y
