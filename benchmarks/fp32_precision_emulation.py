"""How accurate is split-precision fp32 MaxSim, and how does the order of its products matter? An
emulation on the CPU (issue 22 chose the split with it; issue 31 the order of its products).

Each fp32 input is rounded as the tensor cores take it (TF32: 10 mantissa bits, round to nearest
with ties away, as ``cvt.rna.tf32.f32``; bf16: round to nearest even; fp16: each row first scaled
by a power of two, its largest magnitude in [2^13, 2^14), as ``maxsim._kernels.mma`` and
``maxsim._split`` do), split into a high and a low part, and the three significant partial
products summed in the order named. The products are exact; they are added to an fp32 accumulator
one k-step (16 values of the width) at a time, each step rounded to nearest (``--rounding
nearest``) or toward zero (``toward-zero``: what the tensor cores' accumulator is reported to do,
and what reproduces the H200's measured error). Then the max over each document's tokens and the
fp32 sum over the query's rows. Relative error: the largest and the mean |score - float64 score| /
|float64 score|, and the mean signed error (a rounding toward zero is a bias, which a sum over
query rows does not average out).

    python benchmarks/fp32_precision_emulation.py [--queries 4] [--docs 100] [--doc-len 180]
"""

from __future__ import annotations

import argparse

import torch

K_STEP = 16  # values of the width one tensor-core step reduces


def tf32(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def rounded_split(round_fn):
    """x -> (hi, lo) = (round(x), round(x - hi)), for a format with fp32's exponent range."""
    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hi = round_fn(x)
        return hi, round_fn(x - hi)
    return split


def fp16_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) as the kernels make them: x scaled per row by a power of two to [2^13, 2^14),
    hi = fp16(x s), lo = fp16(x s - hi) (same scale: fp16 subnormals where the kernels have
    them), both scaled back (exact)."""
    scale = torch.exp2(13 - torch.floor(torch.log2(x.abs().amax(-1, keepdim=True))))
    xs = x * scale
    hi = xs.to(torch.float16).to(torch.float32)
    return hi / scale, (xs - hi).to(torch.float16).to(torch.float32) / scale


def to_fp32(v: torch.Tensor, rounding: str) -> torch.Tensor:
    """float64 -> the fp32 value (as float64) rounded to nearest or toward zero."""
    f = v.to(torch.float32)
    if rounding == "toward-zero":
        f = torch.where(f.double().abs() > v.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    return f.double()


def split_product(split, order: tuple[str, ...]):
    """The product of the hi/lo ``split``, its terms summed in ``order``."""
    def product(a: torch.Tensor, b: torch.Tensor, rounding: str) -> torch.Tensor:  # [M, d] x [N, d] -> [M, N]
        (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
        terms = {"hi.hi": (a_hi, b_hi), "hi.lo": (a_hi, b_lo), "lo.hi": (a_lo, b_hi)}
        acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
        for term in order:
            x, y = (t.double() for t in terms[term])
            for k in range(0, a.shape[1], K_STEP):
                acc = to_fp32(acc + x[:, k:k + K_STEP] @ y[:, k:k + K_STEP].T, rounding)
        return acc.to(torch.float32)
    return product


SMALL_FIRST, HI_FIRST = ("hi.lo", "lo.hi", "hi.hi"), ("hi.hi", "hi.lo", "lo.hi")
PRODUCTS = {
    "ieee (fp32 FMA)": lambda a, b, rounding: a @ b.T,
    "tf32": split_product(rounded_split(tf32), ("hi.hi",)),
    "tf32x3 (small terms first)": split_product(rounded_split(tf32), SMALL_FIRST),
    "bf16x3 (small terms first)": split_product(rounded_split(bf16), SMALL_FIRST),
    "fp16x3 (hi.hi first)": split_product(fp16_split, HI_FIRST),
    "fp16x3 (small terms first)": split_product(fp16_split, SMALL_FIRST),
}


def maxsim_with(product, Q: torch.Tensor, D: torch.Tensor, rounding: str) -> torch.Tensor:
    """``[Nq, Nd]``: max over each document's tokens, then the fp32 sum over the query's rows in order."""
    S = product(Q.reshape(-1, Q.shape[-1]), D.reshape(-1, D.shape[-1]), rounding)  # [Nq*Lq, Nd*Ld]
    best = S.reshape(Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]).amax(-1)  # [Nq, Lq, Nd]
    total = torch.zeros(Q.shape[0], D.shape[0], dtype=best.dtype)
    for row in range(Q.shape[1]):
        total = total + best[:, row]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--doc-len", type=int, default=180)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounding", choices=("nearest", "toward-zero", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    unit = torch.nn.functional.normalize
    Q = unit(torch.randn(args.queries, args.query_len, args.dim), dim=-1)
    D = unit(torch.randn(args.docs, args.doc_len, args.dim), dim=-1)
    exact = maxsim_with(lambda a, b, rounding: a @ b.T, Q.double(), D.double(), "nearest")
    print(f"{args.queries} x {args.docs} documents, ({args.query_len}, {args.doc_len}), d {args.dim}, "
          f"unit-norm tokens; accumulator steps of {K_STEP}")
    print("| product | accumulator rounding | max rel err | mean rel err | mean signed |\n|---|---|---:|---:|---:|")
    for rounding in (("nearest", "toward-zero") if args.rounding == "both" else (args.rounding,)):
        for name, product in PRODUCTS.items():
            if name.startswith("ieee") and rounding != "nearest":
                continue  # CUDA-core FMAs round to nearest
            err = (maxsim_with(product, Q, D, rounding).double() - exact) / exact.abs()
            print(f"| {name} | {rounding} | {float(err.abs().max()):.2e} | {float(err.abs().mean()):.2e} | "
                  f"{float(err.mean()):+.2e} |")


if __name__ == "__main__":
    main()
