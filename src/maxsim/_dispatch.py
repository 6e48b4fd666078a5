"""Backend choice: CUDA tensors run the Triton kernels, CPU tensors PyTorch.

``MAXSIM_BACKEND`` overrides the choice for every call:

- ``auto`` (default): Triton on CUDA tensors, PyTorch elsewhere.
- ``triton``: always the kernels. On CPU tensors this needs ``TRITON_INTERPRET=1`` (set before
  importing maxsim), which runs them in Triton's interpreter: that is how CI tests the kernels.
- ``reference``: always PyTorch, and for ``maxsim.maxsim`` and the packed functions the plain
  chunked reference, :mod:`maxsim.reference` (any device).
- ``cpu``: always PyTorch, and for those the CPU backend, :mod:`maxsim.cpu` (any device).

On the PyTorch side (:func:`backend_for` says ``"reference"``), :func:`pytorch_backend` says which
implementation the dense and packed families run: the CPU backend unless ``reference`` was asked.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference", "cpu")


# Read once, as Triton does: its @jit picks the interpreter when a kernel is defined.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETING


def cuda_index(t: torch.Tensor) -> int:
    """The index of the CUDA device holding ``t`` (the current device for a bare ``cuda``)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _requested() -> str:
    requested = os.environ.get("MAXSIM_BACKEND", "auto").strip().lower() or "auto"
    if requested not in BACKENDS:
        raise ValueError(f"maxsim: MAXSIM_BACKEND must be one of {', '.join(BACKENDS)}; got {requested!r}")
    return requested


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` (PyTorch) for tensors on ``device``, honouring MAXSIM_BACKEND."""
    requested = _requested()
    if requested in ("reference", "cpu"):
        return "reference"
    if device.type == "cuda":
        return "triton"
    if requested == "triton":
        if not interpreting():
            raise RuntimeError(
                f"maxsim: MAXSIM_BACKEND=triton with tensors on {device} needs TRITON_INTERPRET=1 "
                "(set before importing maxsim) to run the kernels in Triton's CPU interpreter"
            )
        return "triton"
    return "reference"


def pytorch_backend() -> str:
    """Where :func:`backend_for` says ``"reference"``: ``"cpu"`` (:mod:`maxsim.cpu`, blocked GEMMs,
    the default) or ``"reference"`` (the plain :mod:`maxsim.reference`, ``MAXSIM_BACKEND=reference``),
    for the families that have both (``maxsim.maxsim``, the packed functions)."""
    return "reference" if _requested() == "reference" else "cpu"


def through_dispatcher() -> bool:
    """Whether the custom ops (rather than the eager paths, which call the launchers directly) must
    carry a call: under torch.compile, which traces them as opaque operators."""
    return torch.compiler.is_compiling()
