"""GPU tier: the forward at real shapes, past 2**31 elements, and run-to-run determinism."""

import pytest
import torch

import maxsim
from maxsim.reference import maxsim_reference
from oracle import rel_err

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# (Nq, Nd, Lq, Ld, d, dtype, masked)
REAL_SHAPES = [
    (1, 2000, 32, 300, 128, F16, False),
    (32, 3000, 32, 128, 128, F16, False),
    (1, 200, 1024, 1024, 128, F16, False),
    (2, 300, 128, 1024, 128, BF16, True),
    (128, 128, 128, 1024, 128, BF16, False),
    (64, 64, 32, 180, 128, BF16, True),
    (32, 500, 32, 128, 768, F16, False),
    (16, 300, 180, 257, 96, F32, True),
    (8, 100, 300, 77, 1024, BF16, True),
    (3, 1000, 1, 1, 64, F16, False),
]


def make(nq, nd, lq, ld, d, dtype, masked, candidates=False):
    Q = torch.randn(nq, lq, d, device="cuda", dtype=dtype)
    dshape = (nq, nd, ld, d) if candidates else (nd, ld, d)
    D = torch.randn(dshape, device="cuda", dtype=dtype)
    qm = dm = None
    if masked:
        qm = torch.rand(nq, lq, device="cuda") > 0.2
        dm = torch.rand(dshape[:-1], device="cuda") > 0.3
    return Q, D, qm, dm


@pytest.mark.parametrize("shape", REAL_SHAPES, ids=[str(s[:5]) + str(s[5])[6:] for s in REAL_SHAPES])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
def test_real_shapes_match_reference(shape, mask_mode):
    Q, D, qm, dm = make(*shape)
    out = maxsim.maxsim(Q, D, qm, dm, mask_mode=mask_mode)
    ref = maxsim_reference(Q, D, qm, dm, mask_mode=mask_mode)
    err = rel_err(out, ref)
    print(f"{shape} rel err vs fp32 reference {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("shape", [(32, 64, 32, 300, 128, F16, True), (4, 16, 1024, 1024, 128, BF16, False)])
def test_candidates_real_shapes(shape):
    Q, D, qm, dm = make(*shape, candidates=True)
    out, arg = maxsim.maxsim(Q, D, qm, dm, return_argmax=True, normalize=True)
    ref, ref_arg = maxsim_reference(Q, D, qm, dm, return_argmax=True, normalize=True)
    assert rel_err(out, ref) < 1e-5
    # Near-ties may resolve differently under different summation orders: allow a tiny fraction.
    assert (arg != ref_arg).float().mean().item() < 1e-3


def test_repeated_inference_calls_replay_their_plan(monkeypatch):
    # The second call of a signature keeps a launch plan; later ones replay it with no validation
    # or configuration work. New values in the same tensors, 2-D inputs, masks, candidate lists.
    from maxsim import _checks
    from maxsim.dense import forward

    cases = [((3, 32, 128), (50, 77, 128), True), ((32, 128), (77, 128), False),
             ((32, 128), (50, 77, 128), True), ((4, 32, 128), (4, 9, 77, 128), True), ((8, 32, 64), (300, 60, 64), False),
             # the warp-specialized kernel on Hopper (its own plan class): one 128-token query as a
             # 2-D tensor against 269K document tokens, and 8 of them against 256K
             ((128, 128), (2100, 128, 128), False), ((8, 128, 128), (2000, 128, 128), False)]
    tensors = []
    for qs, ds, masked in cases:
        Q = torch.randint(-2, 3, qs, device="cuda").to(BF16)
        D = torch.randint(-2, 3, ds, device="cuda").to(BF16)
        qm = torch.rand(qs[:-1], device="cuda") > 0.2 if masked else None
        dm = torch.rand(ds[:-1], device="cuda") > 0.3 if masked else None
        for _ in range(2):
            maxsim.maxsim(Q, D, qm, dm, return_argmax=True)
        tensors.append((Q, D, qm, dm))
    refs = []
    for Q, D, qm, dm in tensors:  # new values, same tensors
        Q.copy_(torch.randint_like(Q, -2, 3))
        D.copy_(torch.randint_like(D, -2, 3))
        refs.append(maxsim_reference(Q, D, qm, dm, return_argmax=True))
    checked = []
    real_check = _checks.check_inputs
    monkeypatch.setattr(_checks, "check_inputs", lambda *a, **k: checked.append(1) or real_check(*a, **k))
    for (Q, D, qm, dm), (ref, ref_arg) in zip(tensors, refs):
        out, arg = maxsim.maxsim(Q, D, qm, dm, return_argmax=True)
        assert torch.equal(out, ref) and torch.equal(arg, ref_arg)
        assert torch.equal(maxsim.maxsim(Q, D, qm, dm), ref)  # its own signature: validated, then planned
    # only the scores-only calls (first of their signature) were validated
    from maxsim import _launch
    assert len(checked) == len(cases), {getattr(k, "__name__", k): why for k, why in _launch.ORDINARY_PATH_ONLY.items()}
    if torch.cuda.get_device_capability()[0] == 9:
        from maxsim.dense.forward_ws import WarpSpecializedPlan

        kinds = {type(p).__name__ for p in forward._PLANS.values()}
        assert WarpSpecializedPlan.__name__ in kinds and "_ForwardPlan" in kinds
    # A bad argument is never hidden by a plan: a new signature, so validated (and refused).
    Q, D, qm, dm = tensors[0]
    with pytest.raises(ValueError, match="mask_mode"):
        maxsim.maxsim(Q, D, qm, dm, mask_mode="nope", return_argmax=True)


def test_argmax_exact_with_integer_inputs():
    Q = torch.randint(-3, 4, (64, 128, 128), device="cuda").half()
    D = torch.randint(-3, 4, (64, 1024, 128), device="cuda").half()
    dm = torch.rand(64, 1024, device="cuda") > 0.1
    out, arg = maxsim.maxsim(Q, D, None, dm, return_argmax=True)
    ref, ref_arg = maxsim_reference(Q, D, None, dm, return_argmax=True)
    assert torch.equal(out, ref) and torch.equal(arg, ref_arg)


# One shape per row of the dense forward tile table (maxsim.tuning.tables), both layouts; each runs
# the inference configuration (scores only) and the training one (with the argmax).
ARGMAX_REGIMES = [
    (64, 64, 32, 180, 128, False),  # short stacked queries: BM=256, BN=64, 2 stages, pointer loads
    (64, 64, 32, 180, 64, False),  # the same at d=64: 3 stages, 8 programs per multiprocessor
    (16, 16, 128, 1024, 128, False),  # long queries: BM=BN=128, 2 stages, TMA; argmax BM=64, TMA
    (8, 1100, 32, 128, 128, False),  # the same on a big corpus (>= 2**17 tokens): BN=128, TMA, 1 program/SM
    (2, 24, 1024, 300, 128, False),  # ColPali-long queries: BM=256, BN=64, query chunks, TMA
    (1, 100, 128, 300, 128, False),  # one 128-row block: BM=128, BN=64, running max
    (4, 100, 16, 300, 128, False),  # 64 rows: bandwidth-bound, pointer loads
    (1, 100, 32, 300, 128, False),  # small BM, running max
    (1, 520, 32, 256, 64, False),  # the same at d=64 on a big corpus: TMA, 4 stages
    (8, 64, 32, 128, 768, False),  # d > 128: K loop, row max, TMA
    (1, 64, 32, 128, 768, False),  # d > 128, few rows: pointer loads, BK=128
    (16, 32, 32, 300, 128, True),  # candidate lists
    (4, 32, 128, 300, 128, True),  # candidate lists of 128-token queries
]


@pytest.mark.parametrize("regime", ARGMAX_REGIMES, ids=[str(r) for r in ARGMAX_REGIMES])
@pytest.mark.parametrize("masks", ["none", "q", "d", "qd"])
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
def test_argmax_exact_in_every_regime(regime, masks, mask_mode):
    # Integer-valued inputs: every dot is exact, ties are frequent, so scores and argmax (lowest
    # index among ties) must match the reference bit for bit.
    nq, nd, lq, ld, d, cand = regime
    Q = torch.randint(-2, 3, (nq, lq, d), device="cuda").to(BF16)
    dshape = (nq, nd, ld, d) if cand else (nd, ld, d)
    D = torch.randint(-2, 3, dshape, device="cuda").to(BF16)
    qm = torch.rand(nq, lq, device="cuda") > 0.2 if "q" in masks else None
    dm = torch.rand(dshape[:-1], device="cuda") > 0.3 if "d" in masks else None
    out, arg = maxsim.maxsim(Q, D, qm, dm, mask_mode=mask_mode, return_argmax=True)
    ref, ref_arg = maxsim_reference(Q, D, qm, dm, mask_mode=mask_mode, return_argmax=True)
    bad = (arg != ref_arg).nonzero()
    assert torch.equal(out, ref), (out - ref).abs().max()
    assert torch.equal(maxsim.maxsim(Q, D, qm, dm, mask_mode=mask_mode), ref)
    assert bad.numel() == 0, f"{len(bad)} argmax mismatches, first {bad[:4].tolist()}: {arg[tuple(bad[:4].T)].tolist()} vs {ref_arg[tuple(bad[:4].T)].tolist()}"


def test_more_than_2_31_elements():
    # 100K documents x 300 tokens x 128 dims = 3.84e9 elements (7.7 GB): int64 addressing.
    Nd, Ld, d = 100_000, 300, 128
    D = torch.randn(Nd, Ld, d, device="cuda", dtype=F16)
    assert D.numel() > 2**31
    Q = torch.randn(2, 32, d, device="cuda", dtype=F16)
    out = maxsim.maxsim(Q, D)
    ref = maxsim_reference(Q, D)
    assert rel_err(out, ref) < 1e-5
    # The last documents live past 2**31 elements: check them on their own too.
    tail = maxsim.maxsim(Q, D[-7:].clone())
    assert rel_err(out[:, -7:], tail) < 1e-6


def test_deterministic():
    Q, D, qm, dm = make(32, 500, 200, 300, 128, BF16, True)
    a = maxsim.maxsim(Q, D, qm, dm, return_argmax=True)
    b = maxsim.maxsim(Q, D, qm, dm, return_argmax=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cached_launch_respects_alignment_and_strides():
    # The thin launch path reuses compiled kernels: a view with another alignment or stride must
    # not run a kernel specialised for the first one.
    base = torch.randn(40, 301, 129, device="cuda", dtype=F16)
    Q = torch.randn(4, 32, 128, device="cuda", dtype=F16)
    views = [base[:, :300, :128], base[:, 1:, 1:], base[1:, :-1, :-1], base[:, :300, :128].contiguous()]
    for _ in range(3):  # the second round runs from the launch cache, the third from launch plans
        for D in views:
            out = maxsim.maxsim(Q, D)
            assert rel_err(out, maxsim_reference(Q, D)) < 1e-5
        Qm = torch.randn(4 * 32 * 128 + 3, device="cuda", dtype=F16)[3:].view(4, 32, 128)  # odd address
        assert rel_err(maxsim.maxsim(Qm, views[0]), maxsim_reference(Qm, views[0])) < 1e-5


def test_cuda_graph_capture_and_replay():
    Q, D, qm, dm = make(64, 64, 32, 180, 128, BF16, True)
    maxsim.maxsim(Q, D, qm, dm)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = maxsim.maxsim(Q, D, qm, dm)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        Q.copy_(torch.randn_like(Q))  # new inputs in the captured buffers
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, maxsim_reference(Q, D, qm, dm)) < 1e-5


def _compiled_forward_variants():
    from maxsim.dense.forward import _maxsim_fwd_kernel
    from maxsim.dense.forward_ws import _maxsim_fwd_ws_kernel

    return sum(len(c[0]) for k in (_maxsim_fwd_kernel, _maxsim_fwd_ws_kernel) for c in k.device_caches.values())


def test_no_recompilation_when_nq_nd_ld_change():
    # After a warm-up of the buckets used, new batch sizes and document lengths reuse the kernels.
    maxsim.warmup(query_lengths=(32,), num_queries=(1, 8, 64), masks=(True,))
    before = _compiled_forward_variants()
    # (8, 1100, 128) is a big corpus: its own variant (on Hopper the warp-specialized kernel),
    # compiled by the warm-up too.
    for nq, nd, ld in [(1, 10, 300), (1, 1000, 17), (8, 5, 129), (7, 333, 64), (64, 20, 180), (200, 3, 1),
                       (8, 1100, 128), (1, 600, 300)]:
        Q = torch.randn(nq, 32, 128, device="cuda", dtype=F16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=F16)
        qm = torch.rand(nq, 32, device="cuda") > 0.1
        dm = torch.rand(nd, ld, device="cuda") > 0.1
        assert rel_err(maxsim.maxsim(Q, D, qm, dm), maxsim_reference(Q, D, qm, dm)) < 1e-5
    assert _compiled_forward_variants() == before


def test_autotune_picks_persists_and_stays_exact(monkeypatch, tmp_path):
    from maxsim.tuning.autotune import TuningCache

    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MAXSIM_AUTOTUNE", "1")
    monkeypatch.setenv("MAXSIM_TUNING_CACHE", str(path))
    Q, D, qm, dm = make(16, 500, 32, 200, 128, F16, True)  # a small corpus (< 2**17 tokens), as below
    out = maxsim.maxsim(Q, D, qm, dm)
    assert rel_err(out, maxsim_reference(Q, D, qm, dm)) < 1e-5
    entries = TuningCache(path)._load()
    assert len(entries) == 1
    # Another batch size and document length in the same bucket: read from the cache, no tuning.
    Q2, D2, qm2, dm2 = make(9, 33, 30, 77, 128, F16, True)
    assert rel_err(maxsim.maxsim(Q2, D2, qm2, dm2), maxsim_reference(Q2, D2, qm2, dm2)) < 1e-5
    assert len(TuningCache(path)._load()) == 1
