"""The one-byte Gluon scorer (maxsim.compressed.onebyte_gluon): its padded word layout and float64
emulation on the CPU, and on a Hopper GPU the kernel against that emulation (int8 and fp8)."""

import pytest
import torch

from maxsim.compressed.onebyte_gluon import build_layout, onebyte_emulation, onebyte_scores
from maxsim.compressed.quantized import quantize_tokens


def _case(seed, num_docs=29, fmt="int8"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 41, (num_docs,), generator=g)
    lengths[3] = 0
    lengths[-1] = 0
    cu = torch.zeros(num_docs + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    tokens = torch.nn.functional.normalize(torch.randn(int(cu[-1]), 128, generator=g), dim=-1)
    values, scales = quantize_tokens(tokens, fmt)
    Q = torch.nn.functional.normalize(torch.randn(3, 20, 128, generator=g), dim=-1)
    return values, scales, cu, Q


def _exact(Q, values, scales, cu, q_mask=None):
    x = values.float().double() * scales.double()[:, None]
    q = Q.double() if q_mask is None else Q.double() * q_mask.double()[..., None]
    out = torch.zeros(Q.shape[0], cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            out[:, j] = (q @ x[lo:hi].T).amax(-1).sum(-1)
    return out


def test_layout_holds_each_token_padded_and_its_words_in_the_stored_order():
    values, scales, cu, _ = _case(int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(values, scales, cu)
    words = values.view(torch.int32)[:, layout.order]  # [T, 32] as stored
    lengths = cu[1:] - cu[:-1]
    assert torch.equal(layout.cu[1:] - layout.cu[:-1], (lengths + 15) // 16 * 16)
    for j in torch.nonzero(lengths).flatten().tolist():
        lo, hi, plo, phi = int(cu[j]), int(cu[j + 1]), int(layout.cu[j]), int(layout.cu[j + 1])
        assert torch.equal(layout.words[plo:plo + hi - lo], words[lo:hi])
        assert torch.all(layout.words[plo + hi - lo:phi] == words[hi - 1])
        assert torch.all(layout.scales[plo + hi - lo:phi] == scales[hi - 1])
        assert torch.all(layout.group_doc[plo // 16:phi // 16] == j)
    assert torch.equal(build_layout(values, scales, cu, chunk=5).words, layout.words)
    with pytest.raises(ValueError, match="int8"):
        build_layout(values.float(), scales, cu)
    fp8_values, fp8_scales = quantize_tokens(values.float(), "fp8_e4m3")
    assert build_layout(fp8_values, fp8_scales, cu).fp8 and not layout.fp8


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_emulation_is_the_dequantised_scores_within_the_query_rounding(fmt):
    """Only the query is rounded (the tokens are the corpus's own bytes): per query row at most
    d * u_j / 2 * max|x| (int8: half a step), or about 2^-4 |q_j|_1 max|x| (e4m3: half an ulp of 3
    bits; subnormals half their step)."""
    values, scales, cu, Q = _case(int(torch.randint(0, 2**31, ()).item()), fmt=fmt)
    q_mask = torch.ones(3, 20, dtype=torch.bool)
    q_mask[2, 12:] = False
    layout = build_layout(values, scales, cu)
    got = onebyte_emulation(Q, layout, q_mask=q_mask)
    exact = _exact(Q, values, scales, cu, q_mask)
    x_max = float((values.float().abs().amax(-1) * scales).max())
    if fmt == "int8":
        row_bound = 128 * Q.abs().amax(-1).double() / 127 / 2 * x_max  # [Nq, Lq]
    else:
        # half an ulp relative, or half the subnormal step (2^-9 of the row's scale amax / 448)
        row_bound = (2.0**-4 * Q.abs().sum(-1).double() + 128 * 2.0**-10 * Q.abs().amax(-1).double() / 448) * x_max
    bound = (row_bound * q_mask.double()).sum(-1) * 1.01
    err = (got - exact).abs()
    assert torch.all(err <= bound[:, None]) and float(err.max()) > 0
    assert torch.all(got[:, 3] == 0) and torch.all(got[:, -1] == 0)
    # the absolute products (the kernel test's accumulation bound) bound the scores themselves
    absolute = onebyte_emulation(Q, layout, q_mask=q_mask, absolute=True)
    assert torch.all(absolute >= got.abs()) and bool((absolute > got.abs()).any())


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the Gluon scorer runs on Hopper (sm_90) only")
@pytest.mark.parametrize("block,qpb,fmt,pairs", [(128, 1, "int8", False), (64, 1, "int8", False), (64, 4, "int8", False),
                                                (128, 1, "fp8_e4m3", False), (64, 4, "fp8_e4m3", False),
                                                (128, 1, "int8", True), (64, 4, "fp8_e4m3", True),
                                                (64, 1, "int8", True), (64, 1, "fp8_e4m3", True)])
def test_kernel_matches_the_emulation(block, qpb, fmt, pairs):
    values, scales, cu, Q = _case(int(torch.randint(0, 2**31, ()).item()), num_docs=307, fmt=fmt)
    q_mask = torch.ones(3, 20, dtype=torch.bool)
    q_mask[1, 15:] = False
    layout = build_layout(values, scales, cu)
    lay = build_layout(values.cuda(), scales.cuda(), cu.cuda())
    got = onebyte_scores(Q.cuda(), lay, q_mask=q_mask.cuda(), block_tokens=block, qpb=qpb, pairs=pairs).double().cpu()
    want = onebyte_emulation(Q, layout, q_mask=q_mask)
    if fmt == "int8":  # int32 products: exact, then fp32 rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # e4m3 products: Hopper adds them with about 14 bits kept, so the bound scales with sum |q x|
        bound = onebyte_emulation(Q, layout, q_mask=q_mask, absolute=True) * 2.0 ** -10 + 1e-4
        assert torch.all((got - want).abs() <= bound), float(((got - want).abs() / bound).max())
    assert torch.all(got[:, 3] == 0) and torch.all(got[:, -1] == 0)
    part = onebyte_scores(Q.cuda(), lay, q_mask=q_mask.cuda(), block_tokens=block, qpb=qpb, pairs=pairs,
                          docs=(41, 250)).cpu()
    torch.testing.assert_close(part.double(), got[:, 41:250], rtol=0, atol=0)
