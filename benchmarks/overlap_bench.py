"""Times the Gluon prototype (maxsim/dense/forward_overlap.py) against the shipped Triton forward on
the compute-bound shapes, over a few tile configurations (GPU).

    python benchmarks/overlap_bench.py
"""

import itertools

import torch
import triton

import maxsim
from maxsim.bench.shapes import GPU_SHAPES, floor_seconds, make_inputs
from maxsim.dense.forward import maxsim_forward
from maxsim.dense.forward_overlap import maxsim_forward_overlap


def main():
    # (shape, training forward with the argmax?)
    for name, argmax in [("32q_x_100k", False), ("inbatch_128x128", False), ("inbatch_128x128", True),
                         ("masked_64x64", False), ("1x1k_128x1024", False)]:
        shape = next(s for s in GPU_SHAPES if s.name == name)
        Q, D, qm, dm = make_inputs(shape, "cuda")
        floor_ms = floor_seconds(shape) * 1e3
        ref = maxsim.maxsim(Q, D, qm, dm)
        if argmax:
            base_fn = lambda: maxsim_forward(Q, D[None], qm, dm[None] if dm is not None else None, save_argmax=True)  # noqa: E731
        else:
            base_fn = lambda: maxsim.maxsim(Q, D, qm, dm)  # noqa: E731
        base = triton.testing.do_bench(base_fn, warmup=25, rep=100, return_mode="median")
        label = name + (" (with argmax)" if argmax else "")
        print(f"{label}: floor {floor_ms:.3f} ms; Triton forward {base:.3f} ms ({100 * floor_ms / base:.0f} %)")
        rows = []
        for BM, BN, stages, warps, waves in itertools.product((128, 256), (64, 128), (3,), (4, 8), (1, 2)):
            if BM == 256 and warps == 4 or argmax and BN == 128:
                continue
            try:
                fn = lambda: maxsim_forward_overlap(Q, D, qm, dm, save_argmax=argmax, BM=BM, BN=BN, STAGES=stages,  # noqa: E731
                                                    num_warps=warps, waves=waves)[0]
                err = float((fn() - ref).abs().max() / ref.abs().max())
                ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                rows.append((ms, BM, BN, stages, warps, waves, err))
            except Exception as e:  # noqa: BLE001
                rows.append((float("inf"), BM, BN, stages, warps, waves, repr(e)[:80]))
        rows.sort(key=lambda r: r[0])
        for ms, BM, BN, stages, warps, waves, err in rows[:6]:
            pct = 100 * floor_ms / ms if ms != float("inf") else 0
            print(f"   overlap BM{BM} BN{BN} stages{stages} w{warps} waves{waves}: {ms:.3f} ms ({pct:.0f} %) err {err}")


if __name__ == "__main__":
    main()
