"""Every embedding width from 8 to 4096: the padded and packed forwards against the float64
oracle, and their gradients against autograd through the reference, at widths that are not
powers of two (96, 320: answerai-colbert-small, ColQwen3) and wider than any K chunk (2560,
4096). Interpreter on CPU, compiled on a GPU."""

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.reference import maxsim_reference
from oracle import grad_step, oracle, rel_err

WIDTHS = [8, 96, 320, 2560, 4096]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def _unit(*shape, dtype):
    return torch.nn.functional.normalize(torch.randn(*shape, device=KERNEL_DEVICE), dim=-1).to(dtype)


@pytest.mark.parametrize("dim", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_padded_and_packed(dim, dtype):
    Q, D = _unit(2, 5, dim, dtype=dtype), _unit(3, 19, dim, dtype=dtype)
    d_mask = torch.rand(3, 19, device=KERNEL_DEVICE) > 0.3
    d_mask[:, 0] = True
    ref64, _ = oracle(Q, D, None, d_mask)
    out = maxsim.maxsim(Q, D, None, d_mask)
    # 16-bit products are exact in fp32; fp32 inputs take the split-precision or IEEE products
    assert out.dtype == torch.float32 and rel_err(out, ref64) <= 1e-5
    documents = [D[j, d_mask[j]] for j in range(3)]  # the same documents, ragged
    packed = maxsim.maxsim_varlen(list(Q), documents)
    assert rel_err(packed, ref64) <= 1e-5


@pytest.mark.parametrize("dim", WIDTHS)
@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_gradients(dim, backward):
    Q, D = _unit(2, 4, dim, dtype=torch.float32), _unit(3, 11, dim, dtype=torch.float32)
    d_mask = torch.rand(3, 11, device=KERNEL_DEVICE) > 0.3
    d_mask[:, 0] = True
    out, gq, gd = grad_step(maxsim.maxsim, Q, D, None, d_mask, backward=backward)
    ref, rq, rd = grad_step(maxsim_reference, Q.cpu(), D.cpu(), None, d_mask.cpu())
    assert gq.shape == Q.shape and gd.shape == D.shape
    assert max(rel_err(out, ref), rel_err(gq, rq), rel_err(gd, rd)) <= 1e-5
    assert torch.all(gd[~d_mask] == 0)  # masked tokens get no gradient


@pytest.mark.parametrize("dim", [320, 2560])
@pytest.mark.parametrize("backward", ["lowmem", "auto"])
def test_candidate_list_gradients(dim, backward):
    """Candidate lists (each query its own documents): lowmem's one-hot kernel takes a wide row in
    column chunks; auto leaves rows wider than its tile to unified."""
    Q, D = _unit(2, 4, dim, dtype=torch.bfloat16), _unit(2, 3, 9, dim, dtype=torch.bfloat16)
    d_mask = torch.rand(2, 3, 9, device=KERNEL_DEVICE) > 0.3
    d_mask[..., 0] = True
    out, gq, gd = grad_step(maxsim.maxsim, Q, D, None, d_mask, backward=backward)
    ref, rq, rd = grad_step(maxsim_reference, Q.float().cpu(), D.float().cpu(), None, d_mask.cpu())
    assert gd.shape == D.shape and gd.dtype == D.dtype
    assert rel_err(out, ref) <= 1e-5
    assert max(rel_err(gq.float(), rq), rel_err(gd.float(), rd)) <= 1e-2  # bf16 gradients
    assert torch.all(gd[~d_mask] == 0)


def test_lowmem_normalize_on_wide_candidate_lists_names_the_fix():
    Q, D = _unit(2, 3, 2560, dtype=torch.bfloat16), _unit(2, 2, 5, 2560, dtype=torch.bfloat16)
    Q.requires_grad_(True)
    scores = maxsim.maxsim(Q, D.requires_grad_(True), normalize=True, backward="lowmem")
    with pytest.raises(ValueError, match="backward='unified'"):
        scores.sum().backward()
