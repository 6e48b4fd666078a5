"""A thin launch path for Triton (and Gluon) kernels.

Triton's ``kernel[grid](...)`` binds and specialises every argument, builds a cache key and
checks globals on each call: tens of microseconds of Python, more than a small MaxSim takes on the
GPU. Here the compiled kernel is looked up by a key at least as fine as Triton's own
specialisation (constexprs, launch options, each tensor's dtype and address mod 16, each
specialised integer's value mod 16 and range), so a hit can launch it directly, through the
compiled kernel's own launcher (skipping the per-call closure and metadata of ``compiled[grid]``
when no launch hook, e.g. a profiler's, is installed). A miss, the interpreter, or any sign that
Triton's internals changed falls back to the ordinary path.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon's host-side descriptor (the warp-specialized forward's); its API moves between releases
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover - another Triton: no Gluon kernel is launched then
    GluonTensorDescriptor = TensorDescriptor

from maxsim._dispatch import interpreting

# Triton's own default pipelining depth on CUDA, for kernels that are not tuned on it.
DEFAULT_STAGES = 3

_COMPILED: dict = {}
# Keyed by the kernel itself, not its id(): a kernel that was collected could pass its id on.
_SPECIALIZED: dict = {}  # kernel -> _value_specialized(kernel)
_FAST_PATH = {"enabled": True}
# Kernels whose direct launch failed, each with the reason: they take Triton's ordinary path from
# then on. Per kernel, so one kernel's surprise never slows every other kernel's calls.
ORDINARY_PATH_ONLY: dict = {}
_I32 = 2**31


def _arg_class(arg, value_specialized: bool):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16
    if isinstance(arg, TensorDescriptor):  # specialised on its element type and box
        return arg.base.dtype, tuple(arg.block_shape), arg.padding
    if isinstance(arg, GluonTensorDescriptor):  # and, for Gluon, its shared-memory layout
        return arg.base.dtype, tuple(arg.block_shape), arg.padding, repr(arg.layout)
    if value_specialized:
        return arg % 16, arg == 1, -_I32 <= arg < _I32
    return -_I32 <= arg < _I32


def _arg_classes(args, flags) -> list:
    """``[_arg_class(a, f) for ...]`` with the common cases inline: this runs on every launch, and
    a Python call per argument is a measurable share of a small call's host time."""
    out = []
    for arg, value_specialized in zip(args, flags):
        if type(arg) is int:
            out.append((arg % 16, arg == 1, -_I32 <= arg < _I32) if value_specialized else -_I32 <= arg < _I32)
        else:
            out.append(_arg_class(arg, value_specialized))
    return out


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    """Whether a launch hook (Triton's profiler interface) must see launches. Triton 3.6 keeps
    them in ``HookChain``s, empty by default (yet called on every ordinary launch)."""
    knobs = _RUNTIME_KNOBS
    return knobs is None or _hook_set(knobs.launch_enter_hook) or _hook_set(knobs.launch_exit_hook)


def _current_stream(device: int):
    """The current CUDA stream's handle, as Triton's own launch path gets it."""
    return triton.runtime.driver.active.get_current_stream(device)


def _value_specialized(kernel) -> tuple[bool, ...] | None:
    """Per parameter, whether Triton specialises an integer argument on its value (not listed in
    the kernel's ``do_not_specialize``); None if this Triton does not expose its parameters."""
    flags = _SPECIALIZED.get(kernel)
    if flags is None:
        params = getattr(kernel, "params", None)
        if params is None or not all(hasattr(p, "do_not_specialize") for p in params):
            return None
        flags = _SPECIALIZED[kernel] = tuple(not p.do_not_specialize for p in params)
    return flags


class Replay:
    """Launches one compiled kernel again, on one grid, with new runtime arguments of the same
    classes (dtype and alignment of each tensor, value class of each specialised integer): what a
    caller that keys its own plans finer than :func:`launch` does can call directly."""

    __slots__ = ("compiled", "grid3", "constexpr_values", "device")

    def __init__(self, compiled, grid3: tuple, constexpr_values: tuple, device: int):
        self.compiled, self.grid3, self.constexpr_values, self.device = compiled, grid3, constexpr_values, device

    def __call__(self, args: tuple) -> None:
        # A compiled kernel's launcher takes a 3-D grid and every argument, constexprs included.
        compiled = self.compiled
        if _hooks_installed():
            compiled[self.grid3](*args, *self.constexpr_values)
        else:
            compiled.run(*self.grid3, _current_stream(self.device), compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *self.constexpr_values)


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, *, num_warps: int, num_stages: int | None = None,
           **options) -> Replay | None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=..., **options)``, minus the
    overhead (Triton and Gluon kernels; options such as ``maxnreg``).

    ``args`` are the runtime arguments in signature order, followed in the signature by
    ``constexprs`` (in order; a kernel with a ``num_warps`` constexpr lists it there too, with the
    launch's value). Returns a :class:`Replay` of this launch when it went through the thin path's
    direct launch (a cached kernel); None where Triton's ordinary path ran.
    """
    kwargs = {**constexprs, "num_warps": num_warps, **options}
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    flags = None
    if not interpreting() and _FAST_PATH["enabled"] and kernel not in ORDINARY_PATH_ONLY:
        flags = _value_specialized(kernel)
    if flags is None:
        kernel[grid](*args, **kwargs)
        return None
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, num_stages, *options.items(), *constexprs.values(), *_arg_classes(args, flags))
    compiled = _COMPILED.get(key)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        names = list(getattr(kernel, "arg_names", []))
        if names != names[: len(args)] + list(constexprs) or not hasattr(compiled, "__getitem__"):
            # constexprs out of signature order, or an unexpected Triton: keep the ordinary path
            ORDINARY_PATH_ONLY[kernel] = f"arguments {names[len(args):]} != constexprs {list(constexprs)}"
            return None
        _COMPILED[key] = compiled
        return None  # a Replay only once the direct launch has run (below)
    replay = Replay(compiled, grid3, tuple(constexprs.values()), device)
    try:
        replay(args)
    except (TypeError, AttributeError, IndexError) as error:  # Triton's launcher API differs: fall back
        ORDINARY_PATH_ONLY[kernel] = f"{type(error).__name__}: {error}"
        kernel[grid](*args, **kwargs)
        return None
    return replay
