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
    (5, 77, 20, 300, 64, torch.float16, 128, 64, 4),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:5]) for c in CASES])
def test_overlapped_forward_matches_reference(case):
    from maxsim.dense.forward_overlap import maxsim_forward_overlap

    nq, nd, lq, ld, d, dtype, BM, BN, warps = case
    Q = torch.randn(nq, lq, d, device="cuda", dtype=dtype)
    D = torch.randn(nd, ld, d, device="cuda", dtype=dtype)
    out = maxsim_forward_overlap(Q, D, BM=BM, BN=BN, num_warps=warps)
    assert rel_err(out, maxsim_reference(Q, D)) < 1e-5
