"""More, smaller consumer warpgroups in the warp-specialized forward (GPU).

Nsight Compute (results/ncu-20261129-2330/) showed the training forward (with the argmax) bound by
its epilogue's latency: two consumer warps a scheduler, each issuing about one instruction in 4.5
cycles, the tensor pipe 64 % busy. This probe runs the kernel with 3 or 4 consumers of 64 query
rows (``half_rows``, ``consumers``) against the shipped 2 of 128, first checking each against it
(argmax equal, scores to fp32 rounding: a 128-token query is then two 64-row chunks, summed), then
timing them at in-batch 128 x 128.

    python benchmarks/probe_ws_consumers.py
"""

import torch
import triton

from maxsim.dense.forward_ws import maxsim_forward_ws

# (half_rows, consumers, q_in_regs, sub_tiles)
CONFIGS = [(128, 2, True, None), (64, 3, True, None), (64, 3, True, 1), (64, 4, False, None), (64, 4, False, 1),
           (64, 4, True, None)]
CHECKS = [  # (Nq, Lq, Nd, Ld, masked)
    (16, 128, 8, 1024, False), (5, 128, 7, 300, False), (9, 32, 33, 200, False), (3, 200, 5, 130, False),
    (7, 128, 6, 256, True), (1, 128, 40, 128, False), (11, 64, 9, 129, False),
]


def name(cfg):
    half, cons, regs, sub = cfg
    return f"{cons}x{half}{'' if regs else ' q-smem'}{'' if sub is None else f' sub{sub}'}"


def check(cfg) -> str:
    half, cons, regs, sub = cfg
    bad = []
    for nq, lq, nd, ld, masked in CHECKS:
        g = torch.Generator(device="cuda").manual_seed(nq * 1000 + ld)
        Q = torch.randint(-3, 4, (nq, lq, 128), device="cuda", generator=g).to(torch.bfloat16)  # frequent ties
        D = torch.randint(-3, 4, (nd, ld, 128), device="cuda", generator=g).to(torch.bfloat16)
        qm = dm = None
        if masked:
            qm = torch.arange(lq, device="cuda")[None, :] < torch.randint(1, lq + 1, (nq, 1), device="cuda", generator=g)
            dm = torch.arange(ld, device="cuda")[None, :] < torch.randint(0, ld + 1, (nd, 1), device="cuda", generator=g)
        for argmax in (False, True):
            ref, ref_arg = maxsim_forward_ws(Q, D, qm, dm, save_argmax=argmax, poison=True)
            out, arg = maxsim_forward_ws(Q, D, qm, dm, save_argmax=argmax, poison=True, half_rows=half,
                                         consumers=cons, q_in_regs=regs, sub_tiles=sub)
            ok = torch.allclose(out, ref, rtol=1e-6, atol=1e-3) and (not argmax or torch.equal(arg, ref_arg))
            if not ok:
                bad.append(f"{(nq, lq, nd, ld, masked, argmax)}: max |diff| {(out - ref).abs().max().item():.3g}"
                           + (f", argmax differs at {(arg != ref_arg).sum().item()}" if argmax else ""))
    return "ok" if not bad else "MISMATCH " + "; ".join(bad[:3])


def main():
    rows = []
    for cfg in CONFIGS:
        try:
            status = check(cfg)
        except Exception as e:  # noqa: BLE001 - report and go on
            status = f"FAILED {type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
        print(f"{name(cfg):18s} {status}", flush=True)
        if not status.startswith("ok"):
            continue
        half, cons, regs, sub = cfg
        for nd, ld in [(128, 1024), (512, 256)]:
            torch.manual_seed(0)
            Q = torch.randn(128, 128, 128, device="cuda", dtype=torch.bfloat16)
            D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
            for argmax in (True, False):
                fn = lambda: maxsim_forward_ws(Q, D, save_argmax=argmax, half_rows=half, consumers=cons,  # noqa: E731
                                               q_in_regs=regs, sub_tiles=sub)
                fn()
                ms = [triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(3)]
                line = (f"{name(cfg):18s} {'argmax' if argmax else 'plain ':6s} Nd {nd:4d} Ld {ld:5d}: "
                        f"{min(ms):.3f}-{max(ms):.3f} ms")
                rows.append(line)
                print(line, flush=True)
    print("\nsummary (in-batch 128 queries x 128 tokens, d 128, bf16):")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
