"""GPU timing with a cold, clean L2: ``cold_ms(fn)``, the median milliseconds of one call.

Why not ``triton.testing.do_bench`` as it is. It empties the L2 before each call by *zeroing* a
256 MB buffer, which leaves the L2 full of dirty lines (about 50 MB on an H200). The timed call must
then write those back before its own reads fit, so every bandwidth-bound call is charged for the
flush's writes, and no kernel could reach the floor ``bytes read / bandwidth`` that BENCHMARKS.md
divides by (measured: benchmarks/HISTORY.md, "a cold, clean L2").

Here the flush *reads* 256 MB instead (a sum: one tiny output). That evicts the inputs just as
well and leaves clean lines, so the call pays for its own traffic and nothing else. The rest is
do_bench's procedure: an estimate over 5 calls, warm-up calls for ``warmup`` ms, then ``rep`` ms of
calls, each after a flush and between CUDA events, median.

``back_to_back(fn, n)`` gives the other side: host and wall time per call of a loop with no flush.
"""

from __future__ import annotations

import statistics
import time

import torch

FLUSH_BYTES = 256 * 2**20  # several times the L2 of any current GPU (H200: 50 MB)

_flush_buffers: dict[int, torch.Tensor] = {}


def flush_l2() -> None:
    """Evict the current CUDA device's L2 by reading FLUSH_BYTES; leaves clean lines."""
    index = torch.cuda.current_device()
    buf = _flush_buffers.get(index)
    if buf is None:
        buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=torch.device("cuda", index))
        _flush_buffers[index] = buf
    buf.sum()  # reads every line; the result is one int64


def cold_ms(fn, warmup: float = 25, rep: float = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device, each call after :func:`flush_l2`
    (``warmup`` and ``rep`` in ms of calls, as in ``triton.testing.do_bench``)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush_l2()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup = max(1, int(warmup / estimate_ms))
    n_repeat = max(1, int(rep / estimate_ms))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_repeat):
        flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def back_to_back(fn, n: int) -> tuple[float, float]:
    """(host, wall) seconds per call of ``fn`` enqueued ``n`` times back to back after a warm-up
    call: host, until the last call returned; wall, until the GPU finished them (one sync at the
    end), a loop's time per call, the host's where it is slower than the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n, (time.perf_counter() - t0) / n
