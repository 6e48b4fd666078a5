"""benchmarks/spliced_passages.py on a small pool made here (CPU): the walk's passages are made of
pool bigrams between a [CLS] and a [SEP], their tokens are the pool's vectors, and the corpus does
not depend on how it is sliced. Nothing here times anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import spliced_passages  # noqa: E402
from spliced_passages import SplicedPassages  # noqa: E402

CLS, SEP = 101, 102


def make_pool(folder: Path, passages: int = 40, dim: int = 8, vocab: int = 30, seed: int = 0) -> dict:
    """A pool folder as real_passages.py writes it: [CLS] w... [SEP] passages of 2-12 wordpieces."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 13, passages)
    ids = []
    for n in lengths:
        ids += [CLS] + rng.integers(1000, 1000 + vocab, n - 2).tolist() + [SEP]
    ids = np.array(ids, dtype=np.int32)
    tokens = rng.standard_normal((ids.size, dim)).astype(np.float16)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "tokens.npy", tokens)
    np.save(folder / "lengths.npy", lengths.astype(np.int64))
    np.save(folder / "ids.npy", ids)
    (folder / "meta.json").write_text(json.dumps(dict(seed=0)))
    return dict(tokens=tokens, lengths=lengths, ids=ids)


@pytest.fixture
def pool(tmp_path):
    return tmp_path / "pool", make_pool(tmp_path / "pool")


def _index_of(gen, n0, n1):
    return gen._token_index(n0, n1)


@pytest.mark.parametrize("jump", [0.0, 0.5, 1.0])
def test_passages_are_pool_bigrams_between_cls_and_sep(pool, jump, monkeypatch):
    folder, data = pool
    monkeypatch.setattr(spliced_passages, "BLOCK_DOCS", 7)  # several blocks
    gen = SplicedPassages(str(folder), 60, jump=jump, seed=3)
    idx = _index_of(gen, 0, 60)
    assert idx.numel() == gen.total_tokens
    words = data["ids"][idx.numpy()]
    bigrams = set(zip(data["ids"][:-1].tolist(), data["ids"][1:].tolist()))
    cu = gen.cu_seqlens.numpy()
    for n in range(60):
        w = words[cu[n]:cu[n + 1]]
        assert len(w) == int(gen.lengths[n]) >= 2
        assert w[0] == CLS and w[-1] == SEP
        assert not np.isin(w[1:-1], [CLS, SEP]).any()
        inner = list(zip(w[:-2].tolist(), w[1:-1].tolist()))  # every step but the forced [SEP]
        assert set(inner) <= bigrams, f"passage {n}: a step that is no pool bigram"
    lengths = set(data["lengths"].tolist())
    assert set(gen.lengths.tolist()) <= lengths


def test_no_jump_copies_pool_runs(pool):
    """jump 0: a passage moves to the next pool token unless that is its pool passage's [SEP]."""
    folder, data = pool
    gen = SplicedPassages(str(folder), 30, jump=0.0, seed=1)
    idx = _index_of(gen, 0, 30).numpy()
    cu = gen.cu_seqlens.numpy()
    ends = set((np.cumsum(data["lengths"]) - 1).tolist())
    for n in range(30):
        run = idx[cu[n]:cu[n + 1] - 1]
        steps = np.diff(run)
        # every step that is not +1 leaves a token whose successor is a [SEP]
        for a, step in zip(run[:-1], steps):
            assert step == 1 or a + 1 in ends


def test_tokens_are_the_pool_vectors_and_slicing_does_not_matter(pool, monkeypatch):
    folder, data = pool
    monkeypatch.setattr(spliced_passages, "BLOCK_DOCS", 9)
    gen = SplicedPassages(str(folder), 50, jump=0.3)
    (first, whole, offsets), = list(gen.slices())
    assert first == 0 and np.array_equal(offsets, gen.cu_seqlens.numpy())
    assert torch.equal(whole, torch.from_numpy(data["tokens"])[_index_of(gen, 0, 50)])
    parts = list(gen.slices(4))
    assert [p[0] for p in parts] == list(range(0, 50, 4))
    assert torch.equal(torch.cat([p[1] for p in parts]), whole)
    again = SplicedPassages(str(folder), 50, jump=0.3)
    assert torch.equal(next(again.slices())[1], whole)
    a, b = _index_of(gen, 0, 50), _index_of(SplicedPassages(str(folder), 50, jump=0.3, seed=1), 0, 50)
    m = min(a.numel(), b.numel())
    assert not torch.equal(a[:m], b[:m])  # another seed, another corpus


def test_saved_queries_are_read_back_without_the_model(pool):
    folder, _ = pool
    gen = SplicedPassages(str(folder), 20, num_queries=3)
    saved = torch.randn(3, spliced_passages.QUERY_LEN, 8).half()
    np.save(gen._query_file(), saved.numpy())
    queries, source = gen.queries()
    assert torch.equal(queries, saved)
    assert source.shape == (3,) and int(source.max()) < 20 and source.unique().numel() == 3


def test_a_pool_without_wordpieces_or_released_is_a_clear_error(pool):
    folder, _ = pool
    (folder / "ids.npy").unlink()
    with pytest.raises(FileNotFoundError, match="ids.npy"):
        SplicedPassages(str(folder), 10)
    make_pool(folder)
    gen = SplicedPassages(str(folder), 10)
    gen.release()
    with pytest.raises(RuntimeError, match="released"):
        next(gen.slices())
    with pytest.raises(ValueError, match="probability"):
        SplicedPassages(str(folder), 10, jump=1.5)
