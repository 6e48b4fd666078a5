"""Measure a GPU's roofline constants for ``maxsim.bench.shapes.Roofline``: device-to-device copy
bandwidth (bytes read + written per second) and dense fp16 / bf16 matmul throughput.

    python benchmarks/roofline_probe.py [--json OUT]

Copy: a 2 GiB buffer copied into another (read once, written once). Matmul: 8192 x 8192 x 8192
products in fp16 and bf16 (torch.matmul, cuBLAS). Each the median of ``triton.testing.do_bench``.
Prints the ``Roofline(...)`` line to add to the table, with the GPU's name.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton


def _median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("roofline_probe: needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    src = torch.empty(2**30, dtype=torch.float16, device="cuda").fill_(1.0)  # [2^30] = 2 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    bytes_per_s = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)
    flops = {}
    n = 8192
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.randn(n, n, dtype=dtype, device="cuda")
        b = torch.randn(n, n, dtype=dtype, device="cuda")
        ms = _median_ms(lambda: torch.matmul(a, b))
        flops[str(dtype).split(".")[-1]] = 2 * n**3 / (ms * 1e-3)
    dense = min(flops.values())
    res = dict(gpu=name, copy_bytes_per_s=bytes_per_s, matmul_flops_per_s=flops, torch=torch.__version__,
               sms=torch.cuda.get_device_properties(0).multi_processor_count)
    print(json.dumps(res, indent=1))
    print(f'Roofline("{name}", bytes_per_s={bytes_per_s / 1e12:.2f}e12, flops_per_s={dense / 1e12:.0f}e12)')
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
