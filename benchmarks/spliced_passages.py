"""Passages spliced from a pool of real token embeddings: 10M passages whose tokens are real MiniLM
vectors and whose posting lists grow as real text's do, without encoding 10M passages.

    python benchmarks/real_passages.py --docs 1000000 --out /tmp/real --device cuda    # the pool
    python benchmarks/headline_bench.py --docs 10000000 --passages spliced:/tmp/real    # 10x the pool

Why: 10M passages of real tokens (``real_passages.py``) are 188 GB of fp16 tokens, more than the
device's disk, and encoding them takes ~1,000 s, more than one device call; the headline makes
several passes over the corpus (the exact truth, the build). The synthetic generator
(``_passages.py``) is cheap but spreads tokens so that PLAID's posting lists hold a few passages,
which starves PLAID's candidate generation. Splicing keeps what PLAID and the codecs feel (every
token is a real contextual vector of a real wordpiece, passages run through real word sequences)
and costs a gather a token.

The walk. A passage takes the length of a random pool passage, starts at a random pool passage's
[CLS] and moves one pool token at a time: to the next token of the same pool passage, or with
probability ``jump`` (and always where that passage's next token would be its [SEP]) to the token
after a random occurrence, anywhere in the pool, of the wordpiece it stands on; so consecutive
wordpieces are a real bigram, and runs between jumps keep their real left context. Its last token
is the [SEP] of the pool passage it stands in. Every pool token appears about (corpus tokens / pool
tokens) times in the corpus.

Queries: ``num_queries`` passages chosen at random (the source; seed + 1); a run of up to 40 of
their wordpieces from a random start, decoded to text and encoded by MiniLM to exactly 32 tokens
(truncated; projected by the pool's map), as ``real_passages.py`` encodes its queries: a real query
vector sits in the span's own context while the passage's tokens sit in the contexts they were
spliced from. The queries need the MiniLM package (on the device with ``.whl-real/extra``); they
are computed once and saved beside the pool (``spliced-queries-*.npy``).

Random numbers: the lengths and starts from ``seed``; block b of ``BLOCK_DOCS`` passages walks with
its own generator (``seed``, b) on ``device``, so a passage's tokens depend on the pool, the
parameters and the device type, not on how a caller slices the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK_DOCS = 100_000  # passages a walk block (its index tensor: BLOCK_DOCS x 128 int64, 100 MB)
JUMP = 0.25  # benchmarks/spliced_calibration.py's pick (its docstring has the run)
QUERY_LEN = 32
SPAN_WORDPIECES = 40


def _seed(*parts: int) -> int:
    """One 63-bit seed from a tuple of small integers (numpy's SeedSequence)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))


class SplicedPassages:
    """``num_docs`` passages spliced from the pool that ``real_passages.py`` built in ``pool_dir``
    (its ``tokens.npy`` [T, d] fp16, ``lengths.npy`` [P] and ``ids.npy`` [T] int32 wordpieces).

    The interface of ``_passages.Passages``: ``config.dim``, ``num_docs``, ``cu_seqlens`` (host int64
    [N + 1]), ``total_tokens``, :meth:`slices`, :meth:`queries`. Holds the pool's tokens on
    ``device`` (18.8 GB for the 1M pool) and four int32/bool tables of T entries beside them;
    :meth:`release` frees them (slices and queries are then unavailable)."""

    def __init__(self, pool_dir: str, num_docs: int, *, device="cpu", num_queries: int = 32, jump: float = JUMP,
                 seed: int = 0):
        if num_docs < 1 or num_queries < 1:
            raise ValueError(f"num_docs and num_queries must be positive; got {num_docs}, {num_queries}")
        if not 0.0 <= jump <= 1.0:
            raise ValueError(f"jump is a probability; got {jump}")
        missing = [f for f in ("tokens.npy", "lengths.npy", "ids.npy") if not os.path.exists(os.path.join(pool_dir, f))]
        if missing:
            raise FileNotFoundError(f"{pool_dir} lacks {', '.join(missing)}: build the pool with "
                                    f"benchmarks/real_passages.py (it writes ids.npy since 2026-12-06)")
        self.pool_dir, self.num_docs, self.num_queries = pool_dir, int(num_docs), int(num_queries)
        self.jump, self.seed = float(jump), int(seed)
        self.device = dev = torch.device(device)
        with open(os.path.join(pool_dir, "meta.json")) as handle:
            self.pool_meta = json.load(handle)
        pool_lengths = torch.from_numpy(np.load(os.path.join(pool_dir, "lengths.npy")).astype(np.int64))  # [P]
        if int(pool_lengths.min()) < 2:
            raise ValueError(f"{pool_dir}: a pool passage shorter than [CLS] [SEP]")
        self.pool = torch.from_numpy(np.load(os.path.join(pool_dir, "tokens.npy"))).to(dev)  # [T, d] fp16
        ids = torch.from_numpy(np.load(os.path.join(pool_dir, "ids.npy"))).to(dev)  # [T] int32
        self.config = SimpleNamespace(dim=int(self.pool.shape[1]))
        T, P = self.pool.shape[0], pool_lengths.numel()
        pool_cu = torch.zeros(P + 1, dtype=torch.int64)
        pool_cu[1:] = torch.cumsum(pool_lengths, 0)
        if int(pool_cu[-1]) != T or ids.numel() != T:
            raise ValueError(f"{pool_dir}: lengths sum to {int(pool_cu[-1])} tokens, tokens.npy has {T}, ids.npy {ids.numel()}")
        g = torch.Generator().manual_seed(_seed(self.seed, 0))
        self.lengths = pool_lengths[torch.randint(0, P, (self.num_docs,), generator=g)]  # [N] a pool passage's length
        self._start = pool_cu[:-1][torch.randint(0, P, (self.num_docs,), generator=g)]  # [N] the [CLS] it starts at
        pool_cu = pool_cu.to(dev)
        # [T] the [SEP] of each token's pool passage
        self._last = torch.repeat_interleave((pool_cu[1:] - 1).to(torch.int32), pool_lengths.to(dev))
        first = torch.zeros(T, dtype=torch.bool, device=dev)
        first[pool_cu[:-1]] = True
        last = torch.zeros(T, dtype=torch.bool, device=dev)
        last[pool_cu[1:] - 1] = True
        self._inner = ~(first | last)  # [T] neither [CLS] nor [SEP]: where a walk may stand
        # Jump targets: occurrences o whose next token is inner, grouped by o's wordpiece
        can_jump = torch.zeros(T, dtype=torch.bool, device=dev)
        can_jump[:-1] = self._inner[1:] & ~last[:-1]
        occ = torch.nonzero(can_jump).squeeze(1)  # [J]
        occ_word = ids[occ].long()  # [J]
        self._occ = occ[torch.argsort(occ_word, stable=True)].to(torch.int32)  # [J] sorted by wordpiece
        counts = torch.bincount(occ_word, minlength=int(ids.max()) + 1)  # [V]
        self._occ_first = torch.cumsum(counts, 0) - counts  # [V]
        self._occ_count = counts
        self._ids = ids
        del first, last, can_jump, occ, occ_word
        cu = torch.zeros(self.num_docs + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(self.lengths, 0)
        self.cu_seqlens = cu
        self.total_tokens = int(cu[-1])
        self._queries = None

    def release(self) -> None:
        """Free the pool and the walk's tables (after the last pass; searching wants the room)."""
        self.pool = self._ids = self._inner = self._last = self._occ = None
        self._occ_first = self._occ_count = None

    # ------------------------------------------------------------------ the walk
    def _block(self, b: int) -> torch.Tensor:
        """Pool token indices (int64, packed [t]) of block ``b``'s passages."""
        if self.pool is None:
            raise RuntimeError("released: the pool is gone")
        dev = self.device
        n0, n1 = b * BLOCK_DOCS, min(self.num_docs, (b + 1) * BLOCK_DOCS)
        lengths = self.lengths[n0:n1].to(dev)  # [B]
        g = torch.Generator(device=dev).manual_seed(_seed(self.seed, 1, b))
        width = int(lengths.max())
        walk = torch.empty(n1 - n0, width, dtype=torch.int64, device=dev)  # [B, L]
        pos = self._start[n0:n1].to(dev)  # [B] the [CLS] it starts at
        walk[:, 0] = pos
        for t in range(1, width):
            after = pos + 1
            jump = (torch.rand(pos.shape, device=dev, generator=g) < self.jump) | ~self._inner[after]
            word = self._ids[pos].long()
            # a wordpiece never followed by an inner token (seen only before [SEP]): any jump target
            count = self._occ_count[word]  # [B]
            anywhere = count == 0
            first = torch.where(anywhere, 0, self._occ_first[word])
            count = torch.where(anywhere, self._occ.numel(), count)
            pick = (torch.rand(pos.shape, device=dev, generator=g) * count).long().clamp_max_(count - 1)
            jumped = self._occ[first + pick].long() + 1
            pos = torch.where(jump | anywhere, jumped, after)
            walk[:, t] = torch.where(t == lengths - 1, self._last[pos].long(), pos)  # the last: its passage's [SEP]
        keep = torch.arange(width, device=dev)[None, :] < lengths[:, None]
        return walk[keep]

    def _token_index(self, n0: int, n1: int) -> torch.Tensor:
        """Pool token indices of passages [n0, n1), block by block."""
        parts = []
        for b in range(n0 // BLOCK_DOCS, (n1 - 1) // BLOCK_DOCS + 1):
            idx = self._block(b)
            base = int(self.cu_seqlens[b * BLOCK_DOCS])
            a = int(self.cu_seqlens[max(n0, b * BLOCK_DOCS)]) - base
            z = int(self.cu_seqlens[min(n1, (b + 1) * BLOCK_DOCS)]) - base
            parts.append(idx[a:z])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def slices(self, slice_docs: int | None = None):
        """Yield ``(first, tokens [t, d] fp16 on device, offsets [n + 1] int64 numpy from 0)``, as
        ``_passages.Passages.slices`` does; every pass gives the same tokens."""
        slice_docs = self.num_docs if slice_docs is None else max(1, int(slice_docs))
        cu = self.cu_seqlens.numpy()
        for first in range(0, self.num_docs, slice_docs):
            last = min(self.num_docs, first + slice_docs)
            tokens = self.pool[self._token_index(first, last)]
            yield first, tokens, cu[first:last + 1] - cu[first]

    # ------------------------------------------------------------------ queries
    def _query_file(self) -> str:
        tag = f"{self.num_docs}-{self.num_queries}-{self.jump:g}-{self.seed}"
        return os.path.join(self.pool_dir, f"spliced-queries-{tag}.npy")

    def queries(self):
        """(queries [Nq, 32, d] fp16, source [Nq] int64) on the device; encoded by MiniLM once and
        saved beside the pool."""
        if self._queries is None:
            path = self._query_file()
            source = torch.from_numpy(np.random.default_rng(_seed(self.seed, 2)).choice(
                self.num_docs, self.num_queries, replace=False).astype(np.int64))
            if os.path.exists(path):
                queries = torch.from_numpy(np.load(path))
            else:
                queries = self._encode_queries(source)
                np.save(path + ".tmp.npy", queries.numpy())
                os.replace(path + ".tmp.npy", path)
            self._queries = (queries.to(self.device), source.to(self.device))
        return self._queries

    def _encode_queries(self, source: torch.Tensor) -> torch.Tensor:
        rows = [self._ids[self._token_index(j, j + 1)].cpu().numpy() for j in source.tolist()]
        return encode_spans(rows, self.config.dim, int(self.pool_meta.get("seed", 0)), self.device,
                            np.random.default_rng(_seed(self.seed, 3)))


def encode_spans(rows: list, dim: int, basis_seed: int, device, rng: np.random.Generator) -> torch.Tensor:
    """Queries [len(rows), 32, dim] fp16 (CPU): from each passage's wordpieces (a row, [CLS] and
    [SEP] included) a run of up to SPAN_WORDPIECES from a random start, decoded to text and encoded
    by MiniLM to exactly 32 tokens, projected by ``real_passages.projection(dim, basis_seed)``."""
    import compressed_fidelity as fidelity
    from real_passages import encode, projection

    device = torch.device(device)
    tokenizer, model = fidelity.load_minilm()
    model = model.to(device)
    spans = []
    for row in rows:
        words = np.asarray(row)[1:-1]
        first = int(rng.integers(0, max(1, len(words) - SPAN_WORDPIECES // 2)))
        spans.append(tokenizer.decode(words[first:first + SPAN_WORDPIECES].tolist()))
    queries, _, _ = encode(spans, projection(dim, basis_seed, device), tokenizer, model, device, QUERY_LEN, 256,
                           exact_len=QUERY_LEN)
    return queries.reshape(len(spans), QUERY_LEN, dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", required=True, help="a folder of benchmarks/real_passages.py")
    ap.add_argument("--docs", type=int, required=True)
    ap.add_argument("--jump", type=float, default=JUMP)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    t0 = time.perf_counter()
    gen = SplicedPassages(args.pool, args.docs, device=args.device, num_queries=args.queries, jump=args.jump)
    for _ in gen.slices(1_000_000):
        pass
    queries, _ = gen.queries()
    print(json.dumps(dict(passages=gen.num_docs, tokens=gen.total_tokens, queries=list(queries.shape),
                          seconds=time.perf_counter() - t0)))


if __name__ == "__main__":
    main()
