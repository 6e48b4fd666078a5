"""Host side of a training step (GPU): where small training shapes spend their time when the
kernels take a fraction of the step.

For each shape and provider: the step time as the benchmark measures it (maxsim.bench.timing.cold_ms), the
host time per step (steps enqueued back to back, one sync at the end), and the kernels' time per
step (torch.profiler). Then the top host-side operators of maxsim's step and naive's.

    python benchmarks/profile_train_host.py
"""

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import maxsim
from maxsim.bench.providers import TRAIN_PROVIDERS
from maxsim.bench.shapes import TRAIN_GPU_SHAPES, make_inputs
from maxsim.bench.timing import back_to_back, cold_ms
from maxsim.bench.train import train_labels, train_step
from maxsim.dense import ops


def via_custom_op(strategy):
    """maxsim's step through the torch.library op and its registered autograd (the path that
    torch.compile sees), for comparison with the eager autograd.Function."""

    def fn(Q, D):
        D4 = D if D.dim() == 4 else D[None]
        return ops.dense_forward(Q, D4, None, None, False, False, True, strategy)[0]

    return fn


def profile_step(step, top=12):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 10  # each kernel counted once
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    lines = [f"      {e.self_cpu_time_total / 10:8.1f} us self CPU  x{e.count // 10:<3d} {e.key[:80]}" for e in rows]
    return kernels, lines


def backward_only_us(Q, D, strategy):
    """The backward launcher alone, on a saved argmax, in microseconds (do_bench median)."""
    from maxsim.dense.backward import maxsim_backward
    from maxsim.dense.forward import maxsim_forward

    _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
    g = torch.randn(Q.shape[0], D.shape[1], device="cuda")
    fn = lambda: maxsim_backward(g, Q, D, arg, normalize=False, strategy=strategy)  # noqa: E731
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def main():
    import cProfile
    import pstats

    profiles = []
    for shape in TRAIN_GPU_SHAPES:
        if shape.name not in ("train_candidates_32x32", "train_inbatch_256x256"):
            continue
        Q, D, qm, dm = make_inputs(shape, "cuda")
        Q.requires_grad_(True)
        D.requires_grad_(True)
        labels = train_labels(shape, "cuda")
        candidates = [
            ("maxsim auto (eager Function)", lambda q, d: maxsim.maxsim(q, d)),
            ("maxsim unified (eager Function)", lambda q, d: maxsim.maxsim(q, d, backward="unified")),
            ("maxsim lowmem (eager Function)", lambda q, d: maxsim.maxsim(q, d, backward="lowmem")),
            ("maxsim auto (custom op)", via_custom_op(ops.choose_strategy("auto", D if D.dim() == 4 else D[None], shape.lq))),
        ]
        for pname in ("naive", "late-interaction-kernels", "flash-maxsim"):
            p = TRAIN_PROVIDERS[pname]
            if p.available("cuda"):
                candidates.append((pname, lambda q, d, p=p: p.fn(*p.prepare(q, d, None, None))))
        # Timings first: once torch.profiler has run (CUPTI), every launch in the process is slower.
        print(f"== {shape.name}")
        for name, fn in candidates:
            try:
                step = lambda fn=fn, Q=Q, D=D, labels=labels: train_step(fn, (Q, D), (Q, D), labels)  # noqa: E731
                step()
                ms = cold_ms(step, warmup=25, rep=200)
                host, wall = (t * 1e6 for t in back_to_back(step, 200))
                print(f"  {name:32s} step {ms * 1e3:7.1f} us | host {host:7.1f} us/step, back-to-back "
                      f"{wall:7.1f} us/step")
                if name in ("maxsim auto (eager Function)", "naive"):
                    profiles.append((f"{shape.name} {name}", step))
            except Exception as exc:  # noqa: BLE001
                print(f"  {name:32s} failed: {type(exc).__name__}: {str(exc)[:120]}")

    print("== lowmem (one-hot lists kernel) against unified, backward alone, candidate lists 32 x 32 (Lq, 300)")
    for lq in (32, 128, 256, 1024):
        Q = torch.randn(32, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(32, 32, 300, 128, device="cuda", dtype=torch.bfloat16)
        print(f"  Lq {lq:5d}: unified {backward_only_us(Q, D, 'unified'):7.1f} us, "
              f"lowmem {backward_only_us(Q, D, 'lowmem'):7.1f} us")

    for title, step in profiles:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, 100 steps: {title}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    for title, step in profiles:
        kernels, lines = profile_step(step)
        print(f"== torch.profiler: {title}: kernels {kernels:7.1f} us/step")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
