"""int8 / fp8 corpora: quantize_tokens round trips, and maxsim_quantized(_varlen) against an fp64
einsum on the dequantised documents (and against maxsim.maxsim on them)."""

import pytest
import torch
from conftest import KERNEL_DEVICE

import maxsim
from maxsim.compressed import quantized
from maxsim.compressed.quantized import (dequantize_tokens, maxsim_quantized, maxsim_quantized_varlen,
                                         quantize_tokens)
from maxsim.selection import varlen as select_varlen
from maxsim.selection.common import device_of

FORMATS = ["int8", "fp8_e4m3"]
# e4m3: 3 mantissa bits, so a normal value rounds within 2**-4 of itself; below 2**-6 (the
# smallest normal) the spacing is the subnormal step 2**-9, half of which is 2**-10.
E4M3_RELATIVE = 2.0 ** -4
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10


def _tokens(*shape, dtype=torch.float32):
    """Random tokens whose magnitudes span three decades (per token), one all-zero token."""
    x = torch.randn(*shape, dtype=torch.float64) * torch.logspace(-2, 1, shape[-2], dtype=torch.float64)[:, None]
    x = x[..., torch.randperm(shape[-2]), :]
    x.reshape(-1, shape[-1])[0] = 0
    return x.to(dtype)


def _oracle(Q, D, q_mask=None, d_mask=None, mask_mode="exclude", normalize=False):
    """fp64 einsum of the contract, written out: Q [Nq, Lq, d], D [Nd, Ld, d] -> [Nq, Nd] (fp64, grads)."""
    q, d = Q.double(), D.double()
    if normalize:
        q, d = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(d, dim=-1)
    if d.shape[1] == 0:
        return q.new_zeros(q.shape[0], d.shape[0]) + 0 * q.sum()
    S = torch.einsum("asd,btd->abst", q, d)  # [Nq, Nd, Lq, Ld]
    if d_mask is not None:
        m = d_mask.bool()[None, :, None, :]
        S = S * m if mask_mode == "multiply" else S.masked_fill(~m, float("-inf"))
    best = S.max(dim=-1).values  # [Nq, Nd, Lq]
    if d_mask is not None and mask_mode == "exclude":
        best = torch.where(d_mask.bool().any(-1)[None, :, None], best, torch.zeros_like(best))
    if q_mask is not None:
        best = torch.where(q_mask.bool()[:, None, :], best, torch.zeros_like(best))
    return best.sum(-1)


def _half_grad_bound(Q_ref, D, d_mask, weights):
    """Elementwise bound on a half-precision Q's gradient error: every (query, document) term
    w[i, j] * winner arrives rounded to D's dtype (maxsim's gradient is in its input's dtype), the
    terms add in fp32, and the sum is rounded once more: u (2 sum |terms| + |gradient|)."""
    unit_roundoff = 2.0 ** -8 if D.dtype == torch.bfloat16 else 2.0 ** -11
    S = torch.einsum("asd,btd->abst", Q_ref.detach(), D.double()).masked_fill(~d_mask[None, :, None, :], float("-inf"))
    winners = D.double()[torch.arange(D.shape[0])[None, :, None], S.argmax(-1)]  # [Nq, Nd, Lq, d]
    term_sum = torch.einsum("ab,absd->asd", weights.double().abs(), winners.abs())  # [Nq, Lq, d]
    return unit_roundoff * (2 * term_sum + Q_ref.grad.abs()) * 1.01 + 1e-5


def _packed_corpus(lengths, dim, format):
    x = _tokens(sum(lengths) + 1, dim)[1:]  # drop the zero row so T may be 0
    values, scales = quantize_tokens(x, format)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return values, scales, cu


def _padded_from_packed(deq, cu):
    return maxsim.pad([deq[cu[j]:cu[j + 1]] for j in range(cu.numel() - 1)])


def _clear_of_ties(Q, D, d_mask, gap=1e-3):
    """[Nq, Nd] bool: True where each query token's best document token beats the runner-up by more
    than ``gap`` (float64 products), so its gradient has one owner however the scores are rounded."""
    sim = torch.einsum("qid,njd->qnij", Q.double(), D.double())  # [Nq, Nd, Lq, Ld]
    sim = sim.masked_fill(~d_mask.bool()[None, :, None, :], float("-inf"))
    top = sim.topk(2, dim=-1).values  # [Nq, Nd, Lq, 2]
    return ((top[..., 0] - top[..., 1]) > gap).all(-1)  # an empty document (-inf - -inf: nan) is not clear


# ---------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_int8_round_trip_within_half_a_step(dtype):
    x = _tokens(3, 40, 24, dtype=dtype)
    values, scales = quantize_tokens(x, "int8")
    assert values.dtype == torch.int8 and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    amax = x.double().abs().amax(-1)  # [3, 40]
    torch.testing.assert_close(scales.double(), amax / 127, rtol=1e-6, atol=0)
    assert int(values.abs().max()) <= 127
    nonzero = amax > 0
    # each nonzero token's largest element lands on +-127 exactly
    assert torch.all(values.abs().amax(-1)[nonzero] == 127)
    zero = ~nonzero
    assert zero.any() and torch.all(scales[zero] == 0) and torch.all(values[zero] == 0)
    error = (x.double() - dequantize_tokens(values, scales, torch.float64)).abs()
    assert torch.all(error <= scales.double()[..., None] / 2 * (1 + 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_round_trip_within_e4m3_rounding(dtype):
    x = _tokens(50, 32, dtype=dtype)
    values, scales = quantize_tokens(x, "fp8_e4m3")
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (50,)
    amax = x.double().abs().amax(-1)
    torch.testing.assert_close(scales.double(), amax / 448, rtol=1e-6, atol=0)
    as_float = values.double()
    assert torch.isfinite(as_float).all() and float(as_float.abs().max()) <= 448
    assert torch.all(as_float.abs().amax(-1)[amax > 0] == 448)
    scaled = x.double() / torch.where(scales > 0, scales, 1).double()[:, None]  # [50, 32], in e4m3 units
    bound = torch.maximum(scaled.abs() * E4M3_RELATIVE, torch.full_like(scaled, E4M3_SUBNORMAL_HALF_STEP))
    error = (x.double() - dequantize_tokens(values, scales, torch.float64)).abs()
    assert torch.all(error <= bound * scales.double()[:, None] * (1 + 1e-5))
    assert torch.all(dequantize_tokens(values, scales)[scales == 0] == 0)


def test_dequantize_is_values_times_scales_in_each_dtype():
    values = torch.randint(-127, 128, (6, 5, 16), dtype=torch.int8)
    scales = torch.rand(6, 5) * 0.1
    exact = values.double() * scales.double()[..., None]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = dequantize_tokens(values, scales, dtype)
        assert got.dtype == dtype and got.shape == (6, 5, 16)
        torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=0, atol=0)  # one rounding
    half_scales = scales.half()
    expected = (values.double() * half_scales.double()[..., None]).float()
    torch.testing.assert_close(dequantize_tokens(values, half_scales), expected)


def test_quantize_empty_and_one_dimensional():
    values, scales = quantize_tokens(torch.zeros(0, 8))
    assert values.shape == (0, 8) and scales.shape == (0,)
    x = torch.randn(12, requires_grad=True)
    values, scales = quantize_tokens(x)
    assert not scales.requires_grad
    assert scales.shape == () and torch.all((x - dequantize_tokens(values, scales)).abs() <= scales / 2 * (1 + 1e-5))


def test_quantize_and_dequantize_bad_input():
    with pytest.raises(ValueError, match="int8.*fp8_e4m3"):
        quantize_tokens(torch.randn(2, 4), "int4")
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 4)
        x[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            quantize_tokens(x)
    with pytest.raises(ValueError, match="x must"):
        quantize_tokens(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must"):
        quantize_tokens(torch.randn(3, 0))
    with pytest.raises(ValueError, match="x must"):
        quantize_tokens([1.0, 2.0])
    values, scales = quantize_tokens(torch.randn(3, 4))
    with pytest.raises(TypeError, match="values"):
        dequantize_tokens(values.to(torch.uint8), scales)
    with pytest.raises(TypeError, match="scales"):
        dequantize_tokens(values, scales.long())
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_tokens(values, scales[:2])
    with pytest.raises(ValueError, match="dtype"):
        dequantize_tokens(values, scales, torch.int32)
    with pytest.raises(ValueError, match="one device"):
        dequantize_tokens(values, scales.to("meta"))


# ---------------------------------------------------------------------- padded scoring
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("normalize", [False, True])
def test_padded_scores_match_the_dequantised_oracle(format, mask_mode, normalize):
    values, scales = quantize_tokens(_tokens(9, 13, 32), format)
    d_mask = torch.rand(9, 13) > 0.3
    d_mask[2] = False  # an empty document
    d_mask[4] = True
    Q = torch.randn(4, 6, 32)
    q_mask = torch.rand(4, 6) > 0.25
    q_mask[3] = False  # a query with no real token
    got = maxsim_quantized(Q, values, scales, d_mask=d_mask, q_mask=q_mask, mask_mode=mask_mode, normalize=normalize,
                           chunk_documents=4)
    D = dequantize_tokens(values, scales)
    expected = _oracle(Q, D, q_mask, d_mask, mask_mode, normalize)
    assert got.shape == (4, 9) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.all(got[3] == 0)
    if mask_mode == "exclude":
        assert torch.all(got[:, 2] == 0)
    direct = maxsim.maxsim(Q, D, q_mask, d_mask, mask_mode=mask_mode, normalize=normalize)
    torch.testing.assert_close(got, direct, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("format", FORMATS)
def test_half_precision_queries_dequantise_into_their_dtype(dtype, format):
    values, scales = quantize_tokens(_tokens(7, 10, 32), format)
    Q = torch.randn(3, 5, 32).to(dtype)
    got = maxsim_quantized(Q, values, scales)
    D = dequantize_tokens(values, scales, dtype)  # the documents rounded to Q's dtype, as promised
    torch.testing.assert_close(got.double(), _oracle(Q, D), rtol=1e-3, atol=1e-3)
    # and not to the fp32 dequantisation, where the dtype's rounding shows
    assert (got.double() - _oracle(Q, dequantize_tokens(values, scales))).abs().max() > 0


def test_padded_single_query_empty_corpus_and_zero_length_documents():
    values, scales = quantize_tokens(_tokens(5, 8, 16))
    Q = torch.randn(6, 16)
    q_mask = torch.rand(6) > 0.3
    got = maxsim_quantized(Q, values, scales, q_mask=q_mask, chunk_documents=2)
    assert got.shape == (5,)
    torch.testing.assert_close(got.double(), _oracle(Q[None], dequantize_tokens(values, scales), q_mask[None])[0],
                               rtol=1e-5, atol=1e-4)
    assert maxsim_quantized(Q[None], values[:0], scales[:0]).shape == (1, 0)
    assert maxsim_quantized(Q, values[:0], scales[:0]).shape == (0,)
    empty = maxsim_quantized(Q[None], values[:, :0], scales[:, :0])
    assert empty.shape == (1, 5) and torch.all(empty == 0)


def test_padded_chunking_invariance(monkeypatch):
    values, scales = quantize_tokens(_tokens(23, 11, 24), "fp8_e4m3")
    d_mask = torch.rand(23, 11) > 0.2
    Q = torch.randn(3, 7, 24)
    whole = maxsim_quantized(Q, values, scales, d_mask=d_mask, chunk_documents=23)
    for chunk in (1, 2, 5, 7, 22, 100):
        torch.testing.assert_close(maxsim_quantized(Q, values, scales, d_mask=d_mask, chunk_documents=chunk), whole,
                                   rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(quantized, "DEFAULT_CHUNK_BYTES", 3 * 11 * 24 * 4)  # three documents a chunk
    torch.testing.assert_close(maxsim_quantized(Q, values, scales, d_mask=d_mask), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
@pytest.mark.parametrize("normalize", [False, True])
def test_padded_gradients_for_q_match_the_oracle(mask_mode, normalize):
    values, scales = quantize_tokens(_tokens(8, 9, 16))
    scales.requires_grad_(True)
    d_mask = torch.rand(8, 9) > 0.3
    d_mask[5] = False
    q_mask = torch.rand(3, 4) > 0.2
    Q = torch.randn(3, 4, 16, requires_grad=True)
    weights = torch.randn(3, 8)  # a loss that weighs every score differently
    (maxsim_quantized(Q, values, scales, d_mask=d_mask, q_mask=q_mask, mask_mode=mask_mode, normalize=normalize,
                      chunk_documents=3) * weights).sum().backward()
    Q_ref = Q.detach().double().requires_grad_(True)
    D = dequantize_tokens(values, scales.detach(), torch.float64)
    (_oracle(Q_ref, D, q_mask, d_mask, mask_mode, normalize) * weights.double()).sum().backward()
    torch.testing.assert_close(Q.grad.double(), Q_ref.grad, rtol=1e-4, atol=1e-5)
    assert scales.grad is None  # the corpus is data, not a parameter


# ---------------------------------------------------------------------- packed scoring
@pytest.mark.parametrize("format", FORMATS)
def test_varlen_matches_the_oracle_with_empty_documents_and_q_mask(format):
    lengths = [5, 0, 12, 1, 0, 8]
    values, scales, cu = _packed_corpus(lengths, 32, format)
    Q = torch.randn(3, 7, 32)
    q_mask = torch.rand(3, 7) > 0.3
    q_mask[1] = False
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales), cu)
    expected = _oracle(Q, D, q_mask, d_mask)
    got = maxsim_quantized_varlen(Q, values, scales, cu, q_mask=q_mask, chunk_documents=4)
    assert got.shape == (3, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.all(got[:, [1, 4]] == 0) and torch.all(got[1] == 0)
    unmasked = maxsim_quantized_varlen(Q, values, scales, cu.to(torch.int32))
    torch.testing.assert_close(unmasked.double(), _oracle(Q, D, None, d_mask), rtol=1e-5, atol=1e-4)
    single = maxsim_quantized_varlen(Q[0], values, scales, cu, q_mask=q_mask[0])
    assert single.shape == (6,)
    torch.testing.assert_close(single, got[0], rtol=1e-5, atol=1e-5)


def test_varlen_list_of_queries_and_empty_cases():
    values, scales, cu = _packed_corpus([4, 9, 3], 16, "int8")
    queries = [torch.randn(5, 16), torch.randn(0, 16), torch.randn(2, 16)]
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales), cu)
    got = maxsim_quantized_varlen(queries, values, scales, cu)
    Q, q_mask = maxsim.pad(queries)
    torch.testing.assert_close(got.double(), _oracle(Q, D, q_mask, d_mask), rtol=1e-5, atol=1e-4)
    assert torch.all(got[1] == 0)
    no_docs = maxsim_quantized_varlen(queries, values[:0], scales[:0], torch.zeros(1, dtype=torch.int64))
    assert no_docs.shape == (3, 0)
    all_empty = maxsim_quantized_varlen(queries, values[:0], scales[:0], torch.zeros(4, dtype=torch.int64))
    assert all_empty.shape == (3, 3) and torch.all(all_empty == 0)


def test_varlen_chunking_invariance(monkeypatch):
    lengths = torch.randint(0, 15, (31,)).tolist()
    values, scales, cu = _packed_corpus(lengths, 24, "fp8_e4m3")
    Q = torch.randn(4, 6, 24).half()
    whole = maxsim_quantized_varlen(Q, values, scales, cu, chunk_documents=31)
    for chunk in (1, 2, 3, 8, 30, 64):
        torch.testing.assert_close(maxsim_quantized_varlen(Q, values, scales, cu, chunk_documents=chunk), whole,
                                   rtol=1e-4, atol=1e-4)
    for tokens in (1, 5, 40):  # the byte budget cuts documents by tokens (at least one document a chunk)
        monkeypatch.setattr(quantized, "DEFAULT_CHUNK_BYTES", tokens * 24 * 6)
        torch.testing.assert_close(maxsim_quantized_varlen(Q, values, scales, cu), whole, rtol=1e-4, atol=1e-4)
    padded_values = torch.zeros(31, max(lengths), 24, dtype=values.dtype)
    padded_scales = torch.zeros(31, max(lengths))
    d_mask = torch.zeros(31, max(lengths), dtype=torch.bool)
    for j, n in enumerate(lengths):
        padded_values[j, :n], padded_scales[j, :n] = values[cu[j]:cu[j + 1]], scales[cu[j]:cu[j + 1]]
        d_mask[j, :n] = True
    torch.testing.assert_close(maxsim_quantized(Q, padded_values, padded_scales, d_mask=d_mask), whole, rtol=1e-4, atol=1e-4)


def test_varlen_gradients_for_q_match_the_oracle():
    lengths = [6, 0, 3, 10, 4]
    values, scales, cu = _packed_corpus(lengths, 16, "int8")
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales, torch.float64), cu)
    weights = torch.randn(3, 5)
    Q = torch.randn(3, 5, 16, requires_grad=True)
    q_mask = torch.rand(3, 5) > 0.3
    (maxsim_quantized_varlen(Q, values, scales, cu, q_mask=q_mask, chunk_documents=2) * weights).sum().backward()
    Q_ref = Q.detach().double().requires_grad_(True)
    (_oracle(Q_ref, D, q_mask, d_mask) * weights.double()).sum().backward()
    torch.testing.assert_close(Q.grad.double(), Q_ref.grad, rtol=1e-4, atol=1e-5)
    assert torch.all(Q.grad[~q_mask] == 0)
    queries = [torch.randn(n, 16, requires_grad=True) for n in (4, 2, 7)]
    (maxsim_quantized_varlen(queries, values, scales, cu) * weights).sum().backward()
    for k, q in enumerate(queries):
        q_ref = q.detach().double().requires_grad_(True)
        (_oracle(q_ref[None], D, None, d_mask)[0] * weights[k].double()).sum().backward()
        torch.testing.assert_close(q.grad.double(), q_ref.grad, rtol=1e-4, atol=1e-5)


def test_backward_dequantises_each_chunk_again(monkeypatch):
    """With a gradient, each chunk runs checkpointed: its documents are dequantised once in the forward
    and once more in the backward, so no chunk's dequantised copy waits for the backward."""
    calls = []
    real = quantized.dequantize_tokens
    monkeypatch.setattr(quantized, "dequantize_tokens", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    values, scales = quantize_tokens(_tokens(10, 6, 16))
    Q = torch.randn(2, 3, 16)
    maxsim_quantized(Q, values, scales, chunk_documents=4)
    assert calls == [4, 4, 2]
    calls.clear()
    Q.requires_grad_(True)
    scores = maxsim_quantized(Q, values, scales, chunk_documents=4)
    assert calls == [4, 4, 2]
    scores.sum().backward()
    assert sorted(calls) == [2, 2, 4, 4, 4, 4]
    flat_values, flat_scales, cu = _packed_corpus([3, 5, 0, 4], 16, "int8")
    calls.clear()
    maxsim_quantized_varlen(Q, flat_values, flat_scales, cu, chunk_documents=2).sum().backward()
    assert sorted(calls) == [4, 4, 8, 8]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_add_up_across_chunks_in_fp32(dtype):
    """One document a chunk: each chunk's gradient for a half-precision Q arrives rounded to Q's dtype
    (it is maxsim_varlen's gradient), but the chunks are summed in fp32 and rounded once at the end.
    Bound: unit roundoff u times (twice the sum of the chunks' |terms| + |the gradient|)."""
    lengths = torch.randint(1, 8, (120,)).tolist()
    values, scales, cu = _packed_corpus(lengths, 16, "int8")
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales, dtype), cu)
    Q = torch.randn(2, 5, 16).to(dtype).requires_grad_(True)
    weights = torch.randn(2, 120).to(dtype).float()
    (maxsim_quantized_varlen(Q, values, scales, cu, chunk_documents=1) * weights).sum().backward()
    Q_ref = Q.detach().double().requires_grad_(True)
    (_oracle(Q_ref, D, None, d_mask) * weights.double()).sum().backward()
    assert Q.grad.dtype == dtype
    assert torch.all((Q.grad.double() - Q_ref.grad).abs() <= _half_grad_bound(Q_ref, D, d_mask, weights))


@pytest.mark.parametrize("format", FORMATS)
def test_through_the_triton_kernels(format, monkeypatch):
    """The path CUDA takes (maxsim.maxsim / maxsim_varlen's kernels): on the GPU when there is one,
    else in Triton's interpreter."""
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    lengths = [3, 0, 7, 5]
    values, scales, cu = _packed_corpus(lengths, 16, format)
    q_mask = torch.tensor([[True, True, False, True], [False, True, True, True]])
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales, torch.float16), cu)
    weights = torch.randn(2, 4).half().float()  # exact in fp16: the kernel's backward may take it so
    Q_host = torch.randn(2, 4, 16).half()
    Q = Q_host.to(KERNEL_DEVICE, copy=True).requires_grad_(True)
    on = dict(device=KERNEL_DEVICE)
    got = maxsim_quantized_varlen(Q, values.to(**on), scales.to(**on), cu.to(**on), q_mask=q_mask.to(**on),
                                  chunk_documents=2)
    (got * weights.to(**on)).sum().backward()
    Q_ref = Q_host.double().requires_grad_(True)
    expected = _oracle(Q_ref, D, q_mask, d_mask)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-3, atol=1e-3)
    assert torch.all((Q.grad.cpu().double() - Q_ref.grad).abs() <= _half_grad_bound(Q_ref, D, d_mask, weights))
    padded_values, _ = maxsim.pad([values[cu[j]:cu[j + 1]].view(torch.int8) for j in range(len(lengths))])
    padded_scales, _ = maxsim.pad([scales[cu[j]:cu[j + 1], None] for j in range(len(lengths))])
    padded = maxsim_quantized(Q.detach(), padded_values.view(values.dtype), padded_scales[..., 0], d_mask=d_mask, q_mask=q_mask,
                              mask_mode="multiply", chunk_documents=3)  # the corpus on the host, Q maybe not
    torch.testing.assert_close(padded.cpu().double(), _oracle(Q_host, D, q_mask, d_mask, "multiply"),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_inference_reads_the_bytes_in_the_stream_kernel(format, dtype, monkeypatch):
    """Without a gradient, the Triton backend scores the one-byte tokens themselves (no dequantised
    chunk): s (q . v) in fp32, against the float64 oracle; whole corpus or chunks, same scores."""
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    calls = []
    real = quantized.quantized_scores
    monkeypatch.setattr(quantized, "quantized_scores", lambda *a: calls.append(a[1].dtype) or real(*a))
    monkeypatch.setattr(quantized, "dequantize_tokens", None)  # a call would fail: no dequantised copy
    lengths = [3, 0, 7, 5, 1, 12]
    values, scales, cu = _packed_corpus(lengths, 16, format)
    on = dict(device=KERNEL_DEVICE)
    Q_host = torch.randn(2, 4, 16).to(dtype)
    q_mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    got = maxsim_quantized_varlen(Q_host.to(**on), values.to(**on), scales.to(**on), cu.to(**on), q_mask=q_mask.to(**on),
                                  quantize_query=False)
    assert calls == [values.dtype]
    D, d_mask = _padded_from_packed(values.double() * scales.double()[:, None], cu)
    expected = _oracle(Q_host, D, q_mask, d_mask)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-5, atol=1e-4)
    chunked = maxsim_quantized_varlen(Q_host.to(**on), values, scales, cu, q_mask=q_mask.to(**on), chunk_documents=2,
                                      quantize_query=False)
    assert len(calls) == 4  # host corpus, three chunks of the bytes
    # tiles fall elsewhere: fp32 sums of up to 16 products with cancellation may round ~10 ulps apart
    torch.testing.assert_close(chunked, got, rtol=1e-5, atol=1e-5)
    # quantize_query=True: the query quantised to the corpus's format, the bytes multiplied
    both = maxsim_quantized_varlen(Q_host.to(**on), values.to(**on), scales.to(**on), cu.to(**on),
                                   q_mask=q_mask.to(**on), quantize_query=True)
    q_values, q_scales = quantize_tokens(Q_host.float(), format)
    Q_read = q_values.double() * q_scales.double()[..., None]
    torch.testing.assert_close(both.cpu().double(), _oracle(Q_read, D, q_mask, d_mask), rtol=1e-5, atol=1e-4)
    # left unset, the selection's rule for this device decides (measured GPU families: quantised)
    default = maxsim_quantized_varlen(Q_host.to(**on), values.to(**on), scales.to(**on), cu.to(**on),
                                      q_mask=q_mask.to(**on))
    taken = select_varlen.quantize_query(None, device_of(Q_host.to(**on))[1])[0]
    assert torch.equal(default, both if taken else got)
    with pytest.raises(TypeError, match="quantize_query"):
        maxsim_quantized_varlen(Q_host.to(**on), values, scales, cu, quantize_query="yes")


@pytest.mark.parametrize("format", FORMATS)
def test_scales_are_the_correctly_rounded_quotient_on_every_device(format):
    """scale = amax / limit rounded once (fp32), so a token quantises to the same bytes on the CPU
    and on a GPU: CUDA divides by a Python scalar as a product with its reciprocal, 1 ulp away for
    some amax, which moved e4m3 values across a rounding boundary (seed 2617039553 of
    test_inference_reads_the_bytes_in_the_stream_kernel: a query byte one step off, a score 2.34)."""
    x = _tokens(4096, 16) * (1 + torch.rand(4096, 1, dtype=torch.float32))
    limit = 127.0 if format == "int8" else 448.0
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        values, scales = quantize_tokens(x.to(device), format)
        want = (x.double().abs().amax(-1) / limit).float()
        assert torch.equal(scales.cpu(), want), device
        if device == "cuda":  # the same bytes as the CPU's
            cpu_values, _ = quantize_tokens(x, format)
            assert torch.equal(values.cpu().view(torch.uint8), cpu_values.view(torch.uint8))


# ---------------------------------------------------------------------- bad input
def test_scoring_bad_input():
    values, scales = quantize_tokens(torch.randn(4, 5, 8))
    flat_values, flat_scales = values.reshape(20, 8), scales.reshape(20)
    cu = torch.tensor([0, 5, 12, 20])
    Q = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="values"):
        maxsim_quantized(Q, values.float(), scales)
    with pytest.raises(TypeError, match="scales"):
        maxsim_quantized(Q, values, scales.to(torch.int32))
    with pytest.raises(ValueError, match="scales must have shape"):
        maxsim_quantized(Q, values, scales[:, :4])
    for bad in (-1.0, float("nan"), float("inf")):
        broken = scales.clone()
        broken[1, 2] = bad
        with pytest.raises(ValueError, match="scales must be finite and >= 0"):
            maxsim_quantized(Q, values, broken)
        with pytest.raises(ValueError, match="scales must be finite and >= 0"):
            maxsim_quantized_varlen(Q, flat_values, broken.reshape(20), cu)
    with pytest.raises(ValueError, match="values must have shape"):
        maxsim_quantized(Q, flat_values, flat_scales)
    with pytest.raises(ValueError, match="Q must have shape"):
        maxsim_quantized(torch.randn(2, 3, 16), values, scales)
    with pytest.raises(TypeError, match="Q must"):
        maxsim_quantized(Q.double(), values, scales)
    with pytest.raises(ValueError, match="d_mask"):
        maxsim_quantized(Q, values, scales, d_mask=torch.ones(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_quantized(Q, values, scales, q_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="d_mask"):
        maxsim_quantized(Q, values, scales, d_mask=torch.full((4, 5), 3.0))
    with pytest.raises(ValueError, match="mask_mode"):
        maxsim_quantized(Q, values, scales, mask_mode="max")
    with pytest.raises(TypeError, match="normalize"):
        maxsim_quantized(Q, values, scales, normalize=1)
    for bad, error in ((0, ValueError), (-1, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="chunk_documents"):
            maxsim_quantized(Q, values, scales, chunk_documents=bad)
        with pytest.raises(error, match="chunk_documents"):
            maxsim_quantized_varlen(Q, flat_values, flat_scales, cu, chunk_documents=bad)
    with pytest.raises(ValueError, match="one device"):
        maxsim_quantized(Q, values, scales.to("meta"))
    with pytest.raises(ValueError, match="values must have shape"):
        maxsim_quantized_varlen(Q, values, scales, cu)
    for bad_cu in (torch.tensor([0, 5, 12, 19]), torch.tensor([1, 5, 12, 20]), torch.tensor([0, 12, 5, 20]),
                   torch.tensor([0.0, 5.0, 12.0, 20.0]), torch.tensor([[0, 20]]), torch.tensor([], dtype=torch.int64),
                   [0, 5, 12, 20]):
        with pytest.raises(ValueError, match="cu_seqlens_d"):
            maxsim_quantized_varlen(Q, flat_values, flat_scales, bad_cu)
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_quantized_varlen(Q, flat_values, flat_scales, cu, q_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_quantized_varlen(Q, flat_values, flat_scales, cu, q_mask=torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_quantized_varlen([Q[0]], flat_values, flat_scales, cu, q_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty list"):
        maxsim_quantized_varlen([], flat_values, flat_scales, cu)
    with pytest.raises(ValueError, match=r"Q\[1\]"):
        maxsim_quantized_varlen([Q[0], torch.randn(3, 9)], flat_values, flat_scales, cu)
    with pytest.raises(TypeError, match=r"Q\[0\]"):
        maxsim_quantized_varlen([Q[0].long()], flat_values, flat_scales, cu)


# ---------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_real_shapes(format, dtype):
    """32 queries (32 x 128) against 20K documents of up to 300 tokens, d = 128; the corpus on the GPU
    and in host memory; padded and packed; against maxsim.maxsim on the dequantised corpus."""
    lengths = torch.randint(0, 301, (20_000,))
    total = int(lengths.sum())
    x = torch.nn.functional.normalize(torch.randn(total, 128, device="cuda"), dim=-1)
    values, scales = quantize_tokens(x, format)
    del x
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device="cuda")
    cu[1:] = torch.cumsum(lengths.cuda(), 0)
    D, d_mask = maxsim.packed_to_padded(dequantize_tokens(values, scales, dtype), cu, int(lengths.max()))
    Q = torch.nn.functional.normalize(torch.randn(32, 32, 128, device="cuda"), dim=-1).to(dtype)
    expected = maxsim.maxsim(Q, D, None, d_mask)
    tolerance = dict(atol=2e-3, rtol=2e-3)
    # The stream kernel reads the bytes, s (q . v) in fp32: against the corpus dequantised in fp32,
    # not rounded to bf16 (that rounding alone moves a 32-token score by up to ~3e-3).
    D_exact, _ = maxsim.packed_to_padded(dequantize_tokens(values, scales, torch.float32), cu, int(lengths.max()))
    exact = maxsim.maxsim(Q.float(), D_exact, None, d_mask, precision="ieee")
    del D_exact
    for where in (dict(), dict(device="cpu")):  # the corpus on the GPU, or streamed from the host
        got = maxsim_quantized_varlen(Q, values.to(**where), scales.to(**where), cu.to(**where), quantize_query=False)
        torch.testing.assert_close(got, exact, **tolerance)
    padded_values, _ = maxsim.packed_to_padded(values.view(torch.int8), cu, int(lengths.max()))
    padded_values = padded_values.view(values.dtype)
    padded_scales, _ = maxsim.packed_to_padded(scales[:, None], cu, int(lengths.max()))
    got = maxsim_quantized(Q, padded_values, padded_scales[..., 0], d_mask=d_mask)
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("format", FORMATS)
def test_gpu_gradients_and_chunks(format):
    values, scales, cu = _packed_corpus(torch.randint(0, 200, (3000,)).tolist(), 128, format)
    values, scales, cu = values.cuda(), scales.cuda(), cu.cuda()
    Q = torch.randn(8, 32, 128, device="cuda", requires_grad=True)
    D, d_mask = _padded_from_packed(dequantize_tokens(values, scales), cu)
    # A pair whose best token wins by a hair may pick the runner-up under the other rounding, moving
    # a whole query token's gradient (seed 499257684, e4m3): such pairs weigh nothing here.
    clear = _clear_of_ties(Q.detach(), D, d_mask)  # [8, 3000]
    assert clear.float().mean() > 0.9
    weights = torch.randn(8, 3000, device="cuda") * clear
    (maxsim_quantized_varlen(Q, values, scales, cu, chunk_documents=700) * weights).sum().backward()
    Q_ref = Q.detach().clone().requires_grad_(True)
    (maxsim.reference.maxsim_reference(Q_ref, D, None, d_mask) * weights).sum().backward()
    torch.testing.assert_close(Q.grad, Q_ref.grad, atol=1e-3, rtol=1e-3)
