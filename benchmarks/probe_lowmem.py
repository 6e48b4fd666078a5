"""Times the lowmem backward of the cross product (counting sort + owned kernel) against unified,
over the owned kernel's entries a pass and warps a program (owned_config), and its
parts alone: the inverse maps (counting sort of the whole argmax at once) and the owned kernel on
them (GPU, cold L2).

Each configuration's grad_D is checked bitwise run to run, and against unified (fp32 summation order
only). A different block sums in another tree, so the bits differ between configurations.

2026-11-29 20:43 (do_bench's zeroing flush): 1 warp took the owned kernel from 1449 (4 warps) to
927 us for the whole lowmem backward at in-batch 128 x 128; the inverse maps alone 131 us.
2026-11-30 01:39 (cold L2, results/lowmem-20261130-0139.log): at 128 x 128, 16 entries a pass took
the owned kernel from 493 to 389 us (the backward 898 -> 809); at 256 x 256 32 stayed best (350
against 379); ColPali B = 128 (--colpali): 64 on 2 warps, 6.68 against 7.57 ms: owned_config's rule.

    python benchmarks/probe_lowmem.py [--colpali]
"""

import argparse

import torch

from maxsim.bench.timing import cold_ms
from maxsim.dense import backward as B
from maxsim.dense.forward import maxsim_forward

CONFIGS = [(32, 1), (16, 1), (8, 1), (64, 1), (64, 2), (32, 2), (16, 2)]  # (entries a pass, warps)


def main():
    shipped = B.owned_config
    ap = argparse.ArgumentParser()
    ap.add_argument("--colpali", action="store_true", help="ColPali B = 128 (1024, 1024) instead")
    args = ap.parse_args()
    # the in-batch training shapes, or ColPali's (rows hold 128 entries there)
    shapes = [(128, 128, 1024, 1024)] if args.colpali else [(128, 128, 128, 1024), (256, 256, 32, 180)]
    for nq, nd, lq, ld in shapes:
        torch.manual_seed(0)
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1, nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
        g = torch.randn(nq, nd, device="cuda")
        unified = 1e3 * cold_ms(lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="unified"))  # noqa: B023
        gd_ref = B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="unified")[1].float()
        counts, rowptr, order = _inverse_maps(Q, D, arg)
        inv = 1e3 * cold_ms(lambda: B.invert_argmax(arg, 0, nd, ld, counts, rowptr, order))  # noqa: B023
        print(f"({nq}, {nd}, {lq}, {ld}): unified backward {unified:.0f} us; inverse maps alone {inv:.0f} us",
              flush=True)
        grad_D = torch.empty(D.shape, dtype=D.dtype, device="cuda")
        for block, warps in CONFIGS:
            B.owned_config = lambda *_, c=(block, warps): c
            try:
                def owned():
                    B.sum_owned_rows(g, Q, D, order, rowptr, g, g, grad_D, 0, nd, False, 128)  # noqa: B023

                t_owned = 1e3 * cold_ms(owned)
                fn = lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="lowmem")  # noqa: E731,B023
                t_all = 1e3 * cold_ms(fn)
                a, b = fn()[1], fn()[1]
                err = ((a.float() - gd_ref).norm() / gd_ref.norm()).item()
                print(f"  owned BE {block:3d} w{warps}: owned kernel {t_owned:5.0f} us, lowmem backward {t_all:5.0f} us; "
                      f"bitwise run to run {torch.equal(a, b)}, rel diff to unified {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  owned BE {block:3d} w{warps}: {type(e).__name__} {e}", flush=True)
        B.owned_config = shipped


def _inverse_maps(Q, D, arg):
    """The inverse maps of all documents at once (the library goes a chunk of documents at a time)."""
    Nq, Lq, _ = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    counts = torch.zeros(Nd * Ld, dtype=torch.int32, device="cuda")
    rowptr = torch.zeros(Nd * Ld + 1, dtype=torch.int32, device="cuda")
    order = torch.empty(Nq * Nd * Lq, dtype=torch.int32, device="cuda")
    B.invert_argmax(arg, 0, Nd, Ld, counts, rowptr, order)
    return counts, rowptr, order


if __name__ == "__main__":
    main()
