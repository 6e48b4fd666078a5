"""Where backward="auto" should stop sending candidate lists to lowmem (GPU): ``LISTS_MAX_LQ``.

Shape: 32 queries x 32 candidates (Lq, Ld 300), d 128, bf16, for Lq from 32 to 2048. For each Lq,
the backward alone (``maxsim_backward``, cold L2) and a whole training step (cross-entropy over
the scores, positive first; ``--pin-cpu`` style host noise is not controlled here, so the step is
given on the GPU clock only) with ``backward="unified"`` and ``"lowmem"``. lowmem also has no fp32
buffer of D's size and is bitwise deterministic, so at a tie it is the better choice. The two
strategies' gradients are compared (they differ only by fp32 summation order).

The threshold was set on 2026-11-29, before lowmem's gather took several documents a step:
lowmem 85 / 106 / 140 / 319 us against unified 149 / 154 / 177 / 319 at Lq 32 / 128 / 256 / 1024.

    python benchmarks/probe_lists_threshold.py
"""

import torch
import torch.nn.functional as F

import maxsim
import maxsim.dense.backward as B
from maxsim.dense.ops import choose_strategy
from maxsim.bench.timing import cold_ms
from maxsim.dense.forward import maxsim_forward

NQ, K, LD, DIM = 32, 32, 300, 128


def main():
    print(f"candidate lists {NQ} x {K}, Ld {LD}, d {DIM}, bf16; us, cold L2", flush=True)
    print(f"{'Lq':>5s} {'bwd unified':>12s} {'bwd lowmem':>11s} {'step unified':>13s} {'step lowmem':>12s} "
          f"{'grad_D rel diff':>16s}  auto now", flush=True)
    for lq in (32, 64, 128, 256, 384, 512, 768, 1024, 2048):
        torch.manual_seed(0)
        Q = torch.randn(NQ, lq, DIM, device="cuda").to(torch.bfloat16)
        D = torch.randn(NQ, K, LD, DIM, device="cuda").to(torch.bfloat16)
        _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
        g = torch.randn(NQ, K, device="cuda")
        bwd = {s: 1e3 * cold_ms(lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy=s))  # noqa: B023
               for s in ("unified", "lowmem")}
        gu = B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="unified")[1].float()
        gl = B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="lowmem")[1].float()
        diff = ((gu - gl).norm() / gu.norm()).item()
        Qg, Dg = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
        labels = torch.zeros(NQ, dtype=torch.long, device="cuda")

        def step(strategy):
            Qg.grad = Dg.grad = None
            F.cross_entropy(maxsim.maxsim(Qg, Dg, backward=strategy), labels).backward()

        steps = {s: 1e3 * cold_ms(lambda: step(s)) for s in ("unified", "lowmem")}  # noqa: B023
        auto = choose_strategy("auto", D, lq)
        print(f"{lq:5d} {bwd['unified']:12.1f} {bwd['lowmem']:11.1f} {steps['unified']:13.1f} "
              f"{steps['lowmem']:12.1f} {diff:16.2e}  {auto}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
