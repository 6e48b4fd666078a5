"""Synthetic passages of multi-vector tokens for the search benchmarks, with queries drawn from
known source passages. All in memory, or slice by slice for corpora larger than the GPU:

    from _passages import HEADLINE, PLAID_BENCH, Passages, make_corpus

    tokens, cu, queries, source = make_corpus(100_000, device="cuda")      # defaults: HEADLINE
    gen = Passages(10_000_000, device="cuda", num_queries=32)              # 640M tokens: 164 GB fp16
    for first, tokens, offsets in gen.slices(500_000):                     # [t, d] fp16, [n + 1] int64
        ...                                                                # encode, score, append
    queries, source = gen.queries()                                        # after the last slice

The model (d = ``dim``). A passage has a length uniform in ``[min_len, max_len]`` and a context
vector c; each of its tokens is one word w of a vocabulary of ``vocab`` standard normal vectors,
and its embedding is

    normalize(topic_weight * c + word_weight * w + noise * N(0, I_d))        (stored as fp16)

The context: with ``context_dim = 0``, one of ``topics`` standard normal topic vectors, uniform
(the historical corpus: passages of one topic are a tight cluster, of two topics unrelated); with
``context_dim = r > 0``, ``z B`` for a passage's own z ~ N(0, I_r) and one random B [r, d] of
N(0, 1/r) entries: contexts spread continuously over an r-dimensional subspace, so a query's
relatedness to the other passages is graded, as in text (``topics`` is then unused). The word:
uniform when ``zipf`` is 0; otherwise the word of rank r has probability proportional to
``1 / (r + 1) ** zipf`` (a few words in every passage, most words rare). A query: ``query_len``
tokens of one source passage, drawn with replacement, each plus ``query_noise * N(0, I_d)``,
normalised, fp16; the source's index comes with it (exact search should rank it first).

Why the defaults (``HEADLINE``; benchmarks/plaid_bench.py passes its historical ``PLAID_BENCH``
explicitly). On the historical corpus (4096 Gaussian topics, 4096 >> passages at calibration scale)
ranks 2-10 of a query are near-ties decided by noise, and every compressed encoding looks broken
beside real embeddings; with discrete topics of ~8 passages instead, the top-10 ends at a cliff
(the topic's siblings) and every encoding looks too good. benchmarks/calibrate_passages.py scores
both against real token embeddings (all-MiniLM-L6-v2, d 384, over gensim's Lee corpus: the data of
benchmarks/compressed_fidelity.py, 500 passages of 14-128 tokens, 50 queries) at the same scale
(500 passages of 32-96 tokens, 100 queries of 32 tokens, d 128): recall@10 against exact fp32
scores for int8, fp8, residual2, residual4 and PQ with m = d / 4 (pq96 real, pq32 synthetic: one
byte per 4 dimensions), over a small grid of parameters, and picked the point whose worst
per-encoding difference from the real recalls is smallest. Its run
(benchmarks/results/calibrate-passages-20261202.log, 7 minutes on this project's 2-core CPU):

    recall@10 vs exact fp32          int8   fp8    residual2 residual4 pq (d/4)  max |Δ|  shape r10 r50
    real: MiniLM, Lee corpus         0.996  0.992  0.840     0.930     0.916     -        0.65  0.23
    HEADLINE: context 32, topic 2,   0.997  0.980  0.854     0.938     0.889     0.027    0.63  0.24
      word 1, zipf 1, noise 0.5,
      query noise 0.3
    PLAID_BENCH (4096 topics)        0.994  0.978  0.743     0.891     0.776     0.140    0.57  0.20
    64 topics (~8 passages a topic)  0.998  0.990  0.918     0.957     0.926     0.078    0.44  0.08

(grid: context_dim 16 / 32 / 64 x topic_weight 1.5 / 2 / 2.5 with zipf 1, then zipf 0, noise 0.3 /
0.8 and query noise 0.15 / 0.5 one at a time around the best: max |Δ| 0.027-0.087; query noise
moves the compressed recalls most, 0.15 -> 0.921 and 0.5 -> 0.787 for residual2.) "shape":
(s_r - s_100) / (s_2 - s_100) of the exact scores, averaged over queries: with HEADLINE the
relatedness of rank-r passages falls off as on the real corpus (0.63 / 0.24 against 0.65 / 0.23 at
ranks 10 and 50); with 8-passage topics it falls off a cliff after the siblings (0.44 / 0.08). The
exact search ranks the source passage first for every query (100 of 100). Limits: the real corpus
has 50 queries (its residual2 recall, 0.840, has a standard error of 0.015 over them), the
calibration is at 500 passages while the headline runs 1M-10M (more near neighbours per query
there: recalls fall with scale, on real corpora too), and PQ stays 0.02-0.05 below the real pq96
at every grid point (only the lower query noise reaches it, overshooting everything else).

Random numbers: one ``torch.Generator`` on ``device``, seeded with ``seed``, draws (in order) the
topic vectors (context_dim 0), the word vectors, the lengths, the passages' topics (context_dim 0)
or the basis and the passages' z, then the tokens ``chunk_tokens`` at a time (words, then noise).
The documents depend on the parameters, the device type and ``chunk_tokens``, not on how a caller
slices them. With ``PLAID_BENCH`` this is exactly the stream of plaid_bench.py's former
``make_corpus``: it rebuilds those corpora bit for bit. The queries: :func:`make_corpus` draws
them from the same stream after the last token (plaid_bench's historical order, which needs every
token in memory); :class:`Passages` draws their sources, token picks and noise up front from a
second generator (seeded ``seed + 1``) and collects the picked tokens while the slices go by, so a
corpus of 10M passages never has to be held at once. The two give the same documents and
different queries for the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CHUNK_TOKENS = 1 << 24  # tokens generated per step: fp32 temporaries of 8 GB at d 128
QUERY_LEN = 32

# benchmarks/plaid_bench.py's corpus (its numbers stay comparable with earlier runs).
PLAID_BENCH = dict(dim=128, min_len=32, max_len=96, topics=4096, vocab=32768, topic_weight=1.0, word_weight=1.0,
                   noise=0.5, zipf=0.0, context_dim=0, query_noise=0.3)

# The calibrated defaults (benchmarks/calibrate_passages.py; the module docstring says how).
HEADLINE = dict(dim=128, min_len=32, max_len=96, topics=4096, vocab=32768, topic_weight=2.0, word_weight=1.0,
                noise=0.5, zipf=1.0, context_dim=32, query_noise=0.3)


@dataclass(frozen=True)
class PassageConfig:
    """The generator's parameters (the module docstring says what each does); defaults HEADLINE."""

    dim: int = HEADLINE["dim"]
    min_len: int = HEADLINE["min_len"]
    max_len: int = HEADLINE["max_len"]
    topics: int = HEADLINE["topics"]
    vocab: int = HEADLINE["vocab"]
    topic_weight: float = HEADLINE["topic_weight"]
    word_weight: float = HEADLINE["word_weight"]
    noise: float = HEADLINE["noise"]
    zipf: float = HEADLINE["zipf"]
    context_dim: int = HEADLINE["context_dim"]
    query_noise: float = HEADLINE["query_noise"]
    query_len: int = QUERY_LEN
    seed: int = 0
    chunk_tokens: int = CHUNK_TOKENS

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len; got {self.min_len}, {self.max_len}")
        if min(self.topics, self.vocab, self.dim, self.query_len, self.chunk_tokens) < 1:
            raise ValueError("topics, vocab, dim, query_len and chunk_tokens must be positive")
        if self.zipf < 0 or self.context_dim < 0:
            raise ValueError(f"need zipf >= 0 and context_dim >= 0; got {self.zipf}, {self.context_dim}")


class Passages:
    """``num_docs`` synthetic passages, generated slice by slice on ``device``.

    ``Passages(num_docs, device=..., num_queries=..., **params)``, params: the fields of
    :class:`PassageConfig`. Holds the per-passage state on ``device`` (length and offset, 16
    bytes a passage, plus a topic id, 8, or z, 4 r) and the tables; ``cu_seqlens`` (host int64 ``[N + 1]``), ``lengths`` and
    ``total_tokens`` are known at once; :meth:`slices` generates the tokens and :meth:`queries`
    returns the queries picked from them.
    """

    def __init__(self, num_docs: int, *, device="cpu", num_queries: int = 64, **params):
        if num_docs < 1 or num_queries < 1:
            raise ValueError(f"num_docs and num_queries must be positive; got {num_docs}, {num_queries}")
        self.config = c = PassageConfig(**params)
        self.num_docs, self.num_queries = int(num_docs), int(num_queries)
        self.device = dev = torch.device(device)
        g = self._generator = torch.Generator(device=dev).manual_seed(c.seed)
        self.topic_vectors = self.doc_topic = self.context_basis = self.doc_context = None
        if c.context_dim == 0:
            self.topic_vectors = torch.randn(c.topics, c.dim, device=dev, generator=g)
        self.word_vectors = torch.randn(c.vocab, c.dim, device=dev, generator=g)
        self.lengths = torch.randint(c.min_len, c.max_len + 1, (num_docs,), device=dev, generator=g)
        self.cu = torch.zeros(num_docs + 1, dtype=torch.int64, device=dev)
        self.cu[1:] = torch.cumsum(self.lengths, 0)
        self.cu_seqlens = self.cu.cpu()
        self.total_tokens = int(self.cu_seqlens[-1])
        if c.context_dim == 0:
            self.doc_topic = torch.randint(0, c.topics, (num_docs,), device=dev, generator=g)
        else:
            self.context_basis = torch.randn(c.context_dim, c.dim, device=dev, generator=g) / c.context_dim ** 0.5
            self.doc_context = torch.randn(num_docs, c.context_dim, device=dev, generator=g)
        self.word_cdf = None
        if c.zipf > 0:
            p = 1.0 / torch.arange(1, c.vocab + 1, dtype=torch.float64, device=dev) ** c.zipf
            self.word_cdf = (torch.cumsum(p, 0) / p.sum()).float()
            self.word_cdf[-1] = 1.0
        self._token_state = g.get_state()  # where every pass over the tokens starts
        self._queries = None

    # ------------------------------------------------------------------ tokens
    def _chunks(self):
        """``(t0, t1, tokens [t1 - t0, d] fp16)`` of the whole corpus, ``chunk_tokens`` at a time,
        in order (the random stream's order); every pass yields the same tokens."""
        c, g, dev = self.config, self._generator, self.device
        g.set_state(self._token_state)
        for t0 in range(0, self.total_tokens, c.chunk_tokens):
            t1 = min(self.total_tokens, t0 + c.chunk_tokens)
            token_doc = torch.searchsorted(self.cu, torch.arange(t0, t1, device=dev), right=True) - 1  # [t]
            if self.word_cdf is None:
                words = torch.randint(0, c.vocab, (t1 - t0,), device=dev, generator=g)
            else:
                u = torch.rand(t1 - t0, device=dev, generator=g)
                words = torch.searchsorted(self.word_cdf, u, right=True).clamp_max_(c.vocab - 1)
                del u
            if self.doc_context is None:
                x = self.topic_vectors[self.doc_topic[token_doc]]
            else:
                x = self.doc_context[token_doc] @ self.context_basis
            del token_doc
            if c.topic_weight != 1.0:
                x.mul_(c.topic_weight)
            w = self.word_vectors[words]
            del words
            if c.word_weight != 1.0:
                w.mul_(c.word_weight)
            x.add_(w)  # (topic + word) + noise: the historical rounding order
            del w
            noise = torch.randn(t1 - t0, c.dim, device=dev, generator=g)
            noise.mul_(c.noise)
            x.add_(noise)
            del noise
            yield t0, t1, torch.nn.functional.normalize(x, dim=-1).half()

    def slices(self, slice_docs: int | None = None):
        """Yield ``(first_document, tokens [t, d] fp16 on device, offsets [n + 1] int64 numpy from
        0)`` for consecutive runs of whole passages, ``slice_docs`` passages each (the last may
        have fewer; None: one slice). Each call is one pass over the corpus, the same every time;
        the queries' tokens are collected on the way (:meth:`queries`)."""
        slice_docs = self.num_docs if slice_docs is None else max(1, int(slice_docs))
        plan = self._query_plan()
        rows = plan["rows"]
        picked = torch.empty(rows.shape[0], self.config.dim, dtype=torch.float16, device=self.device)
        cu_host = self.cu_seqlens.numpy()
        pending, pending_t0, first = [], 0, 0  # generated, not yet yielded: from token pending_t0 = passage first
        for t0, t1, tokens in self._chunks():
            inside = (rows >= t0) & (rows < t1)
            if bool(inside.any()):
                picked[inside] = tokens[rows[inside] - t0]
            pending.append(tokens)
            del tokens
            complete = int(np.searchsorted(cu_host, t1, side="right")) - 1  # passages [0, complete) are whole
            while complete - first >= slice_docs or (t1 == self.total_tokens and complete > first):
                last = min(complete, first + slice_docs)
                a, b = int(cu_host[first]), int(cu_host[last])
                joined = pending[0] if len(pending) == 1 else torch.cat(pending, 0)
                pending = [joined[b - pending_t0:]] if b - pending_t0 < joined.shape[0] else []
                part = joined[a - pending_t0:b - pending_t0]
                del joined
                yield first, part, cu_host[first:last + 1] - a
                del part
                pending_t0, first = b, last
        noise = plan["noise"]
        queries = torch.nn.functional.normalize(picked.float().view(noise.shape) + noise, dim=-1).half()
        self._queries = (queries, plan["source"])

    def _query_plan(self) -> dict:
        """The queries' sources, token rows and noise, from their own generator."""
        c, dev, nq = self.config, self.device, self.num_queries
        g = torch.Generator(device=dev).manual_seed(c.seed + 1)
        source = torch.randint(0, self.num_docs, (nq,), device=dev, generator=g)
        rows = self.cu[source, None] + (torch.rand(nq, c.query_len, device=dev, generator=g)
                                        * self.lengths[source, None]).long()  # [Nq, Lq] token rows
        noise = c.query_noise * torch.randn(nq, c.query_len, c.dim, device=dev, generator=g)
        return dict(source=source, rows=rows.reshape(-1), noise=noise)

    def queries(self):
        """``(queries [Nq, query_len, d] fp16, source [Nq] int64)`` on ``device``, after a full
        pass of :meth:`slices`."""
        if self._queries is None:
            raise RuntimeError("Passages.queries() needs one full pass of slices() first")
        return self._queries


def make_corpus(num_docs: int, *, device="cpu", num_queries: int = 64, **params):
    """The whole corpus in memory: ``(tokens [T, d] fp16, cu_seqlens [N + 1] int64, queries [Nq,
    query_len, d] fp16, source [Nq] int64)``, all on ``device``.

    Parameters: the fields of :class:`PassageConfig` (defaults: ``HEADLINE``; plaid_bench passes
    ``PLAID_BENCH``). The tokens are generated ``chunk_tokens`` at a time into one fp16 tensor
    (``T * d * 2`` bytes: 16 GB for 1M passages of 64 tokens at d 128); the queries are drawn
    after the last token from the same generator (plaid_bench's historical order), so they differ
    from :class:`Passages`' for the same parameters; the documents are the same.
    """
    gen = Passages(num_docs, device=device, num_queries=num_queries, **params)
    c, g, dev = gen.config, gen._generator, gen.device
    tokens = torch.empty(gen.total_tokens, c.dim, dtype=torch.float16, device=dev)
    for t0, t1, chunk in gen._chunks():
        tokens[t0:t1] = chunk
    cu, lengths = gen.cu, gen.lengths
    source = torch.randint(0, num_docs, (num_queries,), device=dev, generator=g)
    pick = cu[source, None] + (torch.rand(num_queries, c.query_len, device=dev, generator=g)
                               * lengths[source, None]).long()  # [Nq, Lq] token rows of the source passage
    noise = c.query_noise * torch.randn(num_queries, c.query_len, c.dim, device=dev, generator=g)
    queries = torch.nn.functional.normalize(tokens[pick].float() + noise, dim=-1).half()
    return tokens, cu, queries, source
