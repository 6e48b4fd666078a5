"""How accurate would split-precision fp32 MaxSim be? An emulation on the CPU, to choose the split
before the GPU kernel is built (issue 22, point 1).

Each fp32 input is rounded as the tensor cores would take it (TF32: 10 mantissa bits, round to
nearest with ties away, as ``cvt.rna.tf32.f32``; bf16: round to nearest even), split into a high
and a low part, and the three significant partial products are summed in fp32. Only the inputs'
rounding is emulated: the products are exact in fp32 and accumulate in IEEE fp32 (the tensor
cores' own accumulation order and truncation are not modelled, so this is a lower bound on the
GPU's error). Relative error: the largest |score - float64 score| / |float64 score|.

    python benchmarks/fp32_precision_emulation.py [--queries 16] [--docs 800]
"""

from __future__ import annotations

import argparse

import torch


def tf32(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def split_product(round_fn):
    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [M, d] x [N, d] -> [M, N]
        a_hi, b_hi = round_fn(a), round_fn(b)
        a_lo, b_lo = round_fn(a - a_hi), round_fn(b - b_hi)
        return a_hi @ b_lo.T + a_lo @ b_hi.T + a_hi @ b_hi.T  # small terms first
    return product


PRODUCTS = {
    "ieee (fp32 FMA)": lambda a, b: a @ b.T,
    "tf32": lambda a, b: tf32(a) @ tf32(b).T,
    "tf32x3": split_product(tf32),
    "bf16x3": split_product(bf16),
}


def maxsim_with(product, Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    S = product(Q.reshape(-1, Q.shape[-1]), D.reshape(-1, D.shape[-1]))  # [Nq*Lq, Nd*Ld]
    return S.reshape(Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]).amax(-1).sum(1)  # [Nq, Nd]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--docs", type=int, default=800)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--doc-len", type=int, default=180)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    unit = torch.nn.functional.normalize
    Q = unit(torch.randn(args.queries, args.query_len, args.dim), dim=-1)
    D = unit(torch.randn(args.docs, args.doc_len, args.dim), dim=-1)
    exact = maxsim_with(lambda a, b: a @ b.T, Q.double(), D.double())
    print(f"{args.queries} x {args.docs} documents, ({args.query_len}, {args.doc_len}), d {args.dim}, unit-norm tokens")
    print("| product | max relative error vs float64 |\n|---|---|")
    for name, product in PRODUCTS.items():
        got = maxsim_with(product, Q, D).double()
        print(f"| {name} | {float(((got - exact).abs() / exact.abs()).max()):.2e} |")


if __name__ == "__main__":
    main()
