"""Times the warp-specialized Gluon forward (maxsim/dense/forward_ws.py) against the shipped
forward on the compute-bound shapes, over a few configurations (GPU).

    python benchmarks/ws_bench.py [--shapes a,b] [--quick]
"""

import argparse
import itertools

import triton

import maxsim
from maxsim.bench.shapes import GPU_SHAPES, floor_seconds, make_inputs
from maxsim.dense.forward import maxsim_forward
from maxsim.dense.forward_ws import maxsim_forward_ws

DEFAULT = "inbatch_128x128,inbatch_128x128+argmax,colpali_1x1k,1x1k_128x1024,32q_x_100k"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--all", action="store_true", help="also split_docs=False (the default rule picks it)")
    args = ap.parse_args()
    for item in args.shapes.split(","):
        name, _, flag = item.partition("+")
        argmax = flag == "argmax"
        shape = next(s for s in GPU_SHAPES if s.name == name)
        Q, D, qm, dm = make_inputs(shape, "cuda")
        floor_ms = floor_seconds(shape) * 1e3
        ref = maxsim.maxsim(Q, D, qm, dm)
        if argmax:
            base_fn = lambda: maxsim_forward(Q, D[None], qm, dm[None] if dm is not None else None, save_argmax=True)  # noqa: E731
            _, ref_arg = base_fn()
        else:
            base_fn = lambda: maxsim.maxsim(Q, D, qm, dm)  # noqa: E731
        base = triton.testing.do_bench(base_fn, warmup=25, rep=100, return_mode="median")
        print(f"{item}: floor {floor_ms:.3f} ms; Triton forward {base:.3f} ms ({100 * floor_ms / base:.1f} %)", flush=True)
        rows = []
        for BN, stages, split, regs in itertools.product((64, 128), (2, 4, 6), (None, True, False), (False, True)):
            if BN == 128 and stages > 4 or split is False and not args.all:
                continue
            # With the argmax, BN = 128 finds the column in every tile (the winning tile [128, 128]
            # would not fit in registers beside the accumulator).
            per_tile = argmax and BN == 128
            try:
                fn = lambda: maxsim_forward_ws(Q, D, qm, dm, save_argmax=argmax, BN=BN, STAGES=stages,  # noqa: E731
                                               split_docs=split, q_in_regs=regs, argmax_per_tile=per_tile)
                out, arg = fn()
                err = float((out - ref).abs().max() / ref.abs().max())
                if argmax:
                    err = (err, int((arg != ref_arg).sum()))
                ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                rows.append((ms, BN, stages, split, regs, err))
            except Exception as e:  # noqa: BLE001
                rows.append((float("inf"), BN, stages, split, regs, repr(e)[:100]))
        rows.sort(key=lambda r: r[0])
        for ms, BN, stages, split, regs, err in rows[:8]:
            pct = 100 * floor_ms / ms if ms != float("inf") else 0
            print(f"   ws BN{BN} stages{stages} split{split} qregs{int(regs)}: {ms:.3f} ms ({pct:.1f} %) err {err}", flush=True)


if __name__ == "__main__":
    main()
