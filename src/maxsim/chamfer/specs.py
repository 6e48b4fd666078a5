"""What each Chamfer-distance kernel supports, declared as data (no kernel imports: the selection
layer, :mod:`maxsim.selection.chamfer`, checks calls against these declarations).

The call's layout is ``"clouds"``: batched point clouds ``x [B, N, D]``, ``y [B, M, D]``;
``masked`` means per-cloud lengths were given. Nothing here normalises, so ``normalize=False``.
"""

from __future__ import annotations

from maxsim._capability import KernelSpec

CLOUDS = ("clouds",)

DIRECT_FORWARD = KernelSpec(
    "chamfer.direct_forward",
    "per-coordinate differences of a [BM, BN] tile of point pairs in fp32 (norm 1 or 2, no "
    "cancellation), running min and argmin per point, both directions in one launch",
    layouts=CLOUDS, normalize=False,
)
DOT_FORWARD = KernelSpec(
    "chamfer.dot_forward",
    "|x|^2 + |y|^2 - 2 x.y from a tiled tl.dot (tensor cores for 16-bit, IEEE for fp32), clamped "
    "at 0, running min and argmin per point, both directions in one launch (norm 2 only)",
    layouts=CLOUDS, normalize=False,
)
ATOMIC_BACKWARD = KernelSpec(
    "chamfer.atomic_backward",
    "each point's own term stored, its neighbour's term added by fp32 atomics (last bits vary run to run)",
    layouts=CLOUDS, normalize=False,
)
OWNED_BACKWARD = KernelSpec(
    "chamfer.owned_backward",
    "destination-owned: the argmin inverted by a stable sort, each point sums its own term and its "
    "entries in a fixed order, written once in the input dtype (bitwise deterministic)",
    layouts=CLOUDS, normalize=False,
)
