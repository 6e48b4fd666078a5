"""How near a small call runs to its floors (issue 56 point 2): one query x 1K documents.

For each shape (default: the bar's one query x 1K documents of 300 tokens, and 1 / 100 / 10K
documents around it), with ``maxsim.bench.timing.cold_ms`` (a cold, clean L2, CUDA events):

* ``empty``: one Triton program that does nothing, the GPU's launch floor;
* ``read``: ``D.sum()`` over the same bytes, what reading them costs with PyTorch's reduction;
* ``bytes``: the bytes at the roofline's copy bandwidth (``maxsim.bench.shapes.roofline_for``);
* ``maxsim``: ``maxsim.maxsim(Q, D)``, and the kernels it launched (``torch.profiler``), so a
  call that is several launches says so;
* ``host``: the host's time a call, enqueued back to back (``timing.back_to_back``): a call whose
  host time exceeds its GPU time is launch-bound, not bandwidth-bound.

    python benchmarks/launch_floor.py [--docs 1,100,1000,10000] [--ld 300] [--out floor.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _kernels_launched(fn) -> list[str]:
    """Names of the CUDA kernels one ``fn()`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    import maxsim
    from maxsim.bench.shapes import roofline_for
    from maxsim.bench.timing import back_to_back, cold_ms

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default="1,100,1000,10000", help="comma-separated document counts")
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", type=int, default=300)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_floor.py times GPU calls: no CUDA device here")
    name = torch.cuda.get_device_name()
    roof = roofline_for(name)
    x = torch.zeros(1, device="cuda")
    empty_ms = cold_ms(lambda: _empty_kernel[(1,)](x))
    rows = []
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}; empty kernel {1e3 * empty_ms:.1f} us")
    print(f"{'docs':>6} {'MB':>7} | {'bytes us':>8} {'read us':>8} {'maxsim us':>9} {'host us':>8} | kernels")
    for nd in (int(n) for n in args.docs.split(",")):
        Q = torch.randn(1, args.lq, args.d, device="cuda", dtype=torch.float16)
        D = torch.randn(nd, args.ld, args.d, device="cuda", dtype=torch.float16)
        nbytes = D.numel() * D.element_size()
        call = lambda: maxsim.maxsim(Q, D)  # noqa: E731
        row = dict(docs=nd, lq=args.lq, ld=args.ld, d=args.d, mb=nbytes / 1e6, empty_us=1e3 * empty_ms,
                   read_us=1e3 * cold_ms(lambda: D.sum()), maxsim_us=1e3 * cold_ms(call),
                   host_us=1e6 * back_to_back(call, 200)[0], kernels=_kernels_launched(call))
        row["bytes_us"] = nbytes / roof.bytes_per_s * 1e6 if roof is not None else None
        rows.append(row)
        bytes_us = f"{row['bytes_us']:8.1f}" if row["bytes_us"] is not None else f"{'-':>8}"
        print(f"{nd:>6} {row['mb']:7.1f} | {bytes_us} {row['read_us']:8.1f} {row['maxsim_us']:9.1f} "
              f"{row['host_us']:8.1f} | {len(row['kernels'])}: {', '.join(k[:40] for k in row['kernels'])}", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
