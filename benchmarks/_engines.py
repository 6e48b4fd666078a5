"""The peer engines that benchmarks/headline_bench.py runs beside ``maxsim.Corpus``: each builds its
index of the same passages with its package's own calls and documented defaults, and answers the
same queries with top-10 passage ids.

    engine = make_engine("xtr-warp", options)    # imports the package (an ImportError is the row's error)
    docs = engine.prepare(tokens, offsets)        # the package's input: device views, host tensors, numpy
    engine.build(docs, index_path, device)        # timed by the caller
    engine.load(index_path, device, queries)      # what makes the index searchable (timed apart)
    ids = engine.search(queries)                  # [b, Lq, d] fp16 on the device -> [b, 10] int64 (-1: none)
    engine.stored_bytes(index_path)               # its index files, or what it holds when it has none
    engine.info(), engine.note()                  # settings for the row's JSON and its note

``ENGINES`` names each with its module (to say "not installed") and the pip line that brings it.
Where each learnt its calls:

* fast-plaid 1.7 (``fast_plaid.search.FastPlaid``): benchmarks/plaid_bench.py's calls, ``create(
  documents_embeddings=[per-passage tensors on the device], nbits=--nbits)`` and ``search(
  queries_embeddings=Q, top_k=10)``, its default search settings.
* xtr-warp-rs 2.1 (``xtr_warp.XTRWarp``; the wheel's xtr_warp/search.py and the README of
  github.com/pau-mensa/xtr-warp-rs): ``create(embeddings_source=[per-passage tensors], device=...,
  nbits=4)``, its defaults otherwise (4 k-means iterations, 2**floor(log2(16 sqrt(tokens)))
  centroids: 65,536 for 64M tokens, a 2 GiB k-means sample), then ``load(device=...)`` (float32
  centroids, its default dtype) and ``search(queries_embeddings=Q, top_k=10, num_threads=...)``
  with every search parameter left to ``None``: the package derives bound, nprobe, t', the
  centroid score threshold and max candidates from the index density (xtr_warp/hyperparams.py;
  the row's JSON keeps the values it picked). The passages go in as host tensors, as in the
  package's README and its own benchmark (benchmark/benchmark.py): the build then moves them to
  the GPU itself, 256 passages at a time.
* colsearch 0.1.7 (``colsearch._internal.inference.shard_engine.scorer.PreloadedGpuCorpus``): the
  "fp16/gpu" lane behind its 3.12x-fast-plaid claim, as its own benchmark runs it
  (benchmarks/beir_benchmark.py ``run_gpu_corpus_mode`` of github.com/ddickmann/colsearch: every
  corpus of at most 1M passages skips LEMUR routing and scores the whole resident corpus exactly,
  ``score_all``). ``PreloadedGpuCorpus(doc_vecs=[per-passage fp16 numpy arrays], doc_ids, dim,
  device)`` pads the passages into tiers of power-of-two lengths on the GPU; ``warmup_maxsim``
  runs its Triton autotune for those lengths; ``score_all(query [Lq, d], k=10)`` takes one query a
  call (a batch of 32 is 32 calls: it has no batched exact search). The public ``colsearch.Index``
  is not used: its shard engine always routes through LEMUR + FAISS first (approximate, and it
  would need faiss-cpu). Its Triton kernel returns fp16 scores (triton_maxsim.py casts the output
  to the query's dtype, fp16 in ``score_all``), so near-ties at rank 10 are broken on rounded
  scores.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

K = 10

# name -> (module that says it is installed, what installs it)
ENGINES = {
    "fast-plaid": ("fast_plaid", "pip install fast-plaid==1.7.0.2110 fastkmeans==0.5.0 usearch numkong"),
    "xtr-warp": ("xtr_warp", "pip install xtr-warp-rs==2.1.0.2110 duckdb"),
    "colsearch": ("colsearch", "pip install colsearch==0.1.7"),
}


def make_engine(name: str, options: dict):
    """The adapter of engine ``name`` (a key of ENGINES); imports its package."""
    return {"fast-plaid": FastPlaid, "xtr-warp": XtrWarp, "colsearch": ColSearch}[name](options)


def _lengths(offsets: np.ndarray) -> list[int]:
    return (offsets[1:] - offsets[:-1]).tolist()


def _ids(hits: list[list[tuple[int, float]]]) -> torch.Tensor:
    """[(passage id, score), ...] per query -> ids [b, K] int64, -1 where fewer than K came back."""
    return torch.tensor([[int(pid) for pid, _ in h[:K]] + [-1] * (K - min(K, len(h))) for h in hits],
                        dtype=torch.int64)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


class FastPlaid:
    """fast-plaid's PLAID index (plaid_bench's calls), its default search settings."""

    stored = "index files"  # what stored_bytes counts (B/tok; GB res off a GPU)

    def __init__(self, options: dict):
        from fast_plaid import search as fp_search

        self._fp = fp_search
        self.nbits = options["nbits"]
        self.index = None
        # views of the device tokens; --engine-host-input: of host tokens, which create() moves to
        # the GPU 25,000 passages at a time (past ~4M passages the fp16 tokens outgrow an H100)
        self.host_input = bool(options.get("engine_host_input"))

    def prepare(self, tokens: torch.Tensor, offsets: np.ndarray) -> list:
        return list(torch.split(tokens, _lengths(offsets)))  # [len_i, d] views, where the tokens are

    def build(self, docs: list, index_path: str, device: torch.device) -> None:
        self._fp.FastPlaid(index=index_path, device=str(device)).create(documents_embeddings=docs, nbits=self.nbits)

    def load(self, index_path: str, device: torch.device, queries: torch.Tensor) -> None:
        self.index = self._fp.FastPlaid(index=index_path, device=str(device))  # reads the index at its first search

    def search(self, q: torch.Tensor) -> torch.Tensor:
        return _ids(self.index.search(queries_embeddings=q, top_k=K, show_progress=False))

    def stored_bytes(self, index_path: str) -> int:
        return dir_bytes(index_path)

    def info(self) -> dict:
        return dict(nbits=self.nbits)

    def note(self) -> str:
        return f"PLAID {self.nbits}-bit, its default search settings"


class XtrWarp:
    """xtr-warp-rs's WARP index: its default build (4-bit residuals) and its automatic search
    parameters; ``--xtr-warp-threads`` is its ``num_threads`` (default 1, the package's: on CUDA,
    more threads fan a batch's queries over CUDA streams and add ~0.3 ms a call, its warning says)."""

    host_input = True  # the README's and its benchmark's input: host tensors, one per passage
    stored = "index files"

    def __init__(self, options: dict):
        from xtr_warp import XTRWarp

        self._cls = XTRWarp
        self.nbits = options["xtr_warp_nbits"]
        self.threads = options["xtr_warp_threads"]
        self.threshold = options.get("xtr_warp_threshold")  # None: its heuristic's
        self.short = 0  # queries that got fewer than K passages back (pruned by the threshold)
        self.index = None
        self.params = None
        self.memory = None

    def prepare(self, tokens: torch.Tensor, offsets: np.ndarray) -> list:
        return list(torch.split(tokens.cpu(), _lengths(offsets)))  # [len_i, d] fp16 views of one host copy

    def build(self, docs: list, index_path: str, device: torch.device) -> None:
        self._cls(index=index_path).create(embeddings_source=docs, device=str(device), nbits=self.nbits,
                                           show_progress=False)

    def load(self, index_path: str, device: torch.device, queries: torch.Tensor) -> None:
        self.index = self._cls(index=index_path)
        self.index.load(device=str(device))  # float32 centroids (its default); mmap only on a CPU
        picked = self.index.optimize_hyperparams(K, queries)  # what search() will use with None
        if picked is not None:
            self.params = dict(zip(("bound", "nprobe", "centroid_score_threshold", "max_candidates", "t_prime"),
                                   picked))
        try:
            self.memory = {k: int(v) for k, v in self.index.estimate_index_memory().items()}
        except Exception as exc:  # only informative: never lose the row to it
            self.memory = {"error": f"{type(exc).__name__}: {exc}"[:200]}

    def search(self, q: torch.Tensor) -> torch.Tensor:
        ids = _ids(self.index.search(queries_embeddings=q, top_k=K, num_threads=self.threads, show_progress=False,
                                     centroid_score_threshold=self.threshold))
        self.short = max(self.short, int((ids < 0).any(1).sum()))
        return ids

    def stored_bytes(self, index_path: str) -> int:
        return dir_bytes(index_path)

    def info(self) -> dict:
        return dict(nbits=self.nbits, num_threads=self.threads, search_params=self.params,
                    centroid_score_threshold=self.threshold, estimated_index_bytes=self.memory,
                    queries_short_of_k=self.short)

    def note(self) -> str:
        p = self.params or {}
        picked = f"nprobe {p['nprobe']}, bound {p['bound']}, t' {p['t_prime']:,}" if p else "its automatic settings"
        threshold = "" if self.threshold is None else f", centroid threshold {self.threshold:g}"
        short = f", {self.short} queries of a batch got < {K} passages" if self.short else ""
        return f"WARP {self.nbits}-bit, {picked}{threshold}, {self.threads} thread(s){short}"


class ColSearch:
    """colsearch's exact lane: the whole corpus resident on the device, padded into power-of-two
    tiers, every passage scored by its Triton MaxSim kernel, one query a call."""

    host_input = True  # it pads on the host (numpy) and copies each tier over once
    stored = "its padded tensors"

    def __init__(self, options: dict):
        from colsearch._internal.inference.shard_engine import scorer

        self._scorer = scorer
        self.warmup = options["colsearch_warmup"]
        self.corpus = None
        self.lengths = None
        self.warmup_s = None

    def prepare(self, tokens: torch.Tensor, offsets: np.ndarray) -> list:
        self.lengths = _lengths(offsets)
        return np.split(tokens.cpu().numpy(), offsets[1:-1])  # [len_i, d] fp16 views of one host copy

    def build(self, docs: list, index_path: str, device: torch.device) -> None:
        self.corpus = self._scorer.PreloadedGpuCorpus(docs, list(range(len(docs))), docs[0].shape[1],
                                                      device=str(device))  # fp16, its default

    def load(self, index_path: str, device: torch.device, queries: torch.Tensor) -> None:
        # Its benchmark's warm-up: Triton autotune at 1,024 passages for query lengths 32-512 and
        # every tier's length (7 configurations each: 105 compilations here). Without it
        # (--no-colsearch-warmup) the harness's warm-up search autotunes the 3 shapes it meets, at
        # the tiers' real sizes. A CPU has nothing to tune: its path is PyTorch.
        if device.type != "cuda" or not self.warmup:
            return
        t0 = time.perf_counter()
        self._scorer.warmup_maxsim(dim=queries.shape[-1], doc_token_counts=sorted(set(self.lengths)),
                                   device=str(device), query_token_counts=[queries.shape[1]])
        self.warmup_s = time.perf_counter() - t0

    def search(self, q: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.corpus.score_all(one, k=K)[0] for one in q], dtype=torch.int64)

    def kernel(self) -> str:
        """Which MaxSim ran: the Triton kernel, or PyTorch (no Triton, a CPU, or Triton failed
        and the package fell back quietly, logging a warning)."""
        from colsearch._internal.kernels import maxsim as cs_maxsim

        chosen = self._scorer._get_maxsim()
        on_cuda = str(self.corpus._device).startswith("cuda")
        if chosen is not cs_maxsim.fast_colbert_scores or not cs_maxsim.TRITON_AVAILABLE or not on_cuda:
            return "pytorch"
        return "pytorch fallback after a Triton error" if cs_maxsim._TRITON_FALLBACK_CACHE else "triton"

    def stored_bytes(self, index_path: str) -> int:
        return int(self.corpus._gpu_bytes)  # the padded fp16 tiers: no files

    def info(self) -> dict:
        c = self.corpus
        return dict(tiers=[t["T"] for t in c._tiers] if c._is_bucketed else [c.max_tok],
                    warmup=self.warmup, warmup_s=self.warmup_s, kernel=self.kernel())

    def note(self) -> str:
        tiers = "/".join(str(t) for t in self.info()["tiers"])
        warm = "" if self.warmup else ", no warmup_maxsim"
        return f"exact fp16 score_all ({self.kernel()}{warm}), tiers of {tiers} tokens, one query a call"
