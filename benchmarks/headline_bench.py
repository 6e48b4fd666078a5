"""The headline: exhaustive search of the largest corpus of ~64-token passages that fits one GPU,
per encoding of ``maxsim.Corpus``, beside other engines' search of the same passages (fast-plaid's
PLAID, xtr-warp-rs's WARP, colsearch's exact resident corpus).

    python benchmarks/headline_bench.py                                  # 1M and 10M passages (H200)
    python benchmarks/headline_bench.py --docs 1000000 --out results/headline.json
    python benchmarks/headline_bench.py --docs 1000000 --encodings '' --engines xtr-warp,colsearch
    python benchmarks/headline_bench.py --docs 2000 --device cpu --reps 2  # smoke test on a CPU
    python benchmarks/headline_bench.py --docs 1000000 --passages real:DIR   # real tokens (real_passages.py)
    python benchmarks/headline_bench.py --docs 10000000 --passages spliced:DIR  # spliced from them (spliced_passages.py)

The engines' wheels (the GPU machine has no network): ``bash benchmarks/engine_wheels.sh DIR``
downloads them, ``pip install --no-deps --no-index --target SITE DIR/*.whl`` and ``PYTHONPATH=SITE``
install them there.

Data: benchmarks/_passages.py with its calibrated defaults (``HEADLINE``: contexts over a 32-dim
subspace, Zipf words; their recalls under each encoding match real MiniLM token embeddings at small
scale, see that module), 32-96 tokens a passage (64 on average), d 128, fp16; 32 queries of 32
tokens, each from a known source passage. Nothing is written to disk: every cell regenerates the
passages from the seed on the device (a pass over 640M tokens takes seconds on the GPU, while the
fp16 tokens of 10M passages are 164 GB: more than the GPU, the host memory or the disk holds), slice
by slice (``--slice-docs``; default: the whole corpus when its fp16 tokens take at most a quarter of
the free GPU memory, else 500K passages).

Per passage count (``--docs``), each cell in its own process (benchmarks/_isolate.py: a crash, an
out-of-memory or an unsupported encoding is a row that says so, and the run goes on):

* truth: exact top-10 of every query, the fp16 tokens scored by ``maxsim.maxsim_varlen`` (fp16
  products are exact in fp32 and accumulate in fp32: the fp32 MaxSim of the stored tokens, up to
  the order of the additions), a slice at a time, all [32, N] scores kept (1.3 GB at 10M) and
  ``torch.topk`` at the end. Also: how often the source passage is the exact top-1.
* one row per ``--encodings``: ``Corpus.from_packed(tokens, offsets, encoding=...)`` on the first
  slice (a residual / PQ corpus trains its codec there, with the library's defaults: at 1M on the
  whole corpus, 131,072 residual centroids by colbert-ai's count; at 10M on the first 500K
  passages, 65,536 centroids for their 32M tokens rather than the 262,144 of all 640M, which would
  make encoding 4x slower. Fewer centroids mean larger residuals and lower recall: on the CPU test,
  2,000 passages, a codec from the first 700 gave residual2 recall 0.50 against 0.81 from all of
  them. ``--slice-docs 1000000`` trains on 1M passages at 10M, twice the encoding time), then
  ``Corpus.append((tokens, offsets))`` per further slice (encoded with that codec). A size whose
  encoded bytes plus the build's working memory exceed the free GPU memory is a "does not fit" row
  (no build tried; 10M in float16, 164 GB). Codec training and encoding run with TF32 matmuls
  (``torch.set_float32_matmul_precision("high")``, ``--no-build-tf32`` to keep fp32; colbert-ai's
  GPU indexer uses fp16); search runs at the default ("highest"). ``residual2:plaid`` (or 4): the
  same codes searched exhaustively, then through ``maxsim.index.from_corpus`` (PLAID's candidate
  generation with ``--plaid-settings``, fast-plaid's by default; one row per ``--plaid-args``
  group), from one build; their notes give the lists' build time (``index_s``) and size.
* one row per ``--engines`` (up to ``--engine-max-docs``, 1M; a package that is missing is a "not
  installed" row that says what installs it), the whole corpus handed over at once in the form its
  package takes, with its own calls and defaults (benchmarks/_engines.py says which and where they
  come from):
  - fast-plaid 1.7: the calls of benchmarks/plaid_bench.py, ``FastPlaid(index=..., device=...)
    .create(documents_embeddings=[per-passage views of the device tokens], nbits=--nbits)`` and
    ``.search(queries_embeddings=Q, top_k=10)``, its default search settings.
  - xtr-warp-rs 2.1: ``XTRWarp(index=...).create(embeddings_source=[per-passage host tensors],
    device=..., nbits=--xtr-warp-nbits)`` (4: its default), ``.load(device=...)``, ``.search(
    queries_embeddings=Q, top_k=10, num_threads=--xtr-warp-threads)`` with its automatic bound,
    nprobe, t', threshold and candidate cap (the JSON keeps the values it picked).
  - colsearch 0.1.7: its exact lane, ``PreloadedGpuCorpus([per-passage fp16 numpy arrays], ids,
    d, device)`` (the corpus padded into power-of-two tiers on the device), ``warmup_maxsim`` (its
    Triton autotune, timed apart: ``engine.warmup_s``; ``--no-colsearch-warmup`` skips it),
    ``score_all(query, k=10)`` one query a call.
  Build s: the package's build call alone (the copy of our tokens into its input form is not
  counted; loading the index is ``load_s``). B/tok: its index files (fast-plaid, xtr-warp) or its
  padded tensors (colsearch). GB res: what the device allocator holds after searching, over what
  it held before the index came to the device (before the load; colsearch: before its build; the
  Rust code of fast-plaid and xtr-warp allocates through the same libtorch, so it is counted); on a
  CPU the stored bytes stand in (the note says which).

Timing: ``Corpus.search(Q, 10)`` (an engine: its search call; colsearch's, 32 calls at batch 32);
batch 32: the 32 queries, median wall clock of ``--reps`` calls after a warm-up call (the device
synchronised); batch 1: each of the 32 queries alone, one call each, median, after each ran once
untimed (a service compiles each kernel variant once; a refined search's pair kernel has several).
Recall@10 at batch 1 and at batch 32 is over the same 32 queries: |top-10 ∩ exact top-10| / 10,
averaged. A cell stops timing after ``--search-budget-s`` (at least one call each; the note then
says how many of the 32 single queries ran). Memory: resident = the corpus's tensors (values,
scales, codes, residuals) on the device; peak = ``torch.cuda.max_memory_allocated`` while searching
(the build's peak is in the JSON).

The whole run starts no cell after ``--deadline-s`` and stops the one running then (rows
"skipped" / "timeout"): a device command that must end within 10 minutes still reports every
finished row (stdout, and ``--out`` rewritten after each row). A cell keeps its searches in a file
as each finishes, so one stopped mid-way (the deadline, a crash) still reports those, then a
"(stopped)" row that says why.

Run time on an H200. Measured (2026-12-02 06:56, an earlier copy of this script whose truth cell
scored a second, different draw of the passages: its recalls of 0.66 are that bug, fixed since;
``results/headline-20261202-0656.*``): at 1M, generation 0.9 s a pass, exact scores 0.6 s, the truth
and the float16, int8 and fp8 cells 46 s together, start-ups included; residual2 did not finish
within 120 s (the Corpus's codec: k-means of 131,072 centroids over a 33.5M-token sample, then
``ResidualCodec.encode``, which works through 64M tokens 128 at a time). Estimated from that and the
code: residual2 / residual4 about 2-2.5 minutes each at 1M and about 5 each at 10M (640M tokens, 256
at a time); pq32 1-3 minutes at 1M and several at 10M (encoding 1,024 tokens at a time, a PyTorch
look-up-table search); fast-plaid's 1M index a minute or two; int8 / fp8 at 10M under a minute each.
Not measured yet: xtr-warp (k-means of 65,536 centroids over a 4.2M-token sample, then its Rust
encoder; its README reports 10 s for 523K BEIR passages on an RTX 5090) and colsearch (16 GB of
tokens copied to the host, padded there in a Python loop over the passages, 24 GB of tiers copied to
the device, then its autotune). So the default ``--docs`` does not fit one 10-minute call:
``--deadline-s`` keeps what finished. To get every row, run it as separate calls, each with its own
``--out``: ``--docs 1000000 --engines ''`` (about 8 minutes), ``--docs 1000000 --encodings ''``
(the engines: the truth, then each engine's build and search), ``--docs 10000000 --encodings
float16,int8,fp8,residual2`` and ``--docs 10000000 --encodings residual4,pq32`` (``--deadline-s 0
--timeout 590`` if a single cell needs the whole call).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engines import ENGINES
from _isolate import failed, run_isolated
from _passages import HEADLINE, Passages

CHUNK_TOKENS = 1 << 22  # generator step: 2 GB fp32 temporaries, small beside a 10M-passage corpus
SLICE_DOCS_LARGE = 500_000  # a slice of a corpus too large to hold in fp16: 8 GB of fp16 tokens
K = 10
ENCODINGS = "float16,int8,fp8,residual2,residual4,pq32"


# ---------------------------------------------------------------------- helpers (child side)
def _device(options: dict) -> torch.device:
    return torch.device(options["device"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup(options: dict) -> torch.device:
    device = _device(options)
    if device.type == "cpu" and options.get("cpu_threads"):
        torch.set_num_threads(options["cpu_threads"])
    return device


def _passages(num_docs: int, options: dict, device) -> Passages:
    """The synthetic generator (``HEADLINE``); with ``--passages real:DIR`` the real-token passages
    that ``benchmarks/real_passages.py`` built in DIR; with ``spliced:DIR`` passages spliced from
    that pool (``benchmarks/spliced_passages.py``, as many as asked). The same interface."""
    kind, _, folder = options.get("passages", "synthetic").partition(":")
    if kind == "real":
        from real_passages import RealPassages

        return RealPassages(folder, num_docs, device=device, num_queries=options["queries"])
    if kind == "spliced":
        from spliced_passages import SplicedPassages

        return SplicedPassages(folder, num_docs, device=device, num_queries=options["queries"], seed=options["seed"])
    return Passages(num_docs, device=device, num_queries=options["queries"], seed=options["seed"],
                    chunk_tokens=CHUNK_TOKENS, **HEADLINE)


def _release(gen, device) -> None:
    """Free what the generator holds on the device (the spliced pool) once its last pass is done."""
    if hasattr(gen, "release"):
        gen.release()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _free_bytes(device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _slice_docs(gen: Passages, options: dict, device) -> int:
    """The whole corpus when its fp16 tokens take at most a quarter of the free memory, else
    SLICE_DOCS_LARGE passages (or ``--slice-docs``)."""
    if options["slice_docs"]:
        return options["slice_docs"]
    free = _free_bytes(device)
    whole = gen.total_tokens * gen.config.dim * 2
    return gen.num_docs if free is None or whole <= free / 4 else SLICE_DOCS_LARGE


def bytes_per_token(encoding: str, dim: int) -> float:
    """Bytes a token takes in ``encoding`` (as ``Corpus.bytes_per_token`` reports them)."""
    if encoding in ("float16", "bfloat16"):
        return 2 * dim
    if encoding == "float32":
        return 4 * dim
    if encoding in ("int8", "fp8"):
        return dim + 4
    if encoding.startswith("residual"):
        return dim * int(encoding[len("residual"):]) / 8 + 4
    if encoding.startswith("pq"):
        return int(encoding[2:])
    raise ValueError(f"unknown encoding {encoding!r}")


def _recall(ids: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over rows of |ids ∩ exact| / k."""
    ids, exact = ids.cpu(), exact.cpu()
    return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, exact)) / exact.numel()


def _search_rows(search, queries: torch.Tensor, exact: torch.Tensor, options: dict, device) -> dict:
    """Times ``search(Q) -> ids [b, k]`` at batch 32 (all the queries, median of --reps after a
    warm-up) and batch 1 (each query alone after a warm-up, median), recall of both."""
    budget = options["search_budget_s"]
    row = {}
    nq = queries.shape[0]
    search(queries)  # warm-up (kernel compilation, allocator)
    _sync(device)
    times, start = [], time.perf_counter()
    ids = None
    for _ in range(max(1, options["reps"])):
        t0 = time.perf_counter()
        ids = search(queries)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    row[f"ms_{nq}"] = 1e3 * statistics.median(times)
    row[f"reps_{nq}"] = len(times)
    row[f"recall_{nq}"] = _recall(ids, exact)
    for i in range(nq):  # each query once, untimed: every kernel variant the singles need is compiled
        search(queries[i:i + 1])
        if time.perf_counter() - start > 2 * budget:
            break
    _sync(device)
    times, found, start = [], [], time.perf_counter()
    for i in range(nq):
        t0 = time.perf_counter()
        one = search(queries[i:i + 1])
        _sync(device)
        times.append(time.perf_counter() - t0)
        found.append(one.cpu())
        if time.perf_counter() - start > budget:
            break
    row["ms_1"] = 1e3 * statistics.median(times)
    row["queries_1"] = len(found)
    row["recall_1"] = _recall(torch.cat(found), exact[:len(found)])
    return row


def _load_truth(folder: str, num_docs: int) -> dict:
    return torch.load(os.path.join(folder, f"truth-{num_docs}.pt"))


# ---------------------------------------------------------------------- cells
def truth_cell(num_docs: int, options: dict, folder: str) -> dict:
    """Exact top-10 of the queries (two passes: the queries come from the passages); saved to
    ``folder``."""
    import maxsim

    device = _setup(options)
    t0 = time.perf_counter()
    gen = _passages(num_docs, options, device)
    slice_docs = _slice_docs(gen, options, device)
    for _ in gen.slices(slice_docs):  # pass 1: collect the queries
        pass
    queries, source = gen.queries()
    _sync(device)
    generate_s = time.perf_counter() - t0
    nq, lq, dim = queries.shape
    q_packed = queries.reshape(nq * lq, dim)
    cu_q = torch.arange(0, nq * lq + 1, lq, device=device)
    scores = torch.empty(nq, num_docs, dtype=torch.float32, device=device)
    score_s = 0.0
    for first, tokens, offsets in gen.slices(slice_docs):  # pass 2: score every passage
        _sync(device)
        t1 = time.perf_counter()
        cu_d = torch.from_numpy(offsets).to(device)
        max_d = int((offsets[1:] - offsets[:-1]).max())
        scores[:, first:first + offsets.size - 1] = maxsim.maxsim_varlen(q_packed, tokens, cu_q, cu_d, lq, max_d)
        _sync(device)
        score_s += time.perf_counter() - t1
    top_scores, top_ids = scores.topk(K + 1, dim=1)  # one more: the gap after the 10th
    torch.save(dict(queries=queries.cpu(), source=source.cpu(), exact_ids=top_ids[:, :K].cpu(),
                    exact_scores=top_scores.cpu()), os.path.join(folder, f"truth-{num_docs}.pt"))
    ties = int((top_scores[:, K - 1] == top_scores[:, K]).sum())
    return dict(tokens=gen.total_tokens, slice_docs=slice_docs, generate_s=generate_s, exact_score_s=score_s,
                source_top1=float((top_ids[:, 0] == source).float().mean()),
                source_top10=float((top_ids[:, :K] == source[:, None]).any(1).float().mean()),
                ties_at_k=ties, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                torch=torch.__version__)


def _stage(encoding: str, what: str, since: float) -> None:
    """One progress line on stderr (a cell that times out then says how far it got)."""
    print(f"  [{encoding}] {what}: {time.perf_counter() - since:.1f} s", file=sys.stderr, flush=True)


def _partial_path(folder: str, num_docs: int, encoding: str) -> str:
    """Where an encoding cell keeps what it has measured so far (read back if it is stopped)."""
    return os.path.join(folder, f"partial-{num_docs}-{encoding.replace(':', '-')}.json")


def _keep_partial(row: dict) -> None:
    """Rewrites the cell's partial file (atomically) after each search: a cell stopped at the
    deadline or by a crash still reports the searches that finished."""
    path = row.get("partial_path")
    if path:
        with open(path + ".tmp", "w") as handle:
            json.dump(row, handle, default=str)
        os.replace(path + ".tmp", path)


def _recover_partial(result: dict, folder: str, num_docs: int, encoding: str) -> dict:
    """A failed cell's result with the searches it finished before it stopped (none: unchanged)."""
    path = _partial_path(folder, num_docs, encoding)
    if result.get("status") == "ok" or not os.path.exists(path):
        return result
    with open(path) as handle:
        kept = json.load(handle)
    return dict(kept, status=result["status"], error=result.get("error"), stopped=True)


def encoding_cell(num_docs: int, encoding: str, options: dict, folder: str) -> dict:
    """Build a Corpus of ``encoding`` slice by slice, time its search, check its recall.
    "residual<n>:plaid": the same corpus searched through ``maxsim.index.from_corpus`` (PLAID's
    candidate generation, ``--plaid-settings``) instead of exhaustively."""
    import maxsim

    partial_path = _partial_path(folder, num_docs, encoding)
    encoding, _, first_stage = encoding.partition(":")
    if first_stage not in ("", "plaid") or (first_stage and not encoding.startswith("residual")):
        raise ValueError(f"unknown first stage {first_stage!r} for {encoding}: only residual<n>:plaid")
    device = _setup(options)
    truth = _load_truth(folder, num_docs)
    gen = _passages(num_docs, options, device)
    dim = gen.config.dim
    slice_docs = _slice_docs(gen, options, device)
    resident = gen.total_tokens * bytes_per_token(encoding, dim)
    slice_tokens = gen.total_tokens * min(1.0, slice_docs / num_docs)
    # the slice's fp16 tokens, their concatenation and the generator's fp32 temporaries
    working = 3 * slice_tokens * dim * 2 + 4 * CHUNK_TOKENS * dim * 4
    free = _free_bytes(device)
    row = dict(bytes_per_token=bytes_per_token(encoding, dim), needed_gb=(resident + working) / 1e9,
               partial_path=partial_path)
    if free is not None and resident + working > free:
        fits = int(num_docs * free / (resident + working))
        return dict(row, note=f"does not fit ({resident / 1e9:.0f} GB + {working / 1e9:.0f} GB to build > "
                              f"{free / 1e9:.0f} GB free; ~{fits / 1e6:.1f}M passages would)")
    refine_encoding = options.get("refine") if encoding.startswith(("residual", "pq")) else None
    # --lookup-only: the codes in pinned host memory, only the look-up layouts on the GPU
    lookup_only = options.get("lookup_only") and encoding.startswith(("residual", "pq", "int8", "fp8")) \
        and device.type == "cuda" and not first_stage
    device_codec = None
    corpus, build_s, generate_s, refine_slices, refine_s = None, 0.0, 0.0, [], 0.0
    t_cell = time.perf_counter()
    previous = torch.get_float32_matmul_precision()
    t_gen = time.perf_counter()
    for first, tokens, offsets in gen.slices(slice_docs):
        _sync(device)
        t0 = time.perf_counter()
        generate_s += t0 - t_gen
        if options["build_tf32"] and device.type == "cuda":
            torch.set_float32_matmul_precision("high")
        try:
            if corpus is None:
                corpus = maxsim.Corpus.from_packed(tokens, offsets, encoding=encoding)
                if lookup_only:  # the codes go to pinned host memory slice by slice
                    device_codec, corpus = corpus.codec, corpus.pin_memory()
            elif lookup_only:
                piece = maxsim.Corpus.from_packed(tokens, offsets, encoding=encoding, codec=device_codec).pin_memory()
                corpus.append(piece, ids=np.arange(len(corpus), len(corpus) + len(piece)))
                del piece
            else:
                corpus.append((tokens, offsets))
            _sync(device)
        finally:
            torch.set_float32_matmul_precision(previous)
        build_s += time.perf_counter() - t0
        if first == 0 and slice_docs < num_docs:  # the first slice trains the codec: its share of the build
            _stage(encoding, f"first slice encoded ({build_s:.1f} s, the codec's training included)", t_cell)
        if refine_encoding:  # the refine stage's tokens, in host memory (pinned: the candidates' copy)
            t1 = time.perf_counter()
            host = maxsim.Corpus.from_packed(tokens, offsets, encoding=refine_encoding)
            refine_slices.append(host.pin_memory() if device.type == "cuda" else host.to("cpu"))
            refine_s += time.perf_counter() - t1
        del tokens
        t_gen = time.perf_counter()
    _stage(encoding, f"built (codes {build_s:.1f} s, refine tokens {refine_s:.1f} s)", t_cell)
    if lookup_only:
        t0 = time.perf_counter()
        corpus = corpus.to(device, lookup_only=True)
        _sync(device)
        row["layout_s"] = time.perf_counter() - t0
        row["host_codes_gb"] = sum(t.numel() * t.element_size() for s in corpus.segments for t in s.parts()) / 1e9
        _stage(encoding, f"layouts on the GPU, codes on the host ({row['layout_s']:.1f} s)", t_cell)
    queries, _ = gen.queries()
    _release(gen, device)
    if not torch.equal(queries.cpu(), truth["queries"]):
        raise RuntimeError("the regenerated queries differ from the truth cell's: the generator is not deterministic")
    parts = [t for s in corpus.segments for t in s.parts()]
    codec = getattr(corpus, "codec", None)  # a residual / PQ corpus's tables (centroids, codebooks)
    parts += [t for t in vars(codec).values() if torch.is_tensor(t)] if codec is not None else []
    if lookup_only:  # what the GPU holds: the layouts (the codes are on the host)
        parts = [t for t in parts if t.device.type == "cuda"]
        parts += [t for s in corpus.segments for t in vars(s.lookup_on(device)).values() if torch.is_tensor(t)]
    row.update(resident_gb=sum(t.numel() * t.element_size() for t in parts) / 1e9, build_s=build_s,
               generate_s=generate_s, segments=len(corpus.segments), slice_docs=slice_docs,
               bytes_per_token=float(getattr(corpus, "bytes_per_token", row["bytes_per_token"])))
    if device.type == "cuda":
        row["peak_build_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
    Q = queries.to(device)
    full = None
    if refine_slices:
        full = refine_slices[0]
        for more in refine_slices[1:]:  # each slice's ids follow on from the slices before it
            full.append(more, ids=np.arange(len(full), len(full) + len(more)))
        del refine_slices
        _stage(encoding, "refine tokens joined", t_cell)
        row.update(refine_encoding=refine_encoding, refine_host_gb=full.num_tokens * full.bytes_per_token / 1e9)
        row["refine_build_s"] = refine_s
    # (label, search, settings) in order: the exhaustive scan, or for a ":plaid" cell the same codes
    # scanned exhaustively first (so that one build times both; not under --plaid-only), then each PLAID setting
    row["searches"] = []
    if not (first_stage == "plaid" and options["plaid_only"]):  # --plaid-only: the scan was measured before
        _time_searches(row, encoding, corpus, dict(progress=False), Q, truth, full, options, device, t_cell)
    if first_stage == "plaid":
        try:  # a failure here (memory at 10M) is the PLAID row's note; the scan's rows stay
            _plaid_searches(row, encoding, corpus, Q, truth, full, options, device, t_cell)
        except Exception as exc:  # noqa: BLE001 - reported in the row, never lost
            row["searches"].append(dict(label=f"{encoding}:plaid", error=f"{type(exc).__name__}: {exc}"[:300]))
    return row


def _plaid_searches(row: dict, encoding: str, corpus, Q, truth, refine, options: dict, device, t_cell: float) -> None:
    """``maxsim.index.from_corpus`` over the scanned corpus's codes, then one timed search per
    --plaid-args group (each refined too)."""
    import maxsim

    for segment in corpus.segments:  # the scan's look-up layouts: the index's codes need the room
        segment._lookup.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    index = maxsim.index.from_corpus(corpus)  # the codes shared (one segment) or joined
    _sync(device)
    row.update(index_s=time.perf_counter() - t0, ivf_gb=index.ivf.numel() * index.ivf.element_size() / 1e9)
    _stage(f"{encoding}:plaid", f"index built ({row['index_s']:.1f} s)", t_cell)
    for overrides in options["plaid_variants"]:
        settings = dict(options["plaid_settings"], **overrides)
        label = ":plaid" + ("[" + ",".join(f"{k}={v}" for k, v in overrides.items()) + "]" if overrides else "")
        _time_searches(row, encoding + label, index, settings, Q, truth, refine, options, device, t_cell)


def _time_searches(row: dict, label: str, searcher, settings: dict, Q, truth, refine, options: dict, device,
                   t_cell: float) -> None:
    """Times ``searcher.search(Q, K, **settings)`` at both batches, then refined from ``refine`` (a
    Corpus or None) at each --refine-factors; appends one entry a search to row["searches"]."""
    def search(q):
        return searcher.search(q, K, **settings).indices

    t_first = time.perf_counter()
    search(Q[:1])  # the first search (a residual corpus builds its look-up layout here)
    _sync(device)
    first_s = time.perf_counter() - t_first
    _stage(label, "first search", t_cell)
    timed = dict(label=label, first_search_s=first_s, **_search_rows(search, Q, truth["exact_ids"], options, device))
    if device.type == "cuda":
        timed["peak_search_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    row["searches"].append(timed)
    _keep_partial(row)
    _stage(label, "searched", t_cell)
    for factor in options["refine_factors"] if refine is not None else ():
        def refined(q, factor=factor):
            return searcher.search(q, K, refine=refine, refine_factor=factor, **settings).indices

        t_first = time.perf_counter()
        refined(Q[:1])
        _sync(device)
        _stage(label, f"first refined search x {factor} ({time.perf_counter() - t_first:.2f} s)", t_cell)
        row["searches"].append(dict(label=f"{label}+r{factor}", refine_factor=factor,
                                    **_search_rows(refined, Q, truth["exact_ids"], options, device)))
        _keep_partial(row)
        _stage(label, f"refined x {factor}", t_cell)


def engine_cell(num_docs: int, name: str, options: dict, folder: str) -> dict:
    """A peer engine's index of the same passages (benchmarks/_engines.py: its package's calls),
    built, loaded and searched at both batches."""
    from _engines import make_engine

    device = _setup(options)
    truth = _load_truth(folder, num_docs)
    engine = make_engine(name, options)  # imports the package: a missing dependency is this row's error
    gen = _passages(num_docs, options, device)
    pieces, offsets = [], [np.zeros(1, dtype=np.int64)]
    host, tokens = None, None
    if engine.host_input:  # slice by slice into one host tensor: never all on the GPU, nor twice on the host
        host = torch.empty(gen.total_tokens, gen.config.dim, dtype=torch.float16)  # [T, d]
    for _, tokens, slice_offsets in gen.slices(_slice_docs(gen, options, device) if host is not None else None):
        if host is not None:
            start = int(offsets[-1][-1])
            host[start:start + tokens.shape[0]].copy_(tokens)
        else:  # the engines take the whole corpus at once
            pieces.append(tokens)
        offsets.append(slice_offsets[1:] + offsets[-1][-1])
    del tokens
    tokens = host if host is not None else pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [T, d] fp16
    offsets = np.concatenate(offsets)  # [N + 1] int64 from 0
    del pieces
    queries, _ = gen.queries()
    _release(gen, device)
    if not torch.equal(queries.cpu(), truth["queries"]):
        raise RuntimeError("the regenerated queries differ from the truth cell's")
    docs = engine.prepare(tokens, offsets)
    if engine.host_input:  # the device copy is not the engine's: free it before its build
        del tokens
        tokens = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    index_path = os.path.join(folder, f"{name}-{num_docs}")
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # before what it builds on the device
    _sync(device)
    t0 = time.perf_counter()
    engine.build(docs, index_path, device)
    _sync(device)
    build_s = time.perf_counter() - t0
    del docs, tokens
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if not engine.host_input:  # its input was our tokens, freed now: count from here
            base = torch.cuda.memory_allocated(device)
    Q = queries.to(device)
    t0 = time.perf_counter()
    engine.load(index_path, device, Q)
    _sync(device)
    stored = engine.stored_bytes(index_path)
    row = dict(build_s=build_s, load_s=time.perf_counter() - t0, stored_gb=stored / 1e9, stored=engine.stored,
               bytes_per_token=stored / gen.total_tokens)
    if device.type == "cuda":
        row["peak_build_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
    row.update(_search_rows(engine.search, Q, truth["exact_ids"], options, device))
    if device.type == "cuda":  # the index's tensors (and any buffers it keeps) on the device
        row["resident_gb"] = (torch.cuda.memory_allocated(device) - base) / 1e9
        row["peak_search_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    else:  # no device allocator to ask: what it stores stands in
        row["resident_gb"] = row["stored_gb"]
    return dict(row, engine=engine.info(), engine_note=engine.note())


# ---------------------------------------------------------------------- parent
def _search_note(timed: dict, cell: dict) -> str:
    """The note of a cell's second and later searches: what the refine or PLAID rows add."""
    if timed.get("error"):
        return f"failed: {timed['error']}"
    notes = []
    if ":plaid" in timed["label"]:
        notes.append(f"maxsim.index.from_corpus over the same codes (built in {cell['index_s']:.1f} s, "
                     f"+{cell['ivf_gb']:.2f} GB of lists)")
    if timed.get("refine_factor"):
        notes.append(f"refined from {cell['refine_encoding']} tokens in pinned host memory ({cell['refine_host_gb']:.1f} GB, "
                     f"copied in {cell['refine_build_s']:.0f} s): k x {timed['refine_factor']} candidates rescored")
    return "; ".join(notes)


def _plaid_variants(text: str) -> list[dict]:
    """``ncells=4;ncells=16,ndocs=8192`` -> one dict of overrides a PLAID search (``[{}]`` for none)."""
    return [_plaid_args(group) for group in text.split(";")] or [{}]


def _plaid_args(text: str) -> dict:
    """``ncells=2,ndocs=1024,centroid_score_threshold=0.45`` -> keyword arguments of index.search."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ("ncells", "ndocs", "centroid_score_threshold") or not value:
            raise SystemExit(f"--plaid-args: {item!r} is not ncells=, ndocs= or centroid_score_threshold=")
        out[key] = None if value.lower() == "none" else float(value) if key == "centroid_score_threshold" else int(value)
    return out


def format_row(r: dict, batch: int) -> str:
    def cell(key, spec):
        return "-" if r.get(key) is None else format(r[key], spec)

    def qps(batch):
        ms = r.get(f"ms_{batch}")
        return "-" if ms is None else f"{batch / (ms * 1e-3):,.0f}"

    return (f"{r['docs']:>10,} {r['encoding']:>10} | {cell('bytes_per_token', '.0f'):>5} {cell('resident_gb', '.2f'):>7} "
            f"{cell('peak_search_gb', '.1f'):>6} {cell('build_s', '.1f'):>7} | {qps(1):>7} {qps(batch):>8} | "
            f"{cell('recall_1', '.3f'):>6} {cell(f'recall_{batch}', '.3f'):>6}" + (f" | {r['note']}" if r.get("note") else ""))


def header(batch: int) -> str:
    return (f"{'docs':>10} {'encoding':>10} | {'B/tok':>5} {'GB res':>7} {'GB pk':>6} {'build s':>7} | "
            f"{'q/s @1':>7} {f'q/s @{batch}':>8} | {'rec@1':>6} {f'rec@{batch}':>6} | note")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="1000000,10000000", help="comma-separated passage counts")
    ap.add_argument("--encodings", default=ENCODINGS, help="comma-separated maxsim.Corpus encodings")
    ap.add_argument("--queries", type=int, default=32, help="queries: the large batch, and the singles of batch 1")
    ap.add_argument("--reps", type=int, default=10, help="timed calls of the large batch (after a warm-up)")
    ap.add_argument("--search-budget-s", type=float, default=30.0, help="stop timing a batch size after this long")
    ap.add_argument("--slice-docs", type=int, default=0,
                    help="passages a slice (0: the whole corpus if its fp16 tokens fit a quarter of the free "
                         f"GPU memory, else {SLICE_DOCS_LARGE})")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated peer engines beside the encodings ({', '.join(ENGINES)}; '' for none)")
    ap.add_argument("--engine-max-docs", "--fast-plaid-max-docs", dest="engine_max_docs", type=int, default=1_000_000,
                    help="run the peer engines up to this many passages")
    ap.add_argument("--nbits", type=int, default=2, help="fast-plaid's residual bits")
    ap.add_argument("--xtr-warp-nbits", type=int, default=4, help="xtr-warp's residual bits (its default: 4)")
    ap.add_argument("--xtr-warp-threshold", type=float, default=None,
                    help="xtr-warp's centroid_score_threshold (default: its heuristic's, 0.4-0.5: on passages whose "
                         "tokens sit below it every centroid is pruned and nothing comes back)")
    ap.add_argument("--xtr-warp-threads", type=int, default=1,
                    help="xtr-warp's search num_threads (its default: 1; on CUDA more fan a batch over streams)")
    ap.add_argument("--no-colsearch-warmup", dest="colsearch_warmup", action="store_false",
                    help="skip colsearch's warmup_maxsim (105 Triton autotune compilations; default: run it, "
                         "as its benchmark does)")
    ap.add_argument("--no-build-tf32", dest="build_tf32", action="store_false",
                    help="codec training and encoding with fp32 matmuls (default: TF32)")
    ap.add_argument("--passages", default="synthetic",
                    help="synthetic (_passages.HEADLINE), real:DIR (a folder of benchmarks/real_passages.py), or "
                         "spliced:DIR (passages spliced from that pool, benchmarks/spliced_passages.py)")
    ap.add_argument("--refine", default=None,
                    help="also time each residual / PQ corpus refined from this encoding's tokens (float16, int8) "
                         "held in pinned host memory: Corpus.search(..., refine=, refine_factor=)")
    ap.add_argument("--refine-factors", default="4", help="comma-separated refine factors (candidates = k x factor)")
    ap.add_argument("--engine-host-input", action="store_true",
                    help="fast-plaid takes host tensors (create() moves them 25,000 passages at a time), so that "
                         "corpora larger than the GPU build")
    ap.add_argument("--lookup-only", action="store_true",
                    help="residual / PQ / int8 / fp8 cells: the codes in pinned host memory, only the look-up layouts "
                         "on the GPU (Corpus.to(device, lookup_only=True)): corpora whose codes and layout do not "
                         "both fit, and the one-byte Gluon scorer")
    ap.add_argument("--plaid-settings", default="fast-plaid", choices=("fast-plaid", "colbert"),
                    help="the search settings of residual<n>:plaid cells (maxsim.index's named settings)")
    ap.add_argument("--plaid-only", action="store_true",
                    help="a :plaid cell times only its PLAID searches, not the exhaustive scan of the same codes")
    ap.add_argument("--plaid-args", default="",
                    help="overrides of those settings, e.g. ncells=2,ndocs=1024,centroid_score_threshold=0.45 "
                         "(none turns the threshold off); several searches of one index: groups split by ';'")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads of each CPU cell (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one cell may take before it is killed")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="start no cell after this many seconds (0: none)")
    ap.add_argument("--tmp", default=None, help="folder for the truth and the engines' indexes (default: the system's)")
    ap.add_argument("--out", default=None,
                    help="write the rows as JSON to this file (after every row); a folder gets headline.json")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("headline_bench needs a CUDA GPU (or --device cpu for a smoke test)")
    if args.passages != "synthetic" and not args.passages.startswith(("real:", "spliced:")):
        raise SystemExit(f"--passages takes synthetic, real:DIR or spliced:DIR; got {args.passages!r}")
    options = dict(passages=args.passages, device=args.device, queries=args.queries, reps=args.reps, search_budget_s=args.search_budget_s,
                   slice_docs=args.slice_docs, nbits=args.nbits, build_tf32=args.build_tf32, seed=args.seed,
                   cpu_threads=args.cpu_threads, xtr_warp_nbits=args.xtr_warp_nbits,
                   xtr_warp_threads=args.xtr_warp_threads,
                   xtr_warp_threshold=args.xtr_warp_threshold, colsearch_warmup=args.colsearch_warmup,
                   refine=args.refine, lookup_only=args.lookup_only, engine_host_input=args.engine_host_input,
                   plaid_settings=dict(settings=args.plaid_settings), plaid_variants=_plaid_variants(args.plaid_args),
                   plaid_only=args.plaid_only,
                   refine_factors=[int(f) for f in args.refine_factors.split(",") if f.strip()])
    encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown --engines {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
    start = time.perf_counter()
    rows, sizes = [], []

    def left() -> float:
        if not args.deadline_s:
            return args.timeout
        return min(args.timeout, args.deadline_s - (time.perf_counter() - start))

    def emit(row: dict) -> None:
        rows.append(row)
        print(format_row(row, args.queries), flush=True)
        if args.out:
            out = Path(args.out) / "headline.json" if Path(args.out).is_dir() else Path(args.out)
            with open(out, "w") as handle:
                json.dump(dict(args=vars(args), generator=HEADLINE, sizes=sizes, rows=rows), handle, indent=1)

    def isolated(fn, *fn_args) -> dict:
        budget = left()
        if budget <= 5:
            return {"status": "skipped", "error": f"past --deadline-s {args.deadline_s:g}"}
        return run_isolated(fn, *fn_args, timeout_s=budget)

    print(f"# headline_bench: exhaustive maxsim.Corpus.search per encoding, k {K}, {args.queries} queries of 32 tokens; "
          f"passages: {args.passages if args.passages != 'synthetic' else f'_passages.HEADLINE {HEADLINE}'}",
          flush=True)
    printed_header = False
    with tempfile.TemporaryDirectory(prefix="maxsim-headline-", dir=args.tmp) as folder:
        for num_docs in (int(x) for x in args.docs.split(",")):
            truth = isolated(truth_cell, num_docs, options, folder)
            if truth["status"] == "ok":
                if not printed_header:
                    tf32 = args.build_tf32 and args.device.startswith("cuda")
                    print(f"# {truth['device_name']}, torch {truth['torch']}; codecs trained and applied with "
                          f"{'TF32' if tf32 else 'fp32'} matmuls; q/s = batch / median wall clock")
                sizes.append(dict(docs=num_docs, **truth))
                print(f"# {num_docs:,} passages, {truth['tokens'] / 1e6:.1f}M tokens, slices of "
                      f"{truth['slice_docs']:,}: generated in {truth['generate_s']:.1f} s, exact scores "
                      f"(fp16 tokens, fp32 accumulation) in {truth['exact_score_s']:.1f} s; the source passage is "
                      f"exact top-1 for {truth['source_top1']:.0%} of the queries, top-10 for "
                      f"{truth['source_top10']:.0%}; {truth['ties_at_k']} ties at rank 10", flush=True)
            if not printed_header:
                print(header(args.queries))
                print("-" * len(header(args.queries)), flush=True)
                printed_header = True
            if truth["status"] != "ok":
                emit(dict(docs=num_docs, encoding="(truth)", note=f"exact search {failed(truth)}"))
                continue
            for encoding in encodings:
                result = _recover_partial(isolated(encoding_cell, num_docs, encoding, options, folder), folder,
                                          num_docs, encoding)
                stopped = result.pop("stopped", False)
                searches = result.pop("searches", None) or [dict(label=encoding)]
                built = {k: v for k, v in result.items() if k not in ("status", "error", "note", "partial_path")}
                if stopped:  # the searches it finished are rows as usual; the last row says why it stopped
                    searches.append(dict(label=f"{encoding} (stopped)",
                                         error=f"{failed(result)}; the rows above finished before it"))
                    result = dict(result, status="ok")
                for i, timed in enumerate(searches):
                    # the first row carries the cell's note; a PLAID or refined row (first under --plaid-only) its own
                    cell_note = (result.get("note") or failed(result)) if i == 0 else ""
                    own_note = _search_note(timed, result) if timed["label"] != encoding else ""
                    note = "; ".join(filter(None, (cell_note, own_note)))
                    if result["status"] == "ok" and timed.get("queries_1", args.queries) < args.queries:
                        note = (note + "; " if note else "") + \
                            f"batch 1: {timed['queries_1']} of {args.queries} queries in the time budget"
                    emit(dict(built if i == 0 else {}, **timed, docs=num_docs, encoding=timed["label"], note=note))
            for name in engines:
                module, install = ENGINES[name]
                if importlib.util.find_spec(module) is None:
                    emit(dict(docs=num_docs, encoding=name, note=f"not installed ({install})"))
                    continue
                if num_docs > args.engine_max_docs:
                    emit(dict(docs=num_docs, encoding=name, note=f"skipped: above --engine-max-docs "
                                                                 f"{args.engine_max_docs:,}"))
                    continue
                result = isolated(engine_cell, num_docs, name, options, folder)
                # its index files (several GB at 1M) are not needed past its row: the disk is shared
                shutil.rmtree(os.path.join(folder, f"{name}-{num_docs}"), ignore_errors=True)
                note = failed(result)
                if not note:
                    # GB res: the device allocator's count; without one, what it stores stands in
                    where = "allocator" if args.device.startswith("cuda") else result["stored"]
                    note = f"{result['engine_note']}; B/tok: {result['stored']}, GB res: {where}"
                    if result.get("queries_1", args.queries) < args.queries:
                        note += f"; batch 1: {result['queries_1']} of {args.queries} queries in the time budget"
                emit(dict({k: v for k, v in result.items() if k not in ("status", "error", "engine_note")},
                          docs=num_docs, encoding=name, note=note))
    print(f"# {time.perf_counter() - start:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
