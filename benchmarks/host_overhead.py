"""Host-side cost of one maxsim call on small shapes (GPU): wall time per call when the GPU is
never the bottleneck, against the kernel's own time inside a CUDA graph.

    python benchmarks/host_overhead.py
"""

import cProfile
import pstats
import time

import torch
import triton

import maxsim
from maxsim import _launch
from maxsim.bench.shapes import GPU_SHAPES, make_inputs


def main():
    for name in ["masked_64x64", "1x1k_128x1024"]:
        shape = next(s for s in GPU_SHAPES if s.name == name)
        Q, D, qm, dm = make_inputs(shape, "cuda")
        fn = lambda: maxsim.maxsim(Q, D, qm, dm)  # noqa: E731
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / n * 1e6
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                out = fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        graph_us = triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median") * 1e3
        ok = torch.allclose(out, maxsim.maxsim(Q, D, qm, dm))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        print(f"{name}: {wall_us:.1f} us per call back to back, {graph_us:.1f} us per graph replay "
              f"(graph scores match: {ok}; thin launch path on: {_launch._FAST_PATH['enabled']})")


if __name__ == "__main__":
    main()
