"""maxsim's CPU backend against maxsim-cpu (Rust + libxsmm) on ragged documents, fp32.

    pip install maxsim-cpu==0.1.0
    python benchmarks/cpu_peer_bench.py --rounds 7
    python benchmarks/cpu_peer_bench.py --rounds 7 --isa avx2   # AVX2 code on an AVX-512 machine
    python benchmarks/cpu_peer_bench.py --rounds 7 --threads 1  # one thread each

One query (or 16) against documents given as a list of ``[L_i, d]`` tensors (PyLate's encode
output), pre-packed (``[T, d]`` + offsets): ``maxsim.maxsim_varlen``, and padded with masks
(``[Nd, L, d]``): ``maxsim.maxsim``, against
``maxsim_cpu.maxsim_scores_variable(q, docs)`` (one query a call, numpy arrays). Every provider
timed in turn each round, best of ``--rounds``; scores compared (max abs difference).

``--isa avx2`` runs the same table with every library held to its AVX2 code (torch's ATen kernels,
MKL's GEMMs, oneDNN, and libxsmm inside maxsim-cpu), the code an AVX2-only CPU (Zen 2, many laptops
and CI machines) runs; the cores, caches and memory are still this machine's.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch

import maxsim

SHAPES = [  # name, queries, query tokens, documents, shortest, longest, d
    ("1q x 1K (60-300)", 1, 32, 1000, 60, 300, 128),
    ("1q x 10K (60-300)", 1, 32, 10000, 60, 300, 128),
    ("1q x 10K (60-300) d96", 1, 32, 10000, 60, 300, 96),
    ("1q x 10K (60-300) d64", 1, 32, 10000, 60, 300, 64),
    ("ColPali 20 tokens x 1K pages (1030)", 1, 20, 1000, 1030, 1030, 128),
    ("16q x 1K (60-300)", 16, 32, 1000, 60, 300, 128),
    ("1q x 10K short (4-16)", 1, 32, 10000, 4, 16, 128),
]


# Each library reads its instruction-set cap once, at load: set before torch and maxsim_cpu start.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "LIBXSMM_TARGET": "hsw"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: every library runs its AVX2 code (see above)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both (torch's and maxsim-cpu's rayon pool); default: torch's count")
    args = ap.parse_args()
    env = dict(AVX2_ENV) if args.isa == "avx2" else {}
    if args.threads:
        env["RAYON_NUM_THREADS"] = str(args.threads)  # read when rayon's pool starts
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    if args.threads:
        torch.set_num_threads(args.threads)
    import maxsim_cpu

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    if args.isa == "avx2":
        isa += f"; held to AVX2 code: torch {torch.backends.cpu.get_cpu_capability()}, " + ", ".join(
            f"{k}={v}" for k, v in AVX2_ENV.items() if k != "ATEN_CPU_CAPABILITY")
    print(f"# {cpu} ({isa}), {torch.get_num_threads()} threads (maxsim-cpu: "
          f"{os.environ.get('RAYON_NUM_THREADS', 'one a core')}), torch {torch.__version__}")
    print("| shape | maxsim list ms | maxsim packed ms | maxsim padded ms | maxsim-cpu ms | list / maxsim-cpu "
          "| max abs diff | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, nq, lq, nd, lo, hi, d in SHAPES:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(lo, hi + 1, (nd,), generator=g).tolist()
        docs = [torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1) for n in lengths]
        queries = [torch.nn.functional.normalize(torch.randn(lq, d, generator=g), dim=-1) for _ in range(nq)]
        packed, cu, max_d = maxsim.pack(docs)
        q_packed, cu_q, _ = maxsim.pack(queries)
        docs_np = [x.numpy() for x in docs]
        Dp, dm = maxsim.pad(docs)  # [Nd, L, d], [Nd, L]
        Qp, qm = maxsim.pad(queries)

        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out

        cells = {"list": [], "packed": [], "padded": [], "peer": []}
        outs = {}
        for _ in range(args.rounds):
            for key, fn in (("list", lambda: maxsim.maxsim_varlen(queries, docs)),
                            ("packed", lambda: maxsim.maxsim_varlen(q_packed, packed, cu_q, cu, lq, max_d)),
                            ("padded", lambda: maxsim.maxsim(Qp, Dp, qm, dm)),
                            ("peer", lambda: np.stack([np.asarray(maxsim_cpu.maxsim_scores_variable(x.numpy(), docs_np))
                                                      for x in queries]))):
                seconds, outs[key] = timed(fn)
                cells[key].append(seconds)
        ms = {k: min(v) * 1e3 for k, v in cells.items()}
        gaps = [np.abs(outs[k].numpy().astype(np.float64) - outs["peer"]) for k in ("list", "padded")]
        diff = max(float(g.max()) for g in gaps)
        rel = max(float((g / np.abs(outs["peer"]).clip(min=1e-30)).max()) for g in gaps)
        print(f"| {name} | {ms['list']:.1f} | {ms['packed']:.1f} | {ms['padded']:.1f} | {ms['peer']:.1f} | "
              f"{ms['peer'] / ms['list']:.2f}x | {diff:.1e} | {rel:.1e} |")


if __name__ == "__main__":
    main()
