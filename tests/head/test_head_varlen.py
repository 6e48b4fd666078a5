"""maxsim_from_hidden_varlen: packed queries against packed hidden states through a head, against the
float64 oracle on the padded tensors (a packed corpus is a padded one with masks)."""

import pytest
import torch
import torch.nn.functional as F

import maxsim
from conftest import KERNEL_DEVICE
from head_oracle import oracle_grads, rel_err

DEV = KERNEL_DEVICE
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def ragged(lengths, width, dtype, unit=False):
    seqs = [torch.randn(n, width) for n in lengths]
    return [(F.normalize(x, dim=-1) if unit else x).to(DEV, dtype) for x in seqs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("normalize", [True, False])
def test_scores_and_gradients_against_padded_oracle(dtype, normalize):
    d, d_model = 16, 40
    queries = ragged([5, 1, 7], d, dtype, unit=True)
    hidden = ragged([9, 0, 3, 14], d_model, dtype)  # an empty document scores 0
    W = (torch.randn(d, d_model) / d_model**0.5).to(DEV, dtype).requires_grad_(True)
    b = (0.1 * torch.randn(d)).to(DEV, dtype).requires_grad_(True)
    q, cu_q, max_q = maxsim.pack(queries)
    h, cu_d, max_d = maxsim.pack(hidden)
    q.requires_grad_(True)
    h.requires_grad_(True)
    out = maxsim.maxsim_from_hidden_varlen(q, h, W, b, cu_q, cu_d, max_q, max_d, normalize=normalize)
    Qp, q_mask = maxsim.packed_to_padded(q.detach(), cu_q, max_q)
    Hp, d_mask = maxsim.packed_to_padded(h.detach(), cu_d, max_d)
    grad = torch.randn(out.shape, device=DEV)
    want, gq, gh, gw, gb = oracle_grads(Qp, Hp, W, b, q_mask, d_mask, grad, normalize=normalize)
    assert out.dtype == torch.float32 and out.shape == (3, 4)
    assert rel_err(out, want) <= TOL[dtype]
    assert torch.all(out[:, 1] == 0)
    if dtype != torch.float32:
        return  # 16-bit inputs: a near tie can crown another winner than float64 does (scores checked above)
    (out * grad).sum().backward()
    # The padded oracle's gradients at the real rows are the packed gradients.
    gq_packed = gq[q_mask.cpu()]
    gh_packed = gh[d_mask.cpu()]
    for got, ref in ((q.grad, gq_packed), (h.grad, gh_packed), (W.grad, gw), (b.grad, gb)):
        assert rel_err(got, ref) <= 10 * TOL[dtype]


def test_lists_equal_packed_and_unbiased_head():
    d, d_model = 8, 24
    queries, hidden = ragged([4, 6], d, torch.float32, unit=True), ragged([3, 5, 2], d_model, torch.float32)
    W = torch.randn(d, d_model, device=DEV)
    got = maxsim.maxsim_from_hidden_varlen(queries, hidden, W)
    q, cu_q, max_q = maxsim.pack(queries)
    h, cu_d, max_d = maxsim.pack(hidden)
    packed = maxsim.maxsim_from_hidden_varlen(q, h, W, None, cu_q, cu_d, max_q, max_d)
    assert torch.allclose(got, packed, rtol=1e-6, atol=1e-6)
    # The definition: the head applied, then maxsim_varlen.
    docs = [F.normalize(x @ W.T, dim=-1) for x in hidden]
    assert torch.allclose(got, maxsim.maxsim_varlen(queries, docs), rtol=1e-5, atol=1e-5)


def test_bad_input():
    q = torch.randn(5, 8, device=DEV)
    h = torch.randn(7, 24, device=DEV)
    cu_q = torch.tensor([0, 5], device=DEV)
    cu_d = torch.tensor([0, 3, 7], device=DEV)
    W = torch.randn(8, 24, device=DEV)
    with pytest.raises(ValueError, match=r"W must have shape \[d, d_model\]"):
        maxsim.maxsim_from_hidden_varlen(q, h, W[:, :20], None, cu_q, cu_d)
    with pytest.raises(TypeError, match="share one dtype"):
        maxsim.maxsim_from_hidden_varlen(q, h.half(), W, None, cu_q, cu_d)
    with pytest.raises(ValueError, match="h must be packed hidden states"):
        maxsim.maxsim_from_hidden_varlen(q, h[None], W, None, cu_q, cu_d)
    with pytest.raises(ValueError, match="not both"):
        maxsim.maxsim_from_hidden_varlen(q, [h], W, None, cu_q, cu_d)
    with pytest.raises(ValueError, match="b must have shape"):
        maxsim.maxsim_from_hidden_varlen(q, h, W, torch.zeros(3, device=DEV), cu_q, cu_d)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim.maxsim_from_hidden_varlen(q, h, W, None, cu_q, torch.tensor([0, 3, 9], device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_real_shapes(dtype):
    # ColBERT-like: d_model 768 -> d 128, 64 queries of 32 tokens, 512 documents up to 300 tokens.
    queries = ragged(torch.randint(8, 33, (64,)).tolist(), 128, dtype, unit=True)
    hidden = ragged(torch.randint(1, 301, (512,)).tolist(), 768, dtype)
    W = (torch.randn(128, 768) / 768**0.5).to(DEV, dtype)
    got = maxsim.maxsim_from_hidden_varlen(queries, hidden, W)
    docs = [F.normalize(F.linear(x.float(), W.float()), dim=-1) for x in hidden]
    want = maxsim.maxsim_varlen([x.float() for x in queries], docs)
    assert rel_err(got, want) <= 5 * TOL[dtype]
