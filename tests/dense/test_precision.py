"""precision= for fp32 inputs: which product each call's kernel is built with ("ieee", "tf32x3",
"tf32"; "fp16x3" runs the 16-bit kernels on a split copy, maxsim._split), the rule of "auto", the gate on GPUs where the tensor-core paths have not run, and the CPU
backend's IEEE answer. (The interpreter computes every dot in fp32 whatever the precision, so the
tests here check what reaches the kernel; tests/compile_check.py checks that the tensor-core
variants build for sm_90 on wgmma, and the GPU tier checks their accuracy.)"""

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.dense import forward as dense_forward
from maxsim.selection.common import precision_choice
from maxsim.tuning import tables as T
from maxsim.varlen import forward as varlen_forward
from maxsim.varlen import stream as varlen_stream

DEV = KERNEL_DEVICE


@pytest.fixture
def seen(monkeypatch):
    """Every DOT_PRECISION a dense or packed forward kernel is launched with, in order."""
    calls = []

    def spy(real):
        def launch(kernel, grid, args, constexprs, **kw):
            calls.append(constexprs["DOT_PRECISION"])
            return real(kernel, grid, args, constexprs, **kw)
        return launch

    monkeypatch.setattr(dense_forward, "launch", spy(dense_forward.launch))
    monkeypatch.setattr(varlen_forward, "launch", spy(varlen_forward.launch))
    monkeypatch.setattr(varlen_stream, "launch", spy(varlen_stream.launch))
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    return calls


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_fp32_calls_reach_the_kernel_with_their_precision(seen, precision):
    Q, D = torch.randn(2, 5, 16, device=DEV), torch.randn(3, 7, 16, device=DEV)
    want = maxsim.maxsim(Q, D, precision="ieee")
    seen.clear()
    out = maxsim.maxsim(Q, D, precision=precision)
    assert seen == [precision]
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    # Training (the autograd path) and the packed layout carry it too.
    Qg = Q.clone().requires_grad_(True)
    maxsim.maxsim(Qg, D, precision=precision).sum().backward()
    docs = [D[0], D[1, :3]]
    maxsim.maxsim_varlen(list(Q), docs, precision=precision)
    q, cu_q, max_q = maxsim.pack(list(Q))
    d, cu_d, max_d = maxsim.pack(docs)
    pairs = torch.tensor([0, 1], device=DEV)
    maxsim.score_pairs_packed(q, d, cu_q, cu_d, pairs, pairs, max_q, max_d, precision=precision)
    assert seen == [precision] * 4


def test_auto_takes_the_fp16_split_on_hopper_copied_where_many_rows_share_a_token(seen, monkeypatch):
    Q, D = torch.randn(2, 5, 16, device=DEV), torch.randn(3, 7, 16, device=DEV)
    maxsim.maxsim(Q, D)  # 10 query rows a document token
    # the interpreter: no split on a family nobody measured; the H200: the split on chip
    assert seen == (["ieee"] if DEV == "cpu" else ["fp16x3"])
    few, many = T.SPLIT16_MIN_ROWS - 1, T.SPLIT16_MIN_ROWS
    big = -(-T.SPLIT16_MIN_PRODUCTS // many)  # document values: enough products for the copy
    choice, why = precision_choice(torch.float32, "auto", "sm90", few, big * 2)
    assert choice == "fp16x3" and "reading the fp32 documents sets the time" in why
    choice, why = precision_choice(torch.float32, "auto", "sm90", many, big)
    assert choice == "fp16x3-copy" and f"{many} query rows share each document token" in why
    choice, why = precision_choice(torch.float32, "auto", "sm90", many, big - 1)  # a small call: on chip
    assert choice == "fp16x3" and "a small call" in why
    assert precision_choice(torch.float32, "fp16x3", "unmeasured", many, big)[0] == "fp16x3-copy"
    assert precision_choice(torch.float32, "auto", "unmeasured", many, big)[0] == "ieee"
    # packed documents are copied whole: past the scratch limit the split stays on chip, and says so
    values = T.split16_scratch_bytes(0) // 6 + 1  # past 256 MB of copy (more than 5 % of these documents)
    rows = -(-T.SPLIT16_MIN_PRODUCTS // values)  # enough products for the copy
    choice, why = precision_choice(torch.float32, "auto", "sm90", max(many, rows), values, packed=True)
    assert choice == "fp16x3" and "scratch limit" in why
    assert precision_choice(torch.float32, "auto", "sm90", max(many, rows), values)[0] == "fp16x3-copy"  # in groups
    monkeypatch.setattr(T, "SPLIT_FP32_FAMILIES", ("sm80",))
    choice, why = precision_choice(torch.float32, "auto", "sm80", few)
    assert choice == "tf32x3" and "verified on sm80" in why


def test_a_training_step_keeps_the_split_on_chip_up_to_a_larger_call(seen, monkeypatch):
    # the copy's d x 3 argmax forward costs a training step more than the on-chip split saves
    many = T.SPLIT16_MIN_ROWS
    big = -(-T.SPLIT16_MIN_PRODUCTS // many)
    assert precision_choice(torch.float32, "auto", "sm90", many, big)[0] == "fp16x3-copy"
    choice, why = precision_choice(torch.float32, "auto", "sm90", many, big, training=True)
    assert choice == "fp16x3" and "a training step's forward" in why
    past = -(-T.SPLIT16_MIN_PRODUCTS_TRAINING // many)
    assert precision_choice(torch.float32, "auto", "sm90", many, past, training=True)[0] == "fp16x3-copy"
    # the call itself: the same shape copies for a forward and splits on chip under autograd
    monkeypatch.setattr(T, "SPLIT16_MIN_PRODUCTS", 0)
    monkeypatch.setattr(T, "SPLIT16_MIN_PRODUCTS_TRAINING", 10**12)
    Q, D = torch.randn(4, 16, 16, device=DEV), torch.randn(3, 7, 16, device=DEV)  # 64 rows a token
    maxsim.maxsim(Q, D, precision="fp16x3")
    maxsim.maxsim(Q.requires_grad_(), D, precision="fp16x3").sum().backward()
    assert seen == ["tf32", "fp16x3"] and Q.grad is not None
    words = str(maxsim.explain(Q, D, gpu="sm90"))
    assert "a training step's forward" in words, words


def test_sixteen_bit_inputs_ignore_it(seen):
    for dtype in (torch.float16, torch.bfloat16):
        Q, D = torch.randn(2, 5, 16, device=DEV).to(dtype), torch.randn(3, 7, 16, device=DEV).to(dtype)
        a = maxsim.maxsim(Q, D, precision="ieee")
        b = maxsim.maxsim(Q, D, precision="tf32")
        assert torch.equal(a, b)
    assert set(seen) == {"tf32"}  # 16-bit tensor-core dots: exact products, any precision word
    assert precision_choice(torch.bfloat16, "ieee", "sm90")[0] == "tf32"


def test_named_precisions_run_when_asked_on_any_family():
    # The explicit words ran on the H200 (this file's GPU tests): a caller who names one gets it on
    # any GPU and any shape; "auto" takes a split only on families where it was measured to win.
    for family in ("sm90", "sm80", "unmeasured", "interpreter"):
        for precision in ("tf32x3", "tf32", "ieee"):
            assert precision_choice(torch.float32, precision, family, 1)[0] == precision
            assert precision_choice(torch.float32, precision, family, 10**6, 10**12)[0] == precision
        assert precision_choice(torch.float32, "fp16x3", family, 1)[0] == "fp16x3"
        assert precision_choice(torch.float32, "fp16x3", family, 10**6, 10**6)[0] == "fp16x3-copy"
        if family != "sm90":
            assert precision_choice(torch.float32, "auto", family, 10**6)[0] == "ieee"


def test_cpu_backend_computes_ieee_and_checks_the_word(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "cpu")
    Q, D = torch.randn(2, 5, 16), torch.randn(3, 7, 16)
    want = maxsim.maxsim(Q, D)
    for precision in ("ieee", "fp16x3", "tf32x3", "tf32"):
        assert torch.equal(maxsim.maxsim(Q, D, precision=precision), want)
    for call in (lambda p: maxsim.maxsim(Q, D, precision=p), lambda p: maxsim.maxsim_varlen(list(Q), list(D), precision=p)):
        with pytest.raises(ValueError, match="precision must be one of 'auto', 'ieee', 'fp16x3', 'tf32x3', 'tf32'"):
            call("bf16x3")


@pytest.mark.gpu
@pytest.mark.parametrize("precision,bound", [("fp16x3", 1e-6), ("auto", 1e-6), ("tf32x3", 1e-6), ("tf32", 2e-3),
                                             ("ieee", 1e-6)])
def test_gpu_fp32_accuracy_against_float64(monkeypatch, precision, bound):
    # The batched shape, scaled: 16 queries x 2K documents, (32, 180), d 128, unit-norm tokens.
    Q = torch.nn.functional.normalize(torch.randn(16, 32, 128, device="cuda"), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(2000, 180, 128, device="cuda"), dim=-1)
    exact = torch.einsum("asd,btd->abst", Q.double(), D.double()).amax(-1).sum(-1)
    for layout in ("padded", "packed"):
        if layout == "padded":
            got = maxsim.maxsim(Q, D, precision=precision)
        else:
            got = maxsim.maxsim_varlen(list(Q), list(D), precision=precision)
        rel = float(((got.double() - exact).abs() / exact.abs()).max())
        assert rel <= bound, f"{layout} {precision}: relative error {rel:.2e} > {bound:.0e}"


def test_explain_says_which_product_runs(monkeypatch):
    Q, D = torch.randn(1, 32, 128), torch.randn(100, 180, 128)
    assert "products: fp16x3 — split precision on chip" in str(maxsim.explain(Q, D, gpu="sm90"))
    assert "products: ieee — IEEE fp32 FMAs" in str(maxsim.explain(Q, D, gpu="sm90", precision="ieee"))
    assert "products: ieee — IEEE fp32 FMAs" in str(maxsim.explain(Q, D, gpu="unmeasured"))
    assert "products: tf32x3 — split precision" in str(maxsim.explain(Q, D, gpu="sm90", precision="tf32x3"))
    assert "products: fp16x3-copy — split precision through the 16-bit kernels" in str(
        maxsim.explain(torch.randn(16, 32, 128), torch.empty(1000, 180, 128), gpu="sm90"))  # 512 rows a token
    assert "products: fp16x3 — split precision on chip" in str(
        maxsim.explain(torch.randn(4, 32, 128), D, gpu="sm90"))  # 128 rows a token, but a small call
    assert "16-bit inputs: every product is exact" in str(maxsim.explain(Q.half(), D.half(), gpu="sm90"))
    monkeypatch.setattr(T, "SPLIT_FP32_FAMILIES", ("unmeasured",))
    assert "products: tf32x3 — split precision" in str(maxsim.explain(Q, D, gpu="unmeasured"))


@pytest.mark.gpu
def test_gpu_explain_names_the_product_a_call_runs():
    # explain() of CUDA tensors reads their device's family, as the call itself does
    from maxsim.selection import dense
    from maxsim.selection.common import device_of, precision_choice

    Q, D = torch.randn(32, 24, 128, device="cuda"), torch.randn(32, 1030, 128, device="cuda")
    product = precision_choice(torch.float32, "auto", device_of(Q)[1], dense.query_rows_per_token(Q, D), D.numel())[0]
    words = str(maxsim.explain(Q, D))
    assert f"products: {product} — " in words and "verified on None" not in words
    if torch.cuda.get_device_capability() == (9, 0):
        assert product == "fp16x3"
