"""maxsim_from_hidden side by side: the fused head, the unfused path (F.linear + F.normalize +
maxsim.maxsim), the path maxsim's selection picks, and late-interaction-kernels' fused head when
installed (``pip install late-interaction-kernels==0.4.5``). Forward and training step: median ms
(triton.testing.do_bench) and peak memory above the inputs. Needs a CUDA GPU.

    python benchmarks/head_bench.py                       # the bar's shapes
    python benchmarks/head_bench.py --shapes 1x10k --mode forward --out results/head.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

import maxsim
from maxsim.head import explain_from_hidden, maxsim_from_hidden

# name: (Nq, Lq, Nd, Ld, d, d_model)
SHAPES = {
    "1x10k": (1, 32, 10_000, 300, 128, 768),
    "inbatch64": (64, 32, 64, 300, 128, 768),
    "8x10k": (8, 32, 10_000, 300, 128, 768),
    "16x1k": (16, 32, 1_000, 300, 128, 768),
}


def inputs(shape, dtype):
    Nq, Lq, Nd, Ld, d, dm = shape
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


def providers():
    out = {"maxsim fused": with_path("fused"), "maxsim auto": with_path("auto"),
           "unfused (F.linear+F.normalize+maxsim)": unfused}
    try:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head

        out["late-interaction-kernels fused_head"] = lambda Q, H, W, b, d_mask: lik_head(Q, H, W, b, d_mask=d_mask)
    except ImportError:
        pass
    return out


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x10k,inbatch64", help=f"comma-separated of {', '.join(SHAPES)}")
    parser.add_argument("--mode", default="both", choices=["forward", "train", "both"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    modes = ["forward", "train"] if args.mode == "both" else [args.mode]
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}")
    print("| shape | mode | provider | median ms | peak MiB above inputs |\n| --- | --- | --- | ---: | ---: |")
    for name in args.shapes.split(","):
        tensors = inputs(SHAPES[name], dtype)
        os.environ["MAXSIM_HEAD_PATH"] = "auto"
        plan = explain_from_hidden(*tensors[:4], d_mask=tensors[4]).forward
        for mode in modes:
            for provider, fn in providers().items():
                try:
                    ms, mib = measure(step_fn(fn, tensors, mode))
                except torch.cuda.OutOfMemoryError:
                    ms, mib = float("nan"), float("nan")
                torch.cuda.empty_cache()
                label = provider + (f" [{plan.kernel.name}]" if provider == "maxsim auto" else "")
                rows.append(dict(shape=name, dims=SHAPES[name], mode=mode, provider=label, ms=ms, peak_mib=mib))
                print(f"| {name} {SHAPES[name]} | {mode} | {label} | {ms:.3f} | {mib:.0f} |", flush=True)
        del tensors
    os.environ.pop("MAXSIM_HEAD_PATH", None)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
