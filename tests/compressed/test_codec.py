"""ResidualCodec against colbert-ai 0.2.22's own codec (CPU), its CUDA decode rule, and numpy's packbits."""

import numpy as np
import pytest
import torch

from maxsim.compressed import ResidualCodec

NBITS = (1, 2, 4, 8)


def _codec_inputs(nbits, dim=128, num_centroids=64, tokens=300):
    """Unit centroids (fp16-representable, as colbert-ai stores them), fp16 embeddings, quantile buckets."""
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim), dim=-1).half().float()
    x = torch.nn.functional.normalize(torch.randn(tokens, dim), dim=-1).half()
    residual = x.float() - centroids[(centroids @ x.float().T).argmax(0)]
    quantiles = torch.arange(1 << nbits) / (1 << nbits)
    cutoffs = residual.flatten().quantile(quantiles[1:])
    weights = residual.flatten().quantile(quantiles + 0.5 / (1 << nbits))
    return centroids, x, cutoffs, weights


@pytest.fixture(scope="module")
def colbert_codec_cls():
    pytest.importorskip("colbert", reason="colbert-ai not installed")
    from colbert.indexing.codecs.residual import ResidualCodec as ColbertCodec
    from colbert.indexing.codecs.residual_embeddings import ResidualEmbeddings
    from colbert.infra import ColBERTConfig

    if torch.cuda.is_available():
        pytest.skip("colbert-ai's CPU codec path is taken only without a visible GPU")
    return ColbertCodec, ResidualEmbeddings, ColBERTConfig


@pytest.mark.parametrize("nbits", NBITS)
def test_encode_decode_bit_exact_with_colbert_cpu(colbert_codec_cls, nbits):
    ColbertCodec, ResidualEmbeddings, ColBERTConfig = colbert_codec_cls
    centroids, x, cutoffs, weights = _codec_inputs(nbits)
    theirs = ColbertCodec(ColBERTConfig(nbits=nbits, dim=128), centroids, avg_residual=torch.tensor(0.1),
                          bucket_cutoffs=cutoffs, bucket_weights=weights)
    compressed = theirs.compress(x)
    ours = ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)
    codes, residuals = ours.encode(x)
    assert codes.dtype == torch.int32 and residuals.dtype == torch.uint8
    assert torch.equal(codes, compressed.codes)
    assert torch.equal(residuals, compressed.residuals)
    expected = theirs.decompress(ResidualEmbeddings(compressed.codes, compressed.residuals))
    got = ours.decode(codes, residuals, dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.parametrize("nbits", NBITS)
def test_fp16_decode_follows_colbert_cuda_kernel(colbert_codec_cls, nbits):
    """decompress_residuals.cu: out = w_fp16[bucket]; out += centroids_fp16[code] (at::Half arithmetic)."""
    ColbertCodec, _, ColBERTConfig = colbert_codec_cls
    centroids, x, cutoffs, weights = _codec_inputs(nbits)
    theirs = ColbertCodec(ColBERTConfig(nbits=nbits, dim=128), centroids, avg_residual=torch.tensor(0.1),
                          bucket_cutoffs=cutoffs, bucket_weights=weights)
    compressed = theirs.compress(x)
    # the kernel's own tables: reversed_bit_map, then the bucket-combination table, per byte
    reversed_bytes = theirs.reversed_bit_map[compressed.residuals.long()]
    buckets = theirs.decompression_lookup_table[reversed_bytes.long()].reshape(x.shape[0], 128).long()
    out = weights.half()[buckets].clone()
    out += centroids.half()[compressed.codes.long()]
    ours = ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)
    got = ours.decode(compressed.codes, compressed.residuals, normalize=False, dtype=torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, out)
    normalized = ours.decode(compressed.codes, compressed.residuals, dtype=torch.float16)
    torch.testing.assert_close(normalized.float(), torch.nn.functional.normalize(out.float(), dim=-1),
                               atol=2e-3, rtol=0)


@pytest.mark.parametrize("nbits", NBITS)
def test_bit_layout_is_numpy_packbits_of_lsb_first_fields(nbits):
    dim = 64
    num_buckets = 1 << nbits
    centroids = torch.randn(5, dim)
    weights = torch.sort(torch.randn(num_buckets)).values
    codec = ResidualCodec(centroids, weights, nbits)
    buckets = torch.randint(0, num_buckets, (7, dim))
    bits = ((buckets.unsqueeze(-1).numpy() >> np.arange(nbits)) & 1).astype(np.uint8)  # [7, d, nbits]
    packed = torch.from_numpy(np.packbits(bits.reshape(7, -1), axis=1))
    codes = torch.randint(0, 5, (7,))
    got = codec.decode(codes, packed, normalize=False, dtype=torch.float32)
    assert torch.equal(got, centroids[codes] + weights[buckets])


@pytest.mark.parametrize("nbits", NBITS)
def test_encode_rule_and_roundtrip(nbits):
    dim = 32 if nbits < 8 else 64
    centroids = torch.randn(40, dim)
    x = torch.randn(200, dim)
    cutoffs = torch.sort(torch.randn((1 << nbits) - 1) * 0.5).values
    weights = torch.randn(1 << nbits)
    codec = ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)
    codes, residuals = codec.encode(x)
    assert torch.equal(codes.long(), (x @ centroids.T).argmax(1))
    residual = x - centroids[codes.long()]
    buckets = (residual.unsqueeze(-1) > cutoffs).sum(-1)  # cutoffs strictly below
    got = codec.decode(codes, residuals, normalize=False, dtype=torch.float32)
    assert torch.equal(got, centroids[codes.long()] + weights[buckets])


def test_encode_ties_take_the_first_centroid_and_cutoff_ties_go_low():
    centroids = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0, 0, 0, 0]])
    x = torch.tensor([[2.0, 0, 0, 0, 0, 0, 0, 0.25]])
    cutoffs = torch.tensor([0.0, 0.25, 1.0])
    weights = torch.tensor([-1.0, 0.1, 0.5, 2.0])
    codec = ResidualCodec(centroids, weights, 2, bucket_cutoffs=cutoffs)
    codes, residuals = codec.encode(x)
    assert codes.tolist() == [0]
    got = codec.decode(codes, residuals, normalize=False, dtype=torch.float32)
    # residual [1, 0, ..., 0.25]: 1.0 is not above cutoff 1.0 -> bucket 2; 0 -> bucket 0; 0.25 -> bucket 1
    assert got[0, 0] == 1.0 + weights[2] and got[0, 1] == weights[0] and got[0, 7] == weights[1]


def test_decode_shapes_empty_and_normalisation():
    codec = ResidualCodec(torch.randn(9, 16), torch.randn(4), 2, bucket_cutoffs=torch.sort(torch.randn(3)).values)
    codes, residuals = codec.encode(torch.randn(6, 16))
    padded = codec.decode(codes.reshape(2, 3), residuals.reshape(2, 3, codec.packed_dim), dtype=torch.float32)
    assert padded.shape == (2, 3, 16)
    torch.testing.assert_close(padded.norm(dim=-1), torch.ones(2, 3))
    empty = codec.decode(codes[:0], residuals[:0])
    assert empty.shape == (0, 16) and empty.dtype == torch.float16
    assert codec.packed_dim == 4 and codec.dim == 16 and codec.nbits == 2


@pytest.mark.parametrize("bad_nbits", [0, 3, 5, 16, 2.0, True])
def test_bad_nbits(bad_nbits):
    with pytest.raises(ValueError, match="nbits"):
        ResidualCodec(torch.randn(4, 16), torch.randn(4), bad_nbits)


def test_bad_construction_and_inputs():
    with pytest.raises(ValueError, match="multiple of 8"):
        ResidualCodec(torch.randn(4, 12), torch.randn(4), 2)
    with pytest.raises(ValueError, match="bucket_weights"):
        ResidualCodec(torch.randn(4, 16), torch.randn(8), 2)
    with pytest.raises(ValueError, match="bucket_cutoffs"):
        ResidualCodec(torch.randn(4, 16), torch.randn(4), 2, bucket_cutoffs=torch.randn(4))
    with pytest.raises(ValueError, match="centroids"):
        ResidualCodec(torch.randn(16), torch.randn(4), 2)
    codec = ResidualCodec(torch.randn(4, 16), torch.randn(4), 2)
    with pytest.raises(ValueError, match="bucket_cutoffs"):
        codec.encode(torch.randn(3, 16))
    with pytest.raises(TypeError, match="residuals"):
        codec.decode(torch.zeros(3, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="residuals"):
        codec.decode(torch.zeros(3, dtype=torch.int32), torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes"):
        codec.decode(torch.zeros(3), torch.zeros(3, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="centroid ids"):
        codec.decode(torch.tensor([0, 4]), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(torch.tensor([0]), torch.zeros(1, 4, dtype=torch.uint8), dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("nbits", [2, 4])
def test_gpu_decode_matches_cpu(nbits):
    centroids, x, cutoffs, weights = _codec_inputs(nbits, tokens=100_000, num_centroids=4096)
    codec = ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)
    codes, residuals = codec.encode(x)
    gpu = codec.to("cuda")
    for dtype in (torch.float16, torch.float32):
        cpu_out = codec.decode(codes, residuals, normalize=False, dtype=dtype)
        gpu_out = gpu.decode(codes.cuda(), residuals.cuda(), normalize=False, dtype=dtype)
        assert torch.equal(cpu_out, gpu_out.cpu())


# ---------------------------------------------------------------------- training
def _objective(x, centroids):
    """Mean cosine of each token with its best centroid (what spherical k-means maximises)."""
    x = torch.nn.functional.normalize(x.float(), dim=-1)
    return float((x @ centroids.T).max(dim=1).values.mean())


def test_train_improves_on_its_start_and_is_reproducible():
    x = torch.nn.functional.normalize(torch.randn(3000, 32), dim=-1)
    start = ResidualCodec.train(x, 2, num_centroids=64, iterations=0)  # the random start alone
    one = ResidualCodec.train(x, 2, num_centroids=64, iterations=1)
    trained = ResidualCodec.train(x, 2, num_centroids=64)
    # each Lloyd step of spherical k-means can only raise the objective
    assert _objective(x, start.centroids) <= _objective(x, one.centroids) + 1e-6
    assert _objective(x, one.centroids) <= _objective(x, trained.centroids) + 1e-6
    assert _objective(x, trained.centroids) > _objective(x, start.centroids)
    again = ResidualCodec.train(x, 2, num_centroids=64)
    assert torch.equal(again.centroids, trained.centroids) and torch.equal(again.bucket_weights, trained.bucket_weights)
    other = ResidualCodec.train(x, 2, num_centroids=64, seed=1)
    assert not torch.equal(other.centroids, trained.centroids)
    norms = trained.centroids.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


def test_train_sums_block_by_block_and_samples_large_residuals_alone(monkeypatch):
    # k-means converts its sample to fixed point a row block at a time, and past 2**23 residual
    # values computes only the drawn ones (a 2**17-centroid sample would need 67 GB otherwise):
    # the codec must be the one the whole-tensor arithmetic gives.
    import maxsim.compressed.codec as codec_module

    x = torch.nn.functional.normalize(torch.randn(70_000, 128), dim=-1)  # 8.96M values > 2**23
    whole = ResidualCodec.train(x, 2, num_centroids=32, iterations=2, sample=70_000)
    monkeypatch.setattr(codec_module, "_FIXED_BLOCK", 997)
    blocks = ResidualCodec.train(x, 2, num_centroids=32, iterations=2, sample=70_000)
    assert torch.equal(blocks.centroids, whole.centroids)
    # the buckets from the drawn values, as the full residual tensor and the same draw give them
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(x.shape[0], generator=generator)[:70_000]
    torch.randperm(70_000, generator=generator)  # k-means' random start
    points = torch.nn.functional.normalize(x[rows].float(), dim=-1)
    residual = (points - whole.centroids[(points @ whole.centroids.T).argmax(1)]).flatten()
    picked = residual[torch.randint(residual.numel(), (1 << 23,), generator=generator)]
    levels = torch.arange(4, dtype=torch.float32) / 4
    torch.testing.assert_close(whole.bucket_cutoffs, picked.quantile(levels[1:]), rtol=0, atol=0)


@pytest.mark.parametrize("nbits", NBITS)
def test_train_buckets_split_the_residuals_evenly(nbits):
    # cutoffs at the residual values' quantiles: encoding the training tokens fills every bucket
    # about equally (all tokens are in the sample here)
    x = torch.nn.functional.normalize(torch.randn(1500, 16), dim=-1)
    codec = ResidualCodec.train(x, nbits, num_centroids=32)
    assert codec.num_centroids == 32 and torch.all(codec.bucket_cutoffs[1:] >= codec.bucket_cutoffs[:-1])
    assert torch.all(codec.bucket_weights[1:] >= codec.bucket_weights[:-1])
    codes, _ = codec.encode(x)
    residual = x - codec.centroids[codes]
    buckets = torch.bucketize(residual.flatten(), codec.bucket_cutoffs)
    share = torch.bincount(buckets, minlength=1 << nbits).float() / residual.numel()
    assert float((share - 1 / (1 << nbits)).abs().max()) < 0.01
    # decoding loses little: the trained codec reconstructs the tokens far better than its centroids alone
    decoded = codec.decode(*codec.encode(x), dtype=torch.float32)
    assert float((decoded * x).sum(-1).mean()) > _objective(x, codec.centroids)


def test_train_default_count_given_centroids_and_errors():
    x = torch.nn.functional.normalize(torch.randn(4096, 16), dim=-1)
    assert ResidualCodec.train(x, 1, iterations=1).num_centroids == 1024  # 2**floor(log2(16 * 64))
    assert ResidualCodec.train(x[:5], 1).num_centroids == 5  # never more centroids than tokens
    fixed = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    assert torch.equal(ResidualCodec.train(x, 4, centroids=fixed).centroids, fixed)
    for bad in (torch.zeros(0, 16), torch.zeros(4, 16, dtype=torch.int64), torch.zeros(16), [[0.0] * 16]):
        with pytest.raises(ValueError, match="x must be"):
            ResidualCodec.train(bad, 2)
    with pytest.raises(ValueError, match="nbits"):
        ResidualCodec.train(x, 3)
    for name in ("iterations", "sample", "num_centroids"):
        with pytest.raises(ValueError, match=name):
            ResidualCodec.train(x, 2, **{name: -1})
    with pytest.raises(ValueError, match="NaN"):
        ResidualCodec.train(torch.full((4, 16), float("nan")), 2)
    with pytest.raises(ValueError, match="centroids must be"):
        ResidualCodec.train(x, 2, centroids=torch.zeros(4, 8))


@pytest.mark.gpu
def test_gpu_train_is_reproducible():
    x = torch.nn.functional.normalize(torch.randn(200_000, 128, device="cuda"), dim=-1)
    a, b = ResidualCodec.train(x, 2), ResidualCodec.train(x, 2)
    assert a.centroids.is_cuda and torch.equal(a.centroids, b.centroids)
    assert torch.equal(a.bucket_cutoffs, b.bucket_cutoffs) and torch.equal(a.bucket_weights, b.bucket_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_assignment_is_the_argmax_of_the_product(monkeypatch, dtype):
    """The assignment the codec trains and encodes with on CUDA (the packed MaxSim kernel's argmax;
    Triton's interpreter here without a GPU) picks the centroid the float64 product picks, wherever
    the best two differ by more than the inputs' rounding; encode's codes likewise."""
    from conftest import KERNEL_DEVICE

    from maxsim.compressed import codec as codec_module

    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    g = torch.Generator().manual_seed(11)
    centroids = torch.nn.functional.normalize(torch.randn(300, 64, generator=g), dim=-1)
    points = torch.nn.functional.normalize(torch.randn(1000, 64, generator=g), dim=-1)  # 8 queries, the last short
    assert codec_module._fused_assignment(torch.device(KERNEL_DEVICE))
    got = codec_module._nearest(points.to(KERNEL_DEVICE, dtype), centroids.to(KERNEL_DEVICE)).cpu()
    exact = points.to(dtype).double() @ centroids.to(dtype).double().T  # [n, C]
    top2 = exact.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert clear.float().mean() > 0.5 and got.dtype == torch.int64 and got.shape == (1000,)
    assert torch.equal(got[clear], exact.argmax(1)[clear])
    cutoffs = torch.tensor([-0.05, 0.0, 0.05])
    codec = ResidualCodec(centroids, torch.tensor([-0.08, -0.02, 0.02, 0.08]), 2, bucket_cutoffs=cutoffs)
    codes, _ = codec.to(KERNEL_DEVICE).encode(points.to(KERNEL_DEVICE), dtype=dtype)
    assert torch.equal(codes.cpu().long()[clear], exact.argmax(1)[clear])
