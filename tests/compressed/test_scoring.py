"""maxsim_residual / maxsim_residual_varlen / plaid_approx_score against decode + the reference."""

import pytest
import torch

import maxsim
from maxsim.compressed import ResidualCodec, maxsim_residual, maxsim_residual_varlen, plaid_approx_score
from maxsim.compressed import scoring
from maxsim.reference import maxsim_reference
from oracle import loop_maxsim


def _codec(nbits=2, dim=32, num_centroids=50):
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim), dim=-1)
    cutoffs = torch.sort(torch.randn((1 << nbits) - 1) * 0.05).values
    weights = torch.sort(torch.randn(1 << nbits) * 0.05).values
    return ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)


def _corpus(codec, lengths):
    total = sum(lengths)
    x = torch.nn.functional.normalize(torch.randn(total, codec.dim), dim=-1)
    codes, residuals = codec.encode(x)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return codes, residuals, cu


@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_matches_decoded_loop(nbits, dtype):
    codec = _codec(nbits, dim=64 if nbits == 8 else 32)
    lengths = [5, 0, 17, 1, 9]
    codes, residuals, cu = _corpus(codec, lengths)
    Q = torch.nn.functional.normalize(torch.randn(3, 7, codec.dim), dim=-1).to(dtype)
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
    decoded = codec.decode(codes, residuals, dtype=torch.float16 if dtype == torch.float16 else torch.float32)
    docs = [decoded[cu[j]:cu[j + 1]] for j in range(len(lengths))]
    expected = loop_maxsim(Q.to(decoded.dtype), docs)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.all(got[:, 1] == 0)  # the empty document


def test_padded_matches_varlen_with_lengths_masks_and_junk_padding():
    codec = _codec()
    lengths = [4, 11, 0, 7]
    codes, residuals, cu = _corpus(codec, lengths)
    Ld = max(lengths)
    padded_codes = torch.randint(0, codec.num_centroids, (4, Ld), dtype=torch.int32)  # junk in the padding
    padded_res = torch.randint(0, 256, (4, Ld, codec.packed_dim), dtype=torch.uint8)
    for j, n in enumerate(lengths):
        padded_codes[j, :n] = codes[cu[j]:cu[j + 1]]
        padded_res[j, :n] = residuals[cu[j]:cu[j + 1]]
    Q = torch.randn(2, 6, codec.dim)
    q_mask = torch.rand(2, 6) > 0.3
    q_mask[1] = False
    got = maxsim_residual(Q, padded_codes, padded_res, codec, d_lengths=torch.tensor(lengths), q_mask=q_mask)
    decoded = codec.decode(codes, residuals, dtype=torch.float32)
    expected = loop_maxsim(Q, [decoded[cu[j]:cu[j + 1]] for j in range(4)], q_mask)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    varlen = maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask)
    torch.testing.assert_close(varlen, expected, atol=1e-4, rtol=1e-4)
    single = maxsim_residual(Q[0], padded_codes, padded_res, codec, d_lengths=torch.tensor(lengths))
    assert single.shape == (4,)
    torch.testing.assert_close(single, loop_maxsim(Q[:1], [decoded[cu[j]:cu[j + 1]] for j in range(4)])[0],
                               atol=1e-4, rtol=1e-4)


def test_unnormalized_decode_and_small_chunks(monkeypatch):
    monkeypatch.setattr(scoring, "_DECODE_CHUNK_BYTES", 3 * 32 * 4)  # three tokens a chunk
    codec = _codec()
    lengths = [2, 5, 3, 1, 6]
    codes, residuals, cu = _corpus(codec, lengths)
    Q = torch.randn(2, 4, codec.dim)
    decoded = codec.decode(codes, residuals, normalize=False, dtype=torch.float32)
    expected = loop_maxsim(Q, [decoded[cu[j]:cu[j + 1]] for j in range(len(lengths))])
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec, normalize=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_gradients_for_q_flow_through():
    codec = _codec()
    lengths = [6, 3, 8]
    codes, residuals, cu = _corpus(codec, lengths)
    Q = torch.randn(2, 5, codec.dim, requires_grad=True)
    maxsim_residual_varlen(Q, codes, residuals, cu, codec).sum().backward()
    decoded = codec.decode(codes, residuals, dtype=torch.float32)
    Q_ref = Q.detach().clone().requires_grad_(True)
    D, d_mask = maxsim.pad([decoded[cu[j]:cu[j + 1]] for j in range(3)])[:2]
    maxsim_reference(Q_ref, D, None, d_mask).sum().backward()
    torch.testing.assert_close(Q.grad, Q_ref.grad)
    Q.grad = None
    padded_codes = torch.zeros(3, 8, dtype=torch.int32)
    padded_res = torch.zeros(3, 8, codec.packed_dim, dtype=torch.uint8)
    for j, n in enumerate(lengths):
        padded_codes[j, :n], padded_res[j, :n] = codes[cu[j]:cu[j + 1]], residuals[cu[j]:cu[j + 1]]
    maxsim_residual(Q, padded_codes, padded_res, codec, d_lengths=torch.tensor(lengths)).sum().backward()
    torch.testing.assert_close(Q.grad, Q_ref.grad)


def _loop_approx(Q, codes, cu, codec, threshold):
    S = Q.float() @ codec.centroids.float().T  # [Nq, Lq, C]
    out = torch.zeros(Q.shape[0], cu.numel() - 1)
    for i in range(Q.shape[0]):
        keep = S[i].max(dim=0).values >= threshold if threshold is not None else None
        for j in range(cu.numel() - 1):
            doc = codes[cu[j]:cu[j + 1]].long()
            if keep is not None:
                doc = doc[keep[doc]]
            for t in range(Q.shape[1]):
                out[i, j] += S[i, t, doc].max() if doc.numel() else scoring.EMPTY_TOKEN_SCORE
    return out


@pytest.mark.parametrize("threshold", [None, 0.0, 0.3, 5.0])
def test_plaid_approx_score_matches_loop(threshold, monkeypatch):
    monkeypatch.setattr(scoring, "_APPROX_CHUNK_BYTES", 4 * 6 * 5)  # chunks cut documents apart
    codec = _codec(num_centroids=20)
    lengths = [3, 0, 9, 4, 1]
    codes, _, cu = _corpus(codec, lengths)
    Q = torch.nn.functional.normalize(torch.randn(2, 3, codec.dim), dim=-1)
    got = plaid_approx_score(Q, codes, cu, codec, centroid_score_threshold=threshold)
    torch.testing.assert_close(got, _loop_approx(Q, codes, cu, codec, threshold))
    single = plaid_approx_score(Q[1], codes, cu, codec, centroid_score_threshold=threshold)
    torch.testing.assert_close(single, got[1])


def test_bad_inputs():
    codec = _codec()
    codes, residuals, cu = _corpus(codec, [3, 2])
    Q = torch.randn(1, 2, codec.dim)
    with pytest.raises(TypeError, match="codec"):
        maxsim_residual_varlen(Q, codes, residuals, cu, "codec")
    with pytest.raises(ValueError, match="Q"):
        maxsim_residual_varlen(torch.randn(1, 2, 8), codes, residuals, cu, codec)
    with pytest.raises(TypeError, match="Q"):
        maxsim_residual_varlen(Q.long(), codes, residuals, cu, codec)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_residual_varlen(Q, codes, residuals, torch.tensor([0, 3, 4]), codec)
    with pytest.raises(ValueError, match="residuals"):
        maxsim_residual_varlen(Q, codes, residuals[:, :2].contiguous(), cu, codec)
    with pytest.raises(ValueError, match="decode_dtype"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, decode_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="d_lengths"):
        maxsim_residual(Q, codes.reshape(1, 5), residuals.reshape(1, 5, -1), codec, d_lengths=torch.tensor([6]))
    with pytest.raises(ValueError, match="codes"):
        maxsim_residual(Q, codes, residuals, codec)


@pytest.mark.gpu
@pytest.mark.parametrize("nbits", [2, 4])
def test_gpu_real_shapes(nbits):
    """1 and 32 queries (32 x 128) against 20K documents of up to 300 tokens, d = 128."""
    codec = _codec(nbits, dim=128, num_centroids=4096).to("cuda")
    lengths = torch.randint(0, 301, (20_000,))
    total = int(lengths.sum())
    codes = torch.randint(0, 4096, (total,), dtype=torch.int32, device="cuda")
    residuals = torch.randint(0, 256, (total, codec.packed_dim), dtype=torch.uint8, device="cuda")
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device="cuda")
    cu[1:] = torch.cumsum(lengths.cuda(), 0)
    decoded = codec.decode(codes, residuals, dtype=torch.float16)
    D, d_mask = maxsim.pad([decoded[cu[j]:cu[j + 1]] for j in range(lengths.numel())])[:2]
    for num_queries in (1, 32):
        Q = torch.nn.functional.normalize(torch.randn(num_queries, 32, 128, device="cuda"), dim=-1).half()
        expected = maxsim.maxsim(Q, D, None, d_mask)
        got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
        Ld = int(lengths.max())
        got_padded = maxsim_residual(Q, codes.new_zeros(lengths.numel(), Ld).masked_scatter(d_mask, codes),
                                     residuals.new_zeros(lengths.numel(), Ld, codec.packed_dim).masked_scatter(
                                         d_mask.unsqueeze(-1), residuals), codec, d_lengths=lengths.cuda())
        torch.testing.assert_close(got_padded, expected, atol=1e-3, rtol=1e-3)
    approx = plaid_approx_score(Q[0], codes, cu, codec, centroid_score_threshold=0.4)
    assert approx.shape == (lengths.numel(),) and torch.isfinite(approx).all()


def test_padded_scorers_share_the_dense_mask_convention():
    # maxsim_residual, maxsim_pq and maxsim_quantized take the real tokens as maxsim.maxsim does:
    # q_mask, and d_mask (any pattern, by keyword) or d_lengths; each equals maxsim.maxsim on the
    # decoded tokens with that mask, and a junk code under a False never matters.
    from maxsim.compressed import ProductQuantizer, dequantize_tokens, maxsim_pq, maxsim_quantized, quantize_tokens

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    codec = _codec()
    Nd, Ld, d = 5, 9, codec.dim
    Q = torch.randn(3, 4, d, generator=g)
    q_mask = torch.rand(3, 4, generator=g) > 0.3
    d_mask = torch.rand(Nd, Ld, generator=g) > 0.4  # not a prefix
    d_mask[2] = False  # an empty document
    lengths = torch.randint(0, Ld + 1, (Nd,), generator=g)
    prefix = torch.arange(Ld) < lengths[:, None]
    tokens = torch.nn.functional.normalize(torch.randn(Nd * Ld, d, generator=g), dim=-1)
    codes, residuals = codec.encode(tokens)
    codes, residuals = codes.view(Nd, Ld), residuals.view(Nd, Ld, -1)
    decoded = codec.decode(codes, residuals, dtype=torch.float32)
    pq = ProductQuantizer.train(tokens.repeat(6, 1), 4)  # (256 tokens at least: one per centroid)
    pq_codes = pq.encode(tokens).view(Nd, Ld, 4)
    values, scales = quantize_tokens(tokens.view(Nd, Ld, d), "int8")
    cases = [(lambda **m: maxsim_residual(Q, codes, residuals, codec, q_mask=q_mask, **m), decoded),
             (lambda **m: maxsim_pq(Q, pq_codes, pq, q_mask=q_mask, **m), pq.decode(pq_codes.view(-1, 4)).view(Nd, Ld, d)),
             (lambda **m: maxsim_quantized(Q, values, scales, q_mask=q_mask, **m), dequantize_tokens(values, scales))]
    for score, D in cases:
        for given, mask in ((dict(d_mask=d_mask), d_mask), (dict(d_lengths=lengths), prefix)):
            want = maxsim.maxsim(Q, D.float(), q_mask, mask)
            torch.testing.assert_close(score(**given), want, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="d_mask or d_lengths, not both"):
            score(d_mask=d_mask, d_lengths=lengths)
