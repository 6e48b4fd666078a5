"""The PQ look-up scorer (maxsim.compressed.pq_lut): its int8 codebook words, the padded layout,
and its scores against a float64 emulation of the same arithmetic and against the exact scores of
the decoded tokens within the quantisation's worst-case bound."""

import pytest
import torch

from conftest import KERNEL_DEVICE
from maxsim.compressed.pq import ProductQuantizer
from maxsim.compressed.pq_lut import (build_layout, code_order, pq_lut_emulation, pq_lut_scores, prepare_queries,
                                      quantized_codebooks, supports)


def _case(seed, num_docs=23, m=32, sub_dim=4):
    g = torch.Generator().manual_seed(seed)
    # sub-spaces of different spreads: one scale per sub-space must follow each
    spread = torch.logspace(-2, 0, m, dtype=torch.float32)[torch.randperm(m, generator=g)]
    pq = ProductQuantizer(torch.randn(m, 256, sub_dim, generator=g) * spread[:, None, None])
    lengths = torch.randint(0, 41, (num_docs,), generator=g)
    lengths[2] = 0
    lengths[-1] = 0
    cu = torch.zeros(num_docs + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    codes = torch.randint(0, 256, (int(cu[-1]), m), generator=g, dtype=torch.uint8)
    Q = torch.nn.functional.normalize(torch.randn(3, 20, m * sub_dim, generator=g), dim=-1)
    return pq, codes, cu, Q


def _exact(Q, pq, codes, cu, q_mask=None):
    """float64 MaxSim of Q against the decoded documents (empty ones 0)."""
    x = pq.decode(codes).double()
    q = Q.double() if q_mask is None else Q.double() * q_mask.double()[..., None]
    out = torch.zeros(Q.shape[0], cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            out[:, j] = (q @ x[lo:hi].T).amax(-1).sum(-1)
    return out


def test_codebook_words_hold_each_centroid_scaled_per_sub_space():
    pq, _, _, _ = _case(int(torch.randint(0, 2**31, ()).item()))
    words, scales = quantized_codebooks(pq.codebooks)
    assert words.shape == (32, 256) and words.dtype == torch.int32 and scales.shape == (32,)
    c8 = words.view(torch.int8).reshape(32, 256, 4).double()  # low byte first: coordinate 0
    back = c8 * scales.double()[:, None, None]
    # each coordinate within half a step of its sub-space's scale, and each sub-space uses its range
    assert torch.all((back - pq.codebooks.double()).abs() <= scales.double()[:, None, None] / 2 * 1.0001)
    assert torch.all(c8.abs().amax(dim=(1, 2)) == 127)


def test_layout_pads_documents_by_repeating_their_last_token():
    pq, codes, cu, _ = _case(int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(pq, codes, cu, group=16)
    lengths = cu[1:] - cu[:-1]
    assert torch.equal(layout.cu[1:] - layout.cu[:-1], (lengths + 15) // 16 * 16)
    stored = codes[:, layout.order]  # each token's codes in the stored order
    for j in torch.nonzero(lengths).flatten().tolist():
        lo, hi, plo, phi = int(cu[j]), int(cu[j + 1]), int(layout.cu[j]), int(layout.cu[j + 1])
        assert torch.equal(layout.codes[plo:plo + hi - lo], stored[lo:hi])
        assert torch.all(layout.codes[plo + hi - lo:phi] == stored[hi - 1])
        # every group of 16 rows knows its document
        assert torch.all(layout.group_doc[plo // 16:phi // 16] == j)
    assert torch.all(layout.group_doc[int(layout.cu[-1]) // 16:] == -1)
    # built a few rows at a time (bounded temporaries), the same layout
    assert torch.equal(build_layout(pq, codes, cu, group=16, chunk=7).codes, layout.codes)


@pytest.mark.parametrize("block,qpb", [(32, 1), (64, 2)])
def test_scores_match_the_emulation(block, qpb):
    pq, codes, cu, Q = _case(int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(pq, codes, cu, group=8)
    q_mask = torch.ones(3, 20, dtype=torch.bool)
    q_mask[1, 15:] = False
    on = KERNEL_DEVICE
    lay = layout.to(on)
    got = pq_lut_scores(Q.to(on), lay, q_mask=q_mask.to(on), block_tokens=block, qpb=qpb).cpu()
    want = pq_lut_emulation(Q, layout, q_mask=q_mask)
    assert got.shape == (3, cu.numel() - 1)
    # fp32 rounding of 20 row maxima; Triton's interpreter rounds the fma's product before its sum,
    # up to 2 u_j a row (the product is near 1.5 * 2**23 u_j), where the GPU's fma rounds once
    qs = prepare_queries(Q, layout, q_mask=q_mask)[1][:3].double()  # [Nq, LQ]
    err = (got.double() - want).abs()
    assert torch.all(err <= 2 * qs.sum(-1)[:, None] + 1e-5 * want.abs() + 1e-6), float(err.max())
    assert torch.all(got[:, 2] == 0) and torch.all(got[:, -1] == 0)  # empty documents
    # a document range (a search's chunk of the stored layout) gives its slice of the columns
    part = pq_lut_scores(Q.to(on), lay, q_mask=q_mask.to(on), block_tokens=block, qpb=qpb, docs=(5, 17)).cpu()
    torch.testing.assert_close(part, got[:, 5:17], rtol=0, atol=0)


def test_scores_within_the_quantisation_bound_of_the_exact_ones():
    """Per query row, |error| <= d max|q_j| max_i s_i: the query row (after its sub-space scales)
    and the codebooks each rounded to int8 by at most half a step."""
    pq, codes, cu, Q = _case(int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(pq, codes, cu)
    got = pq_lut_scores(Q.to(KERNEL_DEVICE), layout.to(KERNEL_DEVICE)).double().cpu()
    exact = _exact(Q, pq, codes, cu)
    bound = 128 * Q.abs().amax(-1).double().sum(-1) * float(layout.scales.max()) * 1.01  # [Nq]
    err = (got - exact).abs()
    assert torch.all(err <= bound[:, None]), float((err - bound[:, None]).max())
    assert float(err.max()) > 0  # a real approximation: the bound is not met by accident of equality


def test_rejects_what_the_kernel_cannot_read():
    pq16 = ProductQuantizer(torch.randn(16, 256, 8))  # 8 dimensions a code
    assert not supports(pq16) and supports(ProductQuantizer(torch.randn(32, 256, 4)))
    with pytest.raises(ValueError, match="4 dimensions"):
        build_layout(pq16, torch.zeros(5, 16, dtype=torch.uint8), torch.tensor([0, 5]))


def test_code_order_gives_each_gluon_thread_its_two_codes_side_by_side():
    order = code_order(32)
    assert sorted(order.tolist()) == list(range(32))  # a permutation: nothing lost
    for sub in range(32):  # sub-space 8k + l + 4b at 8 l + 2 k + b (the wgmma fragment's lane l, half b)
        k, j = divmod(sub, 8)
        assert int(order[8 * (j % 4) + 2 * k + j // 4]) == sub


needs_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                  reason="the Gluon scorer runs on Hopper (sm_90) only")


@needs_hopper
@pytest.mark.parametrize("block,qpb,maxnreg,pairs", [(128, 1, None, False), (128, 2, None, False), (64, 1, None, False),
                                                     (64, 4, 168, False), (128, 1, None, True), (64, 4, None, True),
                                                     (128, 1, 128, True), (64, 4, 168, True)])
def test_gluon_scores_match_the_emulation(block, qpb, maxnreg, pairs):
    from maxsim.compressed.pq_gluon import gluon_scores

    pq, codes, cu, Q = _case(int(torch.randint(0, 2**31, ()).item()), num_docs=301)
    layout = build_layout(pq, codes, cu)
    q_mask = torch.ones(3, 20, dtype=torch.bool)
    q_mask[1, 15:] = False
    lay = layout.to("cuda")
    got = gluon_scores(Q.cuda(), lay, q_mask=q_mask.cuda(), block_tokens=block, qpb=qpb, maxnreg=maxnreg,
                       pairs=pairs).double().cpu()
    want = pq_lut_emulation(Q, layout, q_mask=q_mask)
    qs = prepare_queries(Q, layout, q_mask=q_mask)[1][:3].double()
    err = (got - want).abs()
    assert torch.all(err <= qs.sum(-1)[:, None] + 1e-5 * want.abs() + 1e-6), float(err.max())
    assert torch.all(got[:, 2] == 0) and torch.all(got[:, -1] == 0)  # empty documents
    # the Triton scorer reads the same layout and gives the same scores to fp32 rounding
    triton_scores = pq_lut_scores(Q.cuda(), lay, q_mask=q_mask.cuda(), qpb=qpb).double().cpu()
    torch.testing.assert_close(got, triton_scores, rtol=1e-5, atol=1e-4)
    part = gluon_scores(Q.cuda(), lay, q_mask=q_mask.cuda(), block_tokens=block, qpb=qpb, maxnreg=maxnreg,
                        pairs=pairs, docs=(37, 211)).cpu()
    torch.testing.assert_close(part.double(), got[:, 37:211], rtol=0, atol=0)
