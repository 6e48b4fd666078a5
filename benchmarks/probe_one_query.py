"""One query of up to 128 tokens against a small corpus: the Triton kernel or the warp-specialized
one? (GPU). ``_tuning.WS_ONE_BLOCK_MIN_TOKENS`` decides; this probe times both through
``maxsim.maxsim`` (host path included) with a cold, clean L2 (``maxsim.bench.timing.cold_ms``), and
the host time of a call (calls enqueued back to back, one sync at the end).

    python benchmarks/probe_one_query.py
"""

import torch

import maxsim
import maxsim._tuning as T
import maxsim.dense.forward as F
from maxsim.bench.shapes import Shape, floor_seconds
from maxsim.bench.timing import back_to_back, cold_ms

# (Nd, Lq, Ld), one fp16 query, d = 128: document tokens from 30K to 4M
SHAPES = [(100, 128, 1024), (250, 128, 1024), (500, 128, 1024), (1000, 128, 1024), (2000, 128, 1024),
          (1000, 32, 300), (2000, 32, 300), (4000, 32, 300), (10000, 32, 300), (1000, 64, 300)]


def main():
    default = T.WS_ONE_BLOCK_MIN_TOKENS
    print(f"WS_ONE_BLOCK_MIN_TOKENS = {default}; us, cold clean L2 (host us per call in brackets)")
    for nd, lq, ld in SHAPES:
        torch.manual_seed(0)
        Q = torch.randn(1, lq, 128, device="cuda", dtype=torch.float16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.float16)
        floor_us = floor_seconds(Shape("probe", 1, nd, lq, ld)) * 1e6
        row = []
        ref = None
        for name, threshold in (("triton", 2**62), ("ws", 0)):
            T.WS_ONE_BLOCK_MIN_TOKENS = threshold
            F._PLANS.clear()  # a kept launch plan would skip the rule
            fn = lambda: maxsim.maxsim(Q, D)  # noqa: E731
            out = fn()
            if ref is None:
                ref = out
            err = float((out - ref).abs().max() / ref.abs().max())
            us = cold_ms(fn, warmup=10, rep=60) * 1e3
            row.append(f"{name} {us:7.1f} ({100 * floor_us / us:5.1f} %) [{back_to_back(fn, 200)[0] * 1e6:5.1f}] err {err:.0e}")
        T.WS_ONE_BLOCK_MIN_TOKENS = default
        print(f"Nd {nd:6d} Lq {lq:4d} Ld {ld:5d} ({nd * ld / 1e6:5.2f}M tokens, floor {floor_us:6.1f} us): "
              + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
