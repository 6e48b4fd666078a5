"""An independent float64 oracle of ``maxsim.chamfer_distance``: torch.cdist (no matmul
shortcut) cloud by cloud, then PyTorch3D's reductions written out loop by loop. Shares no code
with maxsim.chamfer."""

from __future__ import annotations

import torch


def cloud_dists(a: torch.Tensor, b: torch.Tensor, norm: int) -> torch.Tensor:
    """[P, Q] float64 distances: squared L2 (norm 2) or L1 (norm 1)."""
    a, b = a.double().cpu(), b.double().cpu()
    if a.shape[0] == 0 or b.shape[0] == 0:
        return torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    if norm == 1:
        return torch.cdist(a, b, p=1)
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


def first_min(row: torch.Tensor) -> tuple[float, int]:
    """(min, lowest index of it) of a 1-D row; a NaN counts as the min."""
    nan = torch.isnan(row)
    if bool(nan.any()):
        return float("nan"), int(torch.nonzero(nan)[0])
    v = row.min()
    return float(v), int(torch.nonzero(row == v)[0])


def nearest(src, tgt, src_len, tgt_len, norm):
    """Per point of src [B, S, D]: (dist [B, S] float64, idx [B, S] int64), 0 / -1 where none."""
    B, S, _ = src.shape
    dist = torch.zeros(B, S, dtype=torch.float64)
    idx = torch.full((B, S), -1, dtype=torch.int64)
    for b in range(B):
        ns, nt = int(src_len[b]), int(tgt_len[b])
        if nt == 0:
            continue
        d = cloud_dists(src[b, :ns], tgt[b, :nt], norm)
        for i in range(ns):
            dist[b, i], idx[b, i] = first_min(d[i])
    return dist, idx


def loss64(x, y, x_len=None, y_len=None, x_normals=None, y_normals=None, weights=None, batch_reduction="mean",
           point_reduction="mean", norm=2, single_directional=False, abs_cosine=True):
    """The loss in float64, differentiable in x and y (winners from the float64 distances)."""
    # On the CPU in float64 (.cpu() keeps the graph: gradients flow back to the callers' tensors).
    x, y = x.cpu(), y.cpu()
    x_normals = None if x_normals is None else x_normals.cpu()
    y_normals = None if y_normals is None else y_normals.cpu()
    B, N, _ = x.shape
    M = y.shape[1]
    x_len = torch.full((B,), N) if x_len is None else x_len.cpu()
    y_len = torch.full((B,), M) if y_len is None else y_len.cpu()
    w = None if weights is None else weights.double().cpu()
    directions = [(x, y, x_len, y_len, x_normals, y_normals)]
    if not single_directional:
        directions.append((y, x, y_len, x_len, y_normals, x_normals))
    per_dir, per_dir_n = [], []
    for src, tgt, sl, tl_, sn, tn in directions:
        _, idx = nearest(src.detach(), tgt.detach(), sl, tl_, norm)
        rows, rows_n = [], []
        for b in range(B):
            terms, nterms = [], []
            for i in range(int(sl[b])):
                j = int(idx[b, i])
                if j < 0:
                    terms.append(torch.zeros((), dtype=torch.float64))
                    nterms.append(torch.zeros((), dtype=torch.float64))
                    continue
                diff = src[b, i].double() - tgt[b, j].double()
                terms.append(diff.abs().sum() if norm == 1 else (diff * diff).sum())
                if sn is not None:
                    a, c = sn[b, i].double(), tn[b, j].double()
                    cos = (a * c).sum() / (a.norm().clamp_min(1e-6) * c.norm().clamp_min(1e-6))
                    nterms.append(1 - (cos.abs() if abs_cosine else cos))
            P = src.shape[1]
            t = torch.stack(terms + [torch.zeros((), dtype=torch.float64)] * (P - len(terms))) if P else \
                torch.zeros(0, dtype=torch.float64)
            tn_ = torch.stack(nterms + [torch.zeros((), dtype=torch.float64)] * (P - len(nterms))) if P and sn is not None \
                else torch.zeros(P, dtype=torch.float64)
            if w is not None:
                t, tn_ = t * w[b], tn_ * w[b]
            rows.append(_points(t, int(sl[b]), point_reduction))
            rows_n.append(_points(tn_, int(sl[b]), point_reduction))
        per_dir.append(torch.stack(rows) if B else torch.zeros(0, dtype=torch.float64))
        per_dir_n.append(torch.stack(rows_n) if B else torch.zeros(0, dtype=torch.float64))

    def join(parts):
        if len(parts) == 1:
            return parts[0]
        if point_reduction is None:
            return tuple(parts)
        return torch.maximum(*parts) if point_reduction == "max" else parts[0] + parts[1]

    loss, loss_n = join(per_dir), join(per_dir_n)

    def batch(v):
        if batch_reduction is None:
            return v
        s = v.sum()
        if batch_reduction == "sum":
            return s
        if w is None:
            return s / max(B, 1)
        return s / (w.sum() if float(w.sum()) != 0 else 1.0)

    return batch(loss), (batch(loss_n) if x_normals is not None else None)


def _points(t, n, point_reduction):
    if point_reduction is None:
        return t
    if point_reduction == "max":
        return t.max() if t.numel() else torch.zeros((), dtype=torch.float64)
    s = t.sum()
    return s / max(n, 1) if point_reduction == "mean" else s
