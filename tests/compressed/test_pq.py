"""ProductQuantizer (train / encode / decode / save / load) and maxsim_pq / maxsim_pq_varlen
against brute-force nearest centroids, the decoded corpus scored by maxsim and a float64 loop."""

import numpy as np
import pytest
import torch

import maxsim
from maxsim.compressed import pq as pq_module
from maxsim.compressed.pq import ProductQuantizer, maxsim_pq, maxsim_pq_varlen
from maxsim.reference import maxsim_reference
from oracle import loop_maxsim


def _random_pq(m=4, sub_dim=4, device="cpu"):
    return ProductQuantizer(torch.randn(m, 256, sub_dim, device=device))


def _random_codes(shape, m, dtype=torch.uint8):
    return torch.randint(0, 256, (*shape, m)).to(dtype)


def _loop_decode(pq, codes):
    """codes [T, m] -> [T, d]: concatenate codebook rows, one sub-space at a time."""
    parts = [pq.codebooks[j][codes[:, j].long()] for j in range(pq.m)]
    return torch.cat(parts, dim=-1)


def _quantisation_error(pq, x):
    return float((pq.decode(pq.encode(x)) - x).square().sum(-1).mean())


def _clustered(num_points, dim, num_clusters=40, spread=0.1):
    centers = torch.randn(num_clusters, dim) * 3
    return centers[torch.randint(num_clusters, (num_points,))] + spread * torch.randn(num_points, dim)


# ---------------------------------------------------------------------- training
def test_train_is_deterministic_for_a_seed():
    x = torch.randn(1500, 16)
    first = ProductQuantizer.train(x, 4, iterations=5, sample=1000, seed=3)
    again = ProductQuantizer.train(x, 4, iterations=5, sample=1000, seed=3)
    other = ProductQuantizer.train(x, 4, iterations=5, sample=1000, seed=4)
    assert first.codebooks.shape == (4, 256, 4) and first.codebooks.dtype == torch.float32
    assert torch.equal(first.codebooks, again.codebooks)
    assert not torch.equal(first.codebooks, other.codebooks)


def test_train_shows_progress_when_asked(capsys):
    pytest.importorskip("tqdm")
    x = torch.randn(600, 8)
    shown = ProductQuantizer.train(x, 2, iterations=3, seed=1, progress=True)
    assert "maxsim PQ k-means" in capsys.readouterr().err
    quiet = ProductQuantizer.train(x, 2, iterations=3, seed=1, progress=False)
    assert capsys.readouterr().err == "" and torch.equal(shown.codebooks, quiet.codebooks)


def test_kmeans_lowers_quantisation_error():
    x = torch.cat([_clustered(3000, 16), torch.randn(1000, 16)])
    trained = ProductQuantizer.train(x, 4, iterations=15, seed=0)
    seeding_only = ProductQuantizer.train(x, 4, iterations=0, seed=0)
    # baselines: 256 random data points per sub-space, and Gaussian codebooks of the data's scale
    sub = x.reshape(-1, 4, 4)
    picks = torch.stack([torch.randperm(x.shape[0])[:256] for _ in range(4)])  # [m, 256]
    sampled = ProductQuantizer(torch.stack([sub[picks[j], j] for j in range(4)]))
    gaussian = ProductQuantizer(torch.randn(4, 256, 4) * x.std())
    error = _quantisation_error(trained, x)
    assert error < 0.9 * _quantisation_error(sampled, x)
    assert error < 0.5 * _quantisation_error(gaussian, x)
    assert error < 0.9 * _quantisation_error(seeding_only, x)  # the Lloyd iterations help


def test_train_on_fewer_distinct_points_than_centroids():
    # 30 distinct tokens repeated: many clusters stay empty and are re-seeded; every distinct
    # sub-vector ends up a centroid, so the round trip is exact and nothing is NaN
    distinct = torch.randn(30, 12)
    x = distinct[torch.randint(30, (600,))]
    pq = ProductQuantizer.train(x.half(), 3, iterations=4)
    assert torch.isfinite(pq.codebooks).all()
    torch.testing.assert_close(pq.decode(pq.encode(x.half().float())), x.half().float(), atol=0, rtol=0)


def test_empty_cluster_is_reseeded_with_the_farthest_point():
    points = torch.randn(1, 400, 2)  # [m, n, s]
    centers = points[:, :256].clone()
    centers[0, 7] = 1e6  # a center no point is near
    assignment, distance = pq_module._assign(points, centers)
    assert not bool((assignment == 7).any())
    reseeded = pq_module._update(points, centers, assignment, distance)
    assert reseeded
    farthest = int(torch.argmax(distance[0]))
    torch.testing.assert_close(centers[0, 7], points[0, farthest])


def test_lloyd_update_moves_centers_to_the_means():
    points = torch.randn(3, 900, 5)  # [m, n, s]
    centers = torch.randn(3, 256, 5)
    # every cluster 0..199 gets at least one point, clusters 200..255 none
    labels = torch.cat([torch.arange(200).expand(3, -1), torch.randint(0, 200, (3, 700))], dim=1)
    assignment = labels.gather(1, torch.stack([torch.randperm(900) for _ in range(3)]))  # [m, n]
    distance = torch.rand(3, 900)
    assert pq_module._update(points, centers, assignment, distance)
    for j in range(3):
        for c in range(200):
            members = points[j][assignment[j] == c]
            torch.testing.assert_close(centers[j, c], members.double().mean(0).float())
    # every empty cluster got a training point, the farthest ones first
    reseeded = centers[:, 200:]  # [m, 56, s]
    for j in range(3):
        farthest = torch.sort(distance[j], descending=True, stable=True).indices[:56]
        torch.testing.assert_close(reseeded[j], points[j, farthest])


def test_seeding_on_a_subset_stays_deterministic_and_good(monkeypatch):
    monkeypatch.setattr(pq_module, "_SEEDING_POINTS", 300)
    x = _clustered(2000, 8)
    first = ProductQuantizer.train(x, 2, iterations=8, seed=1)
    assert torch.equal(first.codebooks, ProductQuantizer.train(x, 2, iterations=8, seed=1).codebooks)
    monkeypatch.undo()
    full_seeding = ProductQuantizer.train(x, 2, iterations=8, seed=1)
    assert _quantisation_error(first, x) < 1.5 * _quantisation_error(full_seeding, x)


def test_train_uses_the_sample_and_the_device_of_x():
    x = torch.randn(3000, 8)
    pq = ProductQuantizer.train(x, 2, iterations=2, sample=300)
    assert pq.device == x.device and pq.dim == 8 and pq.m == 2 and pq.sub_dim == 4
    assert "m=2" in repr(pq) and "d=8" in repr(pq)


# ---------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_encode_is_the_brute_force_nearest_centroid(dtype):
    pq = _random_pq(m=4, sub_dim=3)
    x = torch.randn(700, 12).to(dtype)
    codes = pq.encode(x)
    assert codes.shape == (700, 4) and codes.dtype == torch.uint8
    xs = x.double().reshape(700, 4, 1, 3)
    distance = (xs - pq.codebooks.double().unsqueeze(0)).square().sum(-1)  # [T, m, 256] float64
    expected = distance.argmin(-1)
    agree = codes.long() == expected
    assert agree.float().mean() > 0.999
    # where fp32 rounding picks another centroid, it is as near as the nearest, to rounding
    chosen = distance.gather(-1, codes.long().unsqueeze(-1)).squeeze(-1)
    best = distance.min(-1).values
    assert torch.all(chosen - best <= 1e-5 * (1 + best))


def test_encode_is_exact_under_reduced_matmul_precision():
    # the shortlist's rounding bound widens with the matmul precision: the choice stays exact
    pq = _random_pq(m=2, sub_dim=8)
    x = torch.randn(300, 16)
    expected = pq.encode(x)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert torch.equal(pq.encode(x), expected)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_encode_ties_go_to_the_lowest_index():
    codebooks = torch.randn(2, 256, 4)
    # duplicate centroids: exactly equal distances. Six copies in sub-space 0 (more than encode's
    # shortlist holds), three in sub-space 1 (decided inside the shortlist)
    codebooks[0, [40, 90, 200, 230, 255]] = codebooks[0, 17].clone()
    codebooks[1, [100, 255]] = codebooks[1, 3].clone()
    pq = ProductQuantizer(codebooks)
    x = torch.cat([codebooks[0, 17], codebooks[1, 3]]).unsqueeze(0) + 1e-3 * torch.randn(5, 8)
    codes = pq.encode(x)
    assert torch.all(codes[:, 0] == 17) and torch.all(codes[:, 1] == 3)


@pytest.mark.parametrize("m,sub_dim,dtype", [(4, 3, torch.float32), (3, 4, torch.float16), (2, 8, torch.bfloat16)])
def test_encode_kernel_is_the_brute_force_nearest_centroid(m, sub_dim, dtype):
    """The fused kernel (the CUDA path of encode; the interpreter without a GPU): the nearest of all
    256 centroids to fp32 rounding, the lowest index on exact ties, rows past a block's end untouched."""
    from conftest import KERNEL_DEVICE
    from maxsim.compressed.pq_encode import pq_encode

    codebooks = torch.randn(m, 256, sub_dim)
    codebooks[0, [40, 200, 255]] = codebooks[0, 17].clone()  # exact ties in sub-space 0
    x = torch.randn(77, m * sub_dim)
    x[:5, :sub_dim] = codebooks[0, 17] + 1e-3 * torch.randn(5, sub_dim)
    x = x.to(dtype)
    codes = pq_encode(x.to(KERNEL_DEVICE), codebooks.to(KERNEL_DEVICE), block_tokens=16).cpu()
    assert codes.shape == (77, m) and codes.dtype == torch.uint8
    distance = (x.double().reshape(77, m, 1, sub_dim) - codebooks.double().unsqueeze(0)).square().sum(-1)
    chosen = distance.gather(-1, codes.long().unsqueeze(-1)).squeeze(-1)
    best = distance.min(-1).values
    assert torch.all(chosen - best <= 1e-5 * (1 + best))
    assert (codes.long() == distance.argmin(-1)).float().mean() > 0.99
    assert torch.all(codes[:5, 0] == 17)  # the first of the four equal centroids
    assert torch.equal(pq_encode(x[:0].to(KERNEL_DEVICE), codebooks.to(KERNEL_DEVICE)).cpu(), codes[:0])
    with pytest.raises(ValueError, match="256 centroids"):
        pq_encode(x.to(KERNEL_DEVICE), codebooks[:, :128].to(KERNEL_DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of encode")
def test_encode_on_the_gpu_agrees_with_the_cpu():
    pq = _random_pq(m=16, sub_dim=8)
    x = torch.randn(5000, 128)
    on_gpu = ProductQuantizer(pq.codebooks.cuda()).encode(x.cuda()).cpu()
    on_cpu = pq.encode(x)
    assert (on_gpu == on_cpu).float().mean() > 0.999  # the rest: fp32 near-ties, either is the nearest
    assert ProductQuantizer(pq.codebooks.cuda()).encode(x.cuda().reshape(50, 100, 128)).shape == (50, 100, 16)


def test_decode_encode_round_trip_on_centroids():
    pq = _random_pq(m=5, sub_dim=2)
    codes = _random_codes((300,), 5)
    decoded = pq.decode(codes)
    assert decoded.dtype == torch.float32 and decoded.shape == (300, 10)
    assert torch.equal(decoded, _loop_decode(pq, codes))
    assert torch.equal(pq.encode(decoded), codes)
    for dtype in (torch.int32, torch.int64):
        assert torch.equal(pq.decode(codes.to(dtype)), decoded)
    batched = codes.reshape(30, 10, 5)
    assert torch.equal(pq.decode(batched), decoded.reshape(30, 10, 10))
    assert pq.encode(torch.zeros(0, 10)).shape == (0, 5)


# ---------------------------------------------------------------------- scoring
def _padded_corpus(pq, lengths, Ld, codes_dtype=torch.uint8, junk_padding=False):
    """codes [Nd, Ld, m] with doc_lengths; padding holds random codes (or, for int dtypes,
    values outside [0, 256) with junk_padding) that must never be read."""
    codes = _random_codes((len(lengths), Ld), pq.m, torch.int64)
    mask = torch.arange(Ld) < torch.tensor(lengths)[:, None]  # [Nd, Ld]
    if junk_padding:
        codes = torch.where(mask.unsqueeze(-1), codes, torch.full_like(codes, 999))
    codes = codes.to(codes_dtype)
    docs = [pq.decode(codes[j, :n]) if n else torch.zeros(0, pq.dim) for j, n in enumerate(lengths)]
    return codes, torch.tensor(lengths), mask, docs


@pytest.mark.parametrize("chunk_documents", [None, 1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_padded_scores_match_maxsim_on_the_decoded_corpus(chunk_documents, q_dtype):
    pq = _random_pq(m=4, sub_dim=4)
    lengths = [9, 0, 4, 12, 1, 7, 12]
    codes, doc_lengths, d_mask, docs = _padded_corpus(pq, lengths, 12)
    Q = torch.randn(3, 6, 16).to(q_dtype)
    q_mask = torch.rand(3, 6) > 0.3
    q_mask[2] = False
    got = maxsim_pq(Q, codes, pq, d_lengths=doc_lengths, q_mask=q_mask, chunk_documents=chunk_documents)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    D = pq.decode(codes)  # [Nd, Ld, d], padding decoded too and masked out
    expected = maxsim.maxsim(Q.float(), D, q_mask, d_mask)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, loop_maxsim(Q.float(), docs, q_mask), atol=1e-4, rtol=1e-4)
    assert torch.all(got[:, 1] == 0) and torch.all(got[2] == 0)  # empty document, all-masked query


@pytest.mark.parametrize("codes_dtype", [torch.int32, torch.int64])
def test_integer_codes_and_junk_padding(codes_dtype):
    pq = _random_pq(m=3, sub_dim=2)
    lengths = [5, 2, 0, 6]
    codes, doc_lengths, d_mask, docs = _padded_corpus(pq, lengths, 6, codes_dtype, junk_padding=True)
    Q = torch.randn(2, 4, 6)
    got = maxsim_pq(Q, codes, pq, d_lengths=doc_lengths)
    torch.testing.assert_close(got, loop_maxsim(Q, docs), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="codes"):  # all tokens real: the junk is read
        maxsim_pq(Q, codes, pq)


@pytest.mark.parametrize("chunk_documents", [None, 1, 2, 100])
def test_varlen_scores_match_maxsim_varlen_and_loop(chunk_documents):
    pq = _random_pq(m=2, sub_dim=8)
    lengths = [3, 0, 17, 1, 0, 9, 25]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    codes = _random_codes((int(cu[-1]),), 2)
    Q = torch.randn(4, 5, 16)
    q_mask = torch.rand(4, 5) > 0.25
    got = maxsim_pq_varlen(Q, codes, cu, pq, q_mask=q_mask, chunk_documents=chunk_documents)
    decoded = pq.decode(codes)
    docs = [decoded[cu[j]:cu[j + 1]] for j in range(len(lengths))]
    torch.testing.assert_close(got, loop_maxsim(Q, docs, q_mask), atol=1e-4, rtol=1e-4)
    Q_masked = Q * q_mask.unsqueeze(-1)  # a zero query token scores 0 everywhere: adds nothing
    expected = maxsim.maxsim_varlen(Q_masked.reshape(-1, 16), decoded, torch.arange(5) * 5, cu,
                                    max_seqlen_q=5, max_seqlen_d=max(lengths))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stream_kernel_scores_the_tokens_decoded_in_the_query_dtype(monkeypatch, q_dtype):
    """The Triton path (Triton's interpreter without a GPU): each token decoded on chip, the
    codebooks in Q's dtype; equal to maxsim_varlen on pq.decode(codes).to(Q.dtype), masked query
    tokens left out, empty documents 0; a gradient takes the look-up-table path."""
    from conftest import KERNEL_DEVICE

    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    calls = []
    real = pq_module._on_chip
    monkeypatch.setattr(pq_module, "_on_chip", lambda *a: calls.append(1) or real(*a))
    pq = _random_pq(m=4, sub_dim=8)
    lengths = [3, 0, 17, 1, 0, 9, 70]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    codes = _random_codes((int(cu[-1]),), 4)
    Q = torch.randn(3, 5, 32).to(q_dtype)
    q_mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    dev = KERNEL_DEVICE
    got = maxsim_pq_varlen(Q.to(dev), codes.to(dev), cu.to(dev), pq, q_mask=q_mask.to(dev)).cpu()
    assert got.dtype == torch.float32 and got.shape == (3, len(lengths)) and calls
    decoded = pq.decode(codes).to(q_dtype).double()  # the tokens as the kernel decodes them
    q64 = Q.double() * q_mask.unsqueeze(-1)
    expected = torch.stack([
        torch.stack([(q64[i] @ decoded[cu[j]:cu[j + 1]].T).amax(1).sum() if lengths[j] else torch.tensor(0.0,
                     dtype=torch.float64) for j in range(len(lengths))]) for i in range(3)])
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    one = maxsim_pq_varlen(Q[2].to(dev), codes.to(dev), cu.to(dev), pq).cpu()  # a 2-D query: [Nd]
    torch.testing.assert_close(one, got[2], atol=1e-5, rtol=1e-6)  # summed in another order
    Q_grad = Q.float().to(dev).requires_grad_(True)
    calls.clear()
    maxsim_pq_varlen(Q_grad, codes.to(dev), cu.to(dev), pq).sum().backward()
    assert Q_grad.grad is not None and calls and len(calls) == 1  # asked, and declined: no gradient on chip


def test_two_d_query_and_small_scratch_budget(monkeypatch):
    # a tiny budget splits queries into blocks and documents into many chunks
    monkeypatch.setattr(pq_module, "_SCRATCH_BYTES", 4 * 256 * 3 * 5)
    pq = _random_pq(m=3, sub_dim=4)
    lengths = [4, 11, 0, 7, 2, 2, 9]
    codes, doc_lengths, _, docs = _padded_corpus(pq, lengths, 11)
    Q = torch.randn(5, 4, 12)
    got = maxsim_pq(Q, codes, pq, d_lengths=doc_lengths)
    torch.testing.assert_close(got, loop_maxsim(Q, docs), atol=1e-4, rtol=1e-4)
    single = maxsim_pq(Q[2], codes, pq, d_lengths=doc_lengths)
    assert single.shape == (7,)
    torch.testing.assert_close(single, got[2], atol=1e-5, rtol=1e-5)
    packed = torch.cat([codes[j, :n] for j, n in enumerate(lengths)])
    cu = torch.zeros(8, dtype=torch.int64)
    cu[1:] = torch.cumsum(doc_lengths, 0)
    torch.testing.assert_close(maxsim_pq_varlen(Q, packed, cu, pq), got, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(maxsim_pq_varlen(Q[2], packed, cu, pq), got[2], atol=1e-5, rtol=1e-5)


def test_empty_shapes():
    pq = _random_pq(m=2, sub_dim=2)
    Q = torch.randn(2, 3, 4)
    assert maxsim_pq(Q, _random_codes((0, 5), 2), pq).shape == (2, 0)
    assert torch.equal(maxsim_pq(Q, _random_codes((3, 0), 2), pq), torch.zeros(2, 3))
    assert torch.equal(maxsim_pq(torch.randn(2, 0, 4), _random_codes((3, 4), 2), pq), torch.zeros(2, 3))
    empty_docs = torch.zeros(4, dtype=torch.int64)
    assert torch.equal(maxsim_pq_varlen(Q, _random_codes((0,), 2), empty_docs, pq), torch.zeros(2, 3))
    assert maxsim_pq_varlen(Q, _random_codes((0,), 2), torch.zeros(1, dtype=torch.int64), pq).shape == (2, 0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradients_for_q_match_autograd_of_the_decoded_oracle(layout):
    pq = _random_pq(m=4, sub_dim=4)
    lengths = [6, 3, 0, 8, 1]
    codes, doc_lengths, d_mask, _ = _padded_corpus(pq, lengths, 8)
    Q = torch.randn(3, 5, 16, requires_grad=True)
    q_mask = torch.rand(3, 5) > 0.3
    weights = torch.randn(3, 5)  # a non-uniform upstream gradient
    if layout == "padded":
        scores = maxsim_pq(Q, codes, pq, d_lengths=doc_lengths, q_mask=q_mask, chunk_documents=2)
    else:
        cu = torch.zeros(6, dtype=torch.int64)
        cu[1:] = torch.cumsum(doc_lengths, 0)
        scores = maxsim_pq_varlen(Q, codes[d_mask], cu, pq, q_mask=q_mask, chunk_documents=2)
    (scores * weights).sum().backward()
    Q_ref = Q.detach().clone().requires_grad_(True)
    (maxsim_reference(Q_ref, pq.decode(codes), q_mask, d_mask) * weights).sum().backward()
    torch.testing.assert_close(Q.grad, Q_ref.grad, atol=1e-5, rtol=1e-5)
    assert torch.all(Q.grad[~q_mask] == 0)


def test_half_query_gradient_dtype_and_no_grad_path():
    pq = _random_pq(m=2, sub_dim=4)
    codes = _random_codes((4, 6), 2)
    Q = torch.randn(2, 3, 8).half().requires_grad_(True)
    maxsim_pq(Q, codes, pq).sum().backward()
    assert Q.grad.dtype == torch.float16
    Q_ref = Q.detach().float().requires_grad_(True)
    maxsim_reference(Q_ref, pq.decode(codes)).sum().backward()
    torch.testing.assert_close(Q.grad.float(), Q_ref.grad, atol=1e-2, rtol=1e-3)
    with torch.no_grad():
        assert not maxsim_pq(Q, codes, pq).requires_grad


# ---------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path):
    pq = _random_pq(m=4, sub_dim=3)
    path = tmp_path / "pq.npz"
    pq.save(path)
    loaded = ProductQuantizer.load(path)
    assert torch.equal(loaded.codebooks, pq.codebooks)
    assert (loaded.m, loaded.dim, loaded.sub_dim) == (4, 12, 3)
    assert ProductQuantizer.load(str(path), device="cpu").device == torch.device("cpu")
    assert [p.name for p in tmp_path.iterdir()] == ["pq.npz"]  # no temporary left behind


def test_truncated_and_corrupted_files_are_errors_naming_the_file(tmp_path):
    path = tmp_path / "pq.npz"
    _random_pq().save(path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.npz"):
        ProductQuantizer.load(truncated)
    corrupted = tmp_path / "corrupted.npz"
    flipped = bytearray(data)
    start = flipped.index(b"codebooks.npy")  # inside the codebooks member's data, past its header
    flipped[start + 400] ^= 0xFF
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="corrupted.npz"):
        ProductQuantizer.load(corrupted)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        ProductQuantizer.load(tmp_path / "missing.npz")
    bare = tmp_path / "bare.npy"
    np.save(bare, np.zeros((2, 256, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="bare.npy"):
        ProductQuantizer.load(bare)


def test_wrong_or_missing_format_fields(tmp_path):
    codebooks = np.random.rand(2, 256, 2).astype(np.float32)
    cases = {
        "newer.npz": dict(format=np.array(pq_module.FORMAT_NAME), format_version=np.array(2), codebooks=codebooks),
        "noversion.npz": dict(format=np.array(pq_module.FORMAT_NAME), codebooks=codebooks),
        "otherformat.npz": dict(format=np.array("something-else"), format_version=np.array(1), codebooks=codebooks),
        "nocodebooks.npz": dict(format=np.array(pq_module.FORMAT_NAME), format_version=np.array(1)),
        "badshape.npz": dict(format=np.array(pq_module.FORMAT_NAME), format_version=np.array(1),
                             codebooks=codebooks[:, :100]),
    }
    for name, arrays in cases.items():
        with open(tmp_path / name, "wb") as f:
            np.savez(f, **arrays)
        with pytest.raises(ValueError, match=name):
            ProductQuantizer.load(tmp_path / name)


def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "pq.npz"
    old = _random_pq()
    old.save(path)

    def failing_savez(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", failing_savez)
    with pytest.raises(OSError, match="disk full"):
        _random_pq().save(path)
    monkeypatch.undo()
    assert torch.equal(ProductQuantizer.load(path).codebooks, old.codebooks)
    assert [p.name for p in tmp_path.iterdir()] == ["pq.npz"]


# ---------------------------------------------------------------------- bad input
def test_bad_quantizer_and_training_input():
    with pytest.raises(ValueError, match="codebooks"):
        ProductQuantizer(torch.randn(2, 128, 4))
    with pytest.raises(ValueError, match="codebooks"):
        ProductQuantizer(torch.randint(0, 5, (2, 256, 4)))
    with pytest.raises(ValueError, match="codebooks"):
        ProductQuantizer(torch.full((1, 256, 2), float("nan")))
    x = torch.randn(300, 12)
    with pytest.raises(ValueError, match="multiple of m"):
        ProductQuantizer.train(x, 5)
    with pytest.raises(ValueError, match="256"):
        ProductQuantizer.train(x[:255], 4)
    with pytest.raises(ValueError, match="m"):
        ProductQuantizer.train(x, 0)
    with pytest.raises(TypeError, match="m"):
        ProductQuantizer.train(x, True)
    with pytest.raises(ValueError, match="sample"):
        ProductQuantizer.train(x, 4, sample=100)
    with pytest.raises(ValueError, match="iterations"):
        ProductQuantizer.train(x, 4, iterations=-1)
    with pytest.raises(ValueError, match="x"):
        ProductQuantizer.train(x.long(), 4)
    x_nan = x.clone()
    x_nan[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ProductQuantizer.train(x_nan, 4)
    pq = _random_pq(m=4, sub_dim=3)
    with pytest.raises(ValueError, match="x"):
        pq.encode(torch.randn(3, 8))
    with pytest.raises(ValueError, match="NaN"):
        pq.encode(x_nan)
    with pytest.raises(TypeError, match="codes"):
        pq.decode(torch.rand(3, 4))
    with pytest.raises(ValueError, match="codes"):
        pq.decode(_random_codes((3,), 5))
    with pytest.raises(ValueError, match=r"codes.*\[0, 256\)"):
        pq.decode(torch.tensor([[0, 1, 256, 3]]))


def test_bad_scoring_input():
    pq = _random_pq(m=4, sub_dim=2)
    codes = _random_codes((3, 5), 4)
    packed = _random_codes((7,), 4)
    cu = torch.tensor([0, 3, 7])
    Q = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="pq"):
        maxsim_pq(Q, codes, "pq")
    with pytest.raises(TypeError, match="Q"):
        maxsim_pq(Q.double(), codes, pq)
    with pytest.raises(TypeError, match="Q"):
        maxsim_pq(Q.long(), codes, pq)
    with pytest.raises(ValueError, match="Q"):
        maxsim_pq(torch.randn(2, 3, 6), codes, pq)
    with pytest.raises(TypeError, match="codes"):
        maxsim_pq(Q, codes.float(), pq)
    with pytest.raises(ValueError, match="codes"):
        maxsim_pq(Q, packed, pq)  # [T, m] given to the padded entry point
    with pytest.raises(ValueError, match="codes"):
        maxsim_pq(Q, _random_codes((3, 5), 3), pq)
    for bad_value in (-1, 256):
        bad = codes.long()
        bad[1, 2, 3] = bad_value
        with pytest.raises(ValueError, match=r"codes.*\[0, 256\)"):
            maxsim_pq(Q, bad, pq)
    with pytest.raises(ValueError, match="codes"):
        maxsim_pq(Q, torch.zeros(3, 5, 4, dtype=torch.uint8, device="meta"), pq)
    with pytest.raises(ValueError, match="d_lengths"):
        maxsim_pq(Q, codes, pq, d_lengths=torch.tensor([1, 2, 6]))
    with pytest.raises(ValueError, match="d_lengths"):
        maxsim_pq(Q, codes, pq, d_lengths=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="d_lengths"):
        maxsim_pq(Q, codes, pq, d_lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_pq(Q, codes, pq, q_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_mask"):
        maxsim_pq(Q, codes, pq, q_mask=torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="chunk_documents"):
        maxsim_pq(Q, codes, pq, chunk_documents=0)
    with pytest.raises(TypeError, match="chunk_documents"):
        maxsim_pq(Q, codes, pq, chunk_documents=True)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_pq_varlen(Q, packed, torch.tensor([0, 5, 3, 7]), pq)  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_pq_varlen(Q, packed, torch.tensor([0, 3, 6]), pq)  # does not end at T
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_pq_varlen(Q, packed, torch.tensor([1, 3, 7]), pq)  # does not start at 0
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        maxsim_pq_varlen(Q, packed, cu.float(), pq)
    with pytest.raises(ValueError, match="codes"):
        maxsim_pq_varlen(Q, codes, cu, pq)  # [Nd, Ld, m] given to the packed entry point
    assert maxsim_pq_varlen(Q, packed, cu, pq).shape == (2, 2)


# ---------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
def test_gpu_train_encode_and_score_real_shapes():
    """Train on 200K tokens (d = 128, m = 16) on the GPU, then 1 and 32 queries (32 x 128) against
    20K documents of up to 300 tokens, codes on the GPU and on the CPU, against maxsim on the decoded corpus."""
    tokens = torch.nn.functional.normalize(torch.randn(200_000, 128, device="cuda"), dim=-1)
    pq = ProductQuantizer.train(tokens, 16, iterations=10)
    assert torch.equal(pq.codebooks, ProductQuantizer.train(tokens, 16, iterations=10).codebooks)
    assert pq.device.type == "cuda"
    lengths = torch.randint(0, 301, (20_000,))
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    corpus = torch.nn.functional.normalize(torch.randn(int(cu[-1]), 128, device="cuda"), dim=-1)
    codes = pq.encode(corpus)  # [T, 16] uint8 on the GPU
    decoded = pq.decode(codes)
    D, d_mask = maxsim.pad([decoded[cu[j]:cu[j + 1]] for j in range(lengths.numel())])[:2]
    for num_queries in (1, 32):
        Q = torch.nn.functional.normalize(torch.randn(num_queries, 32, 128, device="cuda"), dim=-1).half()
        expected = maxsim.maxsim(Q.float(), D, None, d_mask)
        # codes beside Q: the stream kernel, tokens decoded on chip in Q's dtype (fp16 products exact)
        on_chip = maxsim.maxsim(Q, D.half(), None, d_mask)
        torch.testing.assert_close(maxsim_pq_varlen(Q, codes, cu.cuda(), pq), on_chip, atol=1e-4, rtol=1e-5)
        # codes on the CPU: the look-up-table path, in fp32
        torch.testing.assert_close(maxsim_pq_varlen(Q, codes.cpu(), cu.cuda(), pq), expected, atol=1e-3, rtol=1e-3)
    Q = Q.float().requires_grad_(True)
    maxsim_pq_varlen(Q, codes, cu, pq).sum().backward()
    Q_ref = Q.detach().clone().requires_grad_(True)
    maxsim.maxsim(Q_ref, D, None, d_mask).sum().backward()
    # fp16 queries against fp32 decoded tokens: near-ties may pick another winner in a few of the
    # 20K documents; a wrong gradient is off by O(1) in norm (relative to the whole gradient).
    assert float((Q.grad - Q_ref.grad).norm() / Q_ref.grad.norm()) < 1e-2
