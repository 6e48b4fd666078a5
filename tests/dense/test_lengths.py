"""maxsim.maxsim with q_lengths / d_lengths instead of masks: the same scores as the equivalent
prefix masks on every backend and layout, NaN (never a finite wrong score) for a bad length."""

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE

DEV = KERNEL_DEVICE


@pytest.fixture(params=["triton", "cpu"])
def backend(request, monkeypatch):
    # "triton": the kernels (Triton's interpreter without a GPU); "cpu": the CPU backend.
    if request.param == "cpu" and DEV == "cuda":
        pytest.skip("the CPU backend runs on CPU tensors")
    monkeypatch.setenv("MAXSIM_BACKEND", request.param)
    return request.param


def prefix_mask(lengths, L):
    return torch.arange(L, device=lengths.device) < lengths[..., None]


def lengths_of(*shape, L):
    lengths = torch.randint(0, L + 1, shape, device=DEV)
    lengths.view(-1)[0] = L  # a full sequence and an empty one among them
    if lengths.numel() > 1:
        lengths.view(-1)[1] = 0
    return lengths


@pytest.mark.parametrize("layout", ["cross", "candidates", "one document"])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_lengths_equal_prefix_masks(backend, layout, mask_mode, dtype):
    Q = torch.randn(3, 7, 16, device=DEV).to(dtype)
    D = {"cross": torch.randn(5, 11, 16), "candidates": torch.randn(3, 4, 11, 16),
         "one document": torch.randn(11, 16)}[layout].to(DEV, dtype)
    q_len = lengths_of(3, L=7)
    d_len = lengths_of(*D.shape[:-2], L=11) if D.dim() > 2 else torch.tensor(6, device=DEV)
    got = maxsim.maxsim(Q, D, q_lengths=q_len, d_lengths=d_len, mask_mode=mask_mode)
    want = maxsim.maxsim(Q, D, prefix_mask(q_len, 7), prefix_mask(d_len, 11), mask_mode=mask_mode)
    assert got.shape == want.shape and torch.equal(got, want)
    # One side given as lengths, the other as a mask.
    got = maxsim.maxsim(Q, D, prefix_mask(q_len, 7), d_lengths=d_len, mask_mode=mask_mode, normalize=True)
    want = maxsim.maxsim(Q, D, prefix_mask(q_len, 7), prefix_mask(d_len, 11), mask_mode=mask_mode, normalize=True)
    assert torch.equal(got, want)


def test_two_dimensional_query_lists_and_argmax(backend):
    Q, D = torch.randn(6, 8, device=DEV), torch.randn(4, 9, 8, device=DEV)
    got, arg = maxsim.maxsim(Q, D, q_lengths=4, d_lengths=[9, 2, 0, 5], return_argmax=True)
    d_mask = prefix_mask(torch.tensor([9, 2, 0, 5], device=DEV), 9)
    want, want_arg = maxsim.maxsim(Q, D, torch.arange(6, device=DEV) < 4, d_mask, return_argmax=True)
    assert got.shape == (4,) and torch.equal(got, want) and torch.equal(arg, want_arg)


def test_gradients_equal_the_mask_path(backend):
    # Integer values: every gradient sum is exact, so the GPU backward's atomics (any order) give
    # the same bits on both paths; a difference is a different winner or a lost contribution.
    Q0, D0 = torch.randint(-3, 4, (2, 5, 8), device=DEV).float(), torch.randint(-3, 4, (3, 6, 8), device=DEV).float()
    q_len, d_len = torch.tensor([5, 2], device=DEV), torch.tensor([6, 1, 3], device=DEV)
    grads = []
    for use_lengths in (True, False):
        Q, D = Q0.clone().requires_grad_(True), D0.clone().requires_grad_(True)
        if use_lengths:
            out = maxsim.maxsim(Q, D, q_lengths=q_len, d_lengths=d_len)
        else:
            out = maxsim.maxsim(Q, D, prefix_mask(q_len, 5), prefix_mask(d_len, 6))
        (out * torch.arange(1, 7, device=DEV).view(2, 3)).sum().backward()
        grads.append((Q.grad, D.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert torch.all(grads[0][1][1, 1:] == 0)  # the padded tail gets no gradient


def test_bad_lengths_give_nan_in_their_outputs_only(backend):
    Q, D = torch.randn(3, 5, 8, device=DEV), torch.randn(4, 6, 8, device=DEV)
    q_len = torch.tensor([5, -1, 3], device=DEV)  # query 1 invalid
    d_len = torch.tensor([6, 7, 2, 0], device=DEV)  # document 1 longer than its padding
    got = maxsim.maxsim(Q, D, q_lengths=q_len, d_lengths=d_len)
    bad = torch.zeros(3, 4, dtype=torch.bool, device=DEV)
    bad[1, :] = True
    bad[:, 1] = True
    assert torch.equal(torch.isnan(got), bad)
    want = maxsim.maxsim(Q, D, prefix_mask(q_len.clamp_min(0), 5), prefix_mask(d_len.clamp_max(6), 6))
    assert torch.equal(got[~bad], want[~bad])
    cand = maxsim.maxsim(Q, torch.randn(3, 2, 6, 8, device=DEV), d_lengths=torch.tensor([[1, 9], [6, 0], [-2, 3]], device=DEV))
    assert torch.equal(torch.isnan(cand), torch.tensor([[False, True], [False, False], [True, False]], device=DEV))


@pytest.mark.parametrize("layout", ["cross", "candidates", "one document"])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32], ids=["int64", "fp32"])
def test_number_masks_equal_bool_masks_and_a_bad_value_gives_nan(backend, layout, mask_mode, mask_dtype):
    # Attention masks as tokenizers return them (int64) or as floats: the kernel reads them as they
    # are; a value other than 0/1 makes its query's or document's scores NaN, nothing else.
    # Integer values: a bad token changes the CPU backend's GEMM shape, hence its summation order;
    # exact sums keep the other scores' bits comparable.
    Q = torch.randint(-3, 4, (3, 7, 16), device=DEV).float()
    D = torch.randint(-3, 4, {"cross": (5, 11, 16), "candidates": (3, 4, 11, 16),
                              "one document": (11, 16)}[layout], device=DEV).float()
    q_real, d_real = torch.rand(Q.shape[:-1], device=DEV) > 0.3, torch.rand(D.shape[:-1], device=DEV) > 0.3
    want = maxsim.maxsim(Q, D, q_real, d_real, mask_mode=mask_mode)
    got = maxsim.maxsim(Q, D, q_real.to(mask_dtype), d_real.to(mask_dtype), mask_mode=mask_mode)
    assert torch.equal(got, want)
    q_num, d_num = q_real.to(mask_dtype), d_real.to(mask_dtype)
    q_num[1, 6] = 2  # query 1
    d_num.view(-1, 11)[-1, 4] = -1  # the last document (of the last list)
    got = maxsim.maxsim(Q, D, q_num, d_num, mask_mode=mask_mode)
    bad = torch.zeros_like(got, dtype=torch.bool)
    bad[1] = True
    if layout == "cross":
        bad[:, -1] = True
    elif layout == "candidates":
        bad[-1, -1] = True
    else:
        bad[:] = True
    assert torch.equal(torch.isnan(got), bad)
    assert torch.equal(got[~bad], want[~bad])


def test_number_mask_gradients_equal_bool_masks(backend):
    # PyLate's training call: int64 attention masks, the multiply rule, gradients through the argmax
    # (a masked winner passes none). Integer values: the sums are exact in any order.
    Q0, D0 = torch.randint(-3, 4, (2, 5, 8), device=DEV).float(), torch.randint(-3, 4, (3, 6, 8), device=DEV).float()
    q_real, d_real = torch.rand(2, 5, device=DEV) > 0.3, torch.rand(3, 6, device=DEV) > 0.4
    grads = []
    for q_mask, d_mask in ((q_real, d_real), (q_real.long(), d_real.long())):
        Q, D = Q0.clone().requires_grad_(True), D0.clone().requires_grad_(True)
        out = maxsim.maxsim(Q, D, q_mask, d_mask, mask_mode="multiply")
        (out * torch.arange(1, 7, device=DEV).view(2, 3)).sum().backward()
        grads.append((out.detach(), Q.grad, D.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_bad_input():
    Q, D = torch.randn(2, 5, 8, device=DEV), torch.randn(3, 6, 8, device=DEV)
    with pytest.raises(ValueError, match="give d_mask or d_lengths, not both"):
        maxsim.maxsim(Q, D, None, torch.ones(3, 6, dtype=torch.bool, device=DEV), d_lengths=[6, 6, 6])
    with pytest.raises(ValueError, match=r"d_lengths must have shape \[3\]"):
        maxsim.maxsim(Q, D, d_lengths=[6, 6])
    with pytest.raises(TypeError, match="q_lengths must hold integers"):
        maxsim.maxsim(Q, D, q_lengths=torch.tensor([5.0, 2.0], device=DEV))
    with pytest.raises(TypeError, match="q_lengths must be an integer tensor"):
        maxsim.maxsim(Q, D, q_lengths=object())


@pytest.mark.gpu
def test_gpu_rerank_with_lengths():
    # The rerank shape: one query against 50K documents padded to 220 tokens.
    Q = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    D = torch.randn(50_000, 220, 128, device="cuda", dtype=torch.float16)
    d_len = torch.randint(1, 221, (50_000,), device="cuda")
    got = maxsim.maxsim(Q, D, d_lengths=d_len)
    want = maxsim.maxsim(Q, D, None, prefix_mask(d_len, 220))
    assert torch.equal(got, want)
