"""The lowmem backward of candidate lists (train_candidates_32x32: 32 queries x 32 candidates,
Lq 32, Ld 300, d 128, bf16) with the grad_Q gather kernel at BS query tokens a program (GPU).

gather_config gives candidate lists BS = 32, measured with grad_D's atomics (unified): one program
per query, 32 programs. lowmem's gather has no atomics; narrower programs put more of them in
flight. Each BS is checked bitwise against BS = 32 (a row sums its documents in the same order).

    python benchmarks/probe_lists_gather.py

Not yet run: written at 23:54 UTC on 2026-11-29, after the session's device time was spent. The
lowmem step of this shape takes 0.110-0.112 ms on the GPU clock (BENCHMARKS.md), of which about
85 us is the backward; late-interaction-kernels' best rounds took 0.084.
"""
import torch
import triton

import maxsim.dense.backward as B
from maxsim.dense.forward import maxsim_forward

torch.manual_seed(0)
nq, k, lq, ld, d = 32, 32, 32, 300, 128
Q = torch.randn(nq, lq, d, device="cuda").to(torch.bfloat16)
D = torch.randn(nq, k, ld, d, device="cuda").to(torch.bfloat16)
_, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
g = torch.randn(nq, k, device="cuda")
shipped = B.gather_config
ref = None
for BS in (32, 16, 8, 4, 2):
    for warps in (4, 2):
        B.gather_config = lambda Lq, BD, candidates, BS=BS, warps=warps: (BS, warps, 1)  # noqa: E731
        fn = lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="lowmem")  # noqa: E731
        gq, gd = fn()
        if ref is None:
            ref = (gq, gd)
        same = torch.equal(gq, ref[0]) and torch.equal(gd, ref[1])
        us = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"BS {BS:2d} warps {warps}: lowmem backward {us:6.1f} us  bitwise equal to BS 32: {same}", flush=True)
B.gather_config = shipped
