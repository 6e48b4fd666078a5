"""GPU tier: the Gluon prototype of the overlapped forward (maxsim/dense/forward_overlap.py)
against the reference. Not yet run on a GPU when written (2026-11-29)."""

import pytest
import torch

from maxsim.reference import maxsim_reference
from oracle import rel_err

pytestmark = pytest.mark.gpu


# (Nq, Nd, Lq, Ld, d, dtype, BM, BN, num_warps): stacked short queries, 128-token queries, ragged
# Ld (tiles run into the next document), Nq not a multiple of the queries per block, d = 64.
CASES = [
    (32, 1000, 32, 128, 128, torch.float16, 128, 64, 4),
    (37, 333, 32, 180, 128, torch.bfloat16, 256, 64, 8),
    (16, 200, 128, 1024, 128, torch.bfloat16, 128, 128, 4),
    (5, 77, 20, 300, 64, torch.float16, 128, 64, 8),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:5]) for c in CASES])
def test_overlapped_forward_matches_reference(case):
    from maxsim.dense.forward_overlap import maxsim_forward_overlap

    nq, nd, lq, ld, d, dtype, BM, BN, warps = case
    Q = torch.randn(nq, lq, d, device="cuda", dtype=dtype)
    D = torch.randn(nd, ld, d, device="cuda", dtype=dtype)
    out, _ = maxsim_forward_overlap(Q, D, BM=BM, BN=BN, num_warps=warps)
    assert rel_err(out, maxsim_reference(Q, D)) < 1e-5


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("warps", [4, 8])
def test_overlapped_forward_masks_and_argmax_exact(mask_mode, warps):
    # Integer-valued inputs: exact dots and frequent ties, so scores and argmax (lowest index)
    # must equal the reference's; one document fully masked scores 0 with argmax -1 (exclude).
    from maxsim.dense.forward_overlap import maxsim_forward_overlap

    Q = torch.randint(-2, 3, (19, 32, 128), device="cuda").to(torch.bfloat16)
    D = torch.randint(-2, 3, (150, 180, 128), device="cuda").to(torch.bfloat16)
    qm = torch.rand(19, 32, device="cuda") > 0.2
    dm = torch.rand(150, 180, device="cuda") > 0.3
    dm[7] = False
    out, arg = maxsim_forward_overlap(Q, D, qm, dm, multiply=mask_mode == "multiply", save_argmax=True,
                                      BM=128, num_warps=warps)
    ref, ref_arg = maxsim_reference(Q, D, qm, dm, mask_mode=mask_mode, return_argmax=True)
    assert torch.equal(out, ref)
    assert torch.equal(arg, ref_arg)
