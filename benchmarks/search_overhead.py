"""Where one ``Corpus.search`` call spends its time beyond the scoring kernel (GPU).

    python benchmarks/search_overhead.py --docs 1000000 --encodings float16,int8

For each encoding: a GPU-resident corpus of random unit-norm passages (32-96 tokens, d 128), and
queries of 32 tokens. Rows: the wall clock of ``Corpus.search(Q, 10)`` (median of ``--reps``,
device synchronised) beside the wall clock of the scorer alone on the same tokens (``maxsim_varlen``
/ ``maxsim_quantized_varlen`` with device offsets and both max lengths: no host work), at 1 and 32
queries. ``--profile`` adds a torch.profiler table (CPU and CUDA time per op) and a cProfile of
the Python calls of one single-query search.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

import maxsim
from plaid_bench import wall_ms as _time  # (benchmarks/ is the script's folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--encodings", default="float16,int8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    lengths = torch.randint(32, 97, (args.docs,), generator=g, device=device)
    offsets = torch.zeros(args.docs + 1, dtype=torch.int64, device=device)
    offsets[1:] = lengths.cumsum(0)
    tokens = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128, generator=g, device=device), dim=-1)
    tokens = tokens.half()
    Q = torch.nn.functional.normalize(torch.randn(32, 32, 128, generator=g, device=device), dim=-1).half()
    max_d = int(lengths.max())
    print(f"{args.docs:,} passages, {tokens.shape[0]:,} tokens, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    for encoding in args.encodings.split(","):
        corpus = maxsim.Corpus.from_packed(tokens, offsets, encoding=encoding)
        for nq in (1, 32):
            q = Q[:nq].reshape(-1, 128).contiguous()
            cu_q = torch.arange(0, nq * 32 + 1, 32, device=device, dtype=torch.int64)
            if encoding in ("int8", "fp8"):
                from maxsim.compressed.quantized import maxsim_quantized_varlen
                seg = corpus.segments[0]
                views = list(Q[:nq])
                cu_host = offsets.cpu()

                def kernel():
                    return maxsim_quantized_varlen(views, seg.embeddings, seg.scales, cu_host)
            elif encoding in ("float16", "bfloat16", "float32"):
                def kernel():
                    return maxsim.maxsim_varlen(q, tokens, cu_q, offsets, 32, max_d)
            else:
                kernel = None
            queries = Q[0] if nq == 1 else Q[:nq]
            t_search = _time(lambda: corpus.search(queries, 10, progress=False), args.reps)
            t_kernel = _time(kernel, args.reps) if kernel else float("nan")
            print(f"{encoding:>9} {nq:>3}q  search {t_search:8.2f} ms  scorer {t_kernel:8.2f} ms  "
                  f"overhead {t_search - t_kernel:8.2f} ms")
        if args.profile:
            search = lambda: corpus.search(Q[0], 10, progress=False)  # noqa: E731
            search()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                search()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
            pr = cProfile.Profile()
            pr.enable()
            search()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
            print(s.getvalue())
        del corpus


if __name__ == "__main__":
    main()
