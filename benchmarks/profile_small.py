"""Where the time of a small call goes (GPU): cProfile of the host path, and kernel time per
configuration measured by CUDA-graph replay (so host overhead is out of the number).

    python benchmarks/profile_small.py
"""

import cProfile
import itertools
import pstats

import torch
import triton

import maxsim
from maxsim._tuning import ForwardConfig
from maxsim.bench.shapes import GPU_SHAPES, make_inputs
from maxsim.dense.forward import maxsim_forward


def graph_time_us(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median") * 1e3


def main():
    shape = next(s for s in GPU_SHAPES if s.name == "masked_64x64")
    Q, D, qm, dm = make_inputs(shape, "cuda")
    for _ in range(10):
        maxsim.maxsim(Q, D, qm, dm)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        maxsim.maxsim(Q, D, qm, dm)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)

    for name in ["masked_64x64", "1x1k_128x1024", "colpali_1x1k", "1q_x_100k"]:
        shape = next(s for s in GPU_SHAPES if s.name == name)
        Q, D, qm, dm = make_inputs(shape, "cuda")
        D4, dm4 = D[None], (dm[None] if dm is not None else None)
        rows = []
        if name == "1q_x_100k":
            grid = [ForwardConfig(32, bn, 128, w, st, wv, False)
                    for bn, w, st, wv in itertools.product((64, 128), (4, 8), (3, 4, 5), (2, 4, 8))]
        else:
            grid = [ForwardConfig(bm, bn, 128, w, st, wv, rm)
                    for bm, bn, w, st, wv, rm in itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (2, 3),
                                                                 (2, 4, 8), (False, True))
                    if bm * bn <= 256 * 128 and not (bm == 256 and w == 4) and (rm or bn <= 64)
                    and not (name != "masked_64x64" and bm == 64)]
        for cfg in grid:
            try:
                us = graph_time_us(lambda: maxsim_forward(Q, D4, qm, dm4, config=cfg))
            except Exception:  # noqa: BLE001 - a config that does not compile is skipped
                continue
            rows.append((us, cfg))
        rows.sort(key=lambda r: r[0])
        print(f"== {name}: kernel time by CUDA graph replay, best 6 of {len(rows)}")
        for us, cfg in rows[:6]:
            print(f"  {us:9.1f} us  {cfg}")


if __name__ == "__main__":
    main()
