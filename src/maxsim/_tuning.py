"""Kernel configurations: chosen by shape from a fixed rule, never autotuned at run time.

A rule (rather than ``triton.autotune``) keeps the hot path free of tuning runs and makes the
compiled-variant count small: only power-of-two buckets of Lq and d and the dtype enter the choice
of constexprs, so a new batch size or document length never compiles again. The rule's constants
come from sweeps on an H200 (``benchmarks/tune_forward.py``; numbers in BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclass(frozen=True)
class ForwardConfig:
    """Tile shape and launch parameters of the dense forward kernel.

    BM: query rows per program (several queries stacked, or a chunk of a long query).
    BN: document tokens per tile.  BK: embedding dims per ``tl.dot`` (d > BK loops over d).
    waves: programs launched per multiprocessor; sets how many documents each program walks.
    """

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    waves: int = 8


def multiprocessor_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count(index)


@functools.lru_cache(maxsize=16)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_config(
    Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, interpret: bool = False
) -> ForwardConfig:
    """The forward tile configuration for a shape (depends on buckets of Lq and d only)."""
    wide = dtype == torch.float32
    BK = min(64 if wide else 128, max(16, next_pow2(d)))
    seg = next_pow2(max(Lq, 1))
    rows = seg if candidates else seg * next_pow2(max(Nq, 1))
    BM = min(128, max(16, rows))
    BN = 32 if wide else 64
    if interpret:
        return ForwardConfig(BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=1, waves=1)
    num_warps = 8 if BM * BN >= 128 * 64 else 4
    return ForwardConfig(BM=BM, BN=BN, BK=BK, num_warps=num_warps, num_stages=3)
