"""Sweep the dense forward kernel's tile configurations on the benchmark shapes (GPU only).

    python benchmarks/tune_forward.py [--shapes a,b]     (any shape of maxsim.bench.shapes, or a set: sweep)

For each shape: checks the default configuration against the reference, then times a grid of
(BM, BN, num_warps, num_stages, waves) and prints the best few with % of the floor. The results
feed the rule in ``maxsim._tuning.forward_config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch

from maxsim._tuning import ForwardConfig, forward_config, next_pow2
from maxsim.bench.shapes import GPU_SHAPES, floor_seconds, make_inputs, shapes_by_name
from maxsim.bench.timing import cold_ms
from maxsim.dense.forward import maxsim_forward
from maxsim.reference import maxsim_reference


def candidate_configs(shape, row_max_only=False, tma=False):
    seg = next_pow2(shape.lq)
    rows = seg * next_pow2(shape.nq)
    bms = sorted({min(max(16, rows), bm) for bm in (32, 64, 128, 256)})
    bks = (64, 128) if shape.d > 128 else (min(128, max(16, next_pow2(shape.d))),)
    if not row_max_only:
        for bm, bn, warps, bk in itertools.product(bms, (32, 64, 128), (4, 8), bks):
            if bm * bn > 256 * 64 or (bm == 256 and warps == 4):
                continue
            yield ForwardConfig(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3, tma=tma)
    # Per-tile row reduction: only the accumulator lives in registers, so wider tiles fit.
    # Two pipeline depths: 3 stages of BM=256 x BN=128 x BK=128 hold ~160 KB of shared memory (one
    # program per SM); 2 stages of a 128 x 128 tile (~96 KB) fit two programs per SM, so that one's
    # epilogue runs during the other's MMAs (measured faster on the compute-bound shapes).
    for bm, bn, warps, bk, stages in itertools.product(bms, (64, 128, 256), (4, 8), bks, (2, 3)):
        if bm < 64 or bm * bn > 256 * 128 or (bm == 256 and warps == 4):
            continue
        yield ForwardConfig(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, row_max=True, tma=tma)


def time_config(Q, D, qm, dm, cfg, ref=None, argmax=False):
    """Median ms of the forward at ``cfg`` (with ``argmax``: the training forward, which also
    saves the winners); with ``ref``, a configuration whose scores are off (relative error > 1e-4)
    raises instead of being timed."""
    fn = lambda: maxsim_forward(Q, D, qm, dm, config=cfg, save_argmax=argmax)  # noqa: E731
    out = fn()[0]
    torch.cuda.synchronize()
    if ref is not None:
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        if not err <= 1e-4:
            raise ValueError(f"wrong scores (rel err {err:.1e})")
    return cold_ms(fn, warmup=10, rep=40)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="")
    ap.add_argument("--row-max-only", action="store_true", help="only the per-tile row-max configurations")
    ap.add_argument("--argmax", action="store_true", help="time the training forward (saves the argmax)")
    ap.add_argument("--tma", action="store_true", help="document tiles through TMA in every configuration")
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    shapes = shapes_by_name(names) if names else GPU_SHAPES
    summary = []
    for shape in shapes:
        Q, D, qm, dm = make_inputs(shape, "cuda")
        D4 = D.unsqueeze(0)
        dm4 = dm.unsqueeze(0) if dm is not None else None
        floor_ms = floor_seconds(shape) * 1e3
        default = forward_config(shape.nq, shape.lq, shape.d, Q.dtype, False, argmax=args.argmax)
        out, _ = maxsim_forward(Q, D4, qm, dm4)
        ref = maxsim_reference(Q, D, qm, dm)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        results = []
        for cfg in candidate_configs(shape, args.row_max_only, args.tma):
            try:
                ms = time_config(Q, D4, qm, dm4, cfg, ref, args.argmax)
            except Exception as e:  # noqa: BLE001 - a config that does not compile (or is wrong) is a result
                print(f"  {shape.name} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append((ms, cfg))
            print(f"  {shape.name} BM={cfg.BM} BN={cfg.BN} BK={cfg.BK} w={cfg.num_warps} s={cfg.num_stages} row_max={cfg.row_max}: "
                  f"{ms:.4f} ms", flush=True)
        if not results:  # e.g. --row-max-only on a shape of fewer than 64 query rows
            print(f"{shape.name}: no candidate configuration ran", flush=True)
            continue
        results.sort(key=lambda r: r[0])
        best_ms, best = results[0]
        # Second pass around the best tile: pipeline depth and waves.
        for stages, waves in itertools.product((2, 3, 4), (1, 2, 4, 8, 16)):
            cfg = dataclasses.replace(best, num_stages=stages, waves=waves)
            try:
                ms = time_config(Q, D4, qm, dm4, cfg, ref, args.argmax)
            except Exception as e:  # noqa: BLE001
                print(f"  {shape.name} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append((ms, cfg))
        results.sort(key=lambda r: r[0])
        default_ms = time_config(Q, D4, qm, dm4, default, argmax=args.argmax)
        best_ms, best = results[0]
        summary.append((shape.name, floor_ms, default_ms, default, best_ms, best, err))
        print(f"{shape.name}: floor {floor_ms:.3f} ms, default {default_ms:.3f} ms, best {best_ms:.3f} ms "
              f"{best}, err {err:.2e}", flush=True)
        del Q, D, D4, qm, dm
        torch.cuda.empty_cache()
    print("\nshape               floor_ms  default_ms  %floor  best_ms  %floor  best config")
    for name, floor_ms, dms, dcfg, bms, bcfg, err in summary:
        print(f"{name:18s} {floor_ms:9.3f} {dms:10.3f} {100 * floor_ms / dms:6.1f}% {bms:8.3f} "
              f"{100 * floor_ms / bms:6.1f}%  BM={bcfg.BM} BN={bcfg.BN} w={bcfg.num_warps} "
              f"BK={bcfg.BK} s={bcfg.num_stages} waves={bcfg.waves} row_max={bcfg.row_max} tma={bcfg.tma} (err {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
