"""GPU tier: the integrations on CUDA tensors (Triton kernels) at real shapes, against each
library's own torch path on the same GPU. Skipped without CUDA; each test skips when its library
is not installed."""

from __future__ import annotations

import pytest
import torch

from _shared import relative_error

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _unit(*shape, dtype=torch.float32):
    return torch.nn.functional.normalize(torch.randn(*shape, device=CUDA), dim=-1).to(dtype)


def _near_ties(Q, D, gap=2e-6):
    """In-batch Q [Nq, Lq, d] x D [Nd, Ld, d]: (query rows [Nq, Lq], document rows [Nd, Ld]) whose
    gradient depends on a winner within ``gap`` of the runner-up (float64). Any product that holds
    fp32's accuracy (~1e-6 relative) may pick either token there, so those rows are left out."""
    sim = torch.einsum("and,bmd->abnm", Q.double(), D.double())  # [Nq, Nd, Lq, Ld]
    top = sim.topk(2, dim=-1)
    tie = (top.values[..., 0] - top.values[..., 1]) < gap  # [Nq, Nd, Lq]
    d_rows = torch.zeros(D.shape[:2], dtype=torch.bool, device=D.device)
    a, b, n = tie.nonzero(as_tuple=True)
    for k in (0, 1):
        d_rows[b, top.indices[a, b, n, k]] = True
    return tie.any(1), d_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pylate_scores_kd_and_training_gradients(dtype):
    pylate_scores = pytest.importorskip("pylate.scores")
    from maxsim.integrations import pylate as mp

    Q, D = _unit(32, 32, 128, dtype=dtype), _unit(256, 180, 128, dtype=dtype)
    q_mask = torch.rand(32, 32, device=CUDA) > 0.1
    d_mask = (torch.rand(256, 180, device=CUDA) > 0.3).float()
    # fp32 scores for every input dtype, as PyLate's kernel backends return them; against its torch
    # path on the same values widened to fp32 (16-bit products are exact there), at the backends'
    # parity tolerance
    tol = dict(atol=1e-4, rtol=1e-4)
    expected = pylate_scores.colbert_scores(Q.float(), D.float(), q_mask, d_mask, backend="torch")
    actual = mp.colbert_scores(Q, D, q_mask, d_mask)
    assert actual.dtype == torch.float32 and actual.device == expected.device
    torch.testing.assert_close(actual, expected, **tol)
    C = _unit(32, 16, 180, 128, dtype=dtype)
    c_mask = torch.rand(32, 16, 180, device=CUDA) > 0.3
    torch.testing.assert_close(mp.colbert_kd_scores(Q, C, q_mask, c_mask),
                               pylate_scores.colbert_kd_scores(Q.float(), C.float(), q_mask, c_mask, backend="torch"),
                               **tol)

    if dtype != torch.float32:
        return
    # A Contrastive-shaped step: in-batch ColBERTScores, fp32, gradients into both sides.
    Q0, D0 = _unit(32, 32, 128), _unit(32, 2, 180, 128)
    stacked_mask = torch.rand(32, 2, 180, device=CUDA) > 0.3

    def step(scorer, **kwargs):
        queries, documents = Q0.clone().requires_grad_(True), D0.clone().requires_grad_(True)
        scores = scorer(queries, documents, None, stacked_mask, **kwargs)
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(32, device=CUDA) * 2)
        loss.backward()
        return loss.detach(), queries.grad, documents.grad

    for actual, expected in zip(step(mp.ColBERTScores()), step(pylate_scores.ColBERTScores(), backend="torch")):
        assert relative_error(actual, expected) < 1e-4


def test_sentence_transformers_maxsim_on_cuda():
    pytest.importorskip("sentence_transformers", minversion="6.0")
    from sentence_transformers.util import similarity as st_similarity

    from maxsim.integrations import sentence_transformers as ms

    queries = [_unit(n, 128) for n in torch.randint(4, 33, (16,)).tolist()]
    documents = [_unit(n, 128) for n in torch.randint(1, 301, (500,)).tolist()]
    expected = st_similarity.maxsim(queries, documents, length_normalize=True)
    actual = ms.maxsim(queries, documents, length_normalize=True)
    assert actual.device.type == "cuda" and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    a, b = _unit(64, 32, 128, dtype=torch.bfloat16), _unit(64, 180, 128, dtype=torch.bfloat16)
    assert relative_error(ms.maxsim_pairwise(a, b), st_similarity.maxsim_pairwise(a, b)) < 5e-2


def test_colpali_score_multi_vector_1k_pages_and_loss():
    pytest.importorskip("colpali_engine.utils.maxsim")
    from colpali_engine.loss.late_interaction_losses import ColbertLoss
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    from maxsim.integrations import colpali as mc

    queries = [_unit(n, 128, dtype=torch.bfloat16) for n in torch.randint(10, 30, (8,)).tolist()]
    pages = [_unit(n, 128, dtype=torch.bfloat16) for n in torch.randint(700, 1031, (1000,)).tolist()]
    mc.unpatch()
    import os

    previous = os.environ.get("COLPALI_SCORES_BACKEND")
    os.environ["COLPALI_SCORES_BACKEND"] = "torch"
    try:
        expected = BaseVisualRetrieverProcessor.score_multi_vector(queries, pages, device=CUDA)
        exact = BaseVisualRetrieverProcessor.score_multi_vector([q.float() for q in queries], [p.float() for p in pages],
                                                                device=CUDA)
        # maxsim's own path (under "torch" the drop-in hands the call to colpali, as colpali's variable says)
        os.environ["COLPALI_SCORES_BACKEND"] = "auto"
        actual = mc.score_multi_vector(queries, pages, device=CUDA)
        assert actual.device.type == "cpu" and actual.dtype == torch.float32
        assert relative_error(actual, expected) < 5e-2  # colpali rounds its bf16 einsum; maxsim is fp32
        torch.testing.assert_close(actual, exact, atol=1e-3, rtol=1e-4)
        # in-batch scores: fp32 on CUDA, as colpali's late-interaction-kernels backend returns them
        qb, db = _unit(16, 24, 128, dtype=torch.bfloat16), _unit(16, 700, 128, dtype=torch.bfloat16)
        inbatch = mc.maxsim_inbatch(qb, db)
        assert inbatch.dtype == torch.float32
        torch.testing.assert_close(inbatch, torch.einsum("bnd,csd->bcns", qb.float(), db.float()).amax(3).sum(2),
                                   atol=1e-4, rtol=1e-5)

        Q0, D0 = _unit(32, 24, 128), _unit(32, 1030, 128)

        def step():
            q, d = Q0.clone().requires_grad_(True), D0.clone().requires_grad_(True)
            loss = ColbertLoss()(q, d)
            loss.backward()
            return loss.detach(), q.grad, d.grad

        os.environ["COLPALI_SCORES_BACKEND"] = "torch"  # colpali's einsum, not its TF32 kernel backend
        expected_step = step()
        os.environ["COLPALI_SCORES_BACKEND"] = "auto"
        mc.patch()
        (loss, q_grad, d_grad), (want_loss, want_q, want_d) = step(), expected_step
        assert relative_error(loss, want_loss) < 1e-4
        q_ties, d_ties = _near_ties(Q0, D0)
        assert q_ties.float().mean() < 0.05 and d_ties.float().mean() < 0.05  # the comparison keeps its rows
        assert relative_error(q_grad[~q_ties], want_q[~q_ties]) < 1e-4
        assert relative_error(d_grad[~d_ties], want_d[~d_ties]) < 1e-4
    finally:
        mc.unpatch()
        if previous is None:
            os.environ.pop("COLPALI_SCORES_BACKEND", None)
        else:
            os.environ["COLPALI_SCORES_BACKEND"] = previous
