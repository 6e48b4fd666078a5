"""Gradients of the fused kernels against autograd through the reference (interpreter on CPU,
compiled on GPU), for every strategy, layout, mask mode, normalize and dtype."""

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.dense import ops
from maxsim.reference import maxsim_reference
from oracle import grad_step, rel_err

STRATEGIES = ["unified", "lowmem", "auto"]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def small_ints(*shape, dtype=torch.float32):
    """Integer values: exact products and sums, exact ties (both sides pick the lowest index)."""
    return torch.randint(-3, 4, shape, device=KERNEL_DEVICE).to(dtype)


def compare(Q, D, q_mask=None, d_mask=None, tol=1e-5, **kw):
    backward = kw.pop("backward", "auto")
    out, gq, gd = grad_step(maxsim.maxsim, Q, D, q_mask, d_mask, backward=backward, **kw)
    ref, rq, rd = grad_step(maxsim_reference, Q.cpu(), D.cpu(), _cpu(q_mask), _cpu(d_mask), **kw)
    assert gq.dtype == Q.dtype and gd.dtype == D.dtype and gq.shape == Q.shape and gd.shape == D.shape
    errs = rel_err(out, ref), rel_err(gq, rq), rel_err(gd, rd)
    print(f"rel err scores {errs[0]:.1e} grad_Q {errs[1]:.1e} grad_D {errs[2]:.1e}")
    assert max(errs) <= tol
    return gq, gd


def _cpu(t):
    return t.cpu() if t is not None else None


@pytest.mark.parametrize("backward", STRATEGIES)
@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
def test_gradients_exact_inputs(backward, layout, mask_mode):
    Q = small_ints(3, 9, 16)
    D = small_ints(4, 70, 16) if layout == "cross" else small_ints(3, 4, 70, 16)
    q_mask = torch.rand(3, 9, device=KERNEL_DEVICE) > 0.3
    d_mask = torch.rand(D.shape[:-1], device=KERNEL_DEVICE) > 0.4
    d_mask[..., 1, :] = False  # an empty document
    gq, gd = compare(Q, D, q_mask, d_mask, backward=backward, mask_mode=mask_mode)
    # Masked tokens get zero gradient.
    assert torch.all(gq[~q_mask] == 0)
    assert torch.all(gd[~d_mask] == 0)


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_gradients_normalize(backward, layout):
    Q = torch.randn(3, 7, 24, device=KERNEL_DEVICE)
    D = torch.randn(5, 33, 24, device=KERNEL_DEVICE) if layout == "cross" else torch.randn(3, 2, 33, 24, device=KERNEL_DEVICE)
    q_mask = torch.rand(3, 7, device=KERNEL_DEVICE) > 0.2
    compare(Q, D, q_mask, None, backward=backward, normalize=True)


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_gradients_normalize_bf16_wide(backward, layout):
    # bf16 in, bf16 gradients out, d = 200 (padded block 256): the Jacobian runs on the fp32 sums.
    Q = torch.randn(2, 9, 200, device=KERNEL_DEVICE).bfloat16()
    D = (torch.randn(4, 40, 200) if layout == "cross" else torch.randn(2, 3, 40, 200)).to(KERNEL_DEVICE).bfloat16()
    compare(Q, D, backward=backward, normalize=True, tol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_gradients_half_precision(dtype, backward, layout):
    # Gradients are written in the input dtype: one rounding of an fp32 sum. Long queries (130
    # tokens) run in chunks in the forward and in the candidate lists' one-hot kernel.
    Q = small_ints(2, 130, 32, dtype=dtype)
    D = small_ints(3, 20, 32, dtype=dtype) if layout == "cross" else small_ints(2, 3, 20, 32, dtype=dtype)
    compare(Q, D, backward=backward, tol=1e-2)


# Rows of 0.7, 24 and 85 entries on average (Nq * Lq / Ld): each (block, warps) of the owned tile table,
# the last with rows of several blocks (several sorted passes).
OWNED_SHAPES = [(3, 20, 90), (6, 40, 10), (8, 64, 6)]


@pytest.mark.parametrize("nq, lq, ld", OWNED_SHAPES)
def test_lowmem_every_owned_config(nq, lq, ld):
    from maxsim.selection.dense import backward_config

    def owned(nq, lq, ld):
        return backward_config("lowmem", (nq, lq, 16), (1, 5, ld, 16))["owned"]

    assert len({owned(*shape) for shape in OWNED_SHAPES}) == len(OWNED_SHAPES)
    compare(small_ints(nq, lq, 16), small_ints(5, ld, 16), backward="lowmem")


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_gradients_wide_embeddings_candidates(backward):
    # d = 200: the padded embedding block (256) narrows the one-hot kernel's token tile.
    Q, D = small_ints(2, 20, 200), small_ints(2, 3, 90, 200)
    compare(Q, D, backward=backward)


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_gradients_long_candidate_lists(backward):
    # 37 candidates: the gather walks them several at a time (gather_config's KB), the last step
    # ragged; Lq 5 leaves the last block of query tokens ragged too.
    Q, D = small_ints(3, 5, 16), small_ints(3, 37, 12, 16)
    d_mask = torch.rand(D.shape[:-1], device=KERNEL_DEVICE) > 0.3
    compare(Q, D, None, d_mask, backward=backward)


def test_ties_send_gradient_to_the_lowest_index():
    Q, D = small_ints(2, 5, 16), small_ints(3, 12, 16)
    D[:, 7] = D[:, 2]  # duplicates of token 2, later in each document
    D[:, 11] = D[:, 2]
    for backward in ["unified", "lowmem"]:
        _, _, gd = grad_step(maxsim.maxsim, Q, D, backward=backward)
        assert torch.all(gd[:, 7] == 0) and torch.all(gd[:, 11] == 0)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_lowmem_is_bitwise_deterministic(layout):
    Q = torch.randn(4, 33, 32, device=KERNEL_DEVICE)
    D = torch.randn((6, 50, 32) if layout == "cross" else (4, 6, 50, 32), device=KERNEL_DEVICE)
    a = grad_step(maxsim.maxsim, Q, D, backward="lowmem", seed=3)
    b = grad_step(maxsim.maxsim, Q, D, backward="lowmem", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_argmax_saved_without_grad(monkeypatch):
    # Inference never goes through the autograd op (which would keep an argmax buffer).
    def boom(*args, **kwargs):
        raise AssertionError("the differentiable op ran for an inference call")

    monkeypatch.setattr(ops, "dense_forward", boom)
    Q = torch.randn(2, 5, 16, device=KERNEL_DEVICE, requires_grad=True)
    D = torch.randn(3, 7, 16, device=KERNEL_DEVICE)
    with torch.no_grad():
        assert maxsim.maxsim(Q, D).shape == (2, 3)
    assert maxsim.maxsim(Q.detach(), D).shape == (2, 3)


def test_bad_backward_name():
    with pytest.raises(ValueError, match="backward must be one of 'auto', 'unified', 'lowmem'; got 'fast'"):
        maxsim.maxsim(torch.randn(2, 5, 16), torch.randn(3, 7, 16), backward="fast")


def test_opcheck_forward_and_backward_ops():
    Q = torch.randn(2, 5, 16, device=KERNEL_DEVICE, requires_grad=True)
    D = torch.randn(1, 3, 7, 16, device=KERNEL_DEVICE, requires_grad=True)
    q_mask = torch.rand(2, 5, device=KERNEL_DEVICE) > 0.3
    for strategy in ["unified", "lowmem"]:
        torch.library.opcheck(ops.dense_forward, (Q, D, q_mask, None, False, False, True, strategy, "ieee"))
    _, argmax = ops.dense_forward(Q.detach(), D.detach(), None, None, False, False, 1, "unified", "ieee")
    grad = torch.randn(2, 3, device=KERNEL_DEVICE)
    torch.library.opcheck(ops.dense_backward, (grad, Q.detach(), D.detach(), argmax, False, "lowmem"))


def test_torch_compile_fullgraph_loss():
    Q = torch.randn(4, 6, 16, device=KERNEL_DEVICE, requires_grad=True)
    D = torch.randn(4, 9, 16, device=KERNEL_DEVICE, requires_grad=True)
    labels = torch.arange(4, device=KERNEL_DEVICE)

    def loss_fn(Q, D):
        return torch.nn.functional.cross_entropy(maxsim.maxsim(Q, D, normalize=True), labels)

    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(Q, D)
    loss.backward()
    gq, gd = Q.grad.clone(), D.grad.clone()
    Q.grad = D.grad = None
    eager = loss_fn(Q, D)
    eager.backward()
    assert torch.allclose(loss, eager)
    assert torch.allclose(gq, Q.grad, atol=1e-6) and torch.allclose(gd, D.grad, atol=1e-6)


def test_eager_training_skips_the_dispatcher():
    # Outside torch.compile a differentiable call must not go through the custom ops (their Python
    # layers cost ~0.4 ms a step on the H200 host), and must give the ops' gradients.
    from torch.utils._python_dispatch import TorchDispatchMode

    class MaxsimOps(TorchDispatchMode):
        """Records every maxsim:: custom op that reaches the dispatcher."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "maxsim":
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    Q = torch.randn(3, 5, 16, device=KERNEL_DEVICE, requires_grad=True)
    D = torch.randn(4, 7, 16, device=KERNEL_DEVICE, requires_grad=True)
    with MaxsimOps() as eager:
        scores = maxsim.maxsim(Q, D)
        scores.sum().backward()
    assert "DenseMaxSim" in type(scores.grad_fn).__name__
    assert eager.seen == []
    Q2, D2 = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    with MaxsimOps() as through_ops:
        ops.dense_forward(Q2, D2[None], None, None, False, False, 1, "unified", "ieee")[0].sum().backward()
    assert through_ops.seen == ["dense_forward.default", "dense_backward.default"]
    torch.testing.assert_close(Q.grad, Q2.grad)
    torch.testing.assert_close(D.grad, D2.grad)


@pytest.mark.parametrize("normalize", [False, True])
def test_lowmem_owned_sum_ignores_the_placement_order(normalize):
    # On the GPU the counting sort's atomics leave each row's entries in any order; the owned
    # kernel must sum them in ascending entry order anyway (bitwise the same grad_D). One token
    # wins for almost every query token, so its rows hold far more entries than one block
    # (the owned tile table's BE) and take the multi-pass path.
    from maxsim.dense import backward as B
    from maxsim.dense.ops import _run_forward
    from maxsim.selection.dense import backward_config

    gen = torch.Generator().manual_seed(5)
    Q = (torch.randn(5, 33, 32, generator=gen) + 2).to(KERNEL_DEVICE)  # a shared direction
    D = torch.randn(1, 4, 40, 32, generator=gen).to(KERNEL_DEVICE)
    D[:, :, 3] = 2  # along it: token 3 wins for (almost) every query token
    _, argmax = _run_forward(Q, D, None, None, False, False, True)
    config = backward_config("lowmem", tuple(Q.shape), tuple(D.shape))
    g = torch.randn(5, 4, generator=gen).to(KERNEL_DEVICE)
    qinv = B._inverse_norms(Q) if normalize else g
    dinv = B._inverse_norms(D) if normalize else g
    n_docs, Ld = 4, 40
    counts = torch.zeros(n_docs * Ld, dtype=torch.int32, device=KERNEL_DEVICE)
    rowptr = torch.zeros(n_docs * Ld + 1, dtype=torch.int32, device=KERNEL_DEVICE)
    order = torch.empty(5 * n_docs * 33, dtype=torch.int32, device=KERNEL_DEVICE)
    B.invert_argmax(argmax, 0, n_docs, Ld, counts, rowptr, order, config["invert"])
    assert int(counts.abs().sum()) == 0 and int((rowptr[1:] - rowptr[:-1]).max()) > 2 * config["owned"][0]
    grads = []
    for shuffle in (False, True):
        o = order.clone()
        if shuffle:  # a different order within every row
            for r in range(n_docs * Ld):
                a, b = int(rowptr[r]), int(rowptr[r + 1])
                o[a:b] = o[a:b][torch.randperm(b - a, generator=gen).to(KERNEL_DEVICE)]
        gd = torch.empty_like(D)
        B.sum_owned_rows(g, Q, D, o, rowptr, qinv, dinv, gd, 0, n_docs, normalize, 32, config["owned"])
        grads.append(gd)
    assert torch.equal(grads[0], grads[1])
    _, ref = B.maxsim_backward(g, Q, D, argmax, normalize=normalize, strategy="unified",
                               config=backward_config("unified", tuple(Q.shape), tuple(D.shape)))
    assert rel_err(grads[0], ref) < 1e-5
