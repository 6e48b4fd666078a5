"""maxsim.integrations.sentence_transformers against the installed Sentence Transformers 6.2:
util.maxsim / maxsim_pairwise, the ColBERT scoring functions and the patch() bindings. The model
and loss tests with the packaged MiniLM are in test_sentence_transformers_minilm.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers", minversion="6.0")
from sentence_transformers.multi_vector_encoder import scoring  # noqa: E402
from sentence_transformers.util import similarity as st_similarity  # noqa: E402

from _shared import bindings, relative_error  # noqa: E402

from maxsim.integrations import sentence_transformers as ms  # noqa: E402

NAMES = {"maxsim", "maxsim_pairwise", "colbert_scores", "colbert_kd_scores", "colbert_scores_pairwise"}
EXACT = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _always_unpatched():
    ms.unpatch()
    yield
    ms.unpatch()


def _padded(batch, length, dim=16, real=None):
    x = torch.nn.functional.normalize(torch.randn(batch, length, dim), dim=-1)
    if real is not None:
        for i, n in enumerate(real):
            x[i, n:] = 0
    return x


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("masks", ["none", "bool", "float"])
def test_maxsim_padded(length_normalize, masks):
    a = _padded(4, 7, real=(7, 3, 5, 1))
    b = _padded(6, 9, real=(9, 2, 0, 4, 9, 6))  # document 2 has no real token: -1e9
    a_mask = b_mask = None
    if masks != "none":
        a_mask = torch.rand(4, 7) > 0.3
        b_mask = torch.rand(6, 9) > 0.3
        b_mask[1] = False
        if masks == "float":
            a_mask, b_mask = a_mask.float(), b_mask.float()
    expected = st_similarity.maxsim(a, b, a_mask, b_mask, length_normalize=length_normalize)
    actual = ms.maxsim(a, b, a_mask, b_mask, length_normalize=length_normalize)
    assert actual.dtype == torch.float32 and actual.shape == (4, 6)
    torch.testing.assert_close(actual, expected, **EXACT)
    assert (actual < -1e8).any()


def test_exclude_rule_differs_from_multiply():
    a = torch.ones(1, 2, 4)
    b = -torch.rand(1, 3, 4) - 0.1
    b_mask = torch.tensor([[True, True, False]])
    actual = ms.maxsim(a, b, None, b_mask)
    torch.testing.assert_close(actual, st_similarity.maxsim(a, b, None, b_mask))
    assert actual[0, 0] < 0  # the masked token never wins (PyLate's rule would give 0)


def test_ragged_lists_single_items_numpy_and_half():
    queries = [torch.randn(n, 16) for n in (3, 8, 1)]
    documents = [torch.randn(n, 16) for n in (4, 0, 11, 2)]
    for length_normalize in (False, True):
        torch.testing.assert_close(ms.maxsim(queries, documents, length_normalize=length_normalize),
                                   st_similarity.maxsim(queries, documents, length_normalize=length_normalize), **EXACT)
    torch.testing.assert_close(ms.maxsim(queries[1], documents[2]), st_similarity.maxsim(queries[1], documents[2]), **EXACT)
    assert ms.maxsim(queries[1], documents[2]).shape == (1, 1)
    a_np, b_np = _padded(3, 5).numpy(), _padded(4, 6).numpy()
    torch.testing.assert_close(ms.maxsim(a_np, b_np), st_similarity.maxsim(a_np, b_np), **EXACT)
    a16, b16 = _padded(3, 5).bfloat16(), _padded(4, 6).bfloat16()
    expected = st_similarity.maxsim(a16.float(), b16.float())  # maxsim's products are exact in fp32
    torch.testing.assert_close(ms.maxsim(a16, b16), expected, **EXACT)
    assert relative_error(ms.maxsim(a16, b16), st_similarity.maxsim(a16, b16)) < 5e-2
    half_lists = ms.maxsim([q.half() for q in queries], [d.half() for d in documents])  # packed, no padding
    assert half_lists.dtype == torch.float32
    torch.testing.assert_close(half_lists, st_similarity.maxsim([q.half().float() for q in queries],
                                                                [d.half().float() for d in documents]), **EXACT)
    per_item_masks = [torch.ones(3), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]), torch.ones(1)]
    torch.testing.assert_close(ms.maxsim(queries, documents, a_mask=per_item_masks),
                               st_similarity.maxsim(queries, documents, a_mask=per_item_masks), **EXACT)


def test_empty_and_bad_inputs():
    b = _padded(3, 4)
    assert ms.maxsim([], b).shape == (0, 3)
    assert ms.maxsim_pairwise([], []).shape == (0,)
    with pytest.raises(ValueError, match="same number"):
        ms.maxsim_pairwise(_padded(2, 3), b)
    with pytest.raises(ValueError, match="b_mask"):
        ms.maxsim(_padded(2, 3), b, b_mask=torch.ones(3, 5))
    with pytest.raises(TypeError, match="a_mask"):
        ms.maxsim(_padded(2, 3), b, a_mask="mask")


@pytest.mark.parametrize("length_normalize", [False, True])
def test_pairwise_and_scoring_functions(length_normalize):
    kw = dict(length_normalize=length_normalize)
    a = _padded(4, 6, real=(6, 2, 4, 3))
    b = _padded(4, 8, real=(8, 5, 0, 1))
    torch.testing.assert_close(ms.maxsim_pairwise(a, b, **kw), st_similarity.maxsim_pairwise(a, b, **kw), **EXACT)
    queries = [torch.randn(n, 16) for n in (3, 8, 1)]
    documents = [torch.randn(n, 16) for n in (4, 1, 11)]
    torch.testing.assert_close(ms.maxsim_pairwise(queries, documents, **kw),
                               st_similarity.maxsim_pairwise(queries, documents, **kw), **EXACT)
    stacked = _padded(4 * 3, 8, real=[8, 5, 2, 7] * 3).reshape(4, 3, 8, 16)  # [Q_doc, N, Ld, d]
    q_mask = torch.rand(4, 6) > 0.2
    d_mask = torch.rand(4, 3, 8) > 0.3
    for masks in ((None, None), (q_mask, d_mask)):
        torch.testing.assert_close(ms.colbert_scores(a, stacked, *masks, **kw),
                                   scoring.colbert_scores(a, stacked, *masks, **kw), **EXACT)
        torch.testing.assert_close(ms.colbert_kd_scores(a, stacked, *masks, **kw),
                                   scoring.colbert_kd_scores(a, stacked, *masks, **kw), **EXACT)
    torch.testing.assert_close(ms.colbert_scores_pairwise(a, b, q_mask, None, **kw),
                               scoring.colbert_scores_pairwise(a, b, q_mask, None, **kw), **EXACT)


def test_gradients_match():
    a0, b0 = _padded(3, 5), _padded(4, 7, real=(7, 3, 6, 2))
    mask = torch.rand(4, 7) > 0.2
    mask[:, 0] = True

    def run(function):
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        scores = function(a, b, None, mask)
        torch.nn.functional.cross_entropy(scores, torch.tensor([0, 1, 2])).backward()
        return scores.detach(), a.grad, b.grad

    for actual, expected in zip(run(ms.maxsim), run(st_similarity.maxsim)):
        assert relative_error(actual, expected) < 1e-5


def test_patch_bindings_and_restore():
    import sentence_transformers.multi_vector_encoder.evaluation  # noqa: F401  (patch() loads these:
    import sentence_transformers.multi_vector_encoder.losses  # noqa: F401     load first to compare)
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoder
    from sentence_transformers.util import SimilarityFunction

    before = bindings("sentence_transformers", NAMES)
    methods = {name: MultiVectorEncoder.__dict__[name] for name in ("similarity", "similarity_pairwise")}
    ms.patch()
    ms.patch()
    patched = bindings("sentence_transformers", NAMES)
    assert patched.keys() == before.keys()
    for (module, name), value in patched.items():
        assert value is getattr(ms, name), (module, name)
    assert SimilarityFunction.to_similarity_fn("maxsim") is ms.maxsim
    assert SimilarityFunction.to_similarity_pairwise_fn("maxsim") is ms.maxsim_pairwise
    a, b = _padded(2, 4), _padded(3, 5)
    torch.testing.assert_close(st_similarity.mean_maxsim(a, b), ms.maxsim(a, b, length_normalize=True), **EXACT)
    ms.unpatch()
    ms.unpatch()
    after = bindings("sentence_transformers", NAMES)
    assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items())
    assert all(MultiVectorEncoder.__dict__[name] is method for name, method in methods.items())
    assert SimilarityFunction.to_similarity_fn("maxsim") is st_similarity.maxsim
