"""maxsim.integrations.colpali against the installed colpali-engine 0.3.18: scores, the
late-interaction losses and their gradients, ``processor.score``, with and without patch()."""

from __future__ import annotations

import pytest
import torch

colpali_maxsim = pytest.importorskip("colpali_engine.utils.maxsim")

from _shared import bindings, relative_error  # noqa: E402

from maxsim.integrations import colpali as mc  # noqa: E402

NAMES = {"maxsim_inbatch", "maxsim_kd"}


@pytest.fixture(autouse=True)
def _auto_backend_and_unpatched(monkeypatch):
    # auto: maxsim for the drop-in; colpali's own functions take their einsum path on CPU tensors
    monkeypatch.delenv("COLPALI_SCORES_BACKEND", raising=False)
    mc.unpatch()
    yield
    mc.unpatch()


def _processor_base():
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    return BaseVisualRetrieverProcessor


def _reference_scores(*args, **kwargs):
    """colpali's own score_multi_vector on its einsum path: under auto it would take
    late-interaction-kernels (TF32) wherever CUDA and that package are there."""
    import os

    os.environ["COLPALI_SCORES_BACKEND"] = "torch"
    try:
        return _processor_base().score_multi_vector(*args, **kwargs)
    finally:
        del os.environ["COLPALI_SCORES_BACKEND"]


def _ragged(lengths, dim=16, shift=0.0):
    return [torch.nn.functional.normalize(torch.randn(n, dim), dim=-1) + shift for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inbatch_and_kd(dtype):
    Q = torch.randn(4, 7, 16).to(dtype)
    D = torch.randn(5, 9, 16).to(dtype)
    D[1, 6:] = 0  # zero padding takes part in the max at 0
    C = torch.randn(4, 3, 9, 16).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=5e-2)
    for ours, theirs, docs in ((mc.maxsim_inbatch, colpali_maxsim.maxsim_inbatch, D), (mc.maxsim_kd, colpali_maxsim.maxsim_kd, C)):
        expected = theirs(Q, docs)
        actual = ours(Q, docs)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual.float(), expected.float(), **tol)
    with pytest.raises(ValueError, match="doc"):
        mc.maxsim_kd(Q, D)
    with pytest.raises(TypeError, match="query"):
        mc.maxsim_inbatch(Q.tolist(), D)


def test_the_backend_variable_keeps_its_meaning(monkeypatch):
    calls = []
    for name in ("maxsim", "maxsim_varlen"):
        monkeypatch.setattr(mc.maxsim, name, lambda *a, **k: calls.append(1) or torch.zeros(0))
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 5, 8)
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")  # colpali's own path, not maxsim
    assert torch.equal(mc.maxsim_inbatch(Q, D), colpali_maxsim.maxsim_inbatch(Q, D)) and not calls
    assert torch.equal(mc.score_multi_vector(list(Q), list(D), device="cpu"),
                       _processor_base().score_multi_vector(list(Q), list(D), device="cpu")) and not calls
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "tensorrt")
    with pytest.raises(ValueError, match="COLPALI_SCORES_BACKEND"):
        mc.maxsim_kd(Q, D[None])


@pytest.mark.parametrize("batch_size", [1, 2, 3, 128])
def test_score_multi_vector_reproduces_chunked_padding(batch_size):
    # Mostly negative similarities, so whether a zero padding row is in a passage's max matters.
    queries = _ragged((3, 6, 1, 4))
    # An empty passage alone in its chunk makes colpali's amax fail: keep it beside others there.
    lengths = (5, 12, 2, 8, 0, 3, 1, 9) if batch_size > 1 else (5, 12, 2, 8, 3, 1, 9)
    passages = _ragged(lengths, shift=-0.4)
    expected = _reference_scores(queries, passages, batch_size=batch_size)
    actual = mc.score_multi_vector(queries, passages, batch_size=batch_size)
    assert actual.dtype == torch.float32 and actual.device.type == "cpu" and actual.shape == (4, len(lengths))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    if batch_size == 1:  # where colpali raises, an empty passage scores 0 (maxsim's empty-set rule)
        alone = mc.score_multi_vector(queries, [torch.randn(3, 16), torch.zeros(0, 16)], batch_size=1)
        assert torch.equal(alone[:, 1], torch.zeros(4))


def test_score_multi_vector_depends_on_chunking_like_colpali():
    queries = _ragged((4, 4))
    passages = _ragged((2, 10, 2, 2), shift=-0.5)
    small, large = (mc.score_multi_vector(queries, passages, batch_size=b) for b in (1, 4))
    assert not torch.allclose(small, large)  # the test inputs do exercise the padding rule
    torch.testing.assert_close(small, _reference_scores(queries, passages, batch_size=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(large, _reference_scores(queries, passages, batch_size=4), atol=1e-5, rtol=1e-5)


def test_score_multi_vector_padded_tensors_and_errors():
    Q = torch.randn(3, 5, 16)
    P = torch.randn(6, 7, 16)
    torch.testing.assert_close(mc.score_multi_vector(Q, P, batch_size=4), _reference_scores(Q, P, batch_size=4),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="No queries"):
        mc.score_multi_vector([], P)
    with pytest.raises(ValueError, match="No passages"):
        mc.score_multi_vector(Q, [])
    with pytest.raises(ValueError, match="batch_size"):
        mc.score_multi_vector(Q, P, batch_size=0)


def _loss_classes():
    from colpali_engine.loss import late_interaction_losses as losses

    return losses


@pytest.mark.parametrize(
    "loss_name, negatives",
    [("ColbertLoss", False), ("ColbertPairwiseCELoss", False), ("ColbertSigmoidLoss", False),
     ("ColbertNegativeCELoss", True), ("ColbertPairwiseNegativeCELoss", True)],
)
def test_losses_and_gradients_match(loss_name, negatives):
    losses = _loss_classes()
    queries0 = torch.nn.functional.normalize(torch.randn(4, 6, 16), dim=-1)
    docs0 = torch.nn.functional.normalize(torch.randn(4, 10, 16), dim=-1)
    docs0[2, 7:] = 0
    negatives0 = torch.nn.functional.normalize(torch.randn(4, 3, 10, 16), dim=-1)

    def step():
        tensors = [t.clone().requires_grad_(True) for t in (queries0, docs0, negatives0)]
        loss = getattr(losses, loss_name)()
        args = tensors if negatives else tensors[:2]
        value = loss(*args)
        value.backward()
        return value.detach(), [t.grad for t in args]

    expected_loss, expected_grads = step()
    mc.patch()
    actual_loss, actual_grads = step()
    torch.testing.assert_close(actual_loss, expected_loss, atol=1e-5, rtol=1e-5)
    # Zero padding rows tie at similarity 0: torch's amax splits a tie's gradient among them,
    # maxsim gives it to the first. Real rows must match; padding rows of a document in total.
    real_rows = docs0.ne(0).any(dim=-1)  # [B, Ld]
    for actual, expected in zip(actual_grads, expected_grads):
        if actual.shape == docs0.shape:
            assert relative_error(actual[real_rows], expected[real_rows]) < 1e-4
            padding = (~real_rows).unsqueeze(-1)
            torch.testing.assert_close((actual * padding).sum(1), (expected * padding).sum(1), atol=1e-5, rtol=1e-4)
        else:
            assert relative_error(actual, expected) < 1e-4


def test_patch_reaches_processor_score_and_is_reversible(monkeypatch):
    import colpali_engine.loss.late_interaction_losses  # noqa: F401
    from colpali_engine.models import ColPaliProcessor

    Base = _processor_base()
    before = bindings("colpali_engine", NAMES)
    original = Base.__dict__["score_multi_vector"]
    # A processor without its tokenizer (that would need the hub): score() only calls score_multi_vector.
    processor = ColPaliProcessor.__new__(ColPaliProcessor)
    queries, passages = _ragged((3, 5)), _ragged((4, 9, 2), shift=-0.3)
    expected = processor.score(queries, passages, device="cpu")

    calls = []
    real = mc.maxsim.maxsim
    monkeypatch.setattr(mc.maxsim, "maxsim", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_varlen = mc.maxsim.maxsim_varlen  # score_multi_vector's packed path
    monkeypatch.setattr(mc.maxsim, "maxsim_varlen", lambda *a, **k: calls.append(2) or real_varlen(*a, **k))
    mc.patch()
    mc.patch()
    assert all(value is getattr(mc, name) for (_, name), value in bindings("colpali_engine", NAMES).items())
    actual = processor.score(queries, passages, device="cpu")
    assert calls
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    mc.unpatch()
    assert Base.__dict__["score_multi_vector"] is original
    after = bindings("colpali_engine", NAMES)
    assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items())
