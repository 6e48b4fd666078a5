"""The Gluon PQ scorer alone, for a profiler (issue 54): one query (or ``--queries``) against
``--docs`` random-coded pq32 documents, a few calls. Needs a Hopper GPU.

    ncu --clock-control none -k regex:_pq_lut_gluon --launch-skip 2 --launch-count 1 --set detailed \\
        python benchmarks/pq_profile.py [--docs 1000000] [--pairs]
    (or: bash benchmarks/gpu_session.sh pqncu)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from pq_probe import make_case, queries  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=1)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--pairs", action="store_true", help="the row-pair epilogue (gluon_scores(pairs=True))")
    args = p.parse_args()
    from maxsim.compressed.pq_gluon import gluon_scores
    from maxsim.compressed.pq_lut import build_layout

    pq, codes, cu = make_case(args.docs)
    layout = build_layout(pq, codes, cu)
    del codes
    Q = queries(args.queries)
    qpb, bt, maxnreg = (1, 128, None) if args.queries == 1 else (4, 64, 168)
    for _ in range(args.calls):
        out = gluon_scores(Q, layout, qpb=qpb, block_tokens=bt, maxnreg=maxnreg, pairs=args.pairs)
    torch.cuda.synchronize()
    print("scores", tuple(out.shape), float(out.max()))


if __name__ == "__main__":
    main()
