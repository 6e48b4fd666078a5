"""Time hand-picked forward configurations on named shapes, and the host cost of a call (GPU).

A narrower tool than tune_forward.py: each probe is a shape and a short list of configurations
written as strings (``"BM256 BN128 w8 s3 v1 rm tma"``: tile, warps, stages, programs per
multiprocessor, per-tile row max, TMA document tiles), so one device call can answer a few
specific questions. The rule's own choice is always timed first.

    python benchmarks/probe_configs.py [--only NAME,...]
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_train_host import host_us_per_step  # noqa: E402
from tune_forward import time_config  # noqa: E402

import maxsim  # noqa: E402
from maxsim import _launch  # noqa: E402
from maxsim._tuning import ForwardConfig, forward_config, is_big_corpus, next_pow2  # noqa: E402
from maxsim.bench.shapes import Shape, floor_seconds, make_inputs, shapes_by_name  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from maxsim.dense.forward import _descriptor_layout, maxsim_forward  # noqa: E402
from maxsim.reference import maxsim_reference  # noqa: E402


def parse(spec: str, d: int) -> ForwardConfig:
    f = dict(re.findall(r"([A-Za-z]+?)(\d+)", spec))
    bk = int(f.get("BK", min(128, max(16, next_pow2(d)))))
    return ForwardConfig(BM=int(f["BM"]), BN=int(f["BN"]), BK=bk, num_warps=int(f["w"]), num_stages=int(f["s"]),
                         waves=int(f.get("v", 2)), row_max=" rm" in f" {spec}", tma=" tma" in f" {spec}")


def spec(cfg: ForwardConfig) -> str:
    """The inverse of :func:`parse`."""
    return (f"BM{cfg.BM} BN{cfg.BN} BK{cfg.BK} w{cfg.num_warps} s{cfg.num_stages} v{cfg.waves}"
            f"{' rm' if cfg.row_max else ''}{' tma' if cfg.tma else ''}")


BW = ["BM32 BN64 w4 s3 v2", "BM32 BN128 w4 s3 v2", "BM32 BN128 w4 s4 v4", "BM32 BN64 w4 s5 v4",
      "BM32 BN64 w4 s3 v2 tma", "BM32 BN64 w4 s4 v4 tma", "BM32 BN128 w4 s3 v2 tma", "BM32 BN128 w4 s3 v4 tma",
      "BM32 BN128 w4 s4 v2 tma", "BM32 BN128 w4 s4 v4 tma", "BM32 BN128 w4 s4 v8 tma", "BM32 BN256 w4 s3 v2 tma",
      "BM32 BN256 w4 s3 v4 tma", "BM32 BN128 w4 s3 v8 rm tma"]
BW_WIDE = ["BM32 BN128 BK64 w4 s3 v8 rm", "BM32 BN128 BK64 w4 s4 v8 rm", "BM32 BN128 BK128 w4 s3 v8 rm",
           "BM32 BN128 BK64 w4 s3 v8 rm tma", "BM32 BN128 BK64 w4 s4 v8 rm tma", "BM32 BN128 BK128 w4 s3 v4 rm tma",
           "BM32 BN64 BK128 w4 s4 v8 rm tma", "BM32 BN256 BK64 w4 s3 v4 rm tma"]
STACKED = ["BM256 BN64 w8 s2 v2 rm", "BM256 BN128 w8 s3 v1 rm tma", "BM256 BN128 w8 s3 v2 rm tma",
           "BM256 BN128 w8 s2 v1 rm tma", "BM256 BN128 w8 s2 v2 rm tma", "BM256 BN64 w8 s2 v2 rm tma",
           "BM256 BN64 w8 s3 v2 rm tma", "BM128 BN128 w4 s2 v2 rm tma"]
LONG = ["BM256 BN128 w8 s3 v2 rm tma", "BM256 BN128 w8 s3 v1 rm tma", "BM256 BN128 w8 s2 v2 rm tma",
        "BM128 BN128 w4 s2 v2 rm tma", "BM128 BN128 w8 s3 v2 rm tma", "BM128 BN128 w4 s4 v1 rm tma",
        "BM128 BN256 w8 s3 v2 rm tma", "BM128 BN256 w8 s2 v2 rm tma", "BM256 BN64 w8 s3 v2 rm tma",
        "BM128 BN64 w4 s3 v2 rm tma"]
ONE128 = ["BM128 BN64 w8 s3 v2", "BM128 BN64 w4 s3 v2 rm tma", "BM128 BN64 w4 s4 v2 rm tma",
          "BM128 BN64 w4 s4 v4 rm tma", "BM128 BN128 w4 s3 v2 rm tma", "BM128 BN128 w4 s2 v2 rm tma",
          "BM128 BN128 w8 s3 v2 rm tma", "BM128 BN128 w4 s3 v1 rm tma", "BM128 BN64 w8 s4 v2"]

SMALL = [f"BM32 BN{bn} w{w} s{st} v{v}" for bn in (64, 128, 256) for st in (2, 3, 4) for v in (1, 2, 3)
         for w in (4,) if bn * st <= 512] + ["BM32 BN128 w8 s3 v1", "BM32 BN128 w2 s3 v2", "BM32 BN128 w8 s3 v2"]

PROBES = {  # in order of importance: a run cut short still answers the first questions
    "stacked_32q100k": ("32q_x_100k", STACKED),
    "stacked_masked": ("masked_64x64", STACKED),
    "stacked_32q10k": (Shape("32q_x_10k", 32, 10_000, 32, 128), STACKED),
    "stacked_32q2k": (Shape("32q_x_2k", 32, 2_000, 32, 128), STACKED),
    "long_ld128_d64": ("sweep_q1_lq1024_ld128_d64", LONG),
    "long_ld128_d128": ("sweep_q1_lq1024_ld128_d128", LONG),
    "long_ld300_d64": ("sweep_q1_lq1024_ld300_d64", LONG),
    "long_colpali": ("colpali_1x1k", LONG),
    "one128": ("1x1k_128x1024", ONE128),
    "bw_1x1k": ("1x1k_32x300", BW),
    "bw_ld300_d64": ("sweep_q1_lq32_ld300_d64", BW),
    "bw_ld300_d768": ("sweep_q1_lq32_ld300_d768", BW_WIDE),
    "inbatch": ("inbatch_128x128", LONG[:8]),
    "stacked_d64": ("sweep_q32_lq32_ld300_d64", STACKED),
    "long_ld300_d128": ("sweep_q1_lq1024_ld300_d128", LONG),
    "bw_ld1024_d64": ("sweep_q1_lq32_ld1024_d64", BW),
    "bw_ld128_d768": ("sweep_q1_lq32_ld128_d768", BW_WIDE),
    "bw_1q100k": ("1q_x_100k", BW),
    "one128_sweep": ("sweep_q1_lq128_ld1024_d128", ONE128),
    "small_1x1k": ("1x1k_32x300", SMALL),
    "small_masked": ("masked_64x64", ["BM256 BN64 w8 s2 v1 rm", "BM256 BN64 w8 s2 v3 rm", "BM256 BN64 w8 s2 v4 rm",
                                      "BM256 BN32 w8 s2 v2 rm", "BM256 BN64 w8 s3 v2 rm"]),
}


def host_us(fn, n: int = 300) -> float:
    """Host microseconds per call (profile_train_host's measure: calls enqueued back to back)."""
    return host_us_per_step(fn, n)[0]


def host_costs():
    print("host cost per call (us), public API and launcher with a given config:")
    for name, tma_spec in [("masked_64x64", "BM128 BN64 w4 s2 v2 rm tma"), ("1x1k_32x300", "BM32 BN128 w4 s3 v4 tma"),
                           ("1x1k_128x1024", "BM128 BN64 w4 s3 v2 rm tma")]:
        shape = shapes_by_name([name])[0]
        Q, D, qm, dm = make_inputs(shape, "cuda")
        D4, dm4 = D.unsqueeze(0), (dm.unsqueeze(0) if dm is not None else None)
        rule = forward_config(shape.nq, shape.lq, shape.d, Q.dtype, False)
        tma = parse(tma_spec, shape.d)
        api = host_us(lambda: maxsim.maxsim(Q, D, qm, dm))
        ptr = host_us(lambda: maxsim_forward(Q, D4, qm, dm4, config=ForwardConfig(**{**rule.__dict__, "tma": False})))
        withtma = host_us(lambda: maxsim_forward(Q, D4, qm, dm4, config=tma))
        desc = host_us(lambda: TensorDescriptor(D4, *_descriptor_layout(D4, tma)), 2000)
        # The thin path's direct launch against Triton's compiled[grid] runner, interleaved so that
        # the host's drift hits both alike (median of 7 rounds each).
        direct, runner = [], []
        for _ in range(7):
            direct.append(host_us(lambda: maxsim.maxsim(Q, D, qm, dm)))
            _launch._hooks_installed, saved = (lambda: True), _launch._hooks_installed
            runner.append(host_us(lambda: maxsim.maxsim(Q, D, qm, dm)))
            _launch._hooks_installed = saved
        print(f"  {name:16s} api {api:6.1f}  launcher(pointer) {ptr:6.1f}  launcher(tma) {withtma:6.1f}  "
              f"TensorDescriptor() {desc:5.1f}  api direct launch {sorted(direct)[3]:6.1f} "
              f"vs via compiled[grid] {sorted(runner)[3]:6.1f}", flush=True)


def flush_costs():
    """Small calls under three L2 states: do_bench's flush (zeroing 256 MB leaves the L2 full of
    dirty lines, which the timed call must write back before its reads fit), a flush that reads
    256 MB (clean lines), and no flush (inputs partly L2-resident from the previous call)."""
    import triton.testing

    print("small calls by L2 state (median us): do_bench zero-flush | read-flush | no flush")
    buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    for name in ["1x1k_32x300", "masked_64x64", "1x1k_128x1024"]:
        shape = shapes_by_name([name])[0]
        Q, D, qm, dm = make_inputs(shape, "cuda")
        fn = lambda: maxsim.maxsim(Q, D, qm, dm)  # noqa: E731
        zero = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        times = {"read": [], "none": []}
        for mode in times:
            for _ in range(200):
                torch.cuda._sleep(400_000)  # ~200 us of GPU time: the host enqueues the call meanwhile
                if mode == "read":
                    buf.sum()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[mode].append(start.elapsed_time(end) * 1e3)
        med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
        print(f"  {name:16s} {zero:7.1f} | {med['read']:7.1f} | {med['none']:7.1f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated probe names")
    args = ap.parse_args(argv)
    only = [p for p in args.only.split(",") if p]
    if not only or "host" in only:
        host_costs()
    if not only or "flush" in only:
        flush_costs()
    summary = []
    for probe, (shape, specs) in PROBES.items():
        if only and probe not in only:
            continue
        shape = shape if isinstance(shape, Shape) else shapes_by_name([shape])[0]
        Q, D, qm, dm = make_inputs(shape, "cuda")
        D4, dm4 = D.unsqueeze(0), (dm.unsqueeze(0) if dm is not None else None)
        ref = maxsim_reference(Q, D, qm, dm)
        floor_ms = floor_seconds(shape) * 1e3
        rule = forward_config(shape.nq, shape.lq, shape.d, Q.dtype, False,
                              big_corpus=is_big_corpus(shape.doc_rows * shape.ld))
        rows = []
        for label, cfg in [("rule", rule)] + [(s, parse(s, shape.d)) for s in specs]:
            try:
                ms = time_config(Q, D4, qm, dm4, cfg, ref)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or is wrong is a result
                print(f"  {probe} {label}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            rows.append((ms, label, cfg))
            print(f"  {probe:16s} {label:34s} {ms:8.4f} ms {100 * floor_ms / ms:5.1f} %", flush=True)
        rule_ms = next(ms for ms, label, _ in rows if label == "rule")
        best_ms, best_label, _ = min(rows)
        summary.append((probe, shape.name, floor_ms, rule_ms, best_ms, best_label, rule))
        del Q, D, D4, qm, dm, dm4, ref
        torch.cuda.empty_cache()
    print(f"\n{'probe':16s} {'floor':>7s} {'rule ms':>8s} {'%':>5s} {'best ms':>8s} {'%':>5s}  best  (rule)")
    for probe, name, floor_ms, rule_ms, best_ms, best_label, rule in summary:
        print(f"{probe:16s} {floor_ms:7.3f} {rule_ms:8.4f} {100 * floor_ms / rule_ms:5.1f} {best_ms:8.4f} "
              f"{100 * floor_ms / best_ms:5.1f}  {best_label}  ({spec(rule)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
