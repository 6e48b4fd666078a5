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
  memory  GPU peak memory of a streamed search at 1x, 2x, 4x the corpus size (flat = good): views
          of the stream part's pinned buffer, in the same process (tokens drawn on the GPU).
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


def _pinned_tokens(num_tokens: int) -> torch.Tensor:
    """``[num_tokens, 128]`` fp16 unit-norm tokens in pinned host memory, drawn on the GPU a slice
    at a time and copied down (drawing 8 GB on the host takes minutes)."""
    emb = torch.empty(num_tokens, 128, dtype=torch.float16, pin_memory=True)  # [T, d]
    step = 1 << 24
    for a in range(0, num_tokens, step):
        part = torch.nn.functional.normalize(torch.randn(min(step, num_tokens - a), 128, device="cuda"), dim=-1)
        emb[a:a + step].copy_(part.half())
    torch.cuda.synchronize()
    return emb


def _corpus_over(emb: torch.Tensor, num_tokens: int, length: int) -> Corpus:
    """A Corpus of documents of ``length`` tokens over the first ``num_tokens`` rows of ``emb`` (a
    view: the 1x / 2x / 4x corpora share one pinned buffer)."""
    n = num_tokens // length
    offsets = torch.arange(0, n * length + 1, length, dtype=torch.int64)  # [n + 1]
    return Corpus(emb[: n * length], offsets)


def _say(text: str) -> None:
    print(text, flush=True)


def _pinned_copy_rate(emb: torch.Tensor, budget: int) -> float:
    """GB/s of plain pinned host-to-device copies of ``emb`` in budget / 4 slices."""
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


def _timed_search(corpus: Corpus, Q, k: int, budget: int) -> tuple[float, float]:
    """(seconds, peak GPU MB above the inputs) of one streamed search."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    corpus.search(Q, k, gpu_memory=budget, progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, (torch.cuda.max_memory_allocated() - base) / 2**20


def part_stream(args):
    """One 32-token query streamed over a pinned host corpus of --stream-gb and over the same
    corpus as a memory-mapped file, beside the plain pinned copy rate and the file's sequential
    read rate measured here; then (part memory) peak GPU memory at 1x, 2x, 4x of --memory-gb,
    views of the same pinned buffer. Rows print as they are measured."""
    budget = int(args.budget_gb * 2**30)
    started = time.perf_counter()
    gb_of = lambda corpus: corpus.num_tokens * 128 * 2 / 1e9  # noqa: E731
    need = max(args.stream_gb, 4 * args.memory_gb if "memory" in args.parts else 0)
    emb = _pinned_tokens(int(need * 2**30) // 256)
    _say(f"# {need:.1f} GB of pinned tokens drawn in {time.perf_counter() - started:.1f} s; search budget "
         f"{args.budget_gb} GB; one query of 32 tokens; k {args.k}")
    Q = [torch.nn.functional.normalize(torch.randn(32, 128, device="cuda"), dim=-1).half()]
    rows = []
    if "stream" in args.parts:
        corpus = _corpus_over(emb, int(args.stream_gb * 2**30) // 256, args.doc_length)
        gb = gb_of(corpus)
        copy_rate = _pinned_copy_rate(corpus.embeddings, budget)
        rows.append(["pinned H2D copy (plain)", f"{gb:.1f}", "", f"{copy_rate:.1f}", "100%"])
        _say(f"  pinned copy: {copy_rate:.1f} GB/s")
        _timed_search(corpus, Q, args.k, budget)  # compile / warm
        seconds, _ = min(_timed_search(corpus, Q, args.k, budget) for _ in range(3))
        rows.append(["search, pinned corpus", f"{gb:.1f}", f"{seconds:.2f}", f"{gb / seconds:.1f}",
                     f"{100 * gb / seconds / copy_rate:.0f}%"])
        _say(f"  search, pinned: {seconds:.2f} s, {gb / seconds:.1f} GB/s")

        directory = args.mmap_dir or tempfile.mkdtemp(prefix="maxsim-bench-")
        path = os.path.join(directory, "corpus")
        t = time.perf_counter()
        if not os.path.exists(os.path.join(path, "manifest.json")):
            corpus.save(path)
        _say(f"  saved {gb:.1f} GB in {time.perf_counter() - t:.1f} s")
        dropped = _drop_cache(path)
        read_rate = _file_read_rate(path)
        state = "cold" if dropped else "maybe cached"
        rows.append([f"sequential file read ({state})", f"{gb:.1f}", "", f"{read_rate:.1f}", "100%"])
        _say(f"  file read: {read_rate:.1f} GB/s ({state})")
        mapped = Corpus.load(path, mmap=True, verify=False)
        dropped = _drop_cache(path)
        seconds, _ = _timed_search(mapped, Q, args.k, budget)
        rows.append([f"search, mmap corpus ({'cold' if dropped else 'maybe cached'})", f"{gb:.1f}",
                     f"{seconds:.2f}", f"{gb / seconds:.1f}", f"{100 * gb / seconds / read_rate:.0f}% of read"])
        _say(f"  search, mmap: {seconds:.2f} s, {gb / seconds:.1f} GB/s")
        del mapped, corpus
        table(f"streaming one 32-token query, budget {args.budget_gb} GB", ["what", "GB", "s", "GB/s", "% of rate"],
              rows)
    if "memory" in args.parts:
        rows = []
        for factor in (1, 2, 4):
            corpus = _corpus_over(emb, int(args.memory_gb * factor * 2**30) // 256, args.doc_length)
            _timed_search(corpus, Q, args.k, budget)  # warm
            seconds, mb = _timed_search(corpus, Q, args.k, budget)
            rows.append([f"{factor}x", f"{gb_of(corpus):.1f}", f"{mb:.0f}", f"{budget / 2**20:.0f}",
                         f"{gb_of(corpus) / seconds:.1f}"])
            _say(f"  {factor}x: peak {mb:.0f} MB, {gb_of(corpus) / seconds:.1f} GB/s")
        table("GPU peak memory vs corpus size (one query)", ["corpus", "GB", "peak MB", "budget MB", "GB/s"], rows)
    _say(f"# stream/memory parts: {time.perf_counter() - started:.0f} s")


ISOLATED_PARTS = {"stream": part_stream}


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
    parts = args.parts.split(",")
    unknown = set(parts) - {"topk", "stream", "memory"}
    if unknown:
        raise SystemExit(f"search_bench: unknown part {sorted(unknown)[0]!r} (topk, stream, memory)")
    if "topk" in parts:
        part_topk(args)  # isolates each provider itself
    if "stream" in parts or "memory" in parts:  # one process: the memory rows reuse the pinned buffer
        result = run_isolated(run_part, "stream", vars(args), timeout_s=args.timeout)
        if result["status"] != "ok":
            print(f"\n## stream/memory: {failed(result)}")


if __name__ == "__main__":
    main()
