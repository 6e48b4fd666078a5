"""Probe: where a refined search's time goes at batch 1 (issue 54 point 4). Needs a GPU.

    python benchmarks/refine_probe.py [--docs 300000] [--factor 4] [--segments 1] [--refine-encoding float16]

A residual2 corpus of random codes (benchmarks/residual_probe.make_case) on the GPU, and float16
tokens of the same document lengths in pinned host memory as its refine corpus. Times, per query
(medians over 32 single queries, after every query ran once untimed): the first stage alone
(``Corpus.search(Q, k * factor)``), the whole refined search, and the refine stage's steps one by
one (device synchronised between them): the candidates to the host, the gather of their tokens,
the wait for their copy to the GPU, ``score_pairs_packed``, the merge (on the host, as the library
merges few pairs) and, for comparison, the same merge on the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from residual_probe import make_case, queries  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=300_000)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--segments", type=int, default=1,
                   help="the refine corpus in this many appended segments (a corpus built slice by slice)")
    p.add_argument("--refine-encoding", default="float16", choices=("float16", "int8", "fp8"))
    args = p.parse_args()
    from maxsim.search import refine as R
    from maxsim.search.corpus import Corpus, CorpusSegment
    from maxsim.varlen.queries import packed_queries
    from maxsim.varlen.ops import score_pairs_packed

    codec, codes, residuals, cu = make_case(2, args.docs)
    offsets = cu.cpu().numpy()
    corpus = Corpus._from_segments([CorpusSegment(codes, offsets, 0, residuals=residuals)], np.arange(args.docs),
                                   codec=codec)
    tokens = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128), dim=-1).half()
    bounds = np.linspace(0, args.docs, args.segments + 1).astype(np.int64)
    full = None
    for a, b in zip(bounds[:-1], bounds[1:]):  # one pinned segment a slice, as headline_bench builds it
        piece = Corpus.from_packed(tokens[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a],
                                   encoding=args.refine_encoding).pin_memory()
        if full is None:
            full = piece
        else:
            full.append(piece, ids=np.arange(a, b))
    Qs = queries(32)
    k, m = args.k, args.k * args.factor

    def timed(fn):
        times = []
        for i in range(32):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(Qs[i:i + 1])
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)

    for i in range(32):  # every query once, untimed: kernels compiled, layout built
        corpus.search(Qs[i:i + 1], k, progress=False, refine=full, refine_factor=args.factor)
    first_k = timed(lambda q: corpus.search(q, k, progress=False))
    first = timed(lambda q: corpus.search(q, m, progress=False))
    whole = timed(lambda q: corpus.search(q, k, progress=False, refine=full, refine_factor=args.factor))
    steps = {n: [] for n in ("first stage", "to host", "gather", "copy wait", "score pairs", "merge", "merge on GPU")}
    for i in range(32):
        q1 = Qs[i:i + 1]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        idx = corpus.search(q1, m, progress=False).indices
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        local = idx.cpu().numpy()
        docs = np.unique(local[local >= 0])
        t2 = time.perf_counter()
        toks, cu_d = R._gather(full, docs, torch.device("cuda"))  # into pinned memory, then copied
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        q, _, cu_q_host, _ = packed_queries(q1, None)
        pos = np.searchsorted(docs, local[0])  # (one query: every candidate is valid)
        q = q.cuda().to(toks.dtype if toks.dtype in (torch.float16, torch.bfloat16) else torch.float32)
        s = score_pairs_packed(q, toks, torch.from_numpy(cu_q_host).cuda(), torch.from_numpy(cu_d).cuda(),
                               torch.zeros(m, dtype=torch.int64, device="cuda"), torch.from_numpy(pos).cuda(),
                               32, int(np.diff(cu_d).max()))
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        top = R.merge_topk(s.view(1, m).float().cpu(), idx.cpu(), k)  # as refine_candidates merges few pairs
        top[0].cuda(), top[1].cuda()
        torch.cuda.synchronize()
        t6 = time.perf_counter()
        R.merge_topk(s.view(1, m), idx.cuda(), k)  # the device merge, for many pairs
        torch.cuda.synchronize()
        t7 = time.perf_counter()
        for n, a, b in zip(steps, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
            steps[n].append(1e3 * (b - a))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  docs {args.docs}  k {k} x {args.factor}  "
          f"refine {args.refine_encoding} in {len(full.segments)} segments")
    print(f"search for k alone {first_k:.3f} ms; first stage alone (k x factor) {first:.3f} ms; refined search {whole:.3f} ms "
          f"({first_k / whole:.0%} of the unrefined search's q/s)")
    for n, v in steps.items():
        print(f"   {n:12s} {statistics.median(v):.3f} ms")
    # the refined search's host time by function (cProfile over the 32 single queries)
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(32):
        corpus.search(Qs[i:i + 1], k, progress=False, refine=full, refine_factor=args.factor)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
