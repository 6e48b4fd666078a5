"""Residual (PLAID) tokens decoded on chip by the packed stream kernel (maxsim/compressed/forward.py,
maxsim/varlen/stream.py) against the chunked path (decode, then maxsim) and an independent float64
loop over decoded tokens; the calls the kernel does not take (padded documents, gradients) on the
chunked path.

Without a GPU the kernel runs in Triton's interpreter (MAXSIM_BACKEND=triton); the chunked path is
the oracle, run under MAXSIM_BACKEND=reference.
"""

import pytest
import torch
from conftest import KERNEL_DEVICE

from maxsim.compressed import ResidualCodec, maxsim_residual, maxsim_residual_varlen, specs
from maxsim.compressed.forward import decode_tables
from maxsim.selection import compressed as select


NBITS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


@pytest.fixture
def on_chip(monkeypatch):
    """How many calls reached the stream kernel's on-chip decode."""
    from maxsim.compressed import scoring

    calls = []
    real = scoring.residual_stream_forward
    monkeypatch.setattr(scoring, "residual_stream_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _codec(nbits, dim, num_centroids=40):
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim), dim=-1)
    cutoffs = torch.sort(torch.randn((1 << nbits) - 1) * 0.05).values
    weights = torch.sort(torch.randn(1 << nbits) * 0.05).values
    return ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs).to(KERNEL_DEVICE)


def _corpus(codec, lengths, code_dtype=torch.int32):
    """Random unit tokens encoded by the codec: codes [T], residuals [T, P], cu_seqlens [Nd + 1]."""
    x = torch.nn.functional.normalize(torch.randn(sum(lengths), codec.dim, device=KERNEL_DEVICE), dim=-1)
    codes, residuals = codec.encode(x)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=KERNEL_DEVICE)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=KERNEL_DEVICE), 0)
    return codes.to(code_dtype), residuals, cu


def _chunked(monkeypatch, fn, *args, **kw):
    """The same call on the PyTorch backend (decode in chunks, then maxsim's reference)."""
    with monkeypatch.context() as m:
        m.setenv("MAXSIM_BACKEND", "reference")
        return fn(*args, **kw)


def _loop_oracle(Q, decoded, cu, q_mask=None):
    """float64: per (query, document) the max over the document's decoded tokens, summed over the
    real query tokens; empty documents 0."""
    Q = Q.unsqueeze(0) if Q.dim() == 2 else Q
    out = torch.zeros(Q.shape[0], cu.numel() - 1, dtype=torch.float64)
    for i in range(Q.shape[0]):
        q = Q[i].double().cpu()
        if q_mask is not None:
            q = q[q_mask[i].cpu()]
        for j in range(cu.numel() - 1):
            doc = decoded[cu[j]:cu[j + 1]].double().cpu()
            if doc.shape[0] and q.shape[0]:
                out[i, j] = (q @ doc.T).max(dim=1).values.sum()
    return out


def _tolerance(dtype, normalize):
    # fp16 decode with normalize: the kernel divides each token's column of scores by its norm
    # after the dot, where the codec rounds every normalised dimension to fp16 (up to 2**-11
    # relative each); and the fp16-rounded norm can land one fp16 step apart when the fp32 sum of
    # squares is ordered differently, moving that token's similarities by ~5e-4 relative.
    # Everything else agrees to fp32 rounding.
    if dtype == torch.float16 and normalize:
        return dict(atol=2e-3, rtol=1e-3)
    return dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_varlen_matches_chunked(monkeypatch, on_chip, nbits, normalize, dtype):
    codec = _codec(nbits, dim=32)
    lengths = [5, 0, 17, 1, 33, 16, 0]  # ragged, empty, one token, tile edges (BN 16 in the interpreter)
    codes, residuals, cu = _corpus(codec, lengths)
    Q = torch.nn.functional.normalize(torch.randn(3, 7, codec.dim, device=KERNEL_DEVICE), dim=-1).to(dtype)
    q_mask = torch.rand(3, 7, device=KERNEL_DEVICE) > 0.3
    q_mask[2] = False  # a query with no real token
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask, normalize=normalize,
                                 decode_dtype=dtype)
    expected = _chunked(monkeypatch, maxsim_residual_varlen, Q, codes, residuals, cu, codec, q_mask=q_mask,
                        normalize=normalize, decode_dtype=dtype)
    assert got.shape == (3, 7) and got.dtype == torch.float32 and got.device.type == KERNEL_DEVICE
    torch.testing.assert_close(got, expected, **_tolerance(dtype, normalize))
    decoded = codec.decode(codes, residuals, normalize=normalize, dtype=dtype)
    oracle = _loop_oracle(Q.to(dtype), decoded, cu.cpu(), q_mask).float()
    torch.testing.assert_close(got.cpu(), oracle, **_tolerance(dtype, normalize))
    assert torch.all(got[:, 1] == 0) and torch.all(got[:, 6] == 0) and torch.all(got[2] == 0)
    assert len(on_chip) == 1


@pytest.mark.parametrize("nbits,dim", [(8, 24), (1, 8), (2, 40), (4, 72)])
def test_dims_not_a_power_of_two(monkeypatch, on_chip, nbits, dim):
    """d padded to the next power of two on chip (and d = 8 to the dot's 16)."""
    codec = _codec(nbits, dim)
    lengths = [3, 20, 9]
    codes, residuals, cu = _corpus(codec, lengths)
    Q = torch.randn(2, 5, dim, device=KERNEL_DEVICE)
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
    expected = _chunked(monkeypatch, maxsim_residual_varlen, Q, codes, residuals, cu, codec)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert len(on_chip) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_padded_with_lengths_junk_padding_and_2d_query(monkeypatch, dtype):
    codec = _codec(2, 32)
    lengths = [4, 19, 0, 7, 16]
    codes, residuals, cu = _corpus(codec, lengths)
    Ld = max(lengths)
    # junk in the padding, out-of-range codes included: never read
    padded_codes = torch.randint(-5, 10 * codec.num_centroids, (5, Ld), dtype=torch.int32, device=KERNEL_DEVICE)
    padded_res = torch.randint(0, 256, (5, Ld, codec.packed_dim), dtype=torch.uint8, device=KERNEL_DEVICE)
    for j, n in enumerate(lengths):
        padded_codes[j, :n] = codes[cu[j]:cu[j + 1]]
        padded_res[j, :n] = residuals[cu[j]:cu[j + 1]]
    doc_lengths = torch.tensor(lengths, device=KERNEL_DEVICE)
    Q = torch.nn.functional.normalize(torch.randn(2, 6, codec.dim, device=KERNEL_DEVICE), dim=-1).to(dtype)
    q_mask = torch.rand(2, 6, device=KERNEL_DEVICE) > 0.4
    got = maxsim_residual(Q, padded_codes, padded_res, codec, d_lengths=doc_lengths, q_mask=q_mask)
    expected = _chunked(monkeypatch, maxsim_residual, Q, padded_codes, padded_res, codec, d_lengths=doc_lengths,
                        q_mask=q_mask)
    torch.testing.assert_close(got, expected, **_tolerance(dtype, True))
    # padded documents take the chunked path, packed ones the stream kernel: the same scores up to
    # the decode dtype's rounding of each normalised token (which the kernel does not round)
    varlen = maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask)
    torch.testing.assert_close(got, varlen, **_tolerance(dtype, True))
    single = maxsim_residual(Q[1], padded_codes, padded_res, codec, d_lengths=doc_lengths)
    assert single.shape == (5,)
    torch.testing.assert_close(single, maxsim_residual_varlen(Q[1:], codes, residuals, cu, codec)[0],
                               **_tolerance(dtype, True))
    # without doc_lengths every token is real (no padding in this corpus of equal lengths)
    full = maxsim_residual(Q, codes[:16].reshape(2, 8), residuals[:16].reshape(2, 8, -1), codec)
    even = torch.tensor([0, 8, 16], device=KERNEL_DEVICE)
    torch.testing.assert_close(full, maxsim_residual_varlen(Q, codes[:16], residuals[:16], even, codec),
                               **_tolerance(dtype, True))


def test_long_query_chunks_and_int64_codes(monkeypatch, on_chip):
    """Lq = 70 > BM (64 in the interpreter): the query is cut into chunks whose sums are added."""
    codec = _codec(4, 32)
    lengths = [12, 40, 1]
    codes, residuals, cu = _corpus(codec, lengths, code_dtype=torch.int64)
    Q = torch.randn(2, 70, codec.dim, device=KERNEL_DEVICE)
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
    expected = _chunked(monkeypatch, maxsim_residual_varlen, Q, codes, residuals, cu, codec)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=2e-5)
    assert len(on_chip) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
def test_gradients_for_q(monkeypatch, on_chip, dtype, normalize):
    """A Q that needs a gradient takes the chunked path (the stream kernel saves no argmax)."""
    codec = _codec(2, 32)
    lengths = [6, 0, 21, 3]
    codes, residuals, cu = _corpus(codec, lengths)
    Q0 = torch.randn(2, 5, codec.dim, device=KERNEL_DEVICE)
    q_mask = torch.rand(2, 5, device=KERNEL_DEVICE) > 0.3
    weights = torch.randn(2, 4, device=KERNEL_DEVICE)  # a non-uniform upstream gradient
    Q = Q0.clone().requires_grad_(True)
    (maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask, normalize=normalize,
                            decode_dtype=dtype) * weights).sum().backward()
    Q_ref = Q0.clone().requires_grad_(True)
    (_chunked(monkeypatch, maxsim_residual_varlen, Q_ref, codes, residuals, cu, codec, q_mask=q_mask,
              normalize=normalize, decode_dtype=dtype) * weights).sum().backward()
    assert Q.grad.dtype == Q.dtype and not on_chip
    # With fp16 decode both gradients are rounded to fp16 once, after sums taken in different
    # orders: one fp16 step apart at most (a wrong winner would move an entry by a whole token).
    grad_tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else _tolerance(dtype, normalize)
    torch.testing.assert_close(Q.grad, Q_ref.grad, **grad_tol)
    assert torch.all(Q.grad[~q_mask] == 0)
    # independently: the winner of each real query token, decoded, weighted and summed
    decoded = codec.decode(codes, residuals, normalize=normalize, dtype=dtype).double()
    Qd = Q0.to(dtype).double()
    expected = torch.zeros_like(Qd)
    for i in range(2):
        for j, n in enumerate(lengths):
            if n:
                doc = decoded[cu[j]:cu[j + 1]]
                win = (Qd[i] @ doc.T).argmax(dim=1)
                expected[i] += weights[i, j].double() * doc[win] * q_mask[i, :, None]
    # (with fp16 decode the gradient reaches Q through the fp16 cast: rounded to fp16 once)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else _tolerance(dtype, normalize)
    torch.testing.assert_close(Q.grad.double(), expected, **tol)


def test_padded_gradients_for_2d_query(monkeypatch):
    codec = _codec(4, 32)
    codes, residuals, _ = _corpus(codec, [30])
    codes, residuals = codes.reshape(3, 10), residuals.reshape(3, 10, -1)
    lengths = torch.tensor([10, 4, 0], device=KERNEL_DEVICE)
    Q = torch.randn(6, codec.dim, device=KERNEL_DEVICE, requires_grad=True)
    maxsim_residual(Q, codes, residuals, codec, d_lengths=lengths).sum().backward()
    Q_ref = Q.detach().clone().requires_grad_(True)
    _chunked(monkeypatch, maxsim_residual, Q_ref, codes, residuals, codec, d_lengths=lengths).sum().backward()
    torch.testing.assert_close(Q.grad, Q_ref.grad, atol=2e-5, rtol=2e-5)


def test_bad_code_scores_nan_in_its_document_only(monkeypatch, on_chip):
    codec = _codec(2, 32)
    codes, residuals, cu = _corpus(codec, [4, 5, 6])
    codes[6] = codec.num_centroids  # in document 1
    Q = torch.randn(2, 3, codec.dim, device=KERNEL_DEVICE)
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
    assert torch.isnan(got[:, 1]).all() and torch.isfinite(got[:, [0, 2]]).all() and len(on_chip) == 1
    with pytest.raises(ValueError, match="codes"):  # the PyTorch backend checks the codes first
        _chunked(monkeypatch, maxsim_residual_varlen, Q, codes, residuals, cu, codec)


def test_bad_inputs():
    codec = _codec(2, 32)
    codes, residuals, cu = _corpus(codec, [3, 2])
    Q = torch.randn(1, 2, codec.dim, device=KERNEL_DEVICE)
    with pytest.raises(TypeError, match="normalize"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, normalize=1)
    with pytest.raises(TypeError, match="normalize"):
        maxsim_residual(Q, codes.reshape(1, 5), residuals.reshape(1, 5, -1), codec, normalize="yes")
    with pytest.raises(ValueError, match="decode_dtype"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, decode_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="residuals"):
        maxsim_residual_varlen(Q, codes, residuals.to(torch.int32), cu, codec)
    with pytest.raises(TypeError, match="codes"):
        maxsim_residual_varlen(Q, codes.float(), residuals, cu, codec)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_residual_varlen(Q, codes, residuals, torch.tensor([0, 4, 3]), codec)
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=torch.ones(2, 2, dtype=torch.bool))


def test_empty_calls():
    codec = _codec(2, 32)
    codes, residuals, cu = _corpus(codec, [3, 2])
    Q = torch.randn(2, 4, codec.dim, device=KERNEL_DEVICE)
    none = torch.zeros(1, dtype=torch.int64, device=KERNEL_DEVICE)
    assert maxsim_residual_varlen(Q, codes[:0], residuals[:0], none, codec).shape == (2, 0)
    empty_docs = torch.zeros(4, dtype=torch.int64, device=KERNEL_DEVICE)
    assert torch.equal(maxsim_residual_varlen(Q, codes[:0], residuals[:0], empty_docs, codec),
                       torch.zeros(2, 3, device=KERNEL_DEVICE))
    assert torch.equal(maxsim_residual_varlen(Q[:, :0], codes, residuals, cu, codec),
                       torch.zeros(2, 2, device=KERNEL_DEVICE))


def test_decode_tables_fold_the_bit_reversal():
    """weights_by_field[v] is the weight of the bucket whose bits are v's reversed; fp16 rounding once;
    the centroids in plane order."""
    for nbits in NBITS:
        codec = _codec(nbits, 16)
        centroids, by_field = decode_tables(codec, torch.float16, KERNEL_DEVICE)
        assert centroids.dtype == torch.float16 and centroids.is_contiguous()
        per_byte, packed = 8 // nbits, codec.packed_dim  # plane k, column p: dimension p * per_byte + k
        for k in range(per_byte):
            assert torch.equal(centroids[:, k * packed:(k + 1) * packed], codec.centroids[:, k::per_byte].half())
        for v in range(1 << nbits):
            bucket = int(format(v, f"0{nbits}b")[::-1], 2)
            assert by_field[v] == codec.bucket_weights[bucket].half()
        assert decode_tables(codec, torch.float16, KERNEL_DEVICE)[1] is by_field  # cached
        codec.bucket_weights.mul_(2)  # an in-place change is seen
        assert decode_tables(codec, torch.float16, KERNEL_DEVICE)[1] is not by_field


def test_selection():
    choice = select.forward_choice(1, 32, 128, torch.float16, "packed", False, True, False, "sm90")
    assert choice.kernel is specs.FUSED_FORWARD
    assert choice.config["BM"] == 32 and "compressed_bench" in choice.record  # the measured one-query tile
    assert choice.config["BN"] * 128 <= 8192
    wide = select.forward_choice(1, 32, 2048, torch.float16, "packed", False, True, False, "sm90")
    assert wide.kernel is specs.CHUNKED_DECODE and "d = 2048" in wide.rejected[0][1]
    interp = select.forward_choice(4, 32, 128, torch.float32, "packed", True, True, False, "interpreter")
    assert interp.kernel is specs.FUSED_FORWARD and interp.config["num_stages"] == 1
    for layout, argmax in (("padded", False), ("packed", True)):  # padded documents, training
        other = select.forward_choice(4, 32, 128, torch.float16, layout, False, True, argmax, "sm90")
        assert other.kernel is specs.CHUNKED_DECODE
    codec = _codec(2, 32)
    text = str(select.explain_residual(torch.randn(32, 32), codec, num_docs=10, gpu="sm90"))
    assert "compressed.stream_forward" in text and "not compressed.chunked_decode" in text


@pytest.mark.gpu
@pytest.mark.parametrize("nbits", [2, 4])
def test_gpu_one_query_100k_documents(nbits):
    """1 query (32 tokens, d 128) x 100K documents of 1-160 tokens from 4096 centroids: the fused
    kernel against decode + maxsim.maxsim_varlen (fp16) and the chunked path, and its gradient."""
    import maxsim

    codec = _codec(nbits, 128, num_centroids=4096).to("cuda")
    lengths = torch.randint(1, 161, (100_000,), device="cuda")
    lengths[::97] = 0  # some empty documents
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device="cuda")
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    codes = torch.randint(0, 4096, (total,), dtype=torch.int32, device="cuda")
    residuals = torch.randint(0, 256, (total, codec.packed_dim), dtype=torch.uint8, device="cuda")
    Q = torch.nn.functional.normalize(torch.randn(1, 32, 128, device="cuda"), dim=-1).half()
    decoded = codec.decode(codes, residuals, dtype=torch.float16)
    q_cu = torch.tensor([0, 32], device="cuda")
    expected = maxsim.maxsim_varlen(Q[0], decoded, q_cu, cu, max_seqlen_q=32, max_seqlen_d=160)
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert torch.all(got[0, ::97] == 0)
    Qg = Q.float().requires_grad_(True)
    weights = torch.randn(1, 100_000, device="cuda")
    (maxsim_residual_varlen(Qg, codes, residuals, cu, codec, decode_dtype=torch.float16) * weights).sum().backward()
    Qr = Q.float().requires_grad_(True)
    (maxsim.maxsim_varlen(Qr[0].half(), decoded, q_cu, cu, max_seqlen_q=32) * weights).sum().backward()
    # Scores agree to fp16 rounding, not bitwise: a near-tie may pick another winner in a few of
    # the 100K documents, moving a few entries of a gradient summed over all of them. A wrong
    # gradient (wrong token, lost document) is off by O(1) in norm (relative to the whole gradient).
    assert float((Qg.grad - Qr.grad).norm() / Qr.grad.norm()) < 1e-2


@pytest.mark.gpu
def test_gpu_many_queries_fp32_decode(monkeypatch, on_chip):
    """32 queries (stacked rows) x 20K packed documents of 0-64 tokens, fp32 decode, q_mask: the
    stream kernel's decode = chunked."""
    codec = _codec(2, 128, num_centroids=4096).to("cuda")
    lengths = torch.randint(0, 65, (20_000,), device="cuda")
    cu = torch.zeros(20_001, dtype=torch.int64, device="cuda")
    cu[1:] = torch.cumsum(lengths, 0)
    codes = torch.randint(0, 4096, (int(cu[-1]),), dtype=torch.int32, device="cuda")
    residuals = torch.randint(0, 256, (int(cu[-1]), codec.packed_dim), dtype=torch.uint8, device="cuda")
    Q = torch.nn.functional.normalize(torch.randn(32, 32, 128, device="cuda"), dim=-1)
    q_mask = torch.rand(32, 32, device="cuda") > 0.2
    got = maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask, decode_dtype=torch.float32)
    expected = _chunked(monkeypatch, maxsim_residual_varlen, Q, codes, residuals, cu, codec, q_mask=q_mask,
                        decode_dtype=torch.float32)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    assert len(on_chip) == 1
