"""maxsim_from_hidden side by side: the fused head, the unfused path (F.linear + F.normalize +
maxsim.maxsim), the path maxsim's selection picks, and late-interaction-kernels' fused head when
installed (``pip install late-interaction-kernels==0.4.5``). Forward and training step: median ms
(triton.testing.do_bench) and peak memory above the inputs. Needs a CUDA GPU.

    python benchmarks/head_bench.py                       # the bar's shapes
    python benchmarks/head_bench.py --shapes 1x10k --mode forward --out results/head.json
    python benchmarks/head_bench.py --shapes 1x10k --mode forward \
        --tiles "BM=32,BN=64,BKM=128,num_warps=4,num_stages=3;BM=32,BN=128,BKM=64,num_warps=8,num_stages=3"
                                                          # the fused kernel under each tile as well

Each (shape, mode, provider) cell runs in a fresh process (benchmarks/_isolate.py) that builds
its inputs from a fixed seed: a provider that crashes the CUDA context is a ``crashed`` row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch
import torch.nn.functional as F
import triton
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated

import maxsim
from maxsim.head import maxsim_from_hidden

# name: (Nq, Lq, Nd, Ld, d, d_model)
SHAPES = {
    "1x10k": (1, 32, 10_000, 300, 128, 768),
    "inbatch64": (64, 32, 64, 300, 128, 768),
    "8x10k": (8, 32, 10_000, 300, 128, 768),
    "16x1k": (16, 32, 1_000, 300, 128, 768),
}
SEED = 0
# provider: the module it needs (None: maxsim's own); one that is not importable is a row saying so.
PROVIDERS = {
    "maxsim fused": None,
    "maxsim auto": None,
    "unfused (F.linear+F.normalize+maxsim)": None,
    "late-interaction-kernels fused_head": "late_interaction_kernels",
}


def inputs(shape, dtype):
    Nq, Lq, Nd, Ld, d, dm = shape
    torch.manual_seed(SEED)
    Q = F.normalize(torch.randn(Nq, Lq, d, device="cuda"), dim=-1).to(dtype)
    H = torch.randn(Nd, Ld, dm, device="cuda", dtype=dtype)
    W = (torch.randn(d, dm, device="cuda") / dm**0.5).to(dtype)
    b = (0.02 * torch.randn(d, device="cuda")).to(dtype)
    lengths = torch.randint(Ld // 3, Ld + 1, (Nd, 1), device="cuda")
    d_mask = torch.arange(Ld, device="cuda")[None, :] < lengths
    return Q, H, W, b, d_mask


def with_path(path):
    def run(Q, H, W, b, d_mask):
        os.environ["MAXSIM_HEAD_PATH"] = path
        return maxsim_from_hidden(Q, H, W, b, d_mask=d_mask)
    return run


def unfused(Q, H, W, b, d_mask):
    return maxsim.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), d_mask=d_mask)


def provider_fn(name):
    """The call a provider makes (imported here, in the measuring process)."""
    if name == "late-interaction-kernels fused_head":
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head

        return lambda Q, H, W, b, d_mask: lik_head(Q, H, W, b, d_mask=d_mask)
    return {"maxsim fused": with_path("fused"), "maxsim auto": with_path("auto"),
            "unfused (F.linear+F.normalize+maxsim)": unfused}[name]


def step_fn(fn, tensors, mode):
    Q, H, W, b, d_mask = tensors
    if mode == "forward":
        def run():
            with torch.no_grad():
                return fn(Q, H, W, b, d_mask)
        return run
    leaves = [t.detach().clone().requires_grad_(True) for t in (Q, H, W, b)]

    def run():
        for t in leaves:
            t.grad = None
        scores = fn(*leaves, d_mask)
        if scores.shape[0] == scores.shape[1]:  # in-batch: the diagonal is the positive
            loss = F.cross_entropy(scores, torch.arange(scores.shape[0], device="cuda"))
        else:
            loss = scores.sum()
        loss.backward()
    return run


def measure(run):
    run()  # compile and warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(run, return_mode="median")
    return ms, peak / 2**20


def measure_cell(shape_name, dtype_name, mode, provider, tile=None):
    """One cell, in its own process: median ms and peak MiB, and for "maxsim auto" the kernel
    maxsim's selection picks for the forward. ``tile``: the fused kernel's MAXSIM_HEAD_TILE."""
    if tile:
        os.environ["MAXSIM_HEAD_TILE"] = tile
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
    tensors = inputs(SHAPES[shape_name], dtype)
    out = {}
    if provider == "maxsim auto":
        os.environ["MAXSIM_HEAD_PATH"] = "auto"
        out["kernel"] = maxsim.explain_from_hidden(*tensors[:4], d_mask=tensors[4]).forward.kernel.name
    out["ms"], out["peak_mib"] = measure(step_fn(provider_fn(provider), tensors, mode))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x10k,inbatch64", help=f"comma-separated of {', '.join(SHAPES)}")
    parser.add_argument("--mode", default="both", choices=["forward", "train", "both"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--tiles", default="", help="';'-separated MAXSIM_HEAD_TILE specs: 'maxsim fused' "
                        "rows under each tile as well (the table's tile is the plain row)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds one cell may take before its process is killed (a 'timeout' row)")
    args = parser.parse_args()
    modes = ["forward", "train"] if args.mode == "both" else [args.mode]
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}")
    print("| shape | mode | provider | median ms | peak MiB above inputs | note |\n"
          "| --- | --- | --- | ---: | ---: | --- |")
    for name in args.shapes.split(","):
        dims = SHAPES[name]
        for mode in modes:
            cells = [(p, m, None) for p, m in PROVIDERS.items()]
            cells += [("maxsim fused", None, t) for t in args.tiles.split(";") if t.strip()]
            for provider, module, tile in cells:
                if module is not None and importlib.util.find_spec(module) is None:
                    result = {"status": "not installed", "error": module}
                else:
                    result = run_isolated(measure_cell, name, args.dtype, mode, provider, tile, timeout_s=args.timeout)
                ok = result["status"] == "ok"
                ms, mib = (result["ms"], result["peak_mib"]) if ok else (float("nan"), float("nan"))
                label = provider + (f" [{result['kernel']}]" if "kernel" in result else "") + (f" [{tile}]" if tile else "")
                rows.append(dict(shape=name, dims=dims, mode=mode, provider=label, status=result["status"], ms=ms,
                                 peak_mib=mib, note=failed(result)))
                shown = f"{ms:.3f} | {mib:.0f}" if ok else f"{result['status']} | -"
                print(f"| {name} {dims} | {mode} | {label} | {shown} | {failed(result)} |", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
