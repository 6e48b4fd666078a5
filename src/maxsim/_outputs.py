"""The one place where launchers allocate the outputs their kernels must write in full.

Kept apart so that the tests can replace :func:`empty` by a version that fills the buffer with
NaN (float) or -2 (int) first: an element a kernel fails to write cannot pass for a result.
"""

from __future__ import annotations

import torch


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
