"""Backend choice: CUDA tensors run the Triton kernels, CPU tensors the PyTorch reference.

``MAXSIM_BACKEND`` overrides the choice for every call:

- ``auto`` (default): Triton on CUDA tensors, the reference elsewhere.
- ``triton``: always the kernels. On CPU tensors this needs ``TRITON_INTERPRET=1`` (set before
  importing maxsim), which runs them in Triton's interpreter: that is how CI tests the kernels.
- ``reference``: always the chunked PyTorch reference (any device).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")


# Read once, as Triton does: its @jit picks the interpreter when a kernel is defined.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETING


def cuda_index(t: torch.Tensor) -> int:
    """The index of the CUDA device holding ``t`` (the current device for a bare ``cuda``)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for tensors on ``device``, honouring MAXSIM_BACKEND."""
    requested = os.environ.get("MAXSIM_BACKEND", "auto").strip().lower() or "auto"
    if requested not in BACKENDS:
        raise ValueError(f"maxsim: MAXSIM_BACKEND must be one of {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "reference":
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


def through_dispatcher() -> bool:
    """Whether the custom ops (rather than the eager paths, which call the launchers directly) must
    carry a call: under torch.compile, which traces them as opaque operators."""
    return torch.compiler.is_compiling()
