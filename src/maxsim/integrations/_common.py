"""Shared plumbing of the integrations: reversible patching and dtype / ragged-pair helpers.

Nothing here imports an optional library; the integration modules pass their library's modules in.
"""

from __future__ import annotations

import inspect
import re
import sys
import types

import torch

import maxsim

# The dtypes the kernels take; anything else (float64, integers) is scored in float32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Libraries whose version was already warned about (once per process).
_WARNED: set[str] = set()


def _version_tuple(version: str) -> tuple[int, ...]:
    """"1.6.0", "0.3.18.post1", "6.2.0rc1" -> (1, 6, 0), (0, 3, 18), (6, 2, 0): the numeric release."""
    release = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in release.group(0).split(".")) if release else ()


def require_library(distribution: str, extra: str, tested: tuple[str, str]) -> None:
    """Before ``patch()`` imports ``distribution``: not installed -> an ImportError that names the
    install command; installed outside ``tested = (lowest, below)`` -> one warning naming the tested
    versions (the patch goes on: a newer release usually keeps the scoring functions)."""
    from importlib import metadata

    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"maxsim: patch() needs {distribution}, which is not installed: "
                                  f'pip install "maxsim[{extra}]"') from None
    lowest, below = tested
    if not _version_tuple(lowest) <= _version_tuple(version) < _version_tuple(below) and distribution not in _WARNED:
        _WARNED.add(distribution)
        import warnings

        warnings.warn(f"maxsim: {distribution} {version} is outside the versions its drop-in was tested with "
                      f"(>= {lowest}, < {below}); scores and patching may differ", stacklevel=3)


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


def scores_dtype(torch_path: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the library's own scores where they would be computed: on CUDA its kernel
    backends' (flash-maxsim, late-interaction-kernels: fp32, whatever the inputs' 16-bit dtype;
    float64 takes its torch path and stays float64), elsewhere its torch path's einsum dtype
    ``torch_path`` (16-bit inputs give 16-bit scores on the CPU, as the libraries' own CPU tests
    expect). maxsim accumulates in fp32 either way."""
    if torch.device(device).type == "cuda" and torch_path != torch.float64:
        return torch.float32
    return torch_path


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


def pack_with_zero_rows(items: list[torch.Tensor], zero_row: list[bool], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pack ``[L_i, d]`` tensors, each followed by one zero row where ``zero_row[i]``, on ``device``
    -> ``(packed [T, d], cu_seqlens int64 [N + 1], longest)``.

    The libraries pad a group of documents to its longest with zero rows, and a zero row takes part
    in the max (similarity 0): one zero row after each shorter document gives the same maxes with
    nothing else padded. One ``torch.cat`` (batched copies, not one copy a document) and one
    transfer to ``device``."""
    zero = items[0].new_zeros(1, items[0].shape[-1])  # [1, d]
    pieces: list[torch.Tensor] = []
    lengths: list[int] = []
    for item, pad in zip(items, zero_row):
        pieces.append(item)
        if pad:
            pieces.append(zero if zero.device == item.device and zero.dtype == item.dtype
                          else zero.to(item.device, item.dtype))
        lengths.append(item.shape[0] + int(pad))
    packed = torch.cat(pieces).to(device)  # [T, d]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=cu[1:])
    return packed, cu.to(packed.device), max(lengths)
