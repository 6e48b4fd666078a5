"""Tuning as data: tile tables per GPU family (:mod:`maxsim.tuning.tables`), the rule reader
(:mod:`maxsim.tuning.rules`) and the opt-in autotuner (:mod:`maxsim.tuning.autotune`).

Nothing here chooses a kernel: :mod:`maxsim.selection` reads these tables.
"""

from __future__ import annotations

import functools

import torch

from maxsim.tuning.rules import next_pow2

FAMILIES = ("sm90", "unmeasured", "interpreter")


@functools.lru_cache(maxsize=16)
def gpu_family(device_index: int) -> str:
    """The tile tables' family of a device: ``"interpreter"`` (index -1: Triton's CPU
    interpreter), ``"sm90"`` (Hopper: measured on an H200) or ``"unmeasured"`` (any other GPU)."""
    if device_index < 0:
        return "interpreter"
    return "sm90" if torch.cuda.get_device_capability(device_index)[0] == 9 else "unmeasured"


@functools.lru_cache(maxsize=16)
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def is_big_corpus(doc_tokens: int) -> bool:
    from maxsim.tuning.tables import BIG_CORPUS_TOKENS

    return doc_tokens >= BIG_CORPUS_TOKENS


__all__ = ["FAMILIES", "gpu_family", "is_big_corpus", "multiprocessors", "next_pow2"]
