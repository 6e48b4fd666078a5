"""Tuning as data: tile tables per GPU family (:mod:`maxsim.tuning.tables`), the rule reader
(:mod:`maxsim.tuning.rules`) and the opt-in autotuner (:mod:`maxsim.tuning.autotune`).

Nothing here chooses a kernel: :mod:`maxsim.selection` reads these tables.
"""

from __future__ import annotations

import functools
import warnings

import torch

from maxsim.tuning.rules import next_pow2

FAMILIES = ("sm90", "unmeasured", "interpreter")


class UntunedGPUWarning(UserWarning):
    """The GPU is not one the tile tables were measured on: Hopper's choices, clamped, are used."""


@functools.lru_cache(maxsize=16)
def gpu_family(device_index: int) -> str:
    """The tile tables' family of a device: ``"interpreter"`` (index -1: Triton's CPU
    interpreter), ``"sm90"`` (Hopper: measured on the H100 and the H200) or ``"unmeasured"`` (any
    other GPU: the nearest measured family's choices, clamped; said once a device)."""
    if device_index < 0:
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major == 9:
        return "sm90"
    warnings.warn(f"maxsim: the kernels' tiles were measured on Hopper GPUs (H100, H200); "
                  f"{torch.cuda.get_device_name(device_index)} (sm{major}{minor}) runs Hopper's choices clamped to "
                  "what every GPU from sm80 holds: the scores are the same, the speed is not tuned "
                  "(maxsim.explain(...) shows each call's plan)", UntunedGPUWarning, stacklevel=2)
    return "unmeasured"


@functools.lru_cache(maxsize=16)
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def free_device_bytes(device: torch.device) -> int:
    """Bytes a new allocation on CUDA ``device`` can take: the driver's free memory plus what
    PyTorch's caching allocator holds unused (freed tensors it keeps for reuse, which the driver
    counts as taken)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def is_big_corpus(doc_tokens: int) -> bool:
    from maxsim.tuning.tables import BIG_CORPUS_TOKENS

    return doc_tokens >= BIG_CORPUS_TOKENS


__all__ = ["FAMILIES", "UntunedGPUWarning", "free_device_bytes", "gpu_family", "is_big_corpus", "multiprocessors",
           "next_pow2"]
