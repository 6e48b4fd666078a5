"""Shared plumbing of the integrations: reversible patching and dtype / ragged-pair helpers.

Nothing here imports an optional library; the integration modules pass their library's modules in.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch

import maxsim

# The dtypes the kernels take; anything else (float64, integers) is scored in float32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PatchSet:
    """Attribute replacements that can be undone exactly.

    Each ``replace`` records whether the owner held the attribute itself (a module global, a class
    attribute in its own ``__dict__``, a function's ``__defaults__``) or inherited it, so that
    ``restore`` puts back the very object that was there, or deletes the override.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, bool, object]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def replace(self, owner: object, name: str, value: object) -> None:
        if isinstance(owner, (types.ModuleType, type)):
            own = vars(owner)
            had_own = name in own
            old = own.get(name)
        else:  # e.g. a function's __defaults__: always the owner's own slot
            had_own = True
            old = getattr(owner, name)
        self._saved.append((owner, name, had_own, old))
        setattr(owner, name, value)

    def restore(self) -> None:
        # Reverse order: an attribute replaced twice gets its first original back.
        while self._saved:
            owner, name, had_own, old = self._saved.pop()
            if had_own:
                setattr(owner, name, old)
            else:
                delattr(owner, name)


def rebind_everywhere(patches: PatchSet, package: str, replacements: dict) -> None:
    """Replace every module global of ``package`` (and its loaded submodules) that *is* one of the
    ``replacements`` keys, and every such object in the defaults of functions defined on the
    classes of those modules (default arguments bound when the class was defined).

    ``from x import f`` copies ``f`` into the importing module at import time, so patching ``x``
    alone would miss those copies; scanning by identity finds them all.
    """
    prefix = package + "."
    modules = [m for n, m in list(sys.modules.items()) if m is not None and (n == package or n.startswith(prefix))]
    seen_functions: set[int] = set()
    for module in modules:
        for name, value in list(vars(module).items()):
            if _is_replaceable(value, replacements):
                patches.replace(module, name, replacements[value])
            elif isinstance(value, type) and getattr(value, "__module__", "").startswith(package):
                for attribute in vars(value).values():
                    if isinstance(attribute, (staticmethod, classmethod)):
                        attribute = attribute.__func__
                    function = inspect.unwrap(attribute) if callable(attribute) else attribute
                    if not isinstance(function, types.FunctionType) or id(function) in seen_functions:
                        continue
                    seen_functions.add(id(function))
                    _rebind_defaults(patches, function, replacements)


def _is_replaceable(value: object, replacements: dict) -> bool:
    try:
        return value in replacements
    except TypeError:  # unhashable
        return False


def _rebind_defaults(patches: PatchSet, function: types.FunctionType, replacements: dict) -> None:
    defaults = function.__defaults__
    if defaults and any(_is_replaceable(v, replacements) for v in defaults):
        new_defaults = tuple(replacements[v] if _is_replaceable(v, replacements) else v for v in defaults)
        patches.replace(function, "__defaults__", new_defaults)
    kwdefaults = function.__kwdefaults__
    if kwdefaults and any(_is_replaceable(v, replacements) for v in kwdefaults.values()):
        patches.replace(
            function,
            "__kwdefaults__",
            {k: (replacements[v] if _is_replaceable(v, replacements) else v) for k, v in kwdefaults.items()},
        )


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype to hand the kernels: the inputs' common dtype when the kernels take it, else fp32."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype if dtype in KERNEL_DTYPES else torch.float32


def as_compute(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def score_ragged_pairs(queries: list[torch.Tensor], documents: list[torch.Tensor]) -> torch.Tensor:
    """MaxSim of ``queries[i]`` against ``documents[i]`` for ragged lists of ``[L, d]`` tensors:
    packed, no padding. Returns ``[B]`` fp32; an empty sequence contributes 0."""
    packed_q, cu_q, max_q = maxsim.pack(queries)  # [Tq, d], [B + 1]
    packed_d, cu_d, max_d = maxsim.pack(documents)  # [Td, d], [B + 1]
    pair_index = torch.arange(len(queries), device=packed_q.device)  # [B]
    return maxsim.score_pairs_packed(
        packed_q, packed_d, cu_q, cu_d, pair_index, pair_index, max_seqlen_q=max_q, max_seqlen_d=max_d
    )
