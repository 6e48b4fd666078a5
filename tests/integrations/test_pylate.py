"""maxsim.integrations.pylate against the installed PyLate 1.6: every scoring function and entry
point gives PyLate's own torch-path results (``backend="torch"``), with and without patch().

Tolerances: PyLate's own backend parity tests (tests/test_scores_flash.py) accept 1e-3 in fp32
and 5e-2 in fp16; fp32 here must agree far tighter (1e-5), half precision to PyLate's 5e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pylate_scores = pytest.importorskip("pylate.scores")

from _shared import assert_grads_close, bindings, parameter_grads, relative_error  # noqa: E402

from maxsim.integrations import pylate as mp  # noqa: E402

TORCH = "torch"  # PyLate's own einsum path
SCORING_NAMES = {"colbert_scores", "colbert_kd_scores", "colbert_scores_pairwise", "rerank"}


@pytest.fixture(autouse=True)
def _always_unpatched():
    mp.unpatch()
    yield
    mp.unpatch()


def _masks(shape, kind: str) -> torch.Tensor:
    mask = torch.rand(shape) > 0.35
    mask[..., 0] = True
    if kind == "bool":
        return mask
    if kind == "int":
        return mask.long()
    return mask.float()


def _tol(dtype):
    return dict(atol=5e-2, rtol=5e-2) if dtype in (torch.float16, torch.bfloat16) else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "int", "float"])
def test_colbert_scores_matches_pylate(dtype, mask_kind):
    Q = torch.nn.functional.normalize(torch.randn(5, 9, 16), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(7, 13, 16), dim=-1).to(dtype)
    q_mask = None if mask_kind == "none" else _masks((5, 9), mask_kind)
    d_mask = None if mask_kind == "none" else _masks((7, 13), mask_kind)
    if d_mask is not None:
        d_mask[3] = 0  # a document with no real token: PyLate scores it 0 per query token
    library = pylate_scores.colbert_scores(Q, D, q_mask, d_mask, backend=TORCH)
    actual = mp.colbert_scores(Q, D, q_mask, d_mask)
    assert actual.shape == (5, 7)
    assert actual.dtype == library.dtype and actual.device == library.device
    torch.testing.assert_close(actual.double(), library.double(), **_tol(dtype))
    if dtype in (torch.float16, torch.bfloat16):
        # maxsim accumulates in fp32: closer to PyLate's rule evaluated in fp32 than PyLate's half path.
        in_fp32 = pylate_scores.colbert_scores(Q.float(), D.float(), q_mask, d_mask, backend=TORCH)
        torch.testing.assert_close(actual.float(), in_fp32, atol=1e-2, rtol=1e-2)


def test_multiply_rule_lets_masked_zero_win():
    # All real similarities negative: PyLate's masked token (similarity 0) wins the max.
    Q = torch.ones(1, 2, 4)
    D = -torch.rand(2, 3, 4) - 0.1
    d_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    expected = pylate_scores.colbert_scores(Q, D, None, d_mask, backend=TORCH)
    actual = mp.colbert_scores(Q, D, None, d_mask)
    torch.testing.assert_close(actual, expected)
    assert actual[0, 0] == 0 and actual[0, 1] < 0


@pytest.mark.parametrize("form", ["numpy", "list_of_arrays", "list_of_lists", "list_of_tensors"])
def test_input_forms(form):
    Q = torch.randn(3, 4, 8)
    D = torch.randn(5, 6, 8)
    convert = {
        "numpy": lambda t: t.numpy(),
        "list_of_arrays": lambda t: [row.numpy() for row in t],
        "list_of_lists": lambda t: t.tolist(),
        "list_of_tensors": lambda t: list(t),
    }[form]
    expected = pylate_scores.colbert_scores(convert(Q), convert(D), backend=TORCH)
    actual = mp.colbert_scores(convert(Q), convert(D))
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_colbert_kd_scores_matches_pylate(dtype):
    Q = torch.randn(4, 6, 16, dtype=dtype)
    D = torch.randn(4, 3, 10, 16, dtype=dtype)
    q_mask = _masks((4, 6), "float")
    d_mask = _masks((4, 3, 10), "bool")
    d_mask[1, 2] = False
    expected = pylate_scores.colbert_kd_scores(Q, D, q_mask, d_mask, backend=TORCH)
    actual = mp.colbert_kd_scores(Q, D, q_mask, d_mask)
    assert actual.shape == (4, 3) and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_colbert_scores_pairwise_tensors_and_ragged():
    Q = torch.randn(5, 7, 8)
    D = torch.randn(5, 11, 8)
    torch.testing.assert_close(mp.colbert_scores_pairwise(Q, D),
                               pylate_scores.colbert_scores_pairwise(Q, D, backend=TORCH), atol=1e-5, rtol=1e-5)
    queries = [torch.randn(n, 8) for n in (1, 7, 3, 32)]
    documents = [torch.randn(n, 8) for n in (5, 1, 40, 9)]
    expected = pylate_scores.colbert_scores_pairwise(queries, documents, backend=TORCH)
    torch.testing.assert_close(mp.colbert_scores_pairwise(queries, documents), expected, atol=1e-5, rtol=1e-5)
    as_numpy = [q.numpy() for q in queries], [d.numpy().astype(np.float64) for d in documents]
    actual = mp.colbert_scores_pairwise(*as_numpy)
    torch.testing.assert_close(actual.double(), expected.double(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="as many"):
        mp.colbert_scores_pairwise(queries, documents[:2])


@pytest.mark.parametrize("with_masks", [False, True])
def test_colbert_scores_class_query_major(with_masks):
    Q = torch.randn(4, 6, 8)
    D = torch.randn(4, 3, 9, 8)  # [Q_doc, N, Ld, d]
    q_mask = _masks((4, 6), "bool") if with_masks else None
    d_mask = _masks((4, 3, 9), "bool") if with_masks else None
    expected = pylate_scores.ColBERTScores()(Q, D, q_mask, d_mask, backend=TORCH)
    actual = mp.ColBERTScores()(Q, D, q_mask, d_mask)
    assert actual.shape == (4, 12)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_gradients_match_pylate():
    Q0 = torch.nn.functional.normalize(torch.randn(4, 8, 16), dim=-1)
    D0 = torch.nn.functional.normalize(torch.randn(6, 12, 16), dim=-1)
    d_mask = _masks((6, 12), "float")

    def run(function, **kwargs):
        Q = Q0.clone().requires_grad_(True)
        D = D0.clone().requires_grad_(True)
        scores = function(Q, D, None, d_mask, **kwargs)
        torch.nn.functional.cross_entropy(scores, torch.arange(4)).backward()
        return scores.detach(), Q.grad, D.grad

    expected = run(pylate_scores.colbert_scores, backend=TORCH)
    actual = run(mp.colbert_scores)
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-5


def test_backend_argument():
    Q, D = torch.randn(2, 3, 4), torch.randn(3, 5, 4)
    with pytest.raises(ValueError, match="backend"):
        mp.colbert_scores(Q, D, backend="nope")
    torch.testing.assert_close(mp.colbert_scores(Q, D, backend="torch"),
                               pylate_scores.colbert_scores(Q, D, backend="torch"))


def test_bad_input():
    with pytest.raises(ValueError, match="queries_embeddings"):
        mp.colbert_scores(torch.randn(3, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="documents_embeddings"):
        mp.colbert_kd_scores(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="queries_embeddings"):
        mp.colbert_scores("text", torch.randn(2, 3, 4))
    # masks hold 0 and 1 only: another value makes that query's scores NaN (no host synchronisation)
    scores = mp.colbert_scores(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.tensor([[1, 1, 1], [1, 0.5, 1]]))
    assert not torch.isnan(scores[0]).any() and torch.isnan(scores[1]).all()


# --- patch() / unpatch() ----------------------------------------------------------------------


def test_import_patches_nothing_and_patch_is_reversible():
    import pylate.evaluation  # noqa: F401  (patch() loads it: load it first to compare)
    import pylate.losses  # noqa: F401
    import pylate.rank  # noqa: F401
    from pylate.losses.distillation import Distillation
    from pylate.models import ColBERT
    from pylate.scores.colbert import ColBERTScores as PylateColBERTScores

    before = bindings("pylate", SCORING_NAMES)
    defaults = Distillation.__init__.__defaults__
    call = PylateColBERTScores.__dict__["__call__"]
    assert "similarity" not in ColBERT.__dict__
    assert all(value.__module__.startswith("pylate") for value in before.values())

    mp.patch()
    mp.patch()  # idempotent
    patched = bindings("pylate", SCORING_NAMES)
    assert patched.keys() == before.keys()
    for (module, name), value in patched.items():
        assert value is getattr(mp, name), (module, name)
    assert Distillation.__init__.__defaults__[0] is mp.colbert_kd_scores
    import pylate.rank.rank as rank_module

    assert rank_module.colbert_scores is mp.colbert_scores

    mp.unpatch()
    mp.unpatch()
    assert bindings("pylate", SCORING_NAMES) == before
    assert all(bindings("pylate", SCORING_NAMES)[key] is value for key, value in before.items())
    assert Distillation.__init__.__defaults__ is defaults
    assert PylateColBERTScores.__dict__["__call__"] is call
    assert "similarity" not in ColBERT.__dict__ and "similarity_pairwise" not in ColBERT.__dict__


def test_patched_entry_points_run_maxsim(monkeypatch):
    from pylate import rank
    from pylate.scores.colbert import ColBERTScores as PylateColBERTScores

    calls = []
    real = mp.maxsim.maxsim

    def counting(*args, **kwargs):
        calls.append(kwargs.get("mask_mode"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mp.maxsim, "maxsim", counting)
    real_pairs = mp.maxsim.score_pairs_packed
    monkeypatch.setattr(mp.maxsim, "score_pairs_packed", lambda *a, **k: calls.append("pairs") or real_pairs(*a, **k))
    Q, D = torch.randn(2, 4, 8), torch.randn(3, 2, 5, 8)
    scorer = PylateColBERTScores()  # made before patch(), like a loss's default metric
    expected = scorer(Q, D)
    queries = [torch.randn(4, 8), torch.randn(3, 8)]
    documents = [[torch.randn(n, 8) for n in (5, 2, 7)], [torch.randn(n, 8) for n in (1, 6)]]
    ids = [["a", "b", "c"], ["d", "e"]]
    expected_ranking = rank.rerank(ids, queries, documents)
    assert not calls
    mp.patch()
    actual = scorer(Q, D)
    assert calls == ["multiply"]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    ranking = rank.rerank(ids, queries, documents)
    assert calls == ["multiply", "pairs"]  # both queries' candidates in one packed call
    for got, want in zip(ranking, expected_ranking):
        assert [r["id"] for r in got] == [r["id"] for r in want]
        np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], rtol=1e-5, atol=1e-5)
    mp.unpatch()
    scorer(Q, D)
    rank.rerank(ids, queries, documents)
    assert len(calls) == 2


@pytest.mark.parametrize("form", ["tensors", "numpy", "padded queries"])
def test_rerank_matches_pylate(form):
    """rank.rerank: PyLate pads each query's candidates to its longest with zero rows, which take
    part in the max; mostly negative similarities make that rule decide many maxes."""
    from pylate import rank

    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    dim = 16
    q_lengths = [5, 9, 1, 7] if form != "padded queries" else [6] * 4
    queries = [torch.randn(n, dim, generator=generator) for n in q_lengths]
    documents = [[torch.randn(int(n), dim, generator=generator) - 0.3
                  for n in torch.randint(1, 12, (int(k),), generator=generator)]
                 for k in torch.randint(1, 9, (len(queries),), generator=generator)]
    documents[0][0] = torch.randn(11, dim, generator=generator) - 0.3  # a longest candidate, unpadded
    # an empty candidate beside non-empty ones (alone, PyLate's own max over nothing fails)
    documents[1].append(torch.empty(0, dim))
    ids = [[f"q{i}-d{j}" for j in range(len(candidates))] for i, candidates in enumerate(documents)]
    if form == "numpy":
        queries = [q.numpy() for q in queries]
        documents = [[c.numpy() for c in candidates] for candidates in documents]
    elif form == "padded queries":
        queries = torch.stack(queries)
    expected = rank.rerank(ids, queries, documents)
    mp.patch()
    actual = rank.rerank(ids, queries, documents)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        want_scores = {r["id"]: r["score"] for r in want}
        assert sorted(r["id"] for r in got) == sorted(want_scores)
        # the same order, except between candidates whose PyLate scores tie within rounding
        assert all(g["id"] == w["id"] or abs(want_scores[g["id"]] - w["score"]) < 1e-5 for g, w in zip(got, want))
        np.testing.assert_allclose([r["score"] for r in got], [want_scores[r["id"]] for r in got], rtol=1e-5, atol=1e-5)
        assert all(isinstance(r["score"], float) for r in got)
    with pytest.raises(ValueError, match="no candidate"):
        mp.rerank([[]], [torch.randn(3, dim)], [[]])


class _TinyColBERT(torch.nn.Module):
    """Stands in for pylate.models.ColBERT in the losses: token embeddings from an embedding
    table and a projection (parameters with gradients), PyLate's skiplist attributes."""

    skiplist = [3]
    do_query_expansion = False

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.project = torch.nn.Linear(24, 16)

    def forward(self, features):
        return {"token_embeddings": self.project(self.embed(features["input_ids"]))}


def _features(batch: int, length: int) -> dict:
    input_ids = torch.randint(0, 50, (batch, length))
    attention_mask = (torch.rand(batch, length) > 0.25).long()
    attention_mask[:, 0] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("loss_name", ["Contrastive", "Distillation"])
def test_losses_and_parameter_gradients_match(loss_name):
    from pylate import losses

    model = _TinyColBERT()
    if loss_name == "Contrastive":
        features = [_features(4, 6), _features(4, 9), _features(4, 9)]
        labels = None
    else:
        features = [_features(3, 6), _features(3 * 4, 9)]
        labels = torch.randn(3, 4)

    def step():
        model.zero_grad()
        loss = getattr(losses, loss_name)(model=model)  # the default score metric
        value = loss(features, labels)
        value.backward()
        return value.detach(), parameter_grads(model)

    expected_loss, expected_grads = step()
    mp.patch()
    actual_loss, actual_grads = step()
    torch.testing.assert_close(actual_loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(actual_grads, expected_grads)
