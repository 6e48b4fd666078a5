"""Where the warp-specialized forward's argmax spends its time (GPU).

The training forward with the argmax takes about 0.92 ms at in-batch 128 x 128 against 0.66 without
it. Replacing the per-element compare and select by FSET.BF and an FMA (no predicate registers,
half the work off the ALU pipe) did not move it (results/ws-*-20261129-20*.log), so the count of
epilogue instructions is not what limits it. This probe separates the suspects, each variant in a
fresh process (the kernel's helpers are swapped before it compiles):

- ``plain-S`` / ``argmax-S``: without and with the argmax, S = 1 or 2 MMAs per tile (``sub_tiles``);
- ``-head``: the kernel as last committed (benchmarks/_forward_ws_head.py), for a before/after;
- ``-masked``: random prefix masks on both sides; ``-smem``: the query block read by the MMA from
  shared memory instead of registers;
- ``triton-1`` / ``triton-0``: the Triton kernel (forward.py) with and without the argmax, as the
  library would run it without the Gluon one;
- ``values-1``: the per-thread tree of maxima without indices (the per-document reduction and the
  stores stay);
- the document length: the same work as Nd x Ld = 128 x 1024 cut into 512 x 256 documents, which
  changes how often the per-document reduction runs (at 20:12 UTC on 2026-11-29, 32 x 4096 timed as
  128 x 1024: it is not the per-document work).

With ``--clocks`` each variant also runs back to back for 3 s while nvidia-smi samples the SM
clock, power and clock-event reasons: at 21:20 UTC every variant ran at the 700 W power cap, the
argmax at a higher clock than the plain forward (results/clocks-20261129-2120.log), so the
argmax's cost is its energy.

    python benchmarks/probe_ws_argmax.py [--variants a,b] [--clocks]
"""

import argparse
import subprocess
import sys

SHAPES = [(128, 1024), (512, 256)]  # (Nd, Ld); Nq = 128 queries of 128 tokens, d = 128, bf16
# (argmax, MMAs per tile, masks)
VARIANTS = ["plain-1", "plain-1-smem", "argmax-1", "argmax-2", "argmax-1-smem", "argmax-2-smem",
            "argmax-2-masked", "argmax-1-smem-masked", "triton-1", "triton-1-masked", "plain-1-masked", "triton-0-masked"]


def run_one(variant: str):
    import torch
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    if "head" not in variant.split("-"):
        import maxsim.dense.forward_ws as W
    else:
        # The kernel as committed (benchmarks/_forward_ws_head.py, written by `git show
        # HEAD:src/maxsim/dense/forward_ws.py` before the call): a before/after in one call.
        import importlib.util

        spec = importlib.util.spec_from_file_location("_forward_ws_head", __file__.replace("probe_ws_argmax.py",
                                                                                             "_forward_ws_head.py"))
        W = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(W)

    kind, sub, *rest = variant.split("-")
    masked = "masked" in rest
    q_in_regs = "smem" not in rest
    if kind == "values":
        @gluon.jit
        def _values_only(s, k, base, HALF: gl.constexpr, BN: gl.constexpr):
            v = gl.permute(gl.reshape(s, [HALF, BN // 8, 8]), (0, 2, 1))  # [HALF, 8, BN // 8]
            return gl.max(v, axis=2), gl.max(k, axis=2)

        W._thread_argmax = _values_only
    for nd, ld in SHAPES:
        torch.manual_seed(0)
        Q = torch.randn(128, 128, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        qm = dm = None
        if masked:
            qm = torch.arange(128, device="cuda")[None, :] < torch.randint(16, 129, (128, 1), device="cuda")
            dm = torch.arange(ld, device="cuda")[None, :] < torch.randint(ld // 8, ld + 1, (nd, 1), device="cuda")
        if kind == "triton":  # the Triton kernel (forward.py) as the library runs it, the Gluon one ruled out
            import maxsim.dense.forward as F

            F.warp_specialize_ok = lambda *args: False
            fn = lambda: F.maxsim_forward(Q, D[None], qm, dm[None] if dm is not None else None,  # noqa: E731
                                          save_argmax=sub == "1")
        else:
            fn = lambda: W.maxsim_forward_ws(Q, D, qm, dm, save_argmax=kind != "plain", BN=128, STAGES=4,  # noqa: E731
                                             q_in_regs=q_in_regs, sub_tiles=int(sub))
        fn()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"{variant:16s} Nd {nd:4d} Ld {ld:5d}: {ms:.3f} ms{clocks_under(fn) if CLOCKS else ''}", flush=True)


CLOCKS = "--clocks" in sys.argv
CLOCK_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def clocks_under(fn, seconds: float = 3.0) -> str:
    """SM clock, power and clock-event reasons that nvidia-smi samples (every 50 ms) while ``fn``
    runs back to back for ``seconds``: is the argmax's cost a lower clock (a power cap)?"""
    import time

    import torch

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={CLOCK_QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    calls = 0
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        calls += 20
    smi.terminate()
    out, _ = smi.communicate()
    rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 3]
    rows = rows[len(rows) // 4:]  # drop the ramp
    if not rows:
        return "  (no nvidia-smi samples)"
    med = lambda k: sorted(float(r[k]) for r in rows)[len(rows) // 2]  # noqa: E731
    reasons = sorted({r[3] for r in rows})
    return (f"  | loop {1e3 * (time.time() - t0) / calls:.3f} ms/call, SM clock {med(0):.0f} MHz, "
            f"power {med(1):.0f} W, {med(2):.0f} C, reasons {','.join(reasons)} ({len(rows)} samples)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--clocks", action="store_true", help="also sample SM clock and power under each variant")
    args = ap.parse_args()
    if args.variant:
        run_one(args.variant)
    else:
        for v in args.variants.split(","):
            subprocess.run([sys.executable, __file__, "--variant", v] + ["--clocks"] * args.clocks,
                           check=False, timeout=180)
