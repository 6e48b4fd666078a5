"""Where the candidate-list training step's time goes, and the lowmem backward's tile choices (GPU).

Shape train_candidates_32x32: 32 queries x 32 candidates, Lq 32, Ld 300, d 128, bf16. D is 79 MB,
so the step's floor is about reading D once (forward) and writing grad_D once (backward).

1. Per-kernel CUDA time of one step (torch.profiler), lowmem and unified.
2. lowmem's grad_Q gather at BS query tokens a program and KB documents a step (gather_config):
   BS = 32 and KB = 1, the width measured for unified (with grad_D's atomics), is one program per
   query, 32 programs; narrower programs and several documents a step put more loads in flight.
   Each is checked against the rule's (bitwise where only BS changes: a row sums its documents in
   the same order).
3. The one-hot grad_D kernel (_grad_d_lists) at other tiles (BN document tokens, warps).
4. The forward with the argmax at other tiles (cold L2).

At 00:38 UTC on 2026-11-30 (BS only, KB = 1): BS = 4 on 4 warps took the backward from 78 to
61 us, the gather in the step from 34.5 to 19.7; the forward's best tile was BN = 64, 4 waves
(25.9 against 31.3 us for the rule's BN = 128, 2 waves) (results/lists-20261130-0038.log).
At 00:47 (BS, KB, warps): 2, 16, 2 took 41.4 us (cold L2), 4, 16, 2 42.8 and 2, 8, 2 43.3,
against 59.4 for 4, 1, 4 (results/lists-20261130-0047.log).

    python benchmarks/probe_lists_gather.py
"""
import itertools

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import maxsim
import maxsim.dense.backward as B
from maxsim._tuning import ForwardConfig
from maxsim.bench.shapes import TRAIN_GPU_SHAPES, make_inputs
from maxsim.bench.timing import cold_ms
from maxsim.bench.train import train_labels, train_step
from maxsim.dense.forward import maxsim_forward

shape = next(s for s in TRAIN_GPU_SHAPES if s.name == "train_candidates_32x32")
Q, D, _, _ = make_inputs(shape, "cuda")
Q.requires_grad_(True)
D.requires_grad_(True)
labels = train_labels(shape, "cuda")
for strategy in ("lowmem", "unified"):
    fn = lambda q, d: maxsim.maxsim(q, d, backward=strategy)  # noqa: E731
    for _ in range(3):
        train_step(fn, (Q, D), (Q, D), labels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            train_step(fn, (Q, D), (Q, D), labels)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    print(f"step, {strategy}: {sum(e.device_time_total for e in events) / 5:.1f} us of kernels")
    for e in events[:10]:
        print(f"    {e.device_time_total / 5:8.1f} us  x{e.count // 5:<3d} {e.key[:100]}")

Q, D = Q.detach(), D.detach()
_, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
g = torch.randn(shape.nq, shape.nd, device="cuda")
shipped = B.gather_config
fn = lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="lowmem")  # noqa: E731
ref = fn()
print(f"shipped rule {shipped(shape.lq, 128, True, scatter=False)}: lowmem backward "
      f"{1e3 * cold_ms(fn):6.1f} us (cold L2)", flush=True)
for BS, KB, warps in itertools.product((2, 4, 8, 32), (1, 4, 8, 16), (2, 4)):
    B.gather_config = lambda Lq, BD, candidates, scatter=True, BS=BS, warps=warps, KB=KB: (BS, warps, 1, KB)  # noqa: E731
    gq, gd = fn()
    same = torch.equal(gq, ref[0]) and torch.equal(gd, ref[1])
    close = torch.allclose(gq.float(), ref[0].float(), rtol=1e-2, atol=1e-2)
    print(f"BS {BS:2d} KB {KB:2d} warps {warps}: lowmem backward {1e3 * cold_ms(fn):6.1f} us (cold L2)  "
          f"bitwise equal to the rule's: {same}, close: {close}", flush=True)
B.gather_config = shipped

# The one-hot grad_D kernel alone, at other tiles.
qinv = dinv = g
for BN in (16, 32, 64, 128):
    for warps in (2, 4, 8):
        Nq, Lq, d = Q.shape
        K, Ld = D.shape[1], D.shape[2]
        out = torch.empty_like(D)
        BS = 32
        fn = lambda: B.launch(B._maxsim_bwd_lists_kernel, (Nq * K, -(-Ld // BN)),  # noqa: E731
                              (Q, D, g, arg, qinv, dinv, out, K, Lq, Ld, d, D.stride(0), D.stride(1), D.stride(2)),
                              dict(BN=BN, BS=BS, BD=128, NORMALIZE=False, DOT_FP32=False),
                              num_warps=warps, num_stages=B.DEFAULT_STAGES)
        fn()
        same = torch.equal(out, ref[1])
        us = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"lists kernel BN {BN:3d} warps {warps}: {us:6.1f} us  equal: {same}", flush=True)

# The forward with the argmax at other tiles (cold L2): BM = 32 (one query).

ref_s, ref_a = maxsim_forward(Q, D, None, None, save_argmax=True)
print(f"forward, the rule: {1e3 * cold_ms(lambda: maxsim_forward(Q, D, None, None, save_argmax=True)):.1f} us")
results = []
for BN, warps, stages, row_max in itertools.product((64, 128), (2, 4), (3,), (False, True)):
    for waves in (2, 4, 8):
        cfg = ForwardConfig(BM=32, BN=BN, BK=128, num_warps=warps, num_stages=stages, waves=waves, row_max=row_max)
        try:
            s, a = maxsim_forward(Q, D, None, None, save_argmax=True, config=cfg)
            ok = torch.equal(a, ref_a) and torch.allclose(s, ref_s, rtol=1e-5, atol=1e-4)
            us = 1e3 * cold_ms(lambda: maxsim_forward(Q, D, None, None, save_argmax=True, config=cfg))  # noqa: B023
            results.append((us, cfg, ok))
        except Exception as e:  # noqa: BLE001
            results.append((float("inf"), cfg, type(e).__name__))
results.sort(key=lambda r: r[0])
for us, cfg, ok in results[:12]:
    print(f"forward {us:6.1f} us  BN {cfg.BN} warps {cfg.num_warps} stages {cfg.num_stages} waves {cfg.waves} "
          f"row_max {cfg.row_max}  equal: {ok}")
print(f"({sum(r[2] is True for r in results)} of {len(results)} configurations equal to the rule's outputs)")
