"""Page-locked host copies of exactly their size.

PyTorch's pinned allocator rounds every block up to a power of two, so a corpus pinned slice by
slice can take up to twice its bytes of host memory (at 10M passages, 40 slices of 2.35 GB of int8
tokens took 40 x 4.29 GB and the host ran out). Large tensors are copied instead into anonymous
memory registered with ``cudaHostRegister`` (page-locked in place, exact size), unregistered when
the last tensor using it is freed; small ones keep the caching allocator (cheaper to allocate).

    host = pinned_copy(t)          # t on any device -> the same values, page-locked on the host
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

EXACT_BYTES = 64 << 20  # below this the power-of-two rounding wastes little and caching is faster

_lock = threading.Lock()
_live = 0  # registrations not yet undone (tests and diagnostics read it through live_registrations)


def live_registrations() -> int:
    """How many exact-size pinned buffers are alive (each undone when its tensors are freed)."""
    return _live


def _unregister(ptr: int) -> None:
    global _live
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the CUDA runtime may be gone first
        pass
    with _lock:
        _live -= 1


def _registered_empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], page-locked in place."""
    global _live
    cudart = torch.cuda.cudart()
    torch.cuda.init()  # cudaHostRegister wants the runtime's context
    buffer = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, freed with the last reference
    array = np.frombuffer(buffer, dtype=np.uint8)
    ptr = array.ctypes.data
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if status != cudart.cudaError.success:
        raise RuntimeError(f"cannot page-lock {nbytes / 1e9:.2f} GB of host memory ({cudart.cudaGetErrorString(status)}): "
                           "keep the corpus in pageable host memory (Corpus.to('cpu')) or memory-mapped (Corpus.load)")
    with _lock:
        _live += 1
    # The array owns the mapping (its base); it dies with the last tensor viewing it, and its
    # weak references are cleared before it releases the mapping: unregister, then unmap.
    weakref.finalize(array, _unregister, ptr)
    return torch.from_numpy(array)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in page-locked host memory (a new tensor; contiguous). From a device, copied
    once straight into the page-locked buffer."""
    nbytes = t.numel() * t.element_size()
    if nbytes >= EXACT_BYTES and torch.cuda.is_available():
        return _registered_empty(nbytes).view(t.dtype).view(t.shape).copy_(t)
    if t.device.type == "cpu":
        return t.pin_memory()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
