"""Times the warp-specialized Gluon forward (maxsim/dense/forward_ws.py) against the shipped
forward on the compute-bound shapes, over a few configurations (GPU). Times are medians with a
cold, clean L2 (maxsim.bench.timing.cold_ms); --graph replays use do_bench_cudagraph.

    python benchmarks/ws_bench.py [--shapes a,b] [--quick]
"""

import argparse
import itertools

import triton

import maxsim
from maxsim._dispatch import cuda_index
from maxsim._tuning import multiprocessors
from maxsim.bench.shapes import GPU_SHAPES, floor_seconds, make_inputs
from maxsim.bench.timing import cold_ms
from maxsim.dense.forward import maxsim_forward
from maxsim.dense.forward_ws import HALF_ROWS, maxsim_forward_ws, ws_plan

DEFAULT = "inbatch_128x128,inbatch_128x128+argmax,colpali_1x1k,1x1k_128x1024,32q_x_100k"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--all", action="store_true", help="also split_docs=False (the default rule picks it)")
    ap.add_argument("--graph", action="store_true",
                    help="also time each configuration replayed from a CUDA graph (GPU time without the host path)")
    ap.add_argument("--stages", default="2,4,6", help="ring depths to try (those that fit in shared memory)")
    ap.add_argument("--qregs-only", type=int, default=0, help="1: only the query block in registers")
    args = ap.parse_args()
    stages_list = [int(x) for x in args.stages.split(",")]
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
        base = cold_ms(base_fn, warmup=25, rep=100)
        graph = (lambda f: triton.testing.do_bench_cudagraph(f, rep=60, return_mode="median")) if args.graph else None
        base_graph = f", in a CUDA graph {graph(base_fn):.3f} ms" if graph else ""
        print(f"{item}: floor {floor_ms:.3f} ms; shipped forward {base:.3f} ms ({100 * floor_ms / base:.1f} %){base_graph}",
              flush=True)
        rows = []
        for BN, stages, split, regs in itertools.product((64, 128), stages_list, (None, True, False), (False, True)):
            # Shared memory (about 224 KB to use): the ring of [BN, d] 16-bit slots beside one
            # query block [128, d] (split documents) or two.
            splits = ws_plan(shape.nq, shape.nd, shape.lq, split, multiprocessors(cuda_index(Q)))[3]
            if (stages * BN + (1 if splits else 2) * HALF_ROWS) * shape.d * 2 > 224 * 1024 \
                    or split is False and not args.all or regs < args.qregs_only:
                continue
            try:
                fn = lambda: maxsim_forward_ws(Q, D, qm, dm, save_argmax=argmax, BN=BN, STAGES=stages,  # noqa: E731
                                               split_docs=split, q_in_regs=regs)
                out, arg = fn()
                err = float((out - ref).abs().max() / ref.abs().max())
                if argmax:
                    err = (err, int((arg != ref_arg).sum()))
                ms = cold_ms(fn, warmup=10, rep=60)
                if graph:
                    err = (err, f"graph {graph(fn):.3f} ms")
                rows.append((ms, BN, stages, split, regs, err))
            except Exception as e:  # noqa: BLE001
                rows.append((float("inf"), BN, stages, split, regs, repr(e)[:100]))
        rows.sort(key=lambda r: r[0])
        for ms, BN, stages, split, regs, err in rows[:8]:
            pct = 100 * floor_ms / ms if ms != float("inf") else 0
            print(f"   ws BN{BN} stages{stages} split{split} qregs{int(regs)}: {ms:.3f} ms ({pct:.1f} %) err {err}", flush=True)


if __name__ == "__main__":
    main()
