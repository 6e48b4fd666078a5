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
    # PyLate's own runs take its einsum path (not its CUDA kernel backends); ours set "auto"
    # (under "torch" the drop-in hands every call back to PyLate, as PyLate's variable says).
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    mp.unpatch()
    yield
    mp.unpatch()


def _use_maxsim(on: bool = True) -> None:
    """patch() and the backend variable at "auto" (maxsim's own path), or both back."""
    os.environ["PYLATE_SCORES_BACKEND"] = "auto" if on else "torch"
    if on:
        mp.patch()
    else:
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

    _use_maxsim()  # the model was loaded before: its similarity must follow
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
    _use_maxsim()
    actual_loss, actual_grads = step()
    torch.testing.assert_close(actual_loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(actual_grads, expected_grads, tolerance=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_workflow_train_encode_and_search_a_corpus(device, tmp_path):
    """A user's whole flow: a few Contrastive steps with patch(), the trained model encodes a
    corpus, ``maxsim.Corpus`` searches it; every step against unpatched PyLate from the same start
    (the same weights after training, the same top-10 as PyLate's exhaustive rerank). On the GPU,
    also PyLate's own PLAID index (fast-plaid) and ``maxsim.index`` over that index's files."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pylate import losses, models, rank

    import maxsim

    documents, queries = lee_corpus(40)

    def trained(patched: bool):
        torch.manual_seed(0)
        colbert = models.ColBERT(model_name_or_path=minilm_dir(), device=device, document_length=64)
        colbert.eval()  # no dropout: both runs see the same activations
        optimizer = torch.optim.SGD(colbert.parameters(), lr=1e-3)
        if patched:
            _use_maxsim()
        try:
            loss = losses.Contrastive(model=colbert)
            for step in range(3):
                pick = slice(4 * step, 4 * step + 4)
                features = [colbert.tokenize(queries[pick], is_query=True),
                            colbert.tokenize(documents[pick], is_query=False, pad=True),
                            colbert.tokenize(documents[20 + 4 * step:24 + 4 * step], is_query=False, pad=True)]
                features = [{key: value.to(device) for key, value in f.items()} for f in features]  # as a Trainer does
                optimizer.zero_grad()
                loss(features, None).backward()
                optimizer.step()
        finally:
            _use_maxsim(False)
        return colbert

    ours, theirs = trained(True), trained(False)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        # (cuBLAS may pick different reduction orders for the two runs' matmuls on the GPU)
        torch.testing.assert_close(a, b, atol=1e-5 if device == "cpu" else 1e-4, rtol=1e-4, msg=name)

    document_embeddings = ours.encode(documents, is_query=False, convert_to_tensor=False)
    query_embeddings = ours.encode(queries[:8], is_query=True)
    corpus = maxsim.Corpus.from_list([torch.as_tensor(d) for d in document_embeddings],
                                     ids=[f"doc-{j}" for j in range(len(documents))])
    result = corpus.search([torch.as_tensor(q) for q in query_embeddings], 10, progress=False, device=device)
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
    if device == "cuda":
        _plaid_index_agrees(document_embeddings, query_embeddings, expected, tmp_path)


def _plaid_index_agrees(document_embeddings, query_embeddings, exhaustive, tmp_path):
    """PyLate's PLAID index (fast-plaid) over the corpus, and ``maxsim.index`` over its files: the
    same top-1 for most queries as PyLate's index and as the exhaustive ranking."""
    pytest.importorskip("fast_plaid")
    from pylate import indexes

    import maxsim.index

    plaid = indexes.PLAID(index_folder=str(tmp_path), index_name="lee", override=True, nbits=4,
                          show_progress=False, device="cuda")
    plaid.add_documents(documents_ids=[str(j) for j in range(len(document_embeddings))],
                        documents_embeddings=document_embeddings)
    theirs = plaid(query_embeddings, k=10)
    index = maxsim.index.load(tmp_path / "lee" / "fast_plaid_index", device="cuda")
    queries = torch.stack([torch.as_tensor(q) for q in query_embeddings]).cuda()  # [8, 32, d]: expanded queries
    _, pids, _ = index.search(queries, k=10)
    for q in range(len(query_embeddings)):
        best = int(pids[q, 0])
        assert best in (int(theirs[q][0]["id"]), exhaustive[q][0]["id"]), (q, best, theirs[q][:3])
    # 40 documents under 4-bit residuals: the approximate top-1 is the exhaustive one for most queries
    assert sum(int(pids[q, 0]) == exhaustive[q][0]["id"] for q in range(len(query_embeddings))) >= 6
