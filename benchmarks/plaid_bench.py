"""PLAID search on the GPU: ``maxsim.index`` against fast-plaid's own search, on fast-plaid's index.

    python benchmarks/plaid_bench.py                              # 100K and 1M documents, 2 bits
    python benchmarks/plaid_bench.py --docs 100000 --queries 1,64 --out results/plaid.json

Per document count: one process builds a fast-plaid index (``FastPlaid.create``, ``--nbits``) of
synthetic passages of ``--min-len``..``--max-len`` tokens (d 128) and the exact top-k of every
query (fp16 tokens, fp32 scores, ``maxsim.topk``), and times that exhaustive search too. Then, each
in its own process (``benchmarks/_isolate.py``: a crash is a row that says so): fast-plaid's
``search`` (its defaults: 8 probed cells, 4096 approximate scores) and ``maxsim.index.load(...)
.search(Q, k, settings="fast-plaid")`` on the same index files, at each batch of ``--queries``.
Times: median wall clock of ``--reps`` calls after a warm-up, the GPU synchronised (fast-plaid
returns Python lists; ours tensors on the GPU). Columns: queries/s, top-k overlap with
fast-plaid's ids, recall@k against the exact top-k.

The corpus (benchmarks/_passages.py, parameters PLAID_BENCH): ``--topics`` topic vectors; a
passage draws one topic, each token is its topic plus one of ``--vocab`` word vectors plus noise,
normalised. A query takes 32 tokens of one passage (with replacement) plus noise, so each query
has a known source passage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated
from _passages import PLAID_BENCH
from _passages import make_corpus as make_passages

DIM = 128
QUERY_LEN = 32
SEED = 0


def make_corpus(num_docs: int, options: dict, device):
    """(tokens [T, d] fp16, cu_seqlens [Nd + 1] int64, queries [Nq, Lq, d] fp16, source [Nq] int64):
    benchmarks/_passages.py's generator with this benchmark's historical parameters (PLAID_BENCH:
    the same corpora and queries, bit for bit, as before the generator moved there)."""
    params = dict(PLAID_BENCH, dim=DIM, query_len=QUERY_LEN, seed=SEED, topics=options["topics"], vocab=options["vocab"],
                  min_len=options["min_len"], max_len=options["max_len"])
    return make_passages(num_docs, device=device, num_queries=max(options["queries"]), **params)


def wall_ms(fn, reps: int) -> float:
    """Median wall-clock ms of ``fn()`` over ``reps`` calls after one warm-up, GPU synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_cell(num_docs: int, options: dict, folder: str) -> dict:
    """The fast-plaid index, the queries and their exact top-k (files in ``folder``); the
    exhaustive fp16 search timed at each batch."""
    import maxsim
    from fast_plaid import search as fp_search

    device = torch.device("cuda")
    tokens, cu, queries, source = make_corpus(num_docs, options, device)
    k = options["k"]
    row = dict(tokens=int(cu[-1]))
    cu_host = cu.cpu()
    for nq in options["queries"]:
        Q = queries[:nq]
        row[f"exhaustive_ms_{nq}"] = wall_ms(lambda: maxsim.topk(Q, tokens, k, cu_seqlens_d=cu_host), options["reps"])
    exact_scores, exact_ids = maxsim.topk(queries, tokens, k, cu_seqlens_d=cu_host)
    torch.save(dict(queries=queries.cpu(), source=source.cpu(), exact_ids=exact_ids.cpu()), f"{folder}/queries.pt")
    row["source_in_exact_topk"] = float((exact_ids == source[:, None]).any(1).float().mean())
    docs = list(torch.split(tokens, torch.diff(cu_host).tolist()))
    t0 = time.perf_counter()
    fp_search.FastPlaid(index=f"{folder}/index", device="cuda").create(documents_embeddings=docs,
                                                                        nbits=options["nbits"])
    row["fast_plaid_build_s"] = time.perf_counter() - t0
    return row


def _overlap_and_recall(ids: torch.Tensor, folder: str, k: int) -> dict:
    data = torch.load(f"{folder}/queries.pt")
    exact = data["exact_ids"][: ids.shape[0]]
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, exact)) / (k * ids.shape[0])
    return dict(recall=recall)


def fast_plaid_cell(options: dict, folder: str) -> dict:
    """fast-plaid's own search at each batch; its ids go to ``folder``."""
    from fast_plaid import search as fp_search

    data = torch.load(f"{folder}/queries.pt")
    index = fp_search.FastPlaid(index=f"{folder}/index", device="cuda")
    k, row = options["k"], {}
    for nq in options["queries"]:
        Q = data["queries"][:nq].cuda()

        def run():
            return index.search(queries_embeddings=Q, top_k=k, show_progress=False)

        row[f"ms_{nq}"] = wall_ms(run, options["reps"])
        ids = torch.tensor([[pid for pid, _ in hits] + [-1] * (k - len(hits)) for hits in run()])
        torch.save(ids, f"{folder}/fast_plaid_{nq}.pt")
        row[f"recall_{nq}"] = _overlap_and_recall(ids, folder, k)["recall"]
    return row


def maxsim_cell(options: dict, folder: str) -> dict:
    """maxsim.index over fast-plaid's files at each batch; ids to ``folder``."""
    import maxsim

    data = torch.load(f"{folder}/queries.pt")
    index = maxsim.index.load(f"{folder}/index", device="cuda")
    k, row = options["k"], {}
    for nq in options["queries"]:
        Q = data["queries"][:nq].cuda()

        def run():
            return index.search(Q, k, settings="fast-plaid")

        row[f"ms_{nq}"] = wall_ms(run, options["reps"])
        if options["profile"]:  # where one call's time goes: the stages' kernels and host work
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            print(f"# maxsim.index search, {nq} queries: the operations by host time")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        ids = run()[1].cpu()
        torch.save(ids, f"{folder}/maxsim_{nq}.pt")
        row[f"recall_{nq}"] = _overlap_and_recall(ids, folder, k)["recall"]
    return row


def run_case(num_docs: int, args) -> list[dict]:
    options = dict(vars(args), queries=[int(x) for x in args.queries.split(",")])
    with tempfile.TemporaryDirectory(prefix="maxsim-plaid-", dir=args.tmp) as folder:
        built = run_isolated(build_cell, num_docs, options, folder, timeout_s=args.timeout)
        if built["status"] != "ok":
            return [dict(docs=num_docs, queries=nq, note=f"build {failed(built)}") for nq in options["queries"]]
        peer = run_isolated(fast_plaid_cell, options, folder, timeout_s=args.timeout)
        ours = run_isolated(maxsim_cell, options, folder, timeout_s=args.timeout)
        rows = []
        for nq in options["queries"]:
            overlap = None
            if peer["status"] == ours["status"] == "ok":
                a, b = torch.load(f"{folder}/fast_plaid_{nq}.pt"), torch.load(f"{folder}/maxsim_{nq}.pt")
                overlap = sum(len(set(x.tolist()) & set(y.tolist()) - {-1}) for x, y in zip(a, b)) / (args.k * nq)
            ex_ms = built[f"exhaustive_ms_{nq}"]
            rows.append(dict(
                docs=num_docs, tokens=built["tokens"], queries=nq, build_s=built["fast_plaid_build_s"],
                source_in_exact=built["source_in_exact_topk"], exhaustive_ms=ex_ms,
                fast_plaid_ms=peer.get(f"ms_{nq}"), fast_plaid_recall=peer.get(f"recall_{nq}"),
                maxsim_ms=ours.get(f"ms_{nq}"), maxsim_recall=ours.get(f"recall_{nq}"), overlap=overlap,
                note="; ".join(f"{side} {failed(r)}" for side, r in (("fast-plaid", peer), ("maxsim", ours))
                               if failed(r))))
        return rows


def format_row(r: dict) -> str:
    def cell(key, spec):
        return "-" if r.get(key) is None else format(r[key], spec)

    def qps(key):
        return "-" if r.get(key) is None else f"{r['queries'] / (r[key] * 1e-3):.0f}"

    speedup = "-" if None in (r.get("maxsim_ms"), r.get("fast_plaid_ms")) else f"{r['fast_plaid_ms'] / r['maxsim_ms']:.2f}"
    return (f"{r['docs']:>8} {r['queries']:>3} | {cell('fast_plaid_ms', '.2f'):>9} {qps('fast_plaid_ms'):>7} "
            f"{cell('fast_plaid_recall', '.3f'):>6} | {cell('maxsim_ms', '.2f'):>9} {qps('maxsim_ms'):>7} "
            f"{cell('maxsim_recall', '.3f'):>6} {cell('overlap', '.3f'):>7} {speedup:>6} | "
            f"{cell('exhaustive_ms', '.2f'):>9} {qps('exhaustive_ms'):>7}" + (f" | {r['note']}" if r.get("note") else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="100000,1000000", help="comma-separated document counts")
    ap.add_argument("--queries", default="1,64", help="comma-separated query batches")
    ap.add_argument("--nbits", type=int, default=2)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=96)
    ap.add_argument("--topics", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of maxsim's search")
    ap.add_argument("--tmp", default=None, help="folder for the index files (default: the system's)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds one process may take before it is killed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("plaid_bench needs a CUDA GPU")
    header = (f"{'docs':>8} {'nq':>3} | {'fp ms':>9} {'q/s':>7} {'rec':>6} | {'maxsim ms':>9} {'q/s':>7} {'rec':>6} "
              f"{'overlap':>7} {'x fp':>6} | {'exh. ms':>9} {'q/s':>7}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; fast-plaid vs maxsim.index "
          f"(settings='fast-plaid'), {args.nbits}-bit, k {args.k}; recall@k against exact fp16 search")
    print(header)
    print("-" * len(header))
    rows = []
    for num_docs in (int(x) for x in args.docs.split(",")):
        for r in run_case(num_docs, args):
            rows.append(r)
            print(format_row(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
