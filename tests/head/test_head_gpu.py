"""maxsim_from_hidden at the bar's shapes on a GPU (skipped without CUDA): the fused kernel and the
path the selection picks, scores and gradients against float64 autograd of the unfused path."""

import pytest
import torch
import torch.nn.functional as F

from head_oracle import rel_err
from maxsim import explain_from_hidden, maxsim_from_hidden

pytestmark = pytest.mark.gpu


def head_inputs(nq, lq, nd, ld, d=128, d_model=768, dtype=torch.bfloat16, grad=False):
    Q = F.normalize(torch.randn(nq, lq, d, device="cuda"), dim=-1).to(dtype)
    H = torch.randn(nd, ld, d_model, device="cuda", dtype=dtype)
    W = (torch.randn(d, d_model, device="cuda") / d_model**0.5).to(dtype)
    b = (0.02 * torch.randn(d, device="cuda")).to(dtype)
    q_mask = torch.rand(nq, lq, device="cuda") > 0.1
    d_mask = torch.arange(ld, device="cuda")[None, :] < torch.randint(ld // 3, ld + 1, (nd, 1), device="cuda")
    leaves = [t.requires_grad_(grad) for t in (Q, H, W, b)]
    return (*leaves, q_mask, d_mask)


def unfused64(Q, H, W, b, q_mask, d_mask, chunk=512):
    """float64 scores of the unfused path, a chunk of documents at a time (no similarity tensor of
    the whole batch)."""
    out = []
    for j0 in range(0, H.shape[0], chunk):
        D = F.normalize(F.linear(H[j0:j0 + chunk].double(), W.double(), b.double()), dim=-1)
        S = torch.einsum("isd,jtd->ijst", Q.double(), D)
        S = S.masked_fill(~d_mask[None, j0:j0 + chunk, None, :], float("-inf")).max(-1).values
        out.append(torch.where(q_mask[:, None, :], S, 0.0).sum(-1))
    return torch.cat(out, dim=1)


def test_one_query_10k_documents_forward(monkeypatch):
    # 1 x 10K documents (32, 300), d_model 768, bf16: the fused kernel is chosen.
    Q, H, W, b, q_mask, d_mask = head_inputs(1, 32, 10_000, 300)
    assert "forward: head.fused_forward" in str(explain_from_hidden(Q, H, W, b, q_mask, d_mask))
    out = maxsim_from_hidden(Q, H, W, b, q_mask, d_mask)
    ref = unfused64(Q, H, W, b, q_mask, d_mask)
    # bf16: one rounding of each projected token (as the unfused path's stored D) and of Q.
    assert out.dtype == torch.float32 and rel_err(out, ref) <= 1e-2
    # The unfused path in bf16 (F.linear + F.normalize + maxsim.maxsim) is no closer to float64.
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "unfused")
    unfused = maxsim_from_hidden(Q, H, W, b, q_mask, d_mask)
    assert rel_err(out, ref) <= 2 * rel_err(unfused, ref) + 1e-3


def fro_err(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def training_grads(path, monkeypatch, inputs):
    monkeypatch.setenv("MAXSIM_HEAD_PATH", path)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[:4]]
    out = maxsim_from_hidden(*leaves, *inputs[4:])
    torch.nn.functional.cross_entropy(out, torch.arange(out.shape[0], device="cuda")).backward()
    return out, [t.grad for t in leaves]


def test_in_batch_training_step(monkeypatch):
    # 64 x 64 (32, 300), d_model 768, bf16: gradients of Q, H, W, b against float64 autograd of
    # the unfused path, on both paths; neither further from it than PyTorch's bf16 unfused path
    # (F.linear + F.normalize in bf16, then maxsim.maxsim) by more than a rounding's worth.
    inputs = head_inputs(64, 32, 64, 300)
    leaves = [t.detach().double().requires_grad_(True) for t in inputs[:4]]
    ref = unfused64(*leaves, *inputs[4:])
    torch.nn.functional.cross_entropy(ref, torch.arange(ref.shape[0], device="cuda")).backward()
    base_out, base_grads = training_grads("unfused", monkeypatch, inputs)
    for path in ("auto", "fused"):
        out, grads = training_grads(path, monkeypatch, inputs)
        assert rel_err(out, ref) <= 1e-2
        for g, base, r, name in zip(grads, base_grads, leaves, "QHWb"):
            assert g.dtype == inputs["QHWb".index(name)].dtype, name
            assert fro_err(g, r.grad) <= 2 * fro_err(base, r.grad) + 1e-2, (path, name)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_fused_against_float64_fp32(monkeypatch, layout):
    # fp32 inputs: IEEE products; gradients agree with float64 autograd to fp32 rounding.
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "fused")
    from head_oracle import oracle_grads

    nq, lq, nd, ld, d, dm = 4, 32, 16, 300, 128, 768
    Q = F.normalize(torch.randn(nq, lq, d, device="cuda"), dim=-1)
    H = torch.randn(*((nq, nd) if layout == "candidates" else (nd,)), ld, dm, device="cuda")
    W = torch.randn(d, dm, device="cuda") / dm**0.5
    b = 0.02 * torch.randn(d, device="cuda")
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
    out = maxsim_from_hidden(*leaves)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    ref = oracle_grads(Q, H, W, b, None, None, g)
    assert rel_err(out, ref[0]) <= 1e-5
    for t, r in zip(leaves, ref[1:]):
        assert rel_err(t.grad, r) <= 1e-4


def test_lowmem_deterministic_gpu(monkeypatch):
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "fused")
    Q, H, W, b, q_mask, d_mask = head_inputs(8, 32, 64, 300, grad=True)
    grads = []
    for _ in range(2):
        for t in (Q, H, W, b):
            t.grad = None
        maxsim_from_hidden(Q, H, W, b, q_mask, d_mask, backward="lowmem").sum().backward()
        grads.append([t.grad.clone() for t in (Q, H, W)])
    for a, c in zip(*grads):
        assert torch.equal(a, c)
