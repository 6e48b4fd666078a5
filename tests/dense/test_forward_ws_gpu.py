"""GPU tier: the warp-specialized Gluon forward (maxsim/dense/forward_ws.py) against the reference
(outputs poisoned before each launch, so an element the kernel fails to write fails the test):
shared and split documents, stacked and chunked queries, ragged Ld, an odd number of row blocks,
both mask rules, the argmax (ties to the lowest index) and NaN."""

import pytest
import torch

from maxsim.reference import maxsim_reference
from oracle import rel_err

pytestmark = pytest.mark.gpu


# (Nq, Nd, Lq, Ld, d, dtype, BN, split_docs): stacked short queries, 128-token queries (split and
# shared), long queries cut into 128-row chunks, ragged Ld (tiles run into the next document), an
# odd number of row blocks (the last program's second consumer has none), d = 64, Nd smaller than
# the multiprocessor count and not a multiple of the documents per program.
CASES = [
    (32, 1000, 32, 128, 128, torch.float16, 128, None),
    (37, 333, 32, 180, 128, torch.bfloat16, 64, None),
    (1, 1000, 128, 1024, 128, torch.float16, 128, None),
    (16, 200, 128, 1024, 128, torch.bfloat16, 128, None),
    (3, 99, 128, 300, 128, torch.bfloat16, 128, False),
    (2, 77, 1024, 1024, 128, torch.bfloat16, 64, None),
    (5, 77, 20, 300, 64, torch.float16, 64, True),
    (1, 7, 100, 129, 128, torch.float16, 128, True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:5]) + ("-split" if c[7] else "") for c in CASES])
def test_ws_forward_matches_reference(case):
    from maxsim.dense.forward_ws import maxsim_forward_ws

    nq, nd, lq, ld, d, dtype, BN, split = case
    Q = torch.randn(nq, lq, d, device="cuda", dtype=dtype)
    D = torch.randn(nd, ld, d, device="cuda", dtype=dtype)
    ref = maxsim_reference(Q, D)
    for q_in_regs, sub in ((False, 1), (True, 1), (True, 2)):
        out, _ = maxsim_forward_ws(Q, D, BN=BN, split_docs=split, q_in_regs=q_in_regs, sub_tiles=sub)
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sub", [1, 2])
@pytest.mark.parametrize("BN,q_in_regs", [(64, False), (128, False), (64, True), (128, True)])
def test_ws_forward_masks_and_argmax_exact(mask_mode, split, BN, q_in_regs, sub):
    # Integer-valued inputs: exact dots and frequent ties, so scores and argmax (lowest index)
    # must equal the reference's; one document fully masked scores 0 with argmax -1 (exclude).
    from maxsim.dense.forward_ws import maxsim_forward_ws

    Q = torch.randint(-2, 3, (19, 32, 128), device="cuda").to(torch.bfloat16)
    D = torch.randint(-2, 3, (150, 180, 128), device="cuda").to(torch.bfloat16)
    qm = torch.rand(19, 32, device="cuda") > 0.2
    dm = torch.rand(150, 180, device="cuda") > 0.3
    dm[7] = False
    out, arg = maxsim_forward_ws(Q, D, qm, dm, multiply=mask_mode == "multiply", save_argmax=True, BN=BN,
                                 split_docs=split, q_in_regs=q_in_regs, sub_tiles=sub)
    ref, ref_arg = maxsim_reference(Q, D, qm, dm, mask_mode=mask_mode, return_argmax=True)
    assert torch.equal(out, ref)
    assert torch.equal(arg, ref_arg)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32])
def test_ws_forward_number_masks_and_a_bad_value_gives_nan(mask_dtype):
    # An attention mask (numbers) scores as its bool mask; a value other than 0/1 makes exactly its
    # query's row and its document's column NaN.
    from maxsim.dense.forward_ws import maxsim_forward_ws

    Q = torch.randint(-2, 3, (19, 32, 128), device="cuda").to(torch.bfloat16)
    D = torch.randint(-2, 3, (150, 180, 128), device="cuda").to(torch.bfloat16)
    qm = torch.rand(19, 32, device="cuda") > 0.2
    dm = torch.rand(150, 180, device="cuda") > 0.3
    want, _ = maxsim_forward_ws(Q, D, qm, dm)
    got, _ = maxsim_forward_ws(Q, D, qm.to(mask_dtype), dm.to(mask_dtype))
    assert torch.equal(got, want)
    q_num, d_num = qm.to(mask_dtype), dm.to(mask_dtype)
    q_num[4, 0], d_num[9, 3] = 2, -1
    got, _ = maxsim_forward_ws(Q, D, q_num, d_num)
    bad = torch.zeros_like(got, dtype=torch.bool)
    bad[4, :], bad[:, 9] = True, True
    assert torch.equal(got.isnan(), bad) and torch.equal(got[~bad], want[~bad])


@pytest.mark.parametrize("sub", [1, 2])
@pytest.mark.parametrize("BN", [64, 128])
def test_ws_forward_propagates_nan(BN, sub):
    # A NaN wins the max: the scores are NaN. Where a NaN is the max, the argmax is a token of that
    # document (which one is not specified: _argmax_step); everywhere else it is exact.
    from maxsim.dense.forward_ws import maxsim_forward_ws

    Q = torch.randint(-2, 3, (8, 32, 128), device="cuda").to(torch.float16)
    D = torch.randint(-2, 3, (40, 300, 128), device="cuda").to(torch.float16)
    D[3, 200, 0] = float("nan")
    D[3, 250, 0] = float("nan")
    out, arg = maxsim_forward_ws(Q, D, save_argmax=True, BN=BN, sub_tiles=sub)
    ref, ref_arg = maxsim_reference(Q, D, return_argmax=True)
    assert torch.equal(out.isnan(), ref.isnan()) and out[:, 3].isnan().all()
    keep = ~ref.isnan()
    assert torch.equal(out[keep], ref[keep])
    assert torch.equal(arg[keep], ref_arg[keep])
    assert ((arg[:, 3] >= 0) & (arg[:, 3] < 300)).all()


def test_ws_forward_repeated_calls_take_each_calls_documents():
    # The second call of a signature goes through maxsim._launch's cached launch: its TMA
    # descriptor must describe this call's D, not the first call's.
    from maxsim.dense.forward_ws import maxsim_forward_ws

    Q = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        D = torch.randn(300, 256, 128, device="cuda", dtype=torch.bfloat16)
        for argmax in (False, True):
            out, arg = maxsim_forward_ws(Q, D, save_argmax=argmax)
            ref, ref_arg = maxsim_reference(Q, D, return_argmax=True)
            assert rel_err(out, ref) < 1e-5
            if argmax:
                assert (arg == ref_arg).float().mean() > 0.999  # random data: near-ties aside
