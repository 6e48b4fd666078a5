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
    row_max: reduce each tile to a per-row max at once instead of a running [BM, BN] max.
    """

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    waves: int = 2
    row_max: bool = False


@functools.lru_cache(maxsize=16)
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def forward_config(Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, interpret: bool = False) -> ForwardConfig:
    """The forward tile configuration for a shape: depends on power-of-two buckets of Lq, Nq and d,
    the dtype and the layout only, so new batch sizes and document lengths never compile again.

    From sweeps on an H200 (kernel time by CUDA-graph replay; BENCHMARKS.md,
    benchmarks/tune_forward.py, benchmarks/profile_small.py):
    - many query rows per document tile (>= 256): BM=256, 8 warps, per-tile row max (71 % of the
      compute floor at 32 x 100K against 56 % with BM=128 and the running [BM, BN] max); long
      queries (>= 128 tokens: in-batch training, ColPali) prefer BN=128 (957 against 1070 us at
      128 x 128 x 128 x 1024);
    - d > 128: BK=64 chunks with BM=128, BN=128 (shared memory caps wider tiles);
    - 128 rows: BM=128, BN=64, running max;
    - fewer rows (one short query, or candidate lists): bandwidth-bound, BM=16-64, BN=128;
    - about 2 programs per multiprocessor, each walking a run of documents, beat more, shorter ones,
      except for short stacked queries and wide d (8).
    """
    seg = next_pow2(max(Lq, 1))
    rows = seg if candidates else seg * next_pow2(max(Nq, 1))
    bk = max(16, next_pow2(d))
    if dtype == torch.float32:
        # IEEE fp32 dots run on the FMA units: modest tiles, a running max.
        cfg = ForwardConfig(BM=min(128, max(16, rows)), BN=32, BK=min(64, bk), num_warps=4, num_stages=2)
    elif d > 128:
        cfg = ForwardConfig(BM=min(128, max(16, rows)), BN=128, BK=64, num_warps=4, num_stages=3, waves=8,
                            row_max=True)
    elif rows >= 256 and seg >= 128:
        cfg = ForwardConfig(BM=256, BN=128, BK=bk, num_warps=8, num_stages=3, waves=2, row_max=True)
    elif rows >= 256:
        cfg = ForwardConfig(BM=256, BN=64, BK=bk, num_warps=8, num_stages=3, waves=8, row_max=True)
    elif rows >= 128:
        cfg = ForwardConfig(BM=128, BN=64, BK=bk, num_warps=8, num_stages=3)
    else:
        cfg = ForwardConfig(BM=max(16, rows), BN=128, BK=bk, num_warps=4, num_stages=3)
    if interpret:
        # The interpreter runs one program at a time: few, small programs, no pipelining.
        return ForwardConfig(BM=min(cfg.BM, 64), BN=min(cfg.BN, 64), BK=cfg.BK, num_warps=4, num_stages=1,
                             waves=1, row_max=cfg.row_max)
    return cfg
