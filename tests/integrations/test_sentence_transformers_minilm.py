"""End to end with a real model, offline: Sentence Transformers 6's MultiVectorEncoder on the
packaged all-MiniLM-L6-v2, over articles of gensim's Lee corpus. model.similarity (of a model
loaded before patch()) and one training step of each multi-vector loss give the same scores,
ranking, losses and parameter gradients as Sentence Transformers' own path."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("sentence_transformers", minversion="6.0")

from _shared import assert_grads_close, lee_corpus, minilm_dir, parameter_grads  # noqa: E402

from maxsim.integrations import sentence_transformers as ms  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from sentence_transformers import MultiVectorEncoder

    torch.manual_seed(0)  # the projection is initialised at random
    encoder = MultiVectorEncoder(minilm_dir(), device="cpu")
    encoder.max_seq_length = 96
    encoder.eval()
    return encoder


@pytest.fixture(autouse=True)
def _always_unpatched():
    ms.unpatch()
    yield
    ms.unpatch()


def test_similarity_and_ranking(model):
    documents, queries = lee_corpus(24)
    document_embeddings = model.encode_document(documents)
    query_embeddings = model.encode_query(queries[:6])
    expected = model.similarity(query_embeddings, document_embeddings)
    expected_pairs = model.similarity_pairwise(query_embeddings, document_embeddings[:6])
    ms.patch()
    actual = model.similarity(query_embeddings, document_embeddings)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(actual.argsort(dim=1, descending=True)[:, :5], expected.argsort(dim=1, descending=True)[:, :5])
    torch.testing.assert_close(model.similarity_pairwise(query_embeddings, document_embeddings[:6]), expected_pairs,
                               atol=1e-4, rtol=1e-5)
    # A query made of an article's opening words ranks that article first or close.
    assert sum(q in actual[q].topk(3).indices.tolist() for q in range(6)) >= 4


@pytest.mark.parametrize(
    "loss_name",
    ["MultiVectorMultipleNegativesRankingLoss", "CachedMultiVectorMultipleNegativesRankingLoss",
     "MultiVectorDistillKLDivLoss", "MultiVectorMarginMSELoss"],
)
def test_training_step(model, loss_name):
    from sentence_transformers.multi_vector_encoder import losses

    documents, queries = lee_corpus(12)
    features = [model.preprocess(queries[:4]), model.preprocess(documents[:4]), model.preprocess(documents[4:8])]
    labels = {"MultiVectorDistillKLDivLoss": torch.randn(4, 2), "MultiVectorMarginMSELoss": torch.randn(4)}.get(loss_name)
    extra = {"mini_batch_size": 2} if loss_name.startswith("Cached") else {}

    def step():
        model.zero_grad()
        loss = getattr(losses, loss_name)(model, **extra)
        value = loss([dict(f) for f in features], labels)
        value.backward()
        return value.detach(), parameter_grads(model)

    expected_loss, expected_grads = step()
    ms.patch()
    actual_loss, actual_grads = step()
    torch.testing.assert_close(actual_loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(actual_grads, expected_grads, tolerance=1e-4)
