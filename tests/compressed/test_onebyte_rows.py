"""int8 tokens as the tensor-core product's rows (maxsim.compressed.onebyte_rows): scores against a
float64 emulation of the same arithmetic (the query quantised per row, exact int32 products)."""

import pytest
import torch

from conftest import KERNEL_DEVICE
from maxsim.compressed.onebyte_rows import int8_rows_emulation, int8_rows_scores
from maxsim.compressed.quantized import dequantize_tokens, quantize_tokens


@pytest.mark.parametrize("block,qpb", [(32, 1), (64, 2)])
def test_scores_match_the_emulation_and_the_dequantised_tokens(block, qpb):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    lengths = torch.randint(0, 70, (15,), generator=g)
    lengths[3] = 0
    cu = torch.zeros(16, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    values, scales = quantize_tokens(torch.randn(int(cu[-1]), 128, generator=g), "int8")
    Q = torch.randn(3, 20, 128, generator=g)
    q_mask = torch.rand(3, 20, generator=g) > 0.2
    on = KERNEL_DEVICE
    got = int8_rows_scores(Q.to(on), values.to(on), scales.to(on), cu.to(on), q_mask=q_mask.to(on), block_tokens=block,
                           qpb=qpb).double().cpu()
    want = int8_rows_emulation(Q, values, scales, cu, q_mask=q_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)  # fp32 rounding of scores up to ~1e3
    assert torch.all(got[:, 3] == 0)  # an empty document
    # the query's int8 rounding: each row within half a step a coordinate of the exact products
    x = dequantize_tokens(values, scales).double()
    q = Q.double() * q_mask.double()[..., None]
    exact = torch.stack([(q @ x[int(cu[j]):int(cu[j + 1])].T).amax(-1).sum(-1) if lengths[j] else torch.zeros(3,
                         dtype=torch.float64) for j in range(15)], dim=1)
    bound = (q.abs().amax(-1) / 254 * x.abs().sum(-1).max()).sum(-1) * 1.01 + 1e-3  # [Nq]
    assert torch.all((got - exact).abs() <= bound[:, None])
