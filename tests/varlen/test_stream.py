"""The token-stream cross-product kernel (maxsim/varlen/stream.py) against the per-document kernel
and the float64 definition: documents that end mid-tile, span tiles, are empty or one token
long; stacked and chunked queries; one-byte tokens with scales; invalid offsets (NaN, never a
wrong number). Without a GPU the kernel runs in Triton's interpreter."""

import pytest
import torch

import maxsim
from conftest import HAS_CUDA, KERNEL_DEVICE
from maxsim.varlen.forward import varlen_forward
from maxsim.varlen.stream import stream_forward

# Small tiles in the interpreter: 8-token tiles so that short documents share and cross them.
SMALL = dict(BM=16, BN=8, BK=16, num_warps=4, num_stages=1, waves=1)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def packed(lengths, dim=16, dtype=torch.float16, ints=True):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    total = int(cu[-1])
    x = torch.randint(-3, 4, (total, dim)) if ints else torch.randn(total, dim)
    return x.to(KERNEL_DEVICE, dtype), cu.to(KERNEL_DEVICE)


def definition(q, cu_q, d, cu_d, scales=None):
    """float64, one (query, document) at a time; an empty one scores 0."""
    d = d.double() * (1.0 if scales is None else scales.double()[:, None])
    out = torch.zeros(cu_q.numel() - 1, cu_d.numel() - 1, dtype=torch.float64)
    for i in range(cu_q.numel() - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].double()
        for j in range(cu_d.numel() - 1):
            dj = d[cu_d[j]:cu_d[j + 1]]
            if len(qi) and len(dj):
                out[i, j] = (qi @ dj.T).max(1).values.sum()
    return out


def per_document(q, cu_q, d, cu_d, max_q):
    return varlen_forward(q, d, cu_q, cu_d, max_q, config=dict(SMALL), max_d=None)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_documents_sharing_and_crossing_tiles_equal_the_per_document_kernel(dtype):
    # 8-token tiles: documents of 1-3 tokens share one, 8 and 9 cross an edge, 21 spans three;
    # empty ones at the start, in the middle, twice in a row and at the end.
    d_lengths = [0, 3, 1, 2, 8, 9, 0, 0, 21, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 0]
    q, cu_q = packed([5, 3, 7], dtype=dtype)
    d, cu_d = packed(d_lengths, dtype=dtype)
    for config in (dict(SMALL), dict(SMALL, waves=4)):  # one run of documents, or several
        got = stream_forward(q, d, cu_q, cu_d, 7, config=config)
        assert torch.equal(got.cpu().double(), definition(q, cu_q, d, cu_d))  # integers: exact
    assert torch.equal(got, per_document(q, cu_q, d, cu_d, 7))
    assert torch.all(got[:, [0, 6, 7, 21]] == 0)


def test_many_queries_chunked_and_random_values():
    # 40-token queries: chunks of BM = 16 rows, partial sums added; random (rounding) values.
    q, cu_q = packed([40, 2, 17], dtype=torch.float32, ints=False)
    d, cu_d = packed([6, 30, 1, 0, 13, 2, 2, 9], dtype=torch.float32, ints=False)
    got = stream_forward(q, d, cu_q, cu_d, 40, config=dict(SMALL))
    ref = definition(q, cu_q, d, cu_d)
    assert torch.allclose(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_one_byte_tokens_with_scales(fmt):
    from maxsim.compressed.quantized import quantize_tokens

    q, cu_q = packed([5, 9], dtype=torch.float16, ints=False)
    x, cu_d = packed([3, 11, 0, 1, 7, 8], dtype=torch.float32, ints=False)
    values, scales = quantize_tokens(x, fmt)
    got = stream_forward(q, values, cu_q, cu_d, 9, config=dict(SMALL), scales=scales)
    ref = definition(q, cu_q, values.float(), cu_d, scales)
    # fp32 products of exact fp16 widenings: only the accumulation rounds
    assert torch.allclose(got.cpu().double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_one_byte_queries_on_the_one_byte_dot(fmt):
    # Q quantised like the tokens: the tensor-core dot of the bytes, then both scales; against
    # float64 on the dequantised query and tokens (exact products: only the fp32 sums round).
    from maxsim.compressed.quantized import quantize_tokens

    q, cu_q = packed([5, 9, 2], dim=40, dtype=torch.float32, ints=False)
    x, cu_d = packed([3, 11, 0, 1, 7, 8, 20], dim=40, dtype=torch.float32, ints=False)
    values, scales = quantize_tokens(x, fmt)
    q_values, q_scales = quantize_tokens(q, fmt)
    # d = 40 in one masked chunk, or two: the one-byte dot raises BK = 16 to its smallest K, 32
    for config in (dict(SMALL, BK=64), dict(SMALL, BK=16)):
        got = stream_forward(q_values, values, cu_q, cu_d, 9, config=config, scales=scales, query_scales=q_scales)
        ref = definition(q_values.double() * q_scales.double()[:, None], cu_q, values.float(), cu_d, scales)
        assert torch.allclose(got.cpu().double(), ref, rtol=1e-5, atol=1e-4)
        assert torch.all(got[:, 2] == 0)


def test_invalid_offsets_are_nan_never_a_wrong_number():
    q, cu_q = packed([4, 6])
    d, cu_d = packed([5, 7, 3, 6, 2, 9])
    want = definition(q, cu_q, d, cu_d)
    bad = cu_d.clone()
    bad[3] = bad[2] - 1  # document 2 ends before it starts; document 3 starts inside document 1
    got = stream_forward(q, d, cu_q, bad, 6, config=dict(SMALL))
    assert got[:, 2].isnan().all()
    others = [0, 1, 3, 4, 5]  # each scored over its own rows, document 3's overlapping document 1's
    assert torch.equal(got[:, others].cpu().double(), definition(q, cu_q, d, bad)[:, others])
    # a document longer than max_d, and one past the data: NaN, the others exact
    got = stream_forward(q, d, cu_q, cu_d, 6, config=dict(SMALL), max_d=8)
    assert got[:, 5].isnan().all() and torch.equal(got[:, :5].cpu().double(), want[:, :5])
    past = cu_d.clone()
    past[-1] = d.shape[0] + 3
    got = stream_forward(q, d, cu_q, past, 6, config=dict(SMALL))
    assert got[:, 5].isnan().all() and torch.equal(got[:, :5].cpu().double(), want[:, :5])
    # an invalid query: its row NaN
    bad_q = cu_q.clone()
    bad_q[1] = 11
    got = stream_forward(q, d, bad_q, cu_d, 6, config=dict(SMALL))
    assert got[0].isnan().all() and got[1].isnan().all()


def test_maxsim_varlen_routes_inference_through_the_stream():
    from maxsim.selection import varlen as select

    q, cu_q = packed([5, 3])
    d, cu_d = packed([7, 1, 0, 12])
    choice = select.forward_choice(q, 2, 5, pairs=False, argmax=False)
    assert choice.kernel.name == "varlen.stream_forward"
    assert select.forward_choice(q, 2, 5, pairs=False, argmax=True).kernel.name == "varlen.cross_forward"
    got = maxsim.maxsim_varlen(q, d, cu_q, cu_d)
    assert torch.equal(got.cpu().double(), definition(q, cu_q, d, cu_d))


def test_one_byte_dot_is_taken_where_measured_or_asked(monkeypatch):
    from maxsim.selection import varlen as select
    from maxsim.tuning import tables

    monkeypatch.setattr(tables, "ONE_BYTE_DOT_FAMILIES", ())
    assert select.quantize_query(None, "sm90")[0] is False
    assert select.quantize_query(True, "sm90")[0] is True and select.quantize_query(False, "sm90")[0] is False
    monkeypatch.setattr(tables, "ONE_BYTE_DOT_FAMILIES", ("sm90",))
    taken, why = select.quantize_query(None, "sm90")
    assert taken and "measured" in why and select.quantize_query(None, "unmeasured")[0] is False


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_short_documents_at_real_scale(dtype):
    # 1 and 8 queries of 32 tokens against 200K documents of 16-112 tokens (12.8M tokens), and
    # 30K of 1-300 tokens with empty ones: the stream against the per-document kernel.
    for lo, hi, n in ((16, 113, 200_000), (0, 301, 30_000)):
        lengths = torch.randint(lo, hi, (n,))
        cu_d = torch.zeros(n + 1, dtype=torch.int64)
        cu_d[1:] = torch.cumsum(lengths, 0)
        d = torch.nn.functional.normalize(torch.randn(int(cu_d[-1]), 128, device="cuda"), dim=-1).to(dtype)
        cu_d = cu_d.cuda()
        for nq in (1, 8):
            q = torch.nn.functional.normalize(torch.randn(nq * 32, 128, device="cuda"), dim=-1).to(dtype)
            cu_q = torch.arange(0, nq * 32 + 1, 32, device="cuda")
            config = dict(BM=min(128, nq * 32), BN=64, BK=128, num_warps=4, num_stages=2, waves=8)
            got = stream_forward(q, d, cu_q, cu_d, 32, config=config)
            want = varlen_forward(q, d, cu_q, cu_d, 32, config=dict(BM=min(128, nq * 32), BN=64, BK=128,
                                                                    num_warps=4, num_stages=3))[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            assert torch.all(got[:, lengths.cuda() == 0] == 0)
