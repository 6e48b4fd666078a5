"""End to end with a real model, offline: PyLate's ColBERT on the packaged all-MiniLM-L6-v2, over
articles of gensim's Lee corpus. Encode, rerank, model.similarity and one training step of each
loss give the same ranking, scores, losses and parameter gradients with patch() as PyLate's own
torch path."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("pylate.models")

from _shared import assert_grads_close, lee_corpus, minilm_dir, parameter_grads  # noqa: E402

from maxsim.integrations import pylate as mp  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from pylate import models

    torch.manual_seed(0)  # the ColBERT projection is initialised at random
    colbert = models.ColBERT(model_name_or_path=minilm_dir(), device="cpu", document_length=96)
    colbert.eval()  # no dropout: both paths see the same activations
    return colbert


@pytest.fixture(autouse=True)
def _pylate_torch_path(monkeypatch):
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    mp.unpatch()
    yield
    mp.unpatch()


def test_encode_rerank_similarity(model):
    from pylate import rank

    documents, queries = lee_corpus(24)
    document_embeddings = model.encode(documents, is_query=False, convert_to_tensor=False)
    query_embeddings = model.encode(queries[:6], is_query=True)
    ids = [list(range(len(documents)))] * 6
    per_query_documents = [document_embeddings] * 6
    expected = rank.rerank(ids, query_embeddings, per_query_documents)
    # model.similarity takes padded tensors (zero rows: 0 in PyLate's max, as in maxsim's multiply rule)
    padded_documents = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(d) for d in document_embeddings[:5]],
                                                       batch_first=True)
    padded_queries = torch.stack([torch.as_tensor(q) for q in query_embeddings[:2]])
    expected_similarity = model.similarity(padded_queries, padded_documents)

    mp.patch()  # the model was loaded before: its similarity must follow
    actual = rank.rerank(ids, query_embeddings, per_query_documents)
    for got, want in zip(actual, expected):
        assert [r["id"] for r in got] == [r["id"] for r in want]
        torch.testing.assert_close(torch.tensor([r["score"] for r in got]), torch.tensor([r["score"] for r in want]),
                                   atol=1e-4, rtol=1e-5)
    # A query made of an article's opening words finds that article among the first few.
    assert sum(q in [r["id"] for r in actual[q][:3]] for q in range(6)) >= 4
    similarity = model.similarity(padded_queries, padded_documents)
    torch.testing.assert_close(similarity, expected_similarity, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("loss_name", ["Contrastive", "CachedContrastive", "Distillation"])
def test_training_step(model, loss_name):
    from pylate import losses

    documents, queries = lee_corpus(12)
    query_features = model.tokenize(queries[:4], is_query=True)
    if loss_name == "Distillation":
        features = [query_features, model.tokenize(documents[:12], is_query=False, pad=True)]  # 3 candidates a query
        labels = torch.randn(4, 3)
    else:
        positives, negatives = documents[:4], documents[4:8]
        features = [query_features, model.tokenize(positives, is_query=False, pad=True),
                    model.tokenize(negatives, is_query=False, pad=True)]
        labels = None
    extra = {"mini_batch_size": 2} if loss_name == "CachedContrastive" else {}

    def step():
        model.zero_grad()
        loss = getattr(losses, loss_name)(model=model, **extra)
        value = loss(features, labels)
        value.backward()
        return value.detach(), parameter_grads(model)

    expected_loss, expected_grads = step()
    mp.patch()
    actual_loss, actual_grads = step()
    torch.testing.assert_close(actual_loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(actual_grads, expected_grads, tolerance=1e-4)


def test_workflow_train_encode_and_search_a_corpus():
    """A user's whole flow at toy size: a few Contrastive steps with patch(), the trained model
    encodes a corpus, ``maxsim.Corpus`` searches it; every step against unpatched PyLate from the
    same start (the same weights after training, the same top-10 as PyLate's exhaustive rerank).
    (PyLate's PLAID index needs fast-plaid, which has no build for this torch: not here.)"""
    from pylate import losses, models, rank

    import maxsim

    documents, queries = lee_corpus(40)

    def trained(patched: bool):
        torch.manual_seed(0)
        colbert = models.ColBERT(model_name_or_path=minilm_dir(), device="cpu", document_length=64)
        colbert.eval()  # no dropout: both runs see the same activations
        optimizer = torch.optim.SGD(colbert.parameters(), lr=1e-3)
        if patched:
            mp.patch()
        try:
            loss = losses.Contrastive(model=colbert)
            for step in range(3):
                pick = slice(4 * step, 4 * step + 4)
                features = [colbert.tokenize(queries[pick], is_query=True),
                            colbert.tokenize(documents[pick], is_query=False, pad=True),
                            colbert.tokenize(documents[20 + 4 * step:24 + 4 * step], is_query=False, pad=True)]
                optimizer.zero_grad()
                loss(features, None).backward()
                optimizer.step()
        finally:
            mp.unpatch()
        return colbert

    ours, theirs = trained(True), trained(False)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)

    document_embeddings = ours.encode(documents, is_query=False, convert_to_tensor=False)
    query_embeddings = ours.encode(queries[:8], is_query=True)
    corpus = maxsim.Corpus.from_list([torch.as_tensor(d) for d in document_embeddings],
                                     ids=[f"doc-{j}" for j in range(len(documents))])
    result = corpus.search([torch.as_tensor(q) for q in query_embeddings], 10, progress=False)
    # PyLate, unpatched, exhaustively: every document reranked for every query
    expected = rank.rerank([list(range(len(documents)))] * 8, query_embeddings, [document_embeddings] * 8)
    for q in range(8):
        want = [r["id"] for r in expected[q][:10]]
        got = result.indices[q].tolist()
        # the same documents in the same order, except where PyLate's own scores tie within rounding
        scores = {r["id"]: r["score"] for r in expected[q]}
        assert all(g == w or abs(scores[g] - scores[w]) < 1e-4 for g, w in zip(got, want)), (q, got, want)
        assert result.ids[q][0] == f"doc-{got[0]}"
    assert sum(q in result.indices[q, :3].tolist() for q in range(8)) >= 5  # queries find their article
