"""Selection for the Chamfer-distance family: which forward kernel (direct differences or tl.dot)
and tile run a call, and which backward (atomics or destination-owned).

The forward candidates (:mod:`maxsim.chamfer.specs`): the direct kernel runs every call (norm 1
is not a dot product; for few coordinates per point the per-coordinate differences cost fewer
instructions a pair than a dot padded to 16 coordinates, and have no cancellation); the dot
kernel runs norm 2 on points wider than ``CHAMFER_DIRECT_MAX_D``. Tiles come from
:mod:`maxsim.tuning.tables`.
"""

from __future__ import annotations

import functools

import torch

from maxsim.chamfer import specs
from maxsim.selection.common import Choice, call_of, device_of
from maxsim.tuning import tables as T
from maxsim.tuning.rules import first_match, next_pow2, tile_of


def _features(dtype: torch.dtype, D: int) -> dict:
    return dict(dtype="fp32" if dtype == torch.float32 else "16bit", d=D)


def _clamp(tile: dict, family: str) -> dict:
    """The sm90 tile as run on ``family`` (the interpreter: small tiles, one stage)."""
    if family == "sm90":
        return tile
    if family == "interpreter":
        c = T.CHAMFER_INTERPRETER_CLAMP
        return {**tile, "BM": min(tile["BM"], c["BM_MAX"]), "BN": min(tile["BN"], c["BN_MAX"]),
                "num_warps": c["num_warps"], "num_stages": c["num_stages"]}
    c = T.CHAMFER_UNMEASURED_CLAMP
    return {**tile, "BM": min(tile["BM"], c["BM_MAX"]), "BN": min(tile["BN"], c["BN_MAX"]),
            "num_stages": min(tile["num_stages"], c["STAGES_MAX"])}


def forward_choice(x: torch.Tensor, norm: int, masked: bool, family: str | None = None) -> Choice:
    """The forward kernel and tile for clouds ``x [B, N, D]`` (y alike) on x's device, or as
    ``family`` (``"sm90"``, ``"unmeasured"``, ``"interpreter"``) would run it."""
    family = family or device_of(x)[1]
    return _forward_choice(x.dtype, x.shape[-1], norm, masked, family)


@functools.lru_cache(maxsize=256)
def _forward_choice(dtype, D, norm, masked, family) -> Choice:
    call = call_of(dtype, D, "clouds", masked, False, True, family)
    f = _features(dtype, D)
    dot_why = specs.DOT_FORWARD.unsupported(call)
    if dot_why is None and norm != 2:
        dot_why = "norm=1 (L1 distance) is not a dot product"
    if dot_why is None and D <= T.CHAMFER_DIRECT_MAX_D:
        dot_why = (f"D = {D} <= {T.CHAMFER_DIRECT_MAX_D}: per-coordinate differences cost fewer instructions a "
                   "pair than a dot padded to 16 coordinates, and do not cancel (not tuned)")
    if dot_why is None:
        rule = first_match(T.CHAMFER_DOT_SM90, f)
        tile = tile_of(rule, f)
        rejected = ((specs.DIRECT_FORWARD.name, f"D = {D} > {T.CHAMFER_DIRECT_MAX_D}: 2 D instructions a pair "
                     "against the dot's fewer (not tuned)"),)
        return Choice(specs.DOT_FORWARD, _clamp(tile, family), rule.name, rule.record, rejected)
    why = specs.DIRECT_FORWARD.unsupported(call)
    if why is not None:  # (the direct kernel's declaration covers every valid call)
        raise RuntimeError(f"maxsim: no Chamfer forward kernel runs this call: {why}")
    rule = first_match(T.CHAMFER_DIRECT_SM90, f)
    tile = {**tile_of(rule, f), "BK": max(16, next_pow2(D))}
    return Choice(specs.DIRECT_FORWARD, _clamp(tile, family), rule.name, rule.record,
                  ((specs.DOT_FORWARD.name, dot_why),))


def backward_choice(x: torch.Tensor, deterministic: bool, family: str | None = None) -> Choice:
    """The backward kernel and its tile: destination-owned when ``deterministic``, else atomics."""
    family = family or device_of(x)[1]
    rule = first_match(T.CHAMFER_BACKWARD, {})
    tile = tile_of(rule, {})
    if family == "interpreter":
        tile = {**tile, "BR": min(tile["BR"], T.CHAMFER_INTERPRETER_CLAMP["BR_MAX"])}
    if deterministic:
        return Choice(specs.OWNED_BACKWARD, tile, "deterministic=True was asked for", rule.record,
                      ((specs.ATOMIC_BACKWARD.name, "its atomics' order varies run to run (deterministic=True)"),))
    return Choice(specs.ATOMIC_BACKWARD, tile, "the default (deterministic=False): no sort of the argmin",
                  rule.record, ((specs.OWNED_BACKWARD.name, "sorts the argmin first: pick it with deterministic=True"),))
