"""Times the lowmem backward of the cross product (counting sort + owned kernel) against unified,
over the owned kernel's warps per program (GPU).

    python benchmarks/probe_lowmem.py
"""

import torch
import triton

from maxsim.dense import backward as B
from maxsim.dense.forward import maxsim_forward


def main():
    for nq, nd, lq, ld in [(128, 128, 128, 1024), (256, 256, 32, 180)]:  # the in-batch training shapes
        torch.manual_seed(0)
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1, nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
        g = torch.randn(nq, nd, device="cuda")
        unified = triton.testing.do_bench(
            lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="unified"), return_mode="median")
        ref = None
        row = []
        for warps in (1, 2, 4):
            B.OWNED_WARPS = warps
            fn = lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="lowmem")  # noqa: E731
            gq, gd = fn()
            same = ref is None or torch.equal(gd, ref)
            ref = gd if ref is None else ref
            row.append(f"lowmem w{warps} {triton.testing.do_bench(fn, return_mode='median') * 1e3:.0f} us "
                       f"(grad_D as w1: {same})")
        B.OWNED_WARPS = 1
        inv = triton.testing.do_bench(lambda: _inverse_only(Q, D, arg), return_mode="median")
        print(f"({nq}, {nd}, {lq}, {ld}): unified {unified * 1e3:.0f} us; " + "; ".join(row)
              + f"; the inverse maps alone {inv * 1e3:.0f} us", flush=True)


def _inverse_only(Q, D, arg):
    Nq, Lq, _ = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    counts = torch.zeros(Nd * Ld, dtype=torch.int32, device="cuda")
    rowptr = torch.zeros(Nd * Ld + 1, dtype=torch.int32, device="cuda")
    order = torch.empty(Nq * Nd * Lq, dtype=torch.int32, device="cuda")
    B.invert_argmax(arg, 0, Nd, Ld, counts, rowptr, order)


if __name__ == "__main__":
    main()
