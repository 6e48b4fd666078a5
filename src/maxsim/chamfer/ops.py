"""``maxsim.chamfer_distance``: validation, backend dispatch, the custom ops, and PyTorch3D's
reductions around the nearest-neighbour kernels.

Two torch.library custom ops wrap the launchers (autograd and ``torch.compile`` see one opaque
operator each; both have fake implementations):

    maxsim::chamfer_nn(x, y, x_len, y_len, norm, both, deterministic)
        -> (dist_x [B, N] fp32, idx_x [B, N] int32, dist_y [B, M], idx_y [B, M])
        (dist_y, idx_y: empty [0] tensors for a single direction)
    maxsim::chamfer_nn_backward(grad_dist_x, grad_dist_y, x, y, idx_x, idx_y, norm, deterministic)
        -> (grad_x, grad_y)

Each op's body asks :mod:`maxsim.selection.chamfer` for its kernel and tile. The reductions,
weights and normals are a few elementwise PyTorch operations on the ``[B, N]`` / ``[B, M]``
results (the normals gathered at the saved argmin); autograd runs through them as usual.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from maxsim import _checks
from maxsim._dispatch import backend_for
from maxsim.chamfer import backward as _backward
from maxsim.chamfer import forward as _forward
from maxsim.chamfer import specs
from maxsim.chamfer.reference import chamfer_nn_reference
from maxsim.selection import chamfer as select

BATCH_REDUCTIONS = (None, "mean", "sum")
POINT_REDUCTIONS = (None, "mean", "sum", "max")


def _empty_pair(device):
    return (torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.int32, device=device))


def _nn_launch(x, y, x_len, y_len, norm, both):
    choice = select.forward_choice(x, norm, masked=True)
    dist_x, idx_x, dist_y, idx_y = _forward.chamfer_forward(
        x, y, x_len, y_len, norm=norm, both=both, config=choice.config, dot=choice.kernel is specs.DOT_FORWARD)
    if not both:
        dist_y, idx_y = _empty_pair(x.device)
    return dist_x, idx_x, dist_y, idx_y


@torch.library.custom_op("maxsim::chamfer_nn", mutates_args=())
def chamfer_nn(x: torch.Tensor, y: torch.Tensor, x_len: torch.Tensor, y_len: torch.Tensor, norm: int, both: bool,
               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, N, D], y [B, M, D], lengths [B] int64 -> nearest-neighbour distances and indices
    (``deterministic`` is for the backward only)."""
    return _nn_launch(x, y, x_len, y_len, norm, both)


@chamfer_nn.register_fake
def _(x, y, x_len, y_len, norm, both, deterministic):
    B, N, _ = x.shape
    M = y.shape[1]
    if not both:
        return (x.new_empty((B, N), dtype=torch.float32), x.new_empty((B, N), dtype=torch.int32),
                x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.int32))
    return (x.new_empty((B, N), dtype=torch.float32), x.new_empty((B, N), dtype=torch.int32),
            x.new_empty((B, M), dtype=torch.float32), x.new_empty((B, M), dtype=torch.int32))


@torch.library.custom_op("maxsim::chamfer_nn_backward", mutates_args=())
def chamfer_nn_backward(grad_dist_x: Optional[torch.Tensor], grad_dist_y: Optional[torch.Tensor], x: torch.Tensor,
                        y: torch.Tensor, idx_x: torch.Tensor, idx_y: torch.Tensor, norm: int,
                        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of x and y (their dtypes) through the saved argmin (idx_y empty: one direction)."""
    both = idx_y.dim() == 2  # (a single direction saved an empty [0] tensor)
    choice = select.backward_choice(x, deterministic)
    return _backward.chamfer_backward(grad_dist_x, grad_dist_y if both else None, x, y, idx_x,
                                      idx_y if both else None, norm=norm, deterministic=deterministic,
                                      config=choice.config)


@chamfer_nn_backward.register_fake
def _(grad_dist_x, grad_dist_y, x, y, idx_x, idx_y, norm, deterministic):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(y, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, y, x_len, y_len, norm, both, deterministic = inputs
    _, idx_x, _, idx_y = output
    ctx.set_materialize_grads(False)
    ctx.norm, ctx.deterministic = norm, deterministic
    ctx.save_for_backward(x, y, idx_x, idx_y)


def _backward_rule(ctx, grad_dist_x, _grad_idx_x, grad_dist_y, _grad_idx_y):
    x, y, idx_x, idx_y = ctx.saved_tensors
    if grad_dist_x is None and grad_dist_y is None:
        return (None,) * 7
    grad_x, grad_y = chamfer_nn_backward(grad_dist_x, grad_dist_y, x, y, idx_x, idx_y, ctx.norm, ctx.deterministic)
    return grad_x, grad_y, None, None, None, None, None


chamfer_nn.register_autograd(_backward_rule, setup_context=_setup_context)


# --- validation ----------------------------------------------------------------------------------

def _check_cloud(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor [B, P, D] (Pointclouds objects: pass "
                        f"points_padded() and num_points_per_cloud()); got {type(t).__name__}")
    _checks.check_dtype(name, t)
    if t.dim() != 3:
        raise ValueError(f"maxsim: {name} must have shape [B, P, D]; got {_checks.shape_str(t)}")


def _lengths(name: str, lengths, B: int, P: int, device) -> torch.Tensor:
    """Validated lengths as int64 [B] on ``device`` (reads the values on the host, as PyTorch3D does)."""
    if lengths is None:
        return torch.full((B,), P, dtype=torch.int64, device=device)
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor [B] of integers or None; got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"maxsim: {name} must hold integers; got {str(lengths.dtype).replace('torch.', '')}")
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"maxsim: {name} must have shape [{B}]; got {_checks.shape_str(lengths)}")
    if lengths.device != device:
        raise ValueError(f"maxsim: {name} is on {lengths.device} but the clouds are on {device}")
    if B and bool(((lengths < 0) | (lengths > P)).any()):
        bad = int(lengths[(lengths < 0) | (lengths > P)][0])
        raise ValueError(f"maxsim: {name} must lie in [0, {P}] (the padded cloud size); found {bad}")
    return lengths.to(torch.int64).contiguous()


def _check_normals(name: str, normals, cloud: torch.Tensor) -> None:
    if not isinstance(normals, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor or None; got {type(normals).__name__}")
    if not normals.dtype.is_floating_point:
        raise TypeError(f"maxsim: {name} must be floating point; got {normals.dtype}")
    if normals.dim() != 3 or tuple(normals.shape[:2]) != tuple(cloud.shape[:2]):
        raise ValueError(f"maxsim: {name} must have shape [{cloud.shape[0]}, {cloud.shape[1]}, D'] like its cloud; "
                         f"got {_checks.shape_str(normals)}")
    if normals.device != cloud.device:
        raise ValueError(f"maxsim: {name} is on {normals.device} but the clouds are on {cloud.device}")


def _check_weights(weights, B: int, device) -> torch.Tensor | None:
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
        raise TypeError("maxsim: weights must be a floating-point torch.Tensor [B] or None; got "
                        f"{type(weights).__name__ if not isinstance(weights, torch.Tensor) else weights.dtype}")
    if tuple(weights.shape) != (B,):
        raise ValueError(f"maxsim: weights must have shape [{B}]; got {_checks.shape_str(weights)}")
    if weights.device != device:
        raise ValueError(f"maxsim: weights is on {weights.device} but the clouds are on {device}")
    if B and bool((weights < 0).any()):
        raise ValueError("maxsim: weights cannot be negative")
    return weights


def _check_args(x, y, norm, batch_reduction, point_reduction, single_directional, abs_cosine, return_indices,
                deterministic):
    _check_cloud("x", x)
    _check_cloud("y", y)
    if x.dtype != y.dtype:
        raise TypeError(f"maxsim: x and y must have the same dtype; got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"maxsim: x and y must be on the same device; got {x.device} and {y.device}")
    if y.shape[0] != x.shape[0] or y.shape[2] != x.shape[2]:
        raise ValueError(f"maxsim: y must have shape [{x.shape[0]}, M, {x.shape[2]}] like x {_checks.shape_str(x)} "
                         f"(same batch and point dimension); got {_checks.shape_str(y)}")
    if x.shape[2] == 0:
        raise ValueError(f"maxsim: the point dimension D must be at least 1; got x {_checks.shape_str(x)}")
    if isinstance(norm, bool) or norm not in (1, 2):
        raise ValueError(f"maxsim: norm must be 1 (L1) or 2 (squared L2); got {norm!r}")
    _checks.check_choice("batch_reduction", batch_reduction, BATCH_REDUCTIONS)
    _checks.check_choice("point_reduction", point_reduction, POINT_REDUCTIONS)
    if point_reduction is None and batch_reduction is not None:
        raise ValueError("maxsim: batch_reduction must be None when point_reduction is None")
    for name, value in (("single_directional", single_directional), ("abs_cosine", abs_cosine),
                        ("return_indices", return_indices), ("deterministic", deterministic)):
        _checks.check_bool(name, value)


# --- the public function -----------------------------------------------------------------------

def chamfer_distance(
    x: torch.Tensor,
    y: torch.Tensor,
    x_lengths: torch.Tensor | None = None,
    y_lengths: torch.Tensor | None = None,
    x_normals: torch.Tensor | None = None,
    y_normals: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    batch_reduction: str | None = "mean",
    point_reduction: str | None = "mean",
    norm: int = 2,
    single_directional: bool = False,
    abs_cosine: bool = True,
    *,
    return_indices: bool = False,
    deterministic: bool = False,
):
    """Chamfer distance between batched point clouds, PyTorch3D's semantics, fused: the ``[N, M]``
    distance matrix is never written to memory.

    ``loss = reduce_b( reduce_i dist(x_i, y_nn(i)) + reduce_j dist(y_j, x_nn(j)) )`` with ``dist``
    the squared Euclidean distance (``norm=2``) or the L1 distance (``norm=1``) and ``nn`` the
    nearest neighbour in the other cloud (ties: the lowest index).

    Args:
        x: ``[B, N, D]`` points (float16, bfloat16 or float32; D >= 1).  y: ``[B, M, D]``, same dtype.
        x_lengths, y_lengths: ``[B]`` integers, the number of real points of each cloud (the rest
            is padding and takes no part); None = all.
        x_normals, y_normals: ``[B, N, D']``, ``[B, M, D']`` (given together): ``loss_normals``
            is the same reductions of ``1 - |cos(n_i, n_nn(i))|`` (``1 - cos`` with ``abs_cosine=False``).
        weights: ``[B]`` non-negative per-cloud weights multiplying each cloud's terms; the batch
            mean divides by their sum (by 1 when they sum to 0).
        batch_reduction: ``"mean"``, ``"sum"`` or None (per cloud).
        point_reduction: ``"mean"`` (over each cloud's real points), ``"sum"``, ``"max"`` (the
            Hausdorff distance: the larger of the two directions; no normals) or None (per point:
            needs batch_reduction None, returns a pair ``(dist_x [B, N], dist_y [B, M])``, or
            ``dist_x`` alone when single_directional).
        norm: 2 (squared Euclidean) or 1 (L1).
        single_directional: only the x -> y term.
        abs_cosine: see the normals.
        return_indices: also return the nearest neighbours: ``(idx_x [B, N], idx_y [B, M])`` int64
            (``idx_x`` alone when single_directional), -1 for padded points and for points whose
            other cloud is empty.
        deterministic: the backward sums every gradient in a fixed order (destination-owned, no
            atomics): bitwise identical run to run; else fp32 atomics (faster, last bits vary).

    Returns:
        ``(loss, loss_normals)`` (``loss_normals`` None without normals), and the indices with
        ``return_indices``. Losses are fp32 (distances are computed and accumulated in fp32; fp32
        inputs exactly, without the ``|x|^2 + |y|^2 - 2 x.y`` cancellation for D <= 16).
        Differentiable in x, y and the normals. A NaN distance wins the min (NaN propagates).

    Equivalent PyTorch (equal-size clouds, norm 2, default reductions)::

        d = torch.cdist(x.double(), y.double()) ** 2          # [B, N, M]
        loss = d.min(2).values.mean(1).mean() + d.min(1).values.mean(1).mean()

    CUDA tensors run the Triton kernels; CPU tensors run :mod:`maxsim.chamfer.reference`
    (``MAXSIM_BACKEND`` forces either).
    """
    _check_args(x, y, norm, batch_reduction, point_reduction, single_directional, abs_cosine, return_indices,
                deterministic)
    B, N, _ = x.shape
    M = y.shape[1]
    x_len = _lengths("x_lengths", x_lengths, B, N, x.device)
    y_len = _lengths("y_lengths", y_lengths, B, M, x.device)
    if (x_normals is None) != (y_normals is None):
        missing = "y_normals" if y_normals is None else "x_normals"
        raise ValueError(f"maxsim: x_normals and y_normals go together; {missing} is None")
    with_normals = x_normals is not None
    if with_normals:
        _check_normals("x_normals", x_normals, x)
        _check_normals("y_normals", y_normals, y)
        if x_normals.shape[2] != y_normals.shape[2]:
            raise ValueError(f"maxsim: x_normals and y_normals must have the same last dim; got "
                             f"{_checks.shape_str(x_normals)} and {_checks.shape_str(y_normals)}")
        if point_reduction == "max":
            raise ValueError('maxsim: normals must be None when point_reduction is "max"')
    w = _check_weights(weights, B, x.device)
    both = not single_directional

    if backend_for(x.device) == "reference":
        dist_x, idx_x, dist_y, idx_y = chamfer_nn_reference(x, y, x_len, y_len, norm, both)
    else:
        dist_x, idx_x, dist_y, idx_y = chamfer_nn(x, y, x_len, y_len, norm, both, deterministic)
        idx_x = idx_x.long()
        idx_y = idx_y.long() if both else None
        dist_y = dist_y if both else None

    terms = [(dist_x, idx_x, x_len, x_normals, y_normals)]
    if both:
        terms.append((dist_y, idx_y, y_len, y_normals, x_normals))
    losses, normal_losses = [], []
    for dist, idx, lengths, own_normals, other_normals in terms:
        # dist is 0 at padded points and at points with no neighbour: nothing to mask.
        if w is not None:
            dist = dist * w.float()[:, None]
        losses.append(_reduce_points(dist, lengths, point_reduction))
        if with_normals:
            cos = _normal_cosines(own_normals, other_normals, idx)
            term = 1.0 - (cos.abs() if abs_cosine else cos)
            term = torch.where(idx >= 0, term, torch.zeros((), dtype=term.dtype, device=term.device))
            if w is not None:
                term = term * w.float()[:, None]
            normal_losses.append(_reduce_points(term, lengths, point_reduction))

    loss = _combine(losses, point_reduction)
    loss_normals = _combine(normal_losses, point_reduction) if with_normals else None
    loss = _reduce_batch(loss, w, batch_reduction)
    if loss_normals is not None:
        loss_normals = _reduce_batch(loss_normals, w, batch_reduction)
    if return_indices:
        return loss, loss_normals, ((idx_x, idx_y) if both else idx_x)
    return loss, loss_normals


def _normal_cosines(own: torch.Tensor, other: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cos(own[b, i], other[b, idx[b, i]]) as [B, P] fp32 (any value where idx is -1)."""
    B, P, Dn = own.shape
    if other.shape[1] == 0:
        return own.float().sum(-1) * 0.0
    near = torch.gather(other.float(), 1, idx.clamp_min(0)[..., None].expand(B, P, Dn))  # [B, P, D']
    return F.cosine_similarity(own.float(), near, dim=2, eps=1e-6)


def _reduce_points(term: torch.Tensor, lengths: torch.Tensor, point_reduction):
    """[B, P] per-point terms (0 at padding) -> [B] (or [B, P] for None)."""
    if point_reduction is None:
        return term
    if point_reduction == "max":
        if term.shape[1] == 0:
            return term.sum(1)
        return term.max(1).values
    total = term.sum(1)
    if point_reduction == "mean":
        total = total / lengths.clamp_min(1).to(total.dtype)
    return total


def _combine(per_direction: list, point_reduction):
    if len(per_direction) == 1:
        return per_direction[0]
    a, b = per_direction
    if point_reduction is None:
        return (a, b)
    if point_reduction == "max":
        return torch.maximum(a, b)
    return a + b


def _reduce_batch(loss, w, batch_reduction):
    if batch_reduction is None:
        return loss
    total = loss.sum()
    if batch_reduction == "sum":
        return total
    if w is None:
        return total / max(loss.shape[0], 1)
    ws = w.float().sum()
    return total / torch.where(ws == 0, torch.ones_like(ws), ws)
