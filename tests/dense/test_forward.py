"""The fused forward kernel against the reference and the float64 oracle.

On a machine without a GPU these run in Triton's interpreter (CI); with a GPU they compile.
"""

import math

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.reference import maxsim_reference
from oracle import oracle, rel_err, torch_dtype_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=KERNEL_DEVICE).to(dtype)


def small_ints(*shape, dtype=torch.float16):
    """Integer values in [-3, 3]: every product and sum is exact, so scores and argmax are exact
    and ties are frequent."""
    return torch.randint(-3, 4, shape, device=KERNEL_DEVICE).to(dtype)


def check_against_oracle(Q, D, q_mask=None, d_mask=None, **kw):
    """Kernel error <= 2x the error of PyTorch in the input dtype + a floor, against float64."""
    out = maxsim.maxsim(Q, D, q_mask, d_mask, **kw)
    ref64, _ = oracle(Q, D, q_mask, d_mask, **kw)
    err = rel_err(out, ref64)
    base = torch_dtype_err(Q, D, ref64, q_mask, d_mask) if not kw else 0.0
    print(f"kernel rel err {err:.2e}, torch {Q.dtype} rel err {base:.2e}")
    assert out.dtype == torch.float32 and out.device.type == KERNEL_DEVICE
    assert err <= 2 * base + 2e-6
    return out


# (Nq, Nd, Lq, Ld, d): lengths 0, 1, primes and block sizes +-1 (BN = 64, BM = 16..128),
# d not a power of two, d wider than one K chunk.
SHAPES = [
    (2, 3, 1, 1, 8),
    (3, 5, 7, 13, 24),
    (2, 4, 15, 63, 32),
    (2, 4, 16, 64, 64),
    (1, 3, 17, 65, 100),
    (5, 2, 31, 127, 128),
    (2, 2, 33, 129, 16),
    (1, 2, 127, 3, 64),
    (2, 2, 129, 37, 32),
    (3, 3, 11, 19, 200),
    (2, 2, 5, 70, 256),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_cross_product(shape, dtype):
    nq, nd, lq, ld, d = shape
    check_against_oracle(rand(nq, lq, d, dtype=dtype), rand(nd, ld, d, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("lq,ld", [(9, 11), (1, 65), (130, 20)])
def test_candidate_layout(dtype, lq, ld):
    check_against_oracle(rand(3, lq, 32, dtype=dtype), rand(3, 4, ld, 32, dtype=dtype))


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_masks_modes_normalize(mask_mode, normalize, layout):
    nq, lq, ld, d = 4, 13, 70, 32
    Q = rand(nq, lq, d)
    D = rand(5, ld, d) if layout == "cross" else rand(nq, 5, ld, d)
    q_mask = torch.rand(nq, lq, device=KERNEL_DEVICE) > 0.3  # holes anywhere
    d_mask = torch.rand(D.shape[:-1], device=KERNEL_DEVICE) > 0.5
    q_mask[1] = False  # a query with no real token
    d_mask[..., 2, :] = False  # a document with no real token
    d_mask[..., 3, 64:] = False  # a document whose only real tokens are in the first tile
    out = check_against_oracle(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=normalize)
    assert torch.all(out[1] == 0)


def test_exact_scores_and_argmax_with_ties():
    # Small integers: the kernel must agree with the oracle bit for bit, ties included.
    for lq, ld, d in [(5, 9, 16), (33, 130, 24), (130, 64, 8)]:
        Q, D = small_ints(3, lq, d), small_ints(4, ld, d)
        D[:, ld // 2] = D[:, 0]  # exact duplicate tokens in every document
        q_mask = torch.rand(3, lq, device=KERNEL_DEVICE) > 0.2
        d_mask = torch.rand(4, ld, device=KERNEL_DEVICE) > 0.2
        d_mask[1] = False
        for mode in ["exclude", "multiply"]:
            scores, arg = maxsim.maxsim(Q, D, q_mask, d_mask, mask_mode=mode, return_argmax=True)
            ref, ref_arg = oracle(Q, D, q_mask, d_mask, mask_mode=mode)
            assert torch.equal(scores.double().cpu(), ref)
            assert arg.dtype == torch.int32 and arg.shape == (3, 4, lq)
            assert torch.equal(arg.long().cpu(), ref_arg)


def test_argmax_candidates_matches_reference():
    Q, D = small_ints(2, 20, 16, dtype=torch.bfloat16), small_ints(2, 3, 70, 16, dtype=torch.bfloat16)
    scores, arg = maxsim.maxsim(Q, D, return_argmax=True)
    ref, ref_arg = maxsim_reference(Q.cpu(), D.cpu(), return_argmax=True)
    assert torch.equal(scores.cpu(), ref) and torch.equal(arg.cpu(), ref_arg)


def test_nan_propagates():
    Q, D = rand(3, 9, 16, dtype=torch.float32), rand(4, 70, 16, dtype=torch.float32)
    D[2, 66, 3] = math.nan  # in the ragged last tile
    Q[1, 4, 0] = math.nan
    d_mask = torch.ones(4, 70, dtype=torch.bool, device=KERNEL_DEVICE)
    out = maxsim.maxsim(Q, D, None, d_mask)
    expected = torch.zeros(3, 4, dtype=torch.bool)
    expected[:, 2] = True
    expected[1, :] = True
    assert torch.equal(torch.isnan(out).cpu(), expected)
    # A NaN in a masked token takes no part.
    d_mask[2, 66] = False
    q_mask = torch.ones(3, 9, dtype=torch.bool, device=KERNEL_DEVICE)
    q_mask[1, 4] = False
    assert not torch.isnan(maxsim.maxsim(Q, D, q_mask, d_mask)).any()


def test_empty_sets():
    for nq, nd, lq, ld in [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)]:
        out, arg = maxsim.maxsim(rand(nq, lq, 16), rand(nd, ld, 16), return_argmax=True)
        assert out.shape == (nq, nd) and torch.all(out == 0)
        assert arg.shape == (nq, nd, lq) and torch.all(arg == -1)


def test_two_d_inputs_and_non_contiguous():
    q, doc = rand(5, 32), rand(7, 32)
    Q = rand(3, 32, 5).transpose(1, 2)  # [3, 5, 32], d not unit-stride
    D = rand(7, 4, 32).transpose(0, 1)  # [4, 7, 32], non-contiguous batch
    assert not Q.is_contiguous() and not D.is_contiguous()
    ref = maxsim_reference(Q.cpu(), D.cpu())
    assert rel_err(maxsim.maxsim(Q, D), ref) < 1e-5
    assert maxsim.maxsim(q, doc).shape == ()
    assert rel_err(maxsim.maxsim(q, D), maxsim_reference(q.cpu(), D.cpu())) < 1e-5
    assert rel_err(maxsim.maxsim(Q, doc), maxsim_reference(Q.cpu(), doc.cpu())) < 1e-5


@pytest.mark.parametrize("row_max", [False, True], ids=["running-max", "row-max"])
@pytest.mark.parametrize("bm,bn", [(16, 16), (64, 32), (32, 64)])
def test_both_max_strategies_every_tile_shape(row_max, bm, bn):
    # The configuration rule picks one strategy per shape; both must be exact everywhere.
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense.forward import maxsim_forward

    Q, D = small_ints(3, 37, 24), small_ints(4, 70, 24)
    q_mask = torch.rand(3, 37, device=KERNEL_DEVICE) > 0.2
    d_mask = torch.rand(4, 70, device=KERNEL_DEVICE) > 0.3
    d_mask[2] = False
    cfg = ForwardConfig(BM=bm, BN=bn, BK=32, num_warps=4, num_stages=1, waves=1, row_max=row_max)
    D[:, 40] = D[:, 3]  # exact ties across tiles
    ref, ref_arg = oracle(Q, D, q_mask, d_mask)
    for save_argmax in (False, True):
        out, arg = maxsim_forward(Q, D[None], q_mask, d_mask[None], save_argmax=save_argmax, config=cfg)
        assert torch.equal(out.double().cpu(), ref)
        if save_argmax:
            assert torch.equal(arg.long().cpu(), ref_arg)


@pytest.mark.parametrize("lanes", [16, None, "flat"], ids=["mask-row-in-pieces", "mask-row-at-once", "flat-walk"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("row_max", [False, True], ids=["running-max", "row-max"])
def test_padding_walk_stops_at_each_documents_last_real_token(layout, row_max, lanes, monkeypatch):
    # Under the exclusion rule the kernel walks each document only up to its last real token.
    # Lengths on and around tile edges (BN = 16), empty documents, holes inside a document, NaN in
    # the padding, a number mask and a bad value: scores and argmax equal the oracle's. With 16
    # lanes, mask rows longer than that are read in pieces: last real tokens in each piece, an
    # empty piece before a real one and after it. A tile with flat_walk walks every tile instead,
    # padded rows predicated off: the same answers.
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense import forward
    from maxsim.dense.forward import _constexprs, _mask_lanes, maxsim_forward

    flat = lanes == "flat"
    if lanes is not None and not flat:
        monkeypatch.setattr(forward, "MASK_ROW_LANES", lanes)

    Nq, Nd, Lq, Ld, d = 2, 12, 9, 50, 24
    Q = small_ints(Nq, Lq, d)
    D = small_ints(Nq if layout == "candidates" else 1, Nd, Ld, d)
    lengths = torch.tensor([0, 1, 15, 16, 17, 31, 32, 33, 49, 50, 0, 7], device=KERNEL_DEVICE)
    d_mask = (torch.arange(Ld, device=KERNEL_DEVICE) < lengths[:, None]).expand(D.shape[:-1]).clone()
    d_mask[:, 8, 20:40] = False  # a hole: tiles inside it hold no real token, the walk goes on
    d_mask[:, 10, 45] = True  # one real token, late: the pieces before it hold none
    D[~d_mask] = float("nan")  # never read, never a score
    D[:, 9, 47] = D[:, 9, 2]  # an exact tie across tiles
    q_mask = torch.rand(Nq, Lq, device=KERNEL_DEVICE) > 0.2
    cfg = ForwardConfig(BM=16, BN=16, BK=32, num_warps=4, num_stages=1, waves=1, row_max=row_max, flat_walk=flat)
    lanes_run = _constexprs(cfg, d, 16, True, True, False, False, True, Q.dtype, False, False,
                            mask_lanes=_mask_lanes(True, False, cfg.flat_walk))["MASK_LANES"]
    assert lanes_run == (0 if flat else lanes or forward.MASK_ROW_LANES)
    D_view, dm_view = (D, d_mask) if layout == "candidates" else (D[0], d_mask[0])
    ref, ref_arg = oracle(Q, D_view.nan_to_num(0.0), q_mask, dm_view)
    launched, real_launch = [], forward.launch
    monkeypatch.setattr(forward, "launch", lambda k, grid, args, consts, **kw: (
        launched.append(consts["MASK_LANES"]), real_launch(k, grid, args, consts, **kw))[1])
    out, arg = maxsim_forward(Q, D, q_mask, d_mask, save_argmax=True, config=cfg)
    assert launched == [lanes_run]  # the walk the tile asked for is the one that ran
    assert torch.equal(out.double().cpu(), ref) and torch.equal(arg.long().cpu(), ref_arg)
    # PyLate's attention mask (int64) gives the same; a 2 makes only its document NaN.
    numbers = d_mask.long()
    numbers[:, 5, 3] = 2
    out, _ = maxsim_forward(Q, D, q_mask, numbers, config=cfg)
    bad = torch.zeros(Nd, dtype=torch.bool)
    bad[5] = True
    assert out[:, bad].isnan().all() and torch.equal(out[:, ~bad].double().cpu(), ref[:, ~bad])


def test_padding_walk_with_many_documents_a_program():
    # Each program walks a run of documents, the next one's extent read while this one's tiles
    # run: every document must get its own extent (on the GPU, 300 documents make runs of three).
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense.forward import maxsim_forward

    Q, D = small_ints(1, 32, 16), small_ints(1, 300, 40, 16)
    lengths = torch.randint(0, 41, (300,), device=KERNEL_DEVICE)
    d_mask = (torch.arange(40, device=KERNEL_DEVICE) < lengths[:, None])[None]
    cfg = ForwardConfig(BM=32, BN=16, BK=16, num_warps=4, num_stages=2, waves=1, row_max=False)
    ref, ref_arg = oracle(Q, D[0], None, d_mask[0])
    out, arg = maxsim_forward(Q, D, None, d_mask, save_argmax=True, config=cfg)
    assert torch.equal(out.double().cpu(), ref) and torch.equal(arg.long().cpu(), ref_arg)


def test_padding_walk_only_where_it_holds():
    # Without a document mask there is no padding; under PyLate's rule a masked token still takes
    # part in the max. The walk's variant does not depend on Ld (one compile for every length).
    from maxsim.dense.forward import MASK_ROW_LANES, _mask_lanes

    assert _mask_lanes(True, False) == MASK_ROW_LANES > 0
    assert _mask_lanes(False, False) == 0 and _mask_lanes(True, True) == 0 and _mask_lanes(True, False, True) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_tma_document_tiles_match_the_oracle(dtype, layout):
    # Document tiles through TMA read past a document's end into the next one (and past the last
    # one into zero fill): masking must hide both, with and without masks, normalize and argmax.
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense.forward import _tma_ready, maxsim_forward

    Nq, Nd, Lq, Ld, d = 3, 5, 20, 45, 40  # Ld ragged against BN, d against BK (two K chunks)
    Q = small_ints(Nq, Lq, d, dtype=dtype)
    D = small_ints(Nq if layout == "candidates" else 1, Nd, Ld, d, dtype=dtype)
    D[..., 44, :] = D[..., 3, :]  # an exact tie across tiles
    q_mask = torch.rand(Nq, Lq, device=KERNEL_DEVICE) > 0.2
    d_mask = torch.rand(D.shape[:-1], device=KERNEL_DEVICE) > 0.3
    d_mask[:, 1] = False
    cfg = ForwardConfig(BM=32, BN=16, BK=32, num_warps=4, num_stages=1, waves=1, row_max=True, tma=True)
    assert _tma_ready(D, cfg)
    D_view = D if layout == "candidates" else D[0]
    dm_view = d_mask if layout == "candidates" else d_mask[0]
    for qm, dm, mask_mode in ((None, None, "exclude"), (q_mask, d_mask, "exclude"), (q_mask, d_mask, "multiply")):
        ref, ref_arg = oracle(Q, D_view, qm, dm_view if dm is not None else None, mask_mode=mask_mode)
        out, arg = maxsim_forward(Q, D, qm, dm, multiply=mask_mode == "multiply", save_argmax=True, config=cfg)
        assert torch.equal(out.double().cpu(), ref)
        assert torch.equal(arg.long().cpu(), ref_arg)
    ref = maxsim_reference(Q, D_view, normalize=True)
    out, _ = maxsim_forward(Q, D, None, None, normalize=True, config=cfg)
    assert rel_err(out, ref) < 1e-5
    # A layout TMA cannot take (tokens not one run of rows) falls back to pointer loads.
    D_strided = torch.cat([D, D], dim=2)[:, :, :Ld]
    assert not _tma_ready(D_strided, cfg)
    out, _ = maxsim_forward(Q, D_strided, None, None, config=cfg)
    assert torch.equal(out.double().cpu(), oracle(Q, D_strided if layout == "candidates" else D_strided[0])[0])


def test_tma_only_where_a_descriptor_describes_d():
    # TMA reads D as [G, Nd*Ld, d] rows with 16-byte aligned rows; anything else must keep the
    # pointer loads (checked without a launch).
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense.forward import _tma_ready

    cfg = ForwardConfig(BM=128, BN=128, BK=128, num_warps=4, num_stages=2, row_max=True, tma=True)
    D = torch.zeros(3, 5, 7, 64, dtype=torch.bfloat16)
    assert _tma_ready(D, cfg) and _tma_ready(D[:1], cfg) and _tma_ready(D[:, 1:3], cfg)
    assert _tma_ready(D.float(), cfg)  # fp32 tiles too (the on-chip split reads them through TMA)
    assert not _tma_ready(torch.zeros(3, 5, 7, 62), cfg)  # fp32 rows of 248 bytes: not 16-byte aligned
    assert _tma_ready(torch.zeros(3, 5, 7, 60), cfg)  # 240 bytes: aligned
    assert not _tma_ready(D.to(torch.int8), cfg)  # one-byte codes: the compressed kernels' own path
    assert not _tma_ready(D[:, :, 1:], cfg)  # tokens of one group are not one run of rows
    assert not _tma_ready(D[..., 1:], cfg)  # rows of 63 elements: not 16-byte aligned
    flat = torch.zeros(3 * 5 * 7 * 64 + 1, dtype=torch.bfloat16)
    assert not _tma_ready(flat[1:].view(3, 5, 7, 64), cfg)  # base not 16-byte aligned
    assert not _tma_ready(D.transpose(0, 1).contiguous().transpose(0, 1), cfg)  # documents interleaved across groups


def test_launch_plan_rebuilds_outputs_and_descriptor_for_new_tensors():
    # A kept plan (dense/forward.py) launches with new tensors of its signature: fresh outputs, a
    # TMA descriptor over the new D (given in the caller's 3-D layout), the kept integers. Checked
    # with a stand-in for the compiled kernel (the GPU tier runs real plans).
    from maxsim.tuning.configs import ForwardConfig
    from maxsim.dense.forward import _descriptor_layout, _ForwardPlan

    cfg = ForwardConfig(BM=256, BN=128, BK=128, num_warps=8, num_stages=3, waves=1, row_max=True, tma=True)
    D4 = torch.zeros(1, 50, 77, 128, dtype=torch.float16)
    launched = []
    plan = _ForwardPlan(launched.append, (8, 50, 32, 77, 128), (8, 50), 1, (8, 50, 32), _descriptor_layout(D4, cfg))
    Q, D, dm = torch.zeros(8, 32, 128, dtype=torch.float16), torch.ones(50, 77, 128, dtype=torch.float16), None
    scores, argmax = plan(Q, D, None, dm)
    (args,) = launched
    assert args[0] is Q and args[1] is D and args[3] is Q and args[4] is Q  # absent masks: any pointer
    desc = args[2]
    assert desc.base is D and list(desc.shape) == [1, 50 * 77, 128] and list(desc.block_shape) == [1, 128, 128]
    assert args[5] is scores and scores.shape == (8, 50) and args[6] is argmax and argmax.shape == (8, 50, 32)
    assert args[7:] == (8, 50, 32, 77, 128)
    scores2, _ = plan(Q, D, None, dm)
    assert scores2 is not scores and launched[1][5] is scores2  # new outputs every call


def test_random_shapes_and_masks_fuzz():
    # Fresh random shapes, layouts, masks and flags each run: the kernel must match the oracle.
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(6):
        nq, nd = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
        lq, ld = (int(x) for x in torch.randint(1, 140, (2,), generator=gen))
        d = int(torch.randint(1, 40, (), generator=gen)) * 8
        cand = bool(torch.randint(0, 2, (), generator=gen))
        mode = ["exclude", "multiply"][int(torch.randint(0, 2, (), generator=gen))]
        Q = small_ints(nq, lq, d)
        D = small_ints(nq, nd, ld, d) if cand else small_ints(nd, ld, d)
        q_mask = torch.rand(Q.shape[:-1], generator=gen).to(KERNEL_DEVICE) > 0.3
        d_mask = torch.rand(D.shape[:-1], generator=gen).to(KERNEL_DEVICE) > 0.5
        scores, arg = maxsim.maxsim(Q, D, q_mask, d_mask, mask_mode=mode, return_argmax=True)
        ref, ref_arg = oracle(Q, D, q_mask, d_mask, mask_mode=mode)
        case = (nq, nd, lq, ld, d, cand, mode)
        assert torch.equal(scores.double().cpu(), ref), case
        assert torch.equal(arg.long().cpu(), ref_arg), case
