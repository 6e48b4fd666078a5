"""The CPU backend against naive PyTorch on the CPU benchmark shapes, fp32 and bf16 (and fp16).

    python benchmarks/cpu_bench.py [--rounds 5] [--dtypes fp32,bf16] [--shapes a,b] [--big]

Each round times naive, maxsim and maxsim with ``MAXSIM_CPU_THREADS=workers`` once per shape
(interleaved, so a neighbour's load hits all alike); a cell is the best of the rounds. naive is
PyLate's torch path in the input dtype (the full similarity tensor, masks multiplied in); maxsim
is ``maxsim.maxsim`` on CPU tensors, which runs the CPU backend (:mod:`maxsim.cpu`). The header's
GEMM rate is one plain fp32 ``torch.mm`` of [4096, 128] x [128, 4096] timed in the same rounds:
the machine's matmul rate to compare with. ``max|diff|`` is against ``maxsim_reference``.
``--big`` adds the issue's larger shapes (1 x 10K and 32 x 1K at (32, 180)). See docs/cpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

import maxsim
from maxsim.bench import CPU_SHAPES, Shape, make_inputs

DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
BIG_SHAPES = [Shape("1q_x_10k_32x180", 1, 10_000, 32, 180), Shape("32q_x_1k_32x180", 32, 1_000, 32, 180)]


def naive(Q, D, q_mask, d_mask):
    """PyLate's torch path: [Nq, Nd, Lq, Ld] in the input dtype, masks multiplied in."""
    S = torch.einsum("asd,btd->abst", Q, D)
    if q_mask is not None:
        S = S * q_mask[:, None, :, None]
    if d_mask is not None:
        S = S * d_mask[None, :, None, :]
    return S.max(-1).values.sum(-1).float()


def ours(Q, D, q_mask, d_mask):
    return maxsim.maxsim(Q, D, q_mask, d_mask)


def workers(Q, D, q_mask, d_mask):
    """maxsim with MAXSIM_CPU_THREADS=workers (single-threaded workers instead of the op's team)."""
    os.environ["MAXSIM_CPU_THREADS"] = "workers"
    try:
        return maxsim.maxsim(Q, D, q_mask, d_mask)
    finally:
        del os.environ["MAXSIM_CPU_THREADS"]


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--shapes", default="", help="comma-separated names (default: the CPU set)")
    ap.add_argument("--big", action="store_true")
    opts = ap.parse_args()
    shapes = CPU_SHAPES + (BIG_SHAPES if opts.big else [])
    if opts.shapes:
        shapes = [s for s in shapes if s.name in opts.shapes.split(",")]
    cases = []
    for dt in opts.dtypes.split(","):
        for s in shapes:
            shape = dataclasses.replace(s, dtype=DTYPES[dt])
            Q, D, qm, dm = make_inputs(shape, "cpu")
            # Against the plain reference (the masked shapes: maxsim's default rule, "exclude").
            err = (ours(Q, D, qm, dm) - maxsim.reference.maxsim_reference(Q, D, qm, dm)).abs().max().item()
            cases.append((shape, (Q, D, qm, dm), err))
    a, b = torch.randn(4096, 128), torch.randn(4096, 128)
    best = {}
    gemm_ms = float("inf")
    with torch.inference_mode():
        for _ in range(opts.rounds):
            gemm_ms = min(gemm_ms, timed(torch.mm, a, b.t()))
            for k, (shape, inputs, _) in enumerate(cases):
                for name, fn in (("naive", naive), ("maxsim", ours), ("workers", workers)):
                    best[k, name] = min(best.get((k, name), float("inf")), timed(fn, *inputs))
    gemm_rate = 2 * 4096 * 4096 * 128 / gemm_ms / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; "
          f"best of {opts.rounds} rounds; plain fp32 GEMM rate {gemm_rate:.0f} GFLOP/s")
    print(f"{'shape':<22} {'dtype':<5} {'naive ms':>10} {'maxsim ms':>10} {'speed-up':>9} {'GFLOP/s':>8} "
          f"{'workers ms':>10} {'max|diff|':>10}")
    for k, (shape, (Q, D, qm, dm), err) in enumerate(cases):
        n, m = best[k, "naive"], best[k, "maxsim"]
        flops = 2 * Q.shape[0] * D.shape[0] * Q.shape[1] * D.shape[1] * Q.shape[2]
        w = best[k, "workers"]
        print(f"{shape.name:<22} {shape.dtype:<5} {n:>10.2f} {m:>10.2f} {n / m:>8.2f}x {flops / m / 1e6:>8.0f} "
              f"{w:>10.2f} {err:>10.2e}")


if __name__ == "__main__":
    main()
