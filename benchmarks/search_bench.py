"""Corpus-scale search benchmark (issue 24, part 6). Run on a GPU:

    python benchmarks/search_bench.py                       # all parts, default sizes
    python benchmarks/search_bench.py --parts topk --topk-docs 1000000
    python benchmarks/search_bench.py --parts stream --stream-gb 4 --budget-gb 2 --mmap-dir /scratch

Parts:
  topk    maxsim.search.topk (as selected, then each path: chunked, fused) vs all scores +
          torch.topk (and flash-maxsim's flash_maxsim_topk, late-interaction-kernels' retrieve when
          importable) on Nq x Nd (Lq, Ld) fp16 shapes; ms (CUDA events, median), peak GPU memory
          above the inputs. Where the selection does not fuse, the fused kernel is also timed on
          the Triton tile (forced) and the reason is printed.
  stream  Corpus.search of one short query over a pinned host corpus and over a memory-mapped
          corpus file, against the plain pinned host-to-device copy rate and a sequential file
          read rate measured in the same run; GB/s and % of those rates.
  memory  GPU peak memory of a streamed search at 1x, 2x, 4x the corpus size (flat = good).
Prints a short table per part. Sizes are arguments; keep the corpus within host RAM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import maxsim
from maxsim.search import Corpus, topk
from maxsim.search.fused_topk import fused_topk
from maxsim.search.specs import FUSED_TOPK
from maxsim.selection.search import topk_choice


def cuda_ms(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def peak_above(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def table(title, header, rows):
    print(f"\n## {title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def part_topk(args):
    rows = []
    for shape in args.topk_shapes.split(","):
        nq, lq, ld = (int(x) for x in shape.split("x"))
        nd = args.topk_docs
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.float16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.float16)
        k = args.k
        # --topk-masked: an all-True d_mask (the masked kernels: the Triton forward everywhere).
        dm = torch.ones(nd, ld, dtype=torch.bool, device="cuda") if args.topk_masked else None
        cands = {
            "maxsim (scores only)": lambda: maxsim.maxsim(Q, D, None, dm),
            "maxsim + torch.topk": lambda: torch.topk(maxsim.maxsim(Q, D, None, dm), k, dim=1),
            "maxsim.search.topk": lambda: topk(Q, D, k, None, dm),
            "maxsim.search.topk chunked": lambda: topk(Q, D, k, None, dm, path="chunked"),
        }
        # The fused kernel: where the selection runs it (path "auto" above is then the same call),
        # and, where it does not (maxsim.maxsim takes the warp-specialized kernel), forced on the
        # Triton table's tile, to measure what fusing would cost there (its last bits may differ).
        choice = topk_choice(Q, D, k, masked=dm is not None, normalize=False)
        print(f"# {nq}x{nd} ({lq},{ld}) k={k}: maxsim.topk runs {choice.kernel.name}"
              + "".join(f"; not {name}: {why}" for name, why in choice.rejected))
        if choice.kernel is FUSED_TOPK:
            cands["maxsim.search.topk fused"] = lambda: topk(Q, D, k, None, dm, path="fused")
        else:
            tile = _triton_tile(Q, D)
            if tile is not None:
                cands["fused kernel, Triton tile (forced)"] = lambda: fused_topk(Q, D, k, None, dm, config=tile)
        try:
            import flash_maxsim  # noqa: F401

            fn = getattr(flash_maxsim, "flash_maxsim_topk", None)
            if fn is not None:
                cands["flash-maxsim topk"] = lambda fn=fn: fn(Q, D, k)
        except Exception:
            pass
        try:
            import late_interaction_kernels as lik  # noqa: F401

            fn = getattr(lik, "retrieve", None)
            if fn is not None:
                cands["late-interaction-kernels retrieve"] = lambda fn=fn: fn(Q, D, k)
        except Exception:
            pass
        base_ms = None
        for name, fn in cands.items():
            try:
                ms = cuda_ms(fn, args.repeat)
                mb = peak_above(fn)
            except Exception as err:  # a peer's API differs: report, keep going
                rows.append([f"{nq}x{nd} ({lq},{ld})", name, "error", type(err).__name__, ""])
                continue
            base_ms = ms if base_ms is None else base_ms
            rows.append([f"{nq}x{nd} ({lq},{ld})", name, f"{ms:.2f}", f"{mb:.0f}", f"{100 * (ms / base_ms - 1):+.1f}%"])
        # Scratch independent of Nd: peak of topk at half the documents.
        half = D[: nd // 2]
        half_mask = None if dm is None else dm[: nd // 2]
        rows.append([f"{nq}x{nd // 2} ({lq},{ld})", "maxsim.search.topk", "",
                     f"{peak_above(lambda: topk(Q, half, k, None, half_mask)):.0f}", ""])
        del Q, D, dm, half, half_mask
        torch.cuda.empty_cache()
    table("top-k vs scoring (fp16, d=128)", ["shape", "provider", "ms", "peak MB above inputs", "vs scores"], rows)


def _triton_tile(Q, D):
    """The dense Triton table's tile for an unmasked call, as a ForwardConfig (None where queries
    are longer than its row block): what the fused kernel would run if it were allowed to."""
    from maxsim.selection.dense import features
    from maxsim.tuning import is_big_corpus
    from maxsim.tuning import tables as T
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.tuning.rules import first_match, next_pow2, tile_of

    Nq, Lq, d = Q.shape
    f = features(Nq, Lq, d, Q.dtype, False, False, is_big_corpus(D.shape[0] * D.shape[1]))
    tile = ForwardConfig(**{"waves": 2, "row_max": False, "tma": False, **tile_of(first_match(T.DENSE_FORWARD_SM90, f), f)})
    return tile if next_pow2(Lq) <= tile.BM else None


def _make_corpus(num_tokens: int, length: int, pinned: bool) -> Corpus:
    n = num_tokens // length
    emb = torch.empty(n * length, 128, dtype=torch.float16, pin_memory=pinned)
    step = 1 << 24
    for a in range(0, emb.shape[0], step):  # random without a second full-size buffer
        emb[a:a + step].normal_()
    offsets = torch.arange(0, n * length + 1, length, dtype=torch.int64)
    return Corpus(emb, offsets)


def _pinned_copy_rate(corpus: Corpus, budget: int) -> float:
    emb = corpus.embeddings
    chunk = min(emb.shape[0], budget // (4 * emb.shape[1] * emb.element_size()))
    dst = torch.empty(chunk, emb.shape[1], dtype=emb.dtype, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for a in range(0, emb.shape[0] - chunk + 1, chunk):
        dst.copy_(emb[a:a + chunk], non_blocking=True)
    torch.cuda.synchronize()
    moved = (emb.shape[0] // chunk) * chunk * emb.shape[1] * emb.element_size()
    return moved / (time.perf_counter() - t) / 1e9


def _drop_cache(directory) -> bool:
    """Evict the corpus files from the page cache (posix_fadvise DONTNEED); False if unsupported."""
    ok = hasattr(os, "posix_fadvise")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            if ok:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return ok


def _file_read_rate(directory) -> float:
    total, t = 0, time.perf_counter()
    buf = bytearray(64 << 20)
    for name in sorted(os.listdir(directory)):
        if name.endswith(".emb.npy"):
            with open(os.path.join(directory, name), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total / (time.perf_counter() - t) / 1e9


def part_stream(args):
    budget = int(args.budget_gb * 2**30)
    tokens = int(args.stream_gb * 2**30) // (128 * 2)
    corpus = _make_corpus(tokens, args.doc_length, pinned=True)
    Q = [torch.randn(32, 128, dtype=torch.float16, device="cuda")]
    gb = corpus.num_tokens * 128 * 2 / 1e9
    rows = []
    copy_rate = _pinned_copy_rate(corpus, budget)
    rows.append(["pinned H2D copy (plain)", f"{gb:.1f}", "", f"{copy_rate:.1f}", "100%"])
    corpus.search(Q, args.k, gpu_memory=budget, progress=False)  # compile / warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    corpus.search(Q, args.k, gpu_memory=budget, progress=False)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    rows.append(["search, pinned corpus", f"{gb:.1f}", f"{s:.2f}", f"{gb / s:.1f}", f"{100 * gb / s / copy_rate:.0f}%"])

    directory = args.mmap_dir or tempfile.mkdtemp(prefix="maxsim-bench-")
    path = os.path.join(directory, "corpus")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        corpus.save(path)
    del corpus
    dropped = _drop_cache(path)
    read_rate = _file_read_rate(path)
    rows.append([f"sequential file read ({'cold' if dropped else 'maybe cached'})", f"{gb:.1f}", "", f"{read_rate:.1f}", "100%"])
    mapped = Corpus.load(path, mmap=True, verify=False)
    dropped = _drop_cache(path)
    t = time.perf_counter()
    mapped.search(Q, args.k, gpu_memory=budget, progress=False)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    rows.append([f"search, mmap corpus ({'cold' if dropped else 'maybe cached'})", f"{gb:.1f}", f"{s:.2f}",
                 f"{gb / s:.1f}", f"{100 * gb / s / read_rate:.0f}% of read"])
    table(f"streaming one 32-token query, budget {args.budget_gb} GB", ["what", "GB", "s", "GB/s", "% of rate"], rows)


def part_memory(args):
    budget = int(args.budget_gb * 2**30)
    Q = [torch.randn(32, 128, dtype=torch.float16, device="cuda") for _ in range(8)]
    rows = []
    for factor in (1, 2, 4):
        tokens = int(args.memory_gb * factor * 2**30) // 256
        corpus = _make_corpus(tokens, args.doc_length, pinned=True)
        mb = peak_above(lambda: corpus.search(Q, args.k, gpu_memory=budget, progress=False))
        rows.append([f"{factor}x", f"{corpus.num_tokens * 256 / 1e9:.1f}", f"{mb:.0f}", f"{budget / 2**20:.0f}"])
        del corpus
    table("GPU peak memory vs corpus size (8 queries)", ["corpus", "GB", "peak MB", "budget MB"], rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="topk,stream,memory")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--topk-docs", type=int, default=100_000,
                   help="Nd of the top-k part (the issue's bar: 1000000, which needs 33-77 GB of GPU memory)")
    p.add_argument("--topk-shapes", default="32x32x128,1x32x300", help="NqxLqxLd,... (the issue's bar shapes)")
    p.add_argument("--topk-masked", action="store_true",
                   help="give every top-k call an all-True d_mask (the masked kernels: the Triton forward, fused top-k)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--stream-gb", type=float, default=8.0, help="pinned corpus size of the stream part")
    p.add_argument("--budget-gb", type=float, default=2.0, help="gpu_memory given to the search")
    p.add_argument("--memory-gb", type=float, default=2.0, help="1x corpus size of the memory part")
    p.add_argument("--doc-length", type=int, default=128)
    p.add_argument("--mmap-dir", help="directory for the corpus file (default: a temporary one)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("search_bench needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, maxsim {maxsim.__version__}")
    for part in args.parts.split(","):
        {"topk": part_topk, "stream": part_stream, "memory": part_memory}[part](args)


if __name__ == "__main__":
    main()
