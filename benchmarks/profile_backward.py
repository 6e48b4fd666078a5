"""Where a training step's time goes (GPU): per-kernel CUDA time of one step for maxsim's backward
strategies and naive PyTorch, then the gather kernel's tile sweep.

    python benchmarks/profile_backward.py
"""

import itertools

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import maxsim
from maxsim.bench.shapes import TRAIN_GPU_SHAPES, make_inputs
from maxsim.bench.train import train_labels, train_step
from maxsim.dense import backward as B
from maxsim.dense.forward import maxsim_forward


def kernels_of_step(fn, args, leaves, labels, top=8):
    for _ in range(3):
        train_step(fn, args, leaves, labels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            train_step(fn, args, leaves, labels)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    total = sum(e.device_time_total for e in prof.key_averages()) / 5
    lines = [f"    {e.device_time_total / 5:9.1f} us  x{e.count // 5:<3d} {e.key[:90]}" for e in rows]
    return total, lines


def main():
    for shape in TRAIN_GPU_SHAPES[:3]:
        Q, D, qm, dm = make_inputs(shape, "cuda")
        Q.requires_grad_(True)
        D.requires_grad_(True)
        labels = train_labels(shape, "cuda")
        for name, fn in [
            ("unified", lambda q, d: maxsim.maxsim(q, d, backward="unified")),
            ("lowmem", lambda q, d: maxsim.maxsim(q, d, backward="lowmem")),
        ]:
            total, lines = kernels_of_step(fn, (Q, D), (Q, D), labels)  # host side: profile_train_host.py
            print(f"{shape.name} {name}: {total:.1f} us of kernels per step")
            print("\n".join(lines))

    # Gather kernel sweep: the backward alone, on the saved argmax.
    for shape in (TRAIN_GPU_SHAPES[0], TRAIN_GPU_SHAPES[1], TRAIN_GPU_SHAPES[2]):
        Q, D, _, _ = make_inputs(shape, "cuda")
        D4 = D if shape.candidates else D[None]
        _, arg = maxsim_forward(Q, D4, None, None, save_argmax=True)
        g = torch.randn(shape.nq, shape.nd, device="cuda")
        ref = B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy="unified")
        base = B.gather_config
        for strategy in ("unified", "lowmem"):
            results = []
            for BS, warps, rotate in itertools.product((4, 8, 16, 32), (4, 8), (0, 1)):
                B.gather_config = lambda Lq, BD, cand, scatter=True, BS=BS, warps=warps, rotate=rotate: (
                    min(BS, triton.next_power_of_2(Lq)), warps, rotate, 1)
                try:
                    fn = lambda: B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy=strategy)  # noqa: E731
                    gq, gd = fn()
                    ok = torch.allclose(gq.float(), ref[0].float(), rtol=2e-2, atol=2e-2)
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    results.append((ms, BS, warps, rotate, ok))
                except Exception as e:  # noqa: BLE001
                    results.append((float("inf"), BS, warps, rotate, repr(e)[:60]))
            B.gather_config = base
            results.sort(key=lambda r: r[0])
            rule = B.gather_config(shape.lq, 128, shape.candidates)
            print(f"{shape.name} backward {strategy}: rule BS,warps,rotate={rule}; best: "
                  + "; ".join(f"BS{bs} w{w} rot{r} {ms * 1e3:.0f}us ok={ok}" for ms, bs, w, r, ok in results[:5]))


if __name__ == "__main__":
    main()
