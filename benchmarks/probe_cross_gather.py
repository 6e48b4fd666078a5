"""lowmem's grad_Q gather on the cross product (no grad_D atomics): query tokens a program (BS),
warps, documents a step (KB) and the walk order (rotate), on the in-batch training shapes (GPU, cold
L2). gather_config gives it unified's configuration (BS 4, 4 warps, rotate 0, KB 1), which was
tuned beside the atomics; alone, more loads in flight may pay (a PREFETCH variant of the unified
kernel took the gather alone from 260 to 155 us at 128 x 128 on 2026-11-29).

Each configuration's grad_Q is compared with the shipped one's (the sum over documents runs in
another order when KB changes, so to fp32 rounding, then the output dtype).

    python benchmarks/probe_cross_gather.py [--scatter]
"""

import argparse
import itertools

import torch

import maxsim.dense.backward as B
from maxsim.bench.timing import cold_ms
from maxsim.dense.forward import maxsim_forward

SHAPES = [(128, 128, 128, 1024), (256, 256, 32, 180), (128, 128, 1024, 1024)]  # Nq, Nd, Lq, Ld


def gather(Q, D, g, arg, BS, warps, rotate, KB, scatter=False):
    """grad_Q [Nq, Lq, d] by the library's gather kernel; with ``scatter`` also grad_D's atomics
    into a zeroed fp32 buffer (unified's kernel, the zeroing included)."""
    gq = torch.empty_like(Q)
    gd = torch.zeros(D.shape, dtype=torch.float32, device=D.device) if scatter else None
    B.launch_gather(g, Q, D, arg, g, g, gq, gd, False, (BS, warps, rotate, KB))
    return gq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scatter", action="store_true", help="with grad_D's atomics (unified's kernel)")
    args = ap.parse_args()
    for nq, nd, lq, ld in SHAPES:
        torch.manual_seed(0)
        Q = torch.randn(nq, lq, 128, device="cuda").to(torch.bfloat16)
        D = torch.randn(1, nd, ld, 128, device="cuda").to(torch.bfloat16)
        _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
        g = torch.randn(nq, nd, device="cuda")
        shipped = B.gather_config(lq, 128, False, scatter=args.scatter)
        ref = gather(Q, D, g, arg, *shipped).float()
        base = cold_ms(lambda: gather(Q, D, g, arg, *shipped, scatter=args.scatter))  # noqa: B023
        results = []
        for BS, warps, rotate, KB in itertools.product((2, 4, 8, 16), (2, 4), (0, 1), (1, 2, 4)):
            if BS * KB * 128 > 8192 or BS > lq:
                continue
            try:
                ms = cold_ms(lambda: gather(Q, D, g, arg, BS, warps, rotate, KB, scatter=args.scatter))  # noqa: B023
                diff = ((gather(Q, D, g, arg, BS, warps, rotate, KB).float() - ref).norm() / ref.norm()).item()
                results.append((ms, BS, warps, rotate, KB, diff))
            except Exception as e:  # noqa: BLE001
                print(f"  BS {BS} w{warps} rot {rotate} KB {KB}: {type(e).__name__} {e}", flush=True)
        results.sort()
        print(f"({nq}, {nd}, {lq}, {ld}) scatter {args.scatter}: shipped BS {shipped[0]} w{shipped[1]} "
              f"rot {shipped[2]} KB {shipped[3]}: {1e3 * base:.0f} us; best 6 of {len(results)}:", flush=True)
        for ms, BS, warps, rotate, KB, diff in results[:6]:
            print(f"  BS {BS:2d} w{warps} rot {rotate} KB {KB}: {1e3 * ms:6.0f} us  (grad_Q rel diff {diff:.1e})",
                  flush=True)


if __name__ == "__main__":
    main()
