"""What a kernel supports, declared as data (no maxsim imports: the kernels' families declare,
:mod:`maxsim.selection` imports the declarations and checks calls against them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SIXTEEN_BIT = (torch.float16, torch.bfloat16)

_FAMILY_WORDS = {"sm90": "a Hopper GPU (sm90)", "unmeasured": "a GPU other than Hopper",
                 "interpreter": "Triton's CPU interpreter"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Call:
    """A call's description, as the selection layer checks it against each kernel's declaration.

    layout: ``"cross"`` (documents shared), ``"candidates"`` (a list per query), ``"packed"``
    (varlen cross product) or ``"pairs"`` (varlen pair list).  family: the device's tile family
    (:func:`maxsim.tuning.gpu_family`).  triton: the installed Triton's (major, minor).
    layout_notes: per kernel name, why the tensors' memory layout does not suit it (or absent).
    """

    dtype: torch.dtype
    d: int
    layout: str
    masked: bool
    normalize: bool
    argmax: bool
    family: str
    triton: tuple[int, int]
    layout_notes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant's declaration.

    name: ``family.variant`` as ``maxsim.explain`` prints it.  summary: one line, what it is.
    dtypes, dims (None: any d >= 1), layouts, masks / normalize / argmax (supported or not),
    families (GPU families it runs on; None: all, the interpreter included), triton (the only
    Triton releases it is written for; None: any).  layout_check: ``(tensors) -> reason | None``
    for what the tensors' memory layout must allow (checked by the selection layer).
    """

    name: str
    summary: str
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    dims: tuple[int, ...] | None = None
    layouts: tuple[str, ...] = ("cross", "candidates")
    masks: bool = True
    normalize: bool = True
    argmax: bool = True
    families: tuple[str, ...] | None = None
    triton: tuple[tuple[int, int], ...] | None = None
    layout_check: Callable | None = field(default=None, compare=False)
    # Widest d it holds on chip, for 16-bit and for fp32 inputs (None: any): a kernel that keeps a
    # whole query block in shared memory runs out of it past these.
    max_dims: tuple[int, int] | None = None

    def unsupported(self, call: Call) -> str | None:
        """Why this kernel cannot run ``call``, in words (None: it can)."""
        if call.dtype not in self.dtypes:
            return f"takes {' or '.join(dtype_name(t) for t in self.dtypes)} inputs, not {dtype_name(call.dtype)}"
        if self.dims is not None and call.d not in self.dims:
            return f"runs d in {{{', '.join(map(str, self.dims))}}} only, not d = {call.d}"
        if self.max_dims is not None:
            widest = self.max_dims[1] if call.dtype == torch.float32 else self.max_dims[0]
            if call.d > widest:
                return (f"keeps its query block in shared memory: d <= {self.max_dims[0]} for 16-bit inputs, "
                        f"{self.max_dims[1]} for fp32, not d = {call.d}")
        if call.layout not in self.layouts:
            return f"runs the {' / '.join(self.layouts)} layout, not {call.layout}"
        if call.masked and not self.masks:
            return "takes no padding masks"
        if call.normalize and not self.normalize:
            return "does not normalise inside the kernel (normalize=True)"
        if call.argmax and not self.argmax:
            return "does not save the argmax (training or return_argmax=True)"
        if self.families is not None and call.family not in self.families:
            where = " or ".join(_FAMILY_WORDS[f] for f in self.families)
            return f"runs on {where} only, not on {_FAMILY_WORDS[call.family]}"
        if self.triton is not None and call.triton not in self.triton:
            want = ", ".join(f"{a}.{b}" for a, b in self.triton)
            return (f"is written for Triton {want} (its API moves between releases), "
                    f"not {call.triton[0]}.{call.triton[1]}")
        return dict(call.layout_notes).get(self.name)
