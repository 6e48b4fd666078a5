"""Corpus-scale search benchmark (issue 24, part 6). Run on a GPU:

    python benchmarks/search_bench.py                       # all parts, default sizes
    python benchmarks/search_bench.py --parts topk --topk-docs 1000000
    python benchmarks/search_bench.py --parts stream --stream-gb 4 --budget-gb 2 --mmap-dir /scratch

Parts:
  topk    maxsim.search.topk vs all scores + torch.topk (and flash-maxsim's flash_maxsim_topk,
          late-interaction-kernels' retrieve when importable) on Nq x Nd (Lq, Ld) fp16 shapes;
          ms (CUDA events, median), peak GPU memory above the inputs.
  stream  Corpus.search of one short query over a pinned host corpus and over a memory-mapped
          corpus file, against the plain pinned host-to-device copy rate and a sequential file
          read rate measured in the same run; GB/s and % of those rates.
  memory  GPU peak memory of a streamed search at 1x, 2x, 4x the corpus size (flat = good).
Prints a short table per part. Sizes are arguments; keep the corpus within host RAM.

Each top-k provider on each shape, and each of the stream and memory parts, runs in a fresh
process (benchmarks/_isolate.py) that builds its inputs from a fixed seed: a provider that crashes
the CUDA context (late-interaction-kernels' retrieve did on an H200) is a ``crashed`` row.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import tempfile
import time

import torch
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated

import maxsim
from maxsim.search import Corpus, topk


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
    for row in [header, ["-" * w for w in widths], *rows]:  # numbers right-aligned, the note left
        print("  ".join(str(x).ljust(w) if h == "note" else str(x).rjust(w)
                        for x, w, h in zip(row, widths, header)).rstrip())


TOPK_SEED = 0
# Peers' top-k: row name -> (module, function); called as function(Q, D, k).
TOPK_PEERS = {
    "flash-maxsim topk": ("flash_maxsim", "flash_maxsim_topk"),
    "late-interaction-kernels retrieve": ("late_interaction_kernels", "retrieve"),
}


def _topk_inputs(nq, lq, ld, nd, masked):
    torch.manual_seed(TOPK_SEED)
    Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.float16)
    D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.float16)
    # --topk-masked: an all-True d_mask (the masked kernels: the Triton forward everywhere).
    dm = torch.ones(nd, ld, dtype=torch.bool, device="cuda") if masked else None
    return Q, D, dm


# maxsim's top-k rows: name -> call(Q, D, k, d_mask); the first is the "vs scores" baseline.
MAXSIM_TOPK = {
    "maxsim (scores only)": lambda Q, D, k, dm: maxsim.maxsim(Q, D, None, dm),
    "maxsim + torch.topk": lambda Q, D, k, dm: torch.topk(maxsim.maxsim(Q, D, None, dm), k, dim=1),
    "maxsim.search.topk": lambda Q, D, k, dm: topk(Q, D, k, None, dm),
}


def topk_cell(nq, lq, ld, nd, k, masked, name, repeat):
    """One provider on one shape, in its own process: ms and peak MB above the inputs; for
    maxsim.search.topk also the peak at half the documents (its scratch must not grow with Nd)."""
    Q, D, dm = _topk_inputs(nq, lq, ld, nd, masked)
    if name in TOPK_PEERS:
        module, function = TOPK_PEERS[name]
        peer = getattr(importlib.import_module(module), function)
        fn = lambda: peer(Q, D, k)  # noqa: E731
    else:
        fn = lambda: MAXSIM_TOPK[name](Q, D, k, dm)  # noqa: E731
    out = {"ms": cuda_ms(fn, repeat), "mb": peak_above(fn)}
    if name == "maxsim.search.topk":
        half, half_mask = D[: nd // 2], None if dm is None else dm[: nd // 2]
        out["half_mb"] = peak_above(lambda: topk(Q, half, k, None, half_mask))
    return out


def part_topk(args):
    rows = []
    for shape in args.topk_shapes.split(","):
        nq, lq, ld = (int(x) for x in shape.split("x"))
        nd, k, masked = args.topk_docs, args.k, args.topk_masked
        label = f"{nq}x{nd} ({lq},{ld})"
        base_ms, half_row = None, None
        for name in list(MAXSIM_TOPK) + list(TOPK_PEERS):
            module = TOPK_PEERS.get(name, (None,))[0]
            if module is not None and importlib.util.find_spec(module) is None:
                rows.append([label, name, "not installed", "", "", module])
                continue
            result = run_isolated(topk_cell, nq, lq, ld, nd, k, masked, name, args.repeat, timeout_s=args.timeout)
            if result["status"] != "ok":  # a crash, a timeout, a peer's API that differs: report, keep going
                rows.append([label, name, result["status"], "", "", failed(result)])
                continue
            ms = result["ms"]
            base_ms = ms if base_ms is None else base_ms
            rows.append([label, name, f"{ms:.2f}", f"{result['mb']:.0f}", f"{100 * (ms / base_ms - 1):+.1f}%", ""])
            if "half_mb" in result:
                half_row = [f"{nq}x{nd // 2} ({lq},{ld})", name, "", f"{result['half_mb']:.0f}", "", ""]
        if half_row is not None:  # scratch independent of Nd: the peak of topk at half the documents
            rows.append(half_row)
    table("top-k vs scoring (fp16, d=128)", ["shape", "provider", "ms", "peak MB above inputs", "vs scores", "note"],
          rows)


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


ISOLATED_PARTS = {"stream": part_stream, "memory": part_memory}


def run_part(part, options):
    """The stream or memory part in a process of its own; it prints its table itself."""
    ISOLATED_PARTS[part](argparse.Namespace(**options))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="topk,stream,memory")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--topk-docs", type=int, default=100_000,
                   help="Nd of the top-k part (the issue's bar: 1000000, which needs 33-77 GB of GPU memory)")
    p.add_argument("--topk-shapes", default="32x32x128,1x32x300", help="NqxLqxLd,... (the issue's bar shapes)")
    p.add_argument("--topk-masked", action="store_true",
                   help="give every top-k call an all-True d_mask (the masked kernels: the Triton forward)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--stream-gb", type=float, default=8.0, help="pinned corpus size of the stream part")
    p.add_argument("--budget-gb", type=float, default=2.0, help="gpu_memory given to the search")
    p.add_argument("--memory-gb", type=float, default=2.0, help="1x corpus size of the memory part")
    p.add_argument("--doc-length", type=int, default=128)
    p.add_argument("--mmap-dir", help="directory for the corpus file (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds one top-k provider, or one other part, may take before its process is killed")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("search_bench needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, maxsim {maxsim.__version__}")
    for part in args.parts.split(","):
        if part == "topk":
            part_topk(args)  # isolates each provider itself
            continue
        if part not in ISOLATED_PARTS:
            raise SystemExit(f"search_bench: unknown part {part!r} (topk, {', '.join(ISOLATED_PARTS)})")
        result = run_isolated(run_part, part, vars(args), timeout_s=args.timeout)
        if result["status"] != "ok":
            print(f"\n## {part}: {failed(result)}")


if __name__ == "__main__":
    main()
