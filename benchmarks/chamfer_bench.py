"""Chamfer distance on the GPU: maxsim.chamfer_distance against torch.cdist + min (where the
[N, M] matrix fits) and flash-maxsim's flash_chamfer (when installed), forward and forward +
backward; median milliseconds (triton.testing.do_bench) and peak memory, as a table.

    python benchmarks/chamfer_bench.py                      # the issue's two shapes, fp32
    python benchmarks/chamfer_bench.py --dtype bfloat16 --shapes 8x16384x16384x3
    python benchmarks/chamfer_bench.py --norm 1 --dtype float16 --shapes 1x4096x4096x130
    python benchmarks/chamfer_bench.py --sweep              # time the forward kernel's tile choices

flash_chamfer takes one pair of clouds [N, d], [M, d] (no batch): a batch runs as a loop over it.
It casts fp32 inputs to fp16 for its dot, so its fp32 numbers are not exact; the table's ``err``
column is each provider's relative error of the loss against a float64 value. ``first s`` is the
first call in a fresh process, compilation included. ``--norm 1`` (L1 distances) has no
flash_chamfer row (it has squared Euclidean only).

Each (provider, pass) cell, and the float64 value, runs in a fresh process (benchmarks/_isolate.py)
that builds the clouds from a fixed seed: a provider that crashes the CUDA context is a
``crashed`` row. ``--sweep`` times maxsim's own kernel only and runs in this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import time

import torch
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated

DEFAULT_SHAPES = ("8x16384x16384x3", "1x100000x100000x3")
SEED = 0


def parse_shape(text: str) -> tuple[int, int, int, int]:
    B, N, M, D = (int(v) for v in text.lower().split("x"))
    return B, N, M, D


def maxsim_loss(x, y, norm, deterministic=False):
    import maxsim.chamfer

    return maxsim.chamfer.chamfer_distance(x, y, norm=norm, deterministic=deterministic)[0]


def cdist_loss(x, y, norm):
    d = torch.cdist(x.float(), y.float(), p=norm) ** norm  # [B, N, M]: squared L2, or L1
    return d.min(2).values.mean(1).mean() + d.min(1).values.mean(1).mean()


def flash_loss(x, y, train: bool):
    import flash_maxsim

    fn = flash_maxsim.flash_chamfer_train if train else flash_maxsim.flash_chamfer
    return torch.stack([fn(x[b], y[b]) for b in range(x.shape[0])]).mean()


def float64_loss(x, y, norm) -> float:
    """The loss in float64 by chunked direct differences (slow, once per shape)."""
    total = 0.0
    for b in range(x.shape[0]):
        for a, c in ((x[b], y[b]), (y[b], x[b])):
            c64 = c.double()
            mins = [torch.cdist(a[s:s + 2048].double(), c64, p=norm,
                                compute_mode="donot_use_mm_for_euclid_dist").min(1).values
                    for s in range(0, a.shape[0], 2048)]
            total += float((torch.cat(mins) ** norm).mean())
    return total / x.shape[0]


def fits(B, N, M, free, factor=3) -> bool:
    """Whether the naive path's [B, N, M] fp32 matrices fit in ``free`` bytes of GPU memory."""
    return B * N * M * 4 * factor < 0.8 * free


def measure(fn, train: bool, x, y):
    """(median ms, peak MiB above the inputs, the loss, the first call's seconds) of fn(x, y)
    (+ backward when train)."""
    from triton.testing import do_bench

    xs, ys = (x.detach().requires_grad_(), y.detach().requires_grad_()) if train else (x, y)

    def step():
        loss = fn(xs, ys)
        if train:
            loss.backward()
            xs.grad = ys.grad = None
        return loss

    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = do_bench(step, warmup=5, rep=50, return_mode="median")
    return ms, peak, float(loss.detach()), first_s


def providers(B, N, M, free, norm):
    """(name, the module it needs or None): the naive path only where it fits (unknown ``free``:
    try it, an OOM is a row)."""
    out = [("maxsim", None), ("maxsim deterministic", None)]
    if free is None or fits(B, N, M, free):
        out.append(("torch.cdist + min", None))
    if norm == 2:
        out.append(("flash_chamfer", "flash_maxsim"))
    return out


def provider_fn(name, train: bool, norm: int):
    return {
        "maxsim": lambda x, y: maxsim_loss(x, y, norm),
        "maxsim deterministic": lambda x, y: maxsim_loss(x, y, norm, deterministic=True),
        "torch.cdist + min": lambda x, y: cdist_loss(x, y, norm),
        "flash_chamfer": lambda x, y: flash_loss(x, y, train),
    }[name]


def clouds(text: str, dtype_name: str):
    """The two point clouds of a shape, the same in every process (fixed seed)."""
    B, N, M, D = parse_shape(text)
    torch.manual_seed(SEED)
    dtype = getattr(torch, dtype_name)
    x = torch.rand(B, N, D, device="cuda").to(dtype)
    y = torch.rand(B, M, D, device="cuda").to(dtype)
    return x, y


def exact_cell(text: str, dtype_name: str, norm: int) -> dict:
    """The float64 loss of a shape, and the GPU memory left free around its clouds."""
    x, y = clouds(text, dtype_name)
    exact = float64_loss(x, y, norm)
    torch.cuda.empty_cache()  # the float64 scratch is not the providers'
    return {"exact": exact, "free": torch.cuda.mem_get_info()[0]}


def measure_cell(text: str, dtype_name: str, name: str, train: bool, norm: int) -> dict:
    """One provider, one pass, in its own process."""
    ms, peak, loss, first_s = measure(provider_fn(name, train, norm), train, *clouds(text, dtype_name))
    return {"ms": ms, "peak": peak, "loss": loss, "first_s": first_s}


def run(shapes, dtype, norm=2, timeout_s=DEFAULT_TIMEOUT_S):
    rows = []
    dtype_name = str(dtype).replace("torch.", "")
    for text in shapes:
        B, N, M, D = parse_shape(text)
        reference = run_isolated(exact_cell, text, dtype_name, norm, timeout_s=timeout_s)
        if reference["status"] != "ok":
            print(f"{text}: the float64 loss {failed(reference)}; err left out")
        exact, free = reference.get("exact"), reference.get("free")
        for (name, module), train in itertools.product(providers(B, N, M, free, norm), (False, True)):
            if name == "maxsim deterministic" and not train:
                continue
            passes = "fwd+bwd" if train else "fwd"
            if module is not None and importlib.util.find_spec(module) is None:
                rows.append((text, dtype_name, name, passes, "not installed", "-", "-", "-", module))
                continue
            result = run_isolated(measure_cell, text, dtype_name, name, train, norm, timeout_s=timeout_s)
            if result["status"] != "ok":
                rows.append((text, dtype_name, name, passes, result["status"], "-", "-", "-", failed(result)))
                continue
            err = "-" if exact is None else f"{abs(result['loss'] - exact) / abs(exact):.1e}"
            rows.append((text, dtype_name, name, passes, f"{result['ms']:.3f}", f"{result['peak']:.0f}", err,
                         f"{result['first_s']:.1f}", ""))
    print_table(("shape BxNxMxD", "dtype", "provider", "pass", "median ms", "peak MiB", "err", "first s", "note"),
                rows)


def sweep(shapes, dtype):
    """Time the forward kernel (both directions, argmin saved) over a few tiles per shape."""
    from triton.testing import do_bench

    from maxsim.chamfer.forward import chamfer_forward

    rows = []
    for text in shapes:
        B, N, M, D = parse_shape(text)
        x = torch.rand(B, N, D, device="cuda").to(dtype)
        y = torch.rand(B, M, D, device="cuda").to(dtype)
        xl = torch.full((B,), N, device="cuda", dtype=torch.int64)
        yl = torch.full((B,), M, device="cuda", dtype=torch.int64)
        dots = (False, True) if D > 3 else (False,)
        for dot, BM, BN, warps, stages in itertools.product(dots, (32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            if BM * BN > 128 * 64 or (dot and BN < 32):
                continue
            cfg = dict(BM=BM, BN=BN, BK=max(16, min(64, 1 << (D - 1).bit_length())), num_warps=warps,
                       num_stages=stages)
            ms = do_bench(lambda: chamfer_forward(x, y, xl, yl, norm=2, both=True, config=cfg, dot=dot),
                          warmup=5, rep=30, return_mode="median")
            rows.append((text, "dot" if dot else "direct", BM, BN, warps, stages, f"{ms:.3f}"))
    rows.sort(key=lambda r: (r[0], float(r[-1])))
    print_table(("shape", "kernel", "BM", "BN", "warps", "stages", "median ms"), rows)


def print_table(header, rows):
    widths = [max(len(str(v)) for v in col) for col in zip(header, *rows)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxNxMxD")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--norm", type=int, default=2, choices=(1, 2), help="2: squared Euclidean; 1: L1")
    parser.add_argument("--sweep", action="store_true", help="time the forward kernel's tiles instead")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds one cell may take before its process is killed (a 'timeout' row)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("chamfer_bench: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    if args.sweep:
        sweep(args.shapes, dtype)
    else:
        run(args.shapes, dtype, args.norm, args.timeout)


if __name__ == "__main__":
    main()
