"""maxsim_from_hidden on the CPU tier: the fused kernel (in Triton's interpreter), the PyTorch
backward, the reference backend and the selection, against a float64 oracle of the unfused path."""

import pytest
import torch
import torch.nn.functional as F

from conftest import KERNEL_DEVICE
from head_oracle import oracle64, oracle_grads, rel_err
from maxsim import explain_from_hidden, maxsim_from_hidden
from maxsim.head import specs
from maxsim.reference import maxsim_reference
from maxsim.selection import head as select

DEV = KERNEL_DEVICE


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "fused")


def make(nq=3, lq=5, nd=4, ld=9, d=16, d_model=40, dtype=torch.float32, candidates=False, bias=True):
    Q = F.normalize(torch.randn(nq, lq, d), dim=-1).to(DEV, dtype)
    H = torch.randn(*((nq, nd) if candidates else (nd,)), ld, d_model).to(DEV, dtype)
    W = (torch.randn(d, d_model) / d_model**0.5).to(DEV, dtype)
    b = (0.1 * torch.randn(d)).to(DEV, dtype) if bias else None
    return Q, H, W, b


def masks(Q, H, empty_doc=True):
    q_mask = torch.rand(Q.shape[:-1], device=DEV) > 0.3
    d_mask = torch.rand(H.shape[:-1], device=DEV) > 0.4
    if empty_doc:
        d_mask[..., 1, :] = False
    return q_mask, d_mask


# The kernel's error against float64: fp32 inputs near fp32 rounding; 16-bit inputs one rounding of
# the projected tokens (as a stored D has) and of the inputs themselves.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_forward_against_oracle(kernels, dtype, layout):
    # Ld 70: two 64-token tiles for 16-bit (32 for fp32); d 24 pads to 32; d_model 40 leaves a ragged K chunk.
    Q, H, W, b = make(nq=3, lq=5, nd=3, ld=70, d=24, d_model=40, dtype=dtype, candidates=layout == "candidates")
    out = maxsim_from_hidden(Q, H, W, b)
    ref = oracle64(Q, H, W, b)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_normalize_and_bias(kernels, normalize, bias):
    Q, H, W, b = make(bias=bias)
    out = maxsim_from_hidden(Q, H, W, b, normalize=normalize)
    assert rel_err(out, oracle64(Q, H, W, b, normalize=normalize)) <= TOL[torch.float32]
    # The same as maxsim.maxsim's reference on the projected documents (Q as given).
    D = F.linear(H, W, b)
    D = F.normalize(D, dim=-1) if normalize else D
    assert rel_err(out, maxsim_reference(Q.cpu(), D.cpu())) <= TOL[torch.float32]


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_masks(kernels, mask_mode, layout):
    Q, H, W, b = make(nd=4, ld=40, candidates=layout == "candidates")
    q_mask, d_mask = masks(Q, H)
    out = maxsim_from_hidden(Q, H, W, b, q_mask, d_mask, mask_mode=mask_mode)
    ref = oracle64(Q, H, W, b, q_mask, d_mask, mask_mode=mask_mode)
    assert rel_err(out, ref) <= TOL[torch.float32]
    if mask_mode == "exclude":
        assert torch.all(out[:, 1] == 0)  # the empty document


def test_long_queries_chunked(kernels):
    # Lq 70 > the interpreter's 64-row block: a query is cut into chunks whose scores are summed.
    Q, H, W, b = make(nq=2, lq=70, nd=2, ld=20)
    assert rel_err(maxsim_from_hidden(Q, H, W, b), oracle64(Q, H, W, b)) <= TOL[torch.float32]


def small_ints(*shape):
    return torch.randint(-2, 3, shape).to(DEV, torch.float32)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_ties_go_to_the_lowest_index(kernels, layout):
    # Integer inputs: exact projections and products, so equal tokens tie exactly; half the
    # document tokens repeat earlier ones.
    Q = small_ints(2, 6, 8)
    H = small_ints(*((2, 3) if layout == "candidates" else (3,)), 40, 12)
    H[..., 20:, :] = H[..., :20, :]
    W, b = small_ints(8, 12), small_ints(8)
    scores, argmax = maxsim_from_hidden(Q, H, W, b, normalize=False, return_argmax=True)
    assert torch.equal(scores.cpu().double(), oracle64(Q, H, W, b, normalize=False))
    D = F.linear(H.double(), W.double(), b.double())
    S = torch.einsum("isd,ijtd->ijst" if layout == "candidates" else "isd,jtd->ijst", Q.double(), D)
    first = (S == S.max(-1, keepdim=True).values).double().argmax(-1)  # the first maximal index
    assert torch.equal(argmax.cpu().long(), first.cpu())
    assert int(argmax.max()) < 20


def test_empty_sets(kernels):
    Q, H, W, b = make()
    for q, h in ((Q[:, :0], H), (Q, H[:, :0]), (Q, H[:0]), (Q[:0], H)):
        out, arg = maxsim_from_hidden(q, h, W, b, return_argmax=True)
        assert out.shape == (q.shape[0], h.shape[0]) and torch.all(out == 0) and torch.all(arg == -1)
    d_mask = torch.zeros(H.shape[:-1], dtype=torch.bool, device=DEV)
    assert torch.all(maxsim_from_hidden(Q, H, W, b, d_mask=d_mask) == 0)


def test_nan_propagates(kernels):
    Q, H, W, b = make()
    H[2, 3, 5] = float("nan")
    out = maxsim_from_hidden(Q, H, W, b)
    assert torch.all(torch.isnan(out[:, 2]))
    assert torch.isfinite(out[:, [0, 1, 3]]).all()


def test_two_d_inputs_and_strides(kernels):
    Q, H, W, b = make(nd=2, ld=11)
    one = maxsim_from_hidden(Q[0], H[1], W, b)
    assert one.shape == () and rel_err(one, oracle64(Q[:1], H[1:2], W, b)[0, 0]) <= TOL[torch.float32]
    Ht = H.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous documents
    Wt = W.t().contiguous().t()  # a transposed W (unit stride on d, not d_model)
    assert rel_err(maxsim_from_hidden(Q, Ht, Wt, b), oracle64(Q, H, W, b)) <= TOL[torch.float32]


# --- gradients -----------------------------------------------------------------------------------

def check_grads(Q, H, W, b, q_mask=None, d_mask=None, tol=2e-5, **kw):
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (Q, H, W, b)]
    out = maxsim_from_hidden(*leaves, q_mask, d_mask, **kw)
    grad = torch.randn(out.shape, device=DEV)
    (out * grad).sum().backward()
    kw.pop("backward", None)
    ref = oracle_grads(Q, H, W, b, q_mask, d_mask, grad, **kw)
    assert rel_err(out, ref[0]) <= tol
    for t, r, name in zip(leaves, ref[1:], ("Q", "H", "W", "b")):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        assert rel_err(t.grad, r) <= tol, name
    return [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("backward", ["auto", "lowmem"])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_gradients(kernels, backward, mask_mode, layout):
    Q, H, W, b = make(nd=4, ld=40, candidates=layout == "candidates")
    q_mask, d_mask = masks(Q, H)
    gq, gh, _, _ = check_grads(Q, H, W, b, q_mask, d_mask, mask_mode=mask_mode, backward=backward)
    assert torch.all(gq[~q_mask] == 0)
    assert torch.all(gh[~d_mask] == 0)  # masked tokens never win (or, multiply, pass nothing)


@pytest.mark.parametrize("normalize", [True, False])
def test_gradients_unnormalized_no_bias(kernels, normalize):
    Q, H, W, _ = make(bias=False)
    check_grads(Q, H, W, None, normalize=normalize)


def test_gradients_only_some_inputs(kernels):
    Q, H, W, b = make()
    Hg = H.clone().requires_grad_(True)
    maxsim_from_hidden(Q, Hg, W, b).sum().backward()
    ref = oracle_grads(Q, H, W, b, None, None, torch.ones(3, 4))
    assert rel_err(Hg.grad, ref[2]) <= 2e-5


def test_lowmem_is_deterministic(kernels):
    Q, H, W, b = make(nd=3, ld=20)
    H[:, 10:] = H[:, :10]  # (repeated winners: several entries a row)
    grads = []
    for _ in range(2):
        Hg = H.clone().requires_grad_(True)
        maxsim_from_hidden(Q, Hg, W, b, backward="lowmem").sum().backward()
        grads.append(Hg.grad)
    assert torch.equal(grads[0], grads[1])


# --- the reference backend (CPU tensors by default) ---------------------------------------------

@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_reference_backend(monkeypatch, layout):
    monkeypatch.setenv("MAXSIM_BACKEND", "reference")
    Q, H, W, b = make(candidates=layout == "candidates")
    q_mask, d_mask = masks(Q, H)
    check_grads(Q, H, W, b, q_mask, d_mask)
    out, arg = maxsim_from_hidden(Q, H, W, b, q_mask, d_mask, return_argmax=True)
    assert arg.shape == out.shape + (Q.shape[1],) and torch.all(arg[:, 1] == -1)


# --- the selection: fused, or project once then score -------------------------------------------

def test_selector_chooses_fused_for_few_row_blocks():
    c = select.forward_choice(1, 32, 128, 768, torch.bfloat16, False, False, True, False, "sm90")
    assert c.kernel is specs.FUSED_FORWARD
    assert c.rejected[0][0] == specs.PROJECT_THEN_SCORE.name and "row block" in c.rejected[0][1]
    # Candidate lists: each list is read by its own query only.
    c = select.forward_choice(64, 32, 128, 768, torch.bfloat16, True, True, True, True, "sm90")
    assert c.kernel is specs.FUSED_FORWARD


def test_selector_chooses_project_once_for_many_row_blocks():
    c = select.forward_choice(64, 32, 128, 768, torch.bfloat16, False, False, True, True, "sm90")
    assert c.kernel is specs.PROJECT_THEN_SCORE
    name, why = c.rejected[0]
    blocks = select.row_blocks(64, 32, 128, False)
    assert name == specs.FUSED_FORWARD.name and f"{blocks} query row blocks" in why and blocks > 2
    # Too wide a head for the on-chip tile.
    c = select.forward_choice(1, 32, 512, 768, torch.bfloat16, False, False, True, False, "sm90")
    assert c.kernel is specs.PROJECT_THEN_SCORE and "d <= 256" in c.rejected[0][1]


def test_both_paths_agree(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    Q, H, W, b = make(nq=24, lq=8, nd=3, ld=20)  # 4 row blocks of 64 rows in the interpreter: unfused
    assert "head.project_then_score" in str(explain_from_hidden(Q, H, W, b)).split("not ")[0]
    auto = maxsim_from_hidden(Q, H, W, b)
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "fused")
    assert "forward: head.fused_forward" in str(explain_from_hidden(Q, H, W, b))
    fused = maxsim_from_hidden(Q, H, W, b)
    ref = oracle64(Q, H, W, b)
    assert rel_err(auto, ref) <= TOL[torch.float32] and rel_err(fused, ref) <= TOL[torch.float32]


def test_forced_path_is_checked(monkeypatch):
    monkeypatch.setenv("MAXSIM_HEAD_PATH", "sometimes")
    with pytest.raises(ValueError, match="MAXSIM_HEAD_PATH"):
        select.forced_path()


# --- bad input -----------------------------------------------------------------------------------

def test_bad_input():
    Q, H, W, b = make()
    cases = [
        ((Q, H, W[:, :-1], b), {}, ValueError, "W must have shape"),
        ((Q, H, W, b[:-1]), {}, ValueError, "b must have shape"),
        ((Q, H, W.double(), b), {}, TypeError, "W must be float16"),
        ((Q, H.half(), W, b), {}, TypeError, "share one dtype"),
        ((Q, H[0, 0, 0], W, b), {}, ValueError, "H must have shape"),
        ((Q, H[None].expand(2, -1, -1, -1), W, b), {}, ValueError, "one candidate list per query"),
        ((Q, H, W, b, Q[..., 0] > 0, H[:, :-1, 0] > 0), {}, ValueError, "d_mask must have shape"),
        ((Q, H, W, b), dict(mask_mode="max"), ValueError, "mask_mode"),
        ((Q, H, W, b), dict(backward="fast"), ValueError, "backward"),
        ((Q, H, W, b), dict(normalize=1), TypeError, "normalize"),
        ((Q, H, W, b, Q[..., 0] * 3), {}, ValueError, "q_mask"),
        ((Q, H, "W", b), {}, TypeError, "W must be a torch.Tensor"),
    ]
    for args, kw, err, words in cases:
        with pytest.raises(err, match=words):
            maxsim_from_hidden(*args, **kw)


def test_zero_dims_are_rejected():
    Q, H, W, b = make()
    with pytest.raises(ValueError, match="at least 1"):
        maxsim_from_hidden(Q[..., :0], H, W[:0], None)


def test_a_forced_tile_runs_and_a_bad_one_says_what_it_needs(kernels, monkeypatch):
    # MAXSIM_HEAD_TILE (tuning sweeps) is the fused kernel's tile: the explanation shows it, the
    # scores are the same; a spec missing a field is one line naming the fields.
    Q, H, W, b = make(nq=2, lq=5, nd=3, ld=40, d=16, d_model=40)
    ref = oracle64(Q, H, W, b)
    monkeypatch.setenv("MAXSIM_HEAD_TILE", "BM=16,BN=16,BKM=16,num_warps=2,num_stages=1,waves=1")
    config = explain_from_hidden(Q, H, W, b).forward.config
    assert (config.BM, config.BN, config.BKM, config.num_warps, config.waves) == (16, 16, 16, 2, 1)
    assert rel_err(maxsim_from_hidden(Q, H, W, b), ref) <= TOL[torch.float32]
    for bad in ("BM=16,BN=16", "BM=16,BN,BKM=16,num_warps=2,num_stages=1", "BM=16,BN=16,BKM=16,num_warps=2,num_stages=x"):
        monkeypatch.setenv("MAXSIM_HEAD_TILE", bad)
        with pytest.raises(ValueError, match="MAXSIM_HEAD_TILE needs BM, BN, BKM, num_warps, num_stages"):
            maxsim_from_hidden(Q, H, W, b)
