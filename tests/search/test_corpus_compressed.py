"""Residual (PLAID) and PQ corpora: search equals the exhaustive top-k of decode-then-score, the
codec is one per corpus (stored once, checked like a segment, never retrained on append), the
file is format version 3, and the index command takes --encoding residual2 / pq<m>."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from commands import run as run_command

from conftest import KERNEL_DEVICE
from maxsim.compressed import ProductQuantizer, ResidualCodec
from maxsim.search import Corpus
from maxsim.search import format as corpus_format

ENCODINGS = ["residual2", "residual4", "pq8"]
D = 32


# The look-up scorer's fp16 table Q @ C^T: the emulation's CPU product and the GPU's may round an
# entry to neighbouring fp16 values (2**-11 apart below 1), each of 32 query rows moving its max.
LOOKUP_TABLE_ATOL = 32 * 2.0 ** -11


def unit_docs(generator, n=200, d=D, longest=12):
    lengths = torch.randint(1, longest, (n,), generator=generator).tolist()
    docs = [F.normalize(torch.randn(L, d, generator=generator), dim=-1) for L in lengths]
    docs[n // 3] = torch.zeros(0, d)  # an empty document scores 0
    docs[7] = docs[3].clone()  # a tie
    return docs


def unit_queries(generator, lengths=(3, 1, 5, 2), d=D, dtype=torch.float32):
    return [F.normalize(torch.randn(L, d, generator=generator), dim=-1).to(dtype) for L in lengths]


def make_codec(encoding, docs, generator):
    """A small codec, quickly: residual trained with 16 centroids; PQ codebooks drawn from the
    tokens' sub-vectors (training PQ runs once, in its own test)."""
    tokens = torch.cat(docs)
    if encoding.startswith("residual"):
        return ResidualCodec.train(tokens, int(encoding[len("residual"):]), num_centroids=16)
    m, d = int(encoding[2:]), tokens.shape[1]
    rows = torch.randint(0, tokens.shape[0], (m, 256), generator=generator)
    sub = tokens.reshape(-1, m, d // m)  # [T, m, s]
    return ProductQuantizer(sub[rows, torch.arange(m)[:, None]])  # [m, 256, s]


def decoded(corpus, dtype=torch.float32):
    """The oracle's documents: every token decoded by the codec (residual: in ``dtype``, normalised)."""
    codec, codes = corpus.codec, corpus.codes
    if isinstance(codec, ProductQuantizer):
        tokens = codec.decode(codes)
    else:
        tokens = codec.decode(codes, corpus.residuals, dtype=dtype)
    offsets = corpus.offsets
    return [tokens[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]


def oracle_scores(queries, corpus, dtype=torch.float32):
    """[Nq, Nd]: decode, then MaxSim by einsum over the padded decoded documents (padding never
    wins; an empty document scores 0), on the corpus's device."""
    docs = decoded(corpus, dtype)
    longest = max(max(d.shape[0] for d in docs), 1)
    padded = torch.zeros(len(docs), longest, docs[0].shape[1], device=docs[0].device)
    real = torch.zeros(len(docs), longest, dtype=torch.bool, device=docs[0].device)
    for j, d in enumerate(docs):
        padded[j, : d.shape[0]], real[j, : d.shape[0]] = d.float(), True
    rows = []
    for q in queries:
        sim = torch.einsum("id,njd->nij", q.float().to(padded.device), padded)
        best = sim.masked_fill(~real[:, None, :], float("-inf")).amax(-1)  # [Nd, Lq]
        rows.append(torch.where(real[:, :1], best, torch.zeros_like(best)).sum(-1))
    return torch.stack(rows).cpu()


def assert_topk(result, full, k, atol=1e-5):
    """Ids equal to the oracle's top-k, ties (and scores within rounding) aside."""
    want_scores, want_indices = torch.sort(full, stable=True, dim=-1, descending=True)
    want_scores, want_indices = want_scores[:, :k], want_indices[:, :k]
    torch.testing.assert_close(result.scores.float().cpu(), want_scores, rtol=0, atol=atol)
    got = result.indices.cpu()
    differ = got != want_indices
    gap = (full.gather(1, got) - full.gather(1, want_indices))[differ]
    assert bool((gap.abs() <= atol).all())


def build(encoding, seed=0, n=200):
    g = torch.Generator().manual_seed(seed)
    docs = unit_docs(g, n)
    codec = make_codec(encoding, docs, g)
    return docs, codec, g


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_search_equals_decode_then_score(tmp_path, encoding):
    docs, codec, g = build(encoding)
    ids = [f"doc-{j}" for j in range(len(docs))]
    corpus = Corpus.from_list(docs, ids=ids, codec=codec)
    assert corpus.encoding == encoding and corpus.encoding.has_codec and not corpus.encoding.has_scales
    assert corpus.codec is codec and encoding in repr(corpus)
    if encoding.startswith("residual"):
        nbits = int(encoding[-1])
        assert corpus.codes.dtype == torch.int32 and corpus.codes.shape == (corpus.num_tokens,)
        assert corpus.residuals.shape == (corpus.num_tokens, D * nbits // 8)
        assert corpus.bytes_per_token == D * nbits // 8 + 4
    else:
        assert corpus.codes.dtype == torch.uint8 and corpus.codes.shape == (corpus.num_tokens, 8)
        assert corpus.residuals is None and corpus.bytes_per_token == 8
    queries = unit_queries(g)
    full = oracle_scores(queries, corpus)
    k = 20
    # Whole corpus, then tiny budgets: many chunks and query batches merged into the running top-k.
    for budget, batch in ((None, None), (6_000, None), (6_000, 1)):
        result = corpus.search(queries, k, gpu_memory=budget, batch_size=batch, progress=False, device="cpu")
        assert_topk(result, full, k)
        assert result.ids == [[ids[j] for j in row] for row in result.indices.tolist()]
    # padded queries with a mask: the same answer
    Q = torch.zeros(len(queries), 5, D)
    mask = torch.zeros(len(queries), 5, dtype=torch.bool)
    for i, q in enumerate(queries):
        Q[i, : q.shape[0]], mask[i, : q.shape[0]] = q, True
    assert_topk(corpus.search(Q, k, q_mask=mask, progress=False, device="cpu"), full, k)

    corpus.save(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["encoding"] == encoding
    assert manifest["dtype"] == ("int32" if encoding.startswith("residual") else "uint8")
    for mmap in (True, False):
        loaded = Corpus.load(tmp_path / "c", mmap=mmap)
        assert loaded.encoding == encoding and loaded.is_mapped == mmap
        assert torch.equal(loaded.codes, corpus.codes)
        if encoding.startswith("residual"):
            assert torch.equal(loaded.residuals, corpus.residuals)
            assert torch.equal(loaded.codec.centroids, codec.centroids.float())
            assert torch.equal(loaded.codec.bucket_weights, codec.bucket_weights.float())
        else:
            assert torch.equal(loaded.codec.codebooks, codec.codebooks)
        assert_topk(loaded.search(queries, k, gpu_memory=6_000, progress=False, device="cpu"), full, k)
        assert torch.equal(loaded.document(5), corpus.document(5))
    copy = Corpus.load(tmp_path / "c").to("cpu")  # a mapped corpus read into memory
    assert not copy.is_mapped and copy.codec.device.type == "cpu"
    assert torch.equal(copy.codes, corpus.codes)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_documents_decode_queries_of_any_float_dtype_and_shards(encoding):
    docs, codec, g = build(encoding, seed=1, n=60)
    corpus = Corpus.from_list(docs, codec=codec)
    tokens = docs[1]
    if encoding.startswith("residual"):
        codes, residuals = codec.encode(tokens)
        want = codec.decode(codes, residuals, dtype=torch.float32)
    else:
        want = codec.decode(codec.encode(tokens))
    assert corpus.document(1).dtype == torch.float32 and torch.equal(corpus.document(1), want)
    assert corpus.document(len(docs) // 3).shape == (0, D)
    for dtype in (torch.float16, torch.bfloat16):
        queries = unit_queries(g, (3, 2), dtype=dtype)
        result = corpus.search(queries, 5, progress=False, device="cpu")
        # fp16 queries decode in fp16 (colbert-ai's GPU rounding): compare within its error
        assert_topk(result, oracle_scores(queries, corpus), 5, atol=2e-2)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32 queries"):
        corpus.search([torch.ones(2, D, dtype=torch.float64)], 3)
    with pytest.raises(ValueError, match=f"d=16 but the corpus has d={D}"):
        corpus.search([torch.ones(2, 16)], 3)
    with pytest.raises(TypeError, match="holds .* codes, not embeddings.*build a new corpus from the float tokens"):
        _ = corpus.embeddings
    shards = [corpus.shard(r, 3) for r in range(3)]
    assert all(s.encoding == encoding and s.codec is codec for s in shards)
    assert torch.equal(torch.cat([s.codes for s in shards]), corpus.codes)
    if encoding.startswith("residual"):
        assert torch.equal(torch.cat([s.residuals for s in shards]), corpus.residuals)
    empty = corpus._slice(0, 0, None)
    assert len(empty) == 0 and empty.encoding == encoding and empty.num_tokens == 0


@pytest.mark.gpu
@pytest.mark.parametrize("encoding,q_dtype", [("residual2", torch.float32), ("residual4", torch.float32),
                                              ("residual2", torch.float16), ("pq16", torch.float32)])
@pytest.mark.parametrize("where", ["pinned", "host", "mmap", "device"])
def test_gpu_streaming_equals_oracle(tmp_path, encoding, q_dtype, where):
    from placement import place

    g = torch.Generator().manual_seed(12)
    docs = unit_docs(g, n=3000, d=128, longest=200)
    if encoding.startswith("residual"):
        codec = ResidualCodec.train(torch.cat(docs).cuda(), int(encoding[-1]), num_centroids=256).to("cpu")
    else:
        codec = make_codec(encoding, docs, g)
    queries = [q.cuda() for q in unit_queries(g, [32] * 16, d=128, dtype=q_dtype)]
    corpus = Corpus.from_list(docs, codec=codec)
    # fp16 queries decode in fp16 (colbert-ai's GPU rounding), fp32 queries in fp32
    full = oracle_scores(queries, corpus.to("cuda"), dtype=torch.float16 if q_dtype == torch.float16 else torch.float32)
    placed = place(corpus, where, tmp_path)
    result = placed.search(queries, 100, gpu_memory=16 << 20, progress=False)  # several chunks when streamed
    assert result.indices.device.type == "cuda"
    if where == "device" and encoding.startswith("residual"):  # resident: the look-up scorer's arithmetic
        from maxsim.compressed.residual_lut import build_layout, lut_emulation

        cu = torch.from_numpy(corpus.offsets)
        layout = build_layout(codec, corpus.codes, corpus.residuals, cu)
        Q = torch.stack([q.float().cpu() for q in queries])
        full = lut_emulation(Q, codec, corpus.codes, corpus.residuals, cu, layout).float()
        assert_topk(result, full, 100, atol=LOOKUP_TABLE_ATOL)
        return
    assert_topk(result, full, 100, atol=1e-4 if q_dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("nbits", [2, 4])
def test_resident_search_scores_with_the_lookup_scorer(monkeypatch, nbits):
    """A resident residual corpus of d 128 is searched by the look-up scorer (Triton's interpreter on
    the CPU, the Gluon kernel on a Hopper GPU): the look-up arithmetic's top-k and scores (its
    float64 emulation), segment by segment, each segment's layout built once and kept."""
    from maxsim.compressed.residual_lut import build_layout, lut_emulation

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=40, d=128, longest=24)
    codec = ResidualCodec.train(torch.cat(docs), nbits, num_centroids=32)
    corpus = Corpus.from_list(docs[:25], codec=codec).append(docs[25:]).to(KERNEL_DEVICE)  # two segments
    queries = [q.to(KERNEL_DEVICE) for q in unit_queries(g, [20, 7], d=128)]
    cu = torch.from_numpy(corpus.offsets)
    codes, residuals = corpus.codes.cpu(), corpus.residuals.cpu()
    Q = torch.zeros(2, 20, 128)
    q_mask = torch.zeros(2, 20, dtype=torch.bool)
    for i, q in enumerate(queries):
        Q[i, :q.shape[0]], q_mask[i, :q.shape[0]] = q.cpu(), True
    want = lut_emulation(Q, codec, codes, residuals, cu, build_layout(codec, codes, residuals, cu),
                         q_mask=q_mask).float()  # [2, 40]
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setenv("MAXSIM_BACKEND", "triton")  # the kernels in the interpreter
    result = corpus.search(queries, 10, progress=False)
    assert_topk(result, want, 10, atol=LOOKUP_TABLE_ATOL)
    assert all(len(s._lookup) == 1 for s in corpus.segments)
    for s in corpus.segments:  # kept: the next search reads the same layout
        assert s.lookup_layout(corpus.encoding, corpus.codec, torch.device(KERNEL_DEVICE)) is next(iter(s._lookup.values()))


def test_resident_pq_search_scores_with_the_lookup_scorer(monkeypatch):
    """A resident pq32 corpus of d 128 is searched by the PQ look-up scorer (Triton's interpreter on
    the CPU): its arithmetic's top-k and scores (the float64 emulation over the whole corpus's
    layout), each segment's layout built once and kept."""
    from maxsim.compressed.pq_lut import build_layout, pq_lut_emulation

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=40, d=128, longest=24)
    codec = make_codec("pq32", docs, g)
    corpus = Corpus.from_list(docs[:25], codec=codec).append(docs[25:]).to(KERNEL_DEVICE)  # two segments
    queries = [q.to(KERNEL_DEVICE) for q in unit_queries(g, [20, 7], d=128)]
    Q = torch.zeros(2, 20, 128)
    q_mask = torch.zeros(2, 20, dtype=torch.bool)
    for i, q in enumerate(queries):
        Q[i, :q.shape[0]], q_mask[i, :q.shape[0]] = q.cpu(), True
    layout = build_layout(codec, corpus.codes.cpu(), torch.from_numpy(corpus.offsets))
    want = pq_lut_emulation(Q, layout, q_mask=q_mask).float()  # [2, 40]
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setenv("MAXSIM_BACKEND", "triton")  # the kernels in the interpreter
    result = corpus.search(queries, 10, progress=False)
    assert_topk(result, want, 10, atol=1e-4)
    assert all(len(s._lookup) == 1 for s in corpus.segments)
    exact = corpus.search(queries, 10, progress=False, device="cpu")  # decode, then score: close, not equal
    torch.testing.assert_close(result.scores.cpu(), exact.scores, atol=0.05, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ["residual2", "residual4", "pq32"])
@pytest.mark.parametrize("start", ["device", "mmap"])
def test_gpu_lookup_only_holds_the_layout_alone_and_searches_the_same(tmp_path, encoding, start):
    """Corpus.to("cuda", lookup_only=True): the codes in host memory (pinned, or the file's
    mapping), each segment's look-up layout on the GPU; the look-up scorer's batches read the
    layouts alone and give the resident corpus's answers, batches it cannot serve (queries over 32
    tokens) stream the codes and give them too."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=600, d=128, longest=90)
    codec = ResidualCodec.train(torch.cat(docs), int(encoding[-1]), num_centroids=64) \
        if encoding.startswith("residual") else make_codec(encoding, docs, g)
    resident = Corpus.from_list(docs[:350], codec=codec).append(docs[350:]).to("cuda")  # two segments
    source = resident
    if start == "mmap":
        resident.save(tmp_path / "c")
        source = Corpus.load(tmp_path / "c", mmap=True)
    held = source.to("cuda", lookup_only=True)
    assert held.device.type == "cpu" and held.where() == ("mmap" if start == "mmap" else "pinned")
    assert all(s.lookup_on(torch.device("cuda")) is not None for s in held.segments)
    queries = [q.cuda() for q in unit_queries(g, [32, 20, 7], d=128)]
    want = resident.search(queries, 20, progress=False)
    got = held.search(queries, 20, progress=False)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.scores, want.scores)
    long_queries = [q.cuda() for q in unit_queries(g, [40, 33], d=128)]  # not the look-up scorer's
    want = resident.search(long_queries, 20, progress=False)
    got = held.search(long_queries, 20, progress=False, gpu_memory=8 << 20)  # streamed, several chunks
    torch.testing.assert_close(got.scores, want.scores, atol=1e-3, rtol=0)
    assert torch.equal(got.indices, want.indices)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the one-byte Gluon scorer runs on Hopper (sm_90) only")
@pytest.mark.parametrize("encoding", ["int8", "fp8"])
def test_gpu_one_byte_lookup_only_scores_with_the_gluon_scorer(encoding):
    """An int8 / fp8 corpus held as its layout (lookup_only): queries of up to 32 tokens get the
    one-byte Gluon scorer's scores (its float64 emulation's, to fp32 rounding for int8 and within
    the e4m3 accumulation's bound for fp8) across segments; longer ones stream the host tokens
    through the stream kernel, as the resident corpus scores them."""
    from maxsim.compressed.onebyte_gluon import build_layout, onebyte_emulation

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=600, d=128, longest=90)
    resident = Corpus.from_list(docs[:350], encoding=encoding).append(docs[350:]).to("cuda")  # two segments
    held = resident.to("cuda", lookup_only=True)
    assert held.device.type == "cpu" and all(s.lookup_on(torch.device("cuda")) is not None for s in held.segments)
    lengths = [32, 20, 7]
    queries = unit_queries(g, lengths, d=128)
    got = held.search([q.cuda() for q in queries], 600, progress=False)  # every document, best first
    scores = torch.zeros(3, 600, dtype=torch.float64)
    scores.scatter_(1, got.indices.cpu(), got.scores.double().cpu())
    values = torch.cat([s.embeddings.cpu() for s in held.segments])
    layout = build_layout(values, torch.cat([s.scales.cpu() for s in held.segments]), torch.tensor(held.offsets))
    Q = torch.zeros(3, 32, 128)
    q_mask = torch.zeros(3, 32, dtype=torch.bool)
    for i, q in enumerate(queries):
        Q[i, :len(q)], q_mask[i, :len(q)] = q.float(), True
    want = onebyte_emulation(Q, layout, q_mask=q_mask)
    if encoding == "int8":
        torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-4)
    else:
        bound = onebyte_emulation(Q, layout, q_mask=q_mask, absolute=True) * 2.0 ** -10 + 1e-4
        assert torch.all((scores - want).abs() <= bound), float(((scores - want).abs() / bound).max())
    long_queries = [q.cuda() for q in unit_queries(g, [40, 33], d=128)]  # past the scorer's 32 rows
    want_long = resident.search(long_queries, 20, progress=False)
    got_long = held.search(long_queries, 20, progress=False, gpu_memory=8 << 20)  # streamed, several chunks
    assert torch.equal(got_long.indices.cpu(), want_long.indices.cpu())
    torch.testing.assert_close(got_long.scores, want_long.scores, atol=1e-5, rtol=0)


def test_lookup_only_wants_a_coded_or_one_byte_corpus_and_a_gpu():
    g = torch.Generator().manual_seed(3)
    docs = unit_docs(g, n=20, d=128, longest=10)
    with pytest.raises(ValueError, match="residual, PQ, int8 or fp8 corpus.* float16"):
        Corpus.from_list(docs, encoding="float16").to("cuda", lookup_only=True)
    codec = ResidualCodec.train(torch.cat(docs), 2, num_centroids=8)
    with pytest.raises(ValueError, match="not a GPU"):
        Corpus.from_list(docs, codec=codec).to("cpu", lookup_only=True)
    with pytest.raises(ValueError, match="not a GPU"):
        Corpus.from_list(docs, encoding="int8").to("cpu", lookup_only=True)
    narrow = Corpus.from_list([x[:, :64] for x in docs], encoding="int8")  # the layout holds d 128 tokens
    with pytest.raises(ValueError, match="d=128 tokens, not d=64"):
        narrow.encoding.build_lookup(None, tuple(narrow.segments[0].parts()), torch.tensor(narrow.offsets))


@pytest.mark.parametrize("why", ["too little free memory", "out of memory while building"])
def test_a_layout_that_does_not_fit_falls_back_to_the_plane_kernel(monkeypatch, why):
    """Where the look-up layout would not fit the device (its bound above the free memory, or an
    OOM while it is built), the segment is scored by the plane kernel: the exact decode-then-score
    answer, a LookupLayoutWarning said once, and a later search with room builds the layout."""
    import warnings

    from maxsim.compressed import scoring
    from maxsim.search import corpus as corpus_module

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=30, d=128, longest=20)
    codec = ResidualCodec.train(torch.cat(docs), 2, num_centroids=32)
    corpus = Corpus.from_list(docs, codec=codec).to(KERNEL_DEVICE)
    queries = [q.to(KERNEL_DEVICE) for q in unit_queries(g, [12, 5], d=128)]
    exact = corpus.search(queries, 10, progress=False, device="cpu")  # decode, then score (PyTorch)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setenv("MAXSIM_BACKEND", "triton")  # the kernels in the interpreter
    real_build = scoring.lookup_layout
    if why == "too little free memory":
        monkeypatch.setattr(corpus_module, "_free_device_bytes", lambda device: 1 << 10)
    else:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        monkeypatch.setattr(scoring, "lookup_layout", out_of_memory)
    with pytest.warns(corpus_module.LookupLayoutWarning, match="decoding kernel"):
        got = corpus.search(queries, 10, progress=False)
    torch.testing.assert_close(got.scores.cpu(), exact.scores, atol=1e-3, rtol=1e-3)  # (ties may swap ids)
    assert not corpus.segments[0]._lookup
    with warnings.catch_warnings():
        warnings.simplefilter("error", corpus_module.LookupLayoutWarning)  # said once, not at every search
        corpus.search(queries, 10, progress=False)
    monkeypatch.setattr(corpus_module, "_free_device_bytes", lambda device: None)
    monkeypatch.setattr(scoring, "lookup_layout", real_build)
    corpus.search(queries, 10, progress=False)
    assert len(corpus.segments[0]._lookup) == 1  # room again: the layout is built and kept


@pytest.mark.parametrize("make", ["packed", "padded", "init"])
def test_codec_keyword_on_every_constructor(make):
    docs, codec, _ = build("residual2", seed=2, n=20)
    tokens = torch.cat(docs)
    offsets = np.concatenate([[0], np.cumsum([x.shape[0] for x in docs])])
    if make == "packed":
        corpus = Corpus.from_packed(tokens, offsets, codec=codec)
    elif make == "init":
        corpus = Corpus(tokens.numpy(), offsets, encoding="residual2", codec=codec)
    else:
        longest = max(x.shape[0] for x in docs)
        padded = torch.zeros(len(docs), longest, D)
        mask = torch.zeros(len(docs), longest, dtype=torch.bool)
        for j, x in enumerate(docs):
            padded[j, : x.shape[0]], mask[j, : x.shape[0]] = x, True
        corpus = Corpus.from_padded(padded, mask, codec=codec)
    codes, residuals = codec.encode(tokens)
    assert corpus.encoding == "residual2" and corpus.codec is codec
    assert torch.equal(corpus.codes, codes) and torch.equal(corpus.residuals, residuals)
    assert np.array_equal(corpus.offsets, offsets)


def test_codec_and_encoding_errors():
    docs, codec, _ = build("residual2", seed=3, n=20)
    with pytest.raises(ValueError, match="codec= is a ResidualCodec for encoding 'residual2', but encoding='residual4'"):
        Corpus.from_list(docs, encoding="residual4", codec=codec)
    with pytest.raises(TypeError, match="codec must be a maxsim.compressed.ResidualCodec or ProductQuantizer"):
        Corpus.from_list(docs, codec="codec")
    with pytest.raises(ValueError, match="tokens have d=16 but the residual2 codec has d=32"):
        Corpus.from_list([torch.randn(3, 16)], codec=codec)
    # m must divide d: one error listing the m that do
    with pytest.raises(ValueError, match="pq48 needs m=48 to divide d=32: use one of pq1, pq2, pq4, pq8, pq16, pq32$"):
        Corpus.from_list(docs, encoding="pq48")
    with pytest.raises(ValueError, match="residual2 needs d to be a multiple of 8"):
        Corpus.from_list([torch.randn(4, 12)], encoding="residual2")
    with pytest.raises(ValueError, match="encoding must be one of"):
        Corpus.from_list(docs, encoding="pq0")
    with pytest.raises(ValueError, match="encoding must be one of"):
        Corpus.from_list(docs, encoding="residual3")
    with pytest.raises(ValueError, match="at least 256 tokens"):
        Corpus.from_list(docs[:3], encoding="pq8")
    with pytest.raises(TypeError, match="must be float16, bfloat16 or float32"):
        Corpus.from_packed(torch.zeros(4, dtype=torch.int32), [0, 4], encoding="int8")


def test_default_training_on_the_tokens():
    g = torch.Generator().manual_seed(4)
    docs = unit_docs(g, n=60, longest=10)
    tokens = torch.cat(docs)
    residual = Corpus.from_list(docs, encoding="residual4")
    assert isinstance(residual.codec, ResidualCodec) and residual.codec.nbits == 4
    want = ResidualCodec.train(tokens, 4)  # the library's defaults (and seed)
    assert torch.equal(residual.codec.centroids, want.centroids)
    assert torch.equal(residual.codes, want.encode(tokens)[0])
    pq = Corpus.from_list(docs, encoding="pq4")
    assert isinstance(pq.codec, ProductQuantizer) and pq.codec.m == 4
    assert torch.equal(pq.codes, pq.codec.encode(tokens))


@pytest.mark.parametrize("encoding", ["residual2", "pq8"])
def test_append_encodes_with_the_corpus_codec(tmp_path, encoding):
    docs, codec, g = build(encoding, seed=5, n=30)
    corpus = Corpus.from_list(docs, codec=codec)
    more = [F.normalize(torch.randn(4, D, generator=g), dim=-1).half(), torch.zeros(0, D, dtype=torch.half)]
    corpus.append(more)
    assert corpus.codec is codec and len(corpus) == 32 and len(corpus.segments) == 2
    assert torch.equal(corpus.document(30), Corpus.from_list(more, codec=codec).document(0))
    corpus.append((more[0].float(), np.array([0, 4])))
    assert torch.equal(corpus.document(32), corpus.document(30))
    corpus.append(Corpus.from_list(docs[:2], ids=np.arange(500, 502), codec=codec))
    assert torch.equal(corpus.document(33), corpus.document(0))
    other_codec = make_codec(encoding, docs[5:], g)
    with pytest.raises(ValueError, match="encoded with another codec.*codec=corpus.codec"):
        corpus.append(Corpus.from_list(docs[:2], codec=other_codec))
    with pytest.raises(ValueError, match=f"cannot append d=16 documents to the corpus of d={D}"):
        corpus.append([torch.randn(3, 16)])
    with pytest.raises(TypeError, match=f"cannot append int8 documents to the corpus of {encoding}: encode them with "
                                        "its codec"):
        corpus.append(Corpus.from_list(docs[:2], encoding="int8"))
    with pytest.raises(TypeError, match=f"cannot append {encoding} documents to the corpus of float32"):
        Corpus.from_list(docs).append(Corpus.from_list(docs[:2], codec=codec))
    queries = unit_queries(g)
    assert_topk(corpus.search(queries, 10, progress=False, device="cpu"), oracle_scores(queries, corpus), 10)

    # on disk: an append brings the corpus's codec (equal tables, dtype and bits)
    Corpus.from_list(docs, codec=codec).save(tmp_path / "c")
    stored = Corpus.load(tmp_path / "c")
    Corpus.from_list(more, ids=np.arange(100, 102), codec=stored.codec).save(tmp_path / "c", append=True)
    with pytest.raises(ValueError, match="codes of another codec to corpus .*codec=Corpus.load"):
        Corpus.from_list(more, ids=np.arange(200, 202), codec=other_codec).save(tmp_path / "c", append=True)
    with pytest.raises(TypeError, match=f"cannot append float16 embeddings to corpus .* of {encoding}: encode the "
                                        "documents with its codec"):
        Corpus.from_list(more, ids=np.arange(200, 202)).save(tmp_path / "c", append=True)
    loaded = Corpus.load(tmp_path / "c")
    assert len(loaded) == 32 and len(loaded.segments) == 2
    assert torch.equal(loaded.document(30), corpus.document(30))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    codec_files = {f["name"] for f in manifest["codec"]["files"].values()}
    assert {p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("codec-")} == codec_files


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def test_codec_and_code_files_are_checked(tmp_path):
    docs, codec, _ = build("residual2", seed=6, n=30)
    Corpus.from_list(docs, codec=codec).save(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    assert manifest["codec"]["kind"] == "residual" and manifest["codec"]["nbits"] == 2
    assert manifest["codec"]["num_centroids"] == 16
    assert set(manifest["codec"]["files"]) == {"centroids", "bucket_weights", "bucket_cutoffs"}
    assert set(manifest["segments"][0]["files"]) == {"codes", "residuals", "lengths", "ids"}

    centroids = tmp_path / "c" / manifest["codec"]["files"]["centroids"]["name"]
    data = centroids.read_bytes()
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    centroids.write_bytes(bytes(flipped))
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{centroids.name} is corrupted"):
        Corpus.load(tmp_path / "c")
    centroids.write_bytes(data)

    codes = tmp_path / "c" / manifest["segments"][0]["files"]["codes"]["name"]
    assert codes.name.endswith(".codes.npy")
    data = codes.read_bytes()
    codes.write_bytes(data[:-6])
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{codes.name} is truncated"):
        Corpus.load(tmp_path / "c", verify=False)
    codes.write_bytes(data)
    residuals = tmp_path / "c" / manifest["segments"][0]["files"]["residuals"]["name"]
    assert residuals.name.endswith(".res.npy")
    residuals.unlink()
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{residuals.name} is missing"):
        Corpus.load(tmp_path / "c")


def test_pq_codebooks_file_is_checked(tmp_path):
    docs, codec, _ = build("pq8", seed=7, n=20)
    Corpus.from_list(docs, codec=codec).save(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    assert manifest["codec"] == {"kind": "pq", "m": 8, "files": manifest["codec"]["files"]}
    books = tmp_path / "c" / manifest["codec"]["files"]["codebooks"]["name"]
    books.write_bytes(books.read_bytes()[:100])
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{books.name} is truncated"):
        Corpus.load(tmp_path / "c", verify=False)
    # a manifest without its codec entry
    del manifest["codec"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(corpus_format.CorpusFormatError, match="of pq8 codes lists no codec"):
        Corpus.load(tmp_path / "c")


def test_version_3_is_refused_by_older_readers(tmp_path, monkeypatch):
    docs, codec, _ = build("pq8", seed=8, n=20)
    Corpus.from_list(docs, codec=codec).save(tmp_path / "c")
    assert _manifest(tmp_path / "c")["version"] == 3 < corpus_format.FORMAT_VERSION
    # a reader of versions up to 2 (the int8 / fp8 maxsim)
    monkeypatch.setattr(corpus_format, "FORMAT_VERSION", 2)
    with pytest.raises(corpus_format.CorpusFormatError, match=r"newer format version \(3\).*versions up to 2"):
        Corpus.load(tmp_path / "c")
    monkeypatch.undo()
    Corpus.load(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    manifest["version"] = corpus_format.FORMAT_VERSION + 1
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(corpus_format.CorpusFormatError, match=f"newer format version \\({corpus_format.FORMAT_VERSION + 1}\\)"):
        Corpus.load(tmp_path / "c")
    # a residual manifest that says version 2 is inconsistent
    manifest["version"] = 2
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(corpus_format.CorpusFormatError, match="inconsistent encoding 'pq8'"):
        Corpus.load(tmp_path / "c")


@pytest.mark.parametrize("when", ["codec", "segment"])
def test_interrupted_overwrite_keeps_the_old_corpus(tmp_path, monkeypatch, when):
    docs, codec, g = build("residual2", seed=9, n=30)
    queries = unit_queries(g, (3,))
    Corpus.from_list(docs, codec=codec).save(tmp_path / "c")
    before = Corpus.load(tmp_path / "c").search(queries, 5, progress=False, device="cpu")
    real = corpus_format._write_array
    calls = {"n": 0}

    def dies(path, array):  # the new corpus's first codec table, or its first segment file
        calls["n"] += 1
        if (when == "codec" and ".centroids" in path.name) or (when == "segment" and ".codes" in path.name):
            path.with_name(path.name + ".tmp").write_bytes(b"\x93NUMPY partial")
            raise KeyboardInterrupt
        real(path, array)

    new_codec = make_codec("residual2", docs[3:], g)
    monkeypatch.setattr(corpus_format, "_write_array", dies)
    with pytest.raises(KeyboardInterrupt):
        Corpus.from_list(docs[:10], codec=new_codec).save(tmp_path / "c", overwrite=True)
    monkeypatch.undo()
    after = Corpus.load(tmp_path / "c").search(queries, 5, progress=False, device="cpu")
    assert torch.equal(after.indices, before.indices) and torch.equal(after.scores, before.scores)
    # the next write removes the orphans
    Corpus.from_list(docs[:10], codec=new_codec).save(tmp_path / "c", overwrite=True)
    listed = {f["name"] for f in _manifest(tmp_path / "c")["codec"]["files"].values()}
    listed |= {f["name"] for s in _manifest(tmp_path / "c")["segments"] for f in s["files"].values()}
    assert {p.name for p in (tmp_path / "c").iterdir()} == listed | {"manifest.json"}


def _write_fast_plaid(path, codec, codes, residuals, doc_lengths):
    """A one-chunk fast-plaid folder (tests/index/test_fast_plaid_index.py writes the full layout)."""
    os.makedirs(path)
    np.save(path / "centroids.npy", codec.centroids.half().numpy())
    np.save(path / "bucket_cutoffs.npy", codec.bucket_cutoffs.numpy())
    np.save(path / "bucket_weights.npy", codec.bucket_weights.numpy())
    np.save(path / "0.codes.npy", codes.long().numpy())
    np.save(path / "0.residuals.npy", residuals.numpy())
    (path / "doclens.0.json").write_text(json.dumps(doc_lengths))
    pid_of_token = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    lists = [torch.unique(pid_of_token[codes.long() == c]) for c in range(codec.num_centroids)]
    np.save(path / "ivf.npy", torch.cat(lists).long().numpy())
    np.save(path / "ivf_lengths.npy", torch.tensor([len(v) for v in lists], dtype=torch.int32).numpy())
    (path / "metadata.json").write_text(json.dumps({"num_chunks": 1, "nbits": codec.nbits,
                                                    "num_embeddings": int(sum(doc_lengths)),
                                                    "num_documents": len(doc_lengths)}))


def test_from_index_reads_a_plaid_index(tmp_path):
    docs, codec, g = build("residual2", seed=10, n=40)
    tokens = torch.cat(docs)
    codes, residuals = codec.encode(tokens)
    lengths = [x.shape[0] for x in docs]
    _write_fast_plaid(tmp_path / "index", codec, codes, residuals, lengths)
    corpus = Corpus.from_index(tmp_path / "index")
    assert corpus.encoding == "residual2" and len(corpus) == 40 and corpus.codec.centroids.dtype == torch.float16
    assert torch.equal(corpus.codes, codes) and torch.equal(corpus.residuals, residuals)
    assert np.array_equal(np.diff(corpus.offsets), lengths)
    queries = unit_queries(g)
    assert_topk(corpus.search(queries, 7, progress=False, device="cpu"), oracle_scores(queries, corpus), 7)
    corpus.save(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.codec.centroids.dtype == torch.float16  # stored as it is: the same decode
    assert torch.equal(loaded.document(3), corpus.document(3))
    # the index's codec keeps its cutoffs: documents appended to it are encoded with it
    loaded.append(docs[:2])
    assert torch.equal(loaded.document(40), corpus.document(0))


# ---------------------------------------------------------------------- the index command


def test_cli_index_residual2_then_search(tmp_path, capsys):
    g = torch.Generator().manual_seed(11)
    docs = unit_docs(g, n=40)
    more = unit_docs(g, n=10)
    queries = unit_queries(g, (2, 4, 3))
    np.save(tmp_path / "docs.npy", torch.cat(docs).numpy())
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    torch.save({"embeddings": more, "ids": list(range(40, 50))}, tmp_path / "more.pt")
    torch.save({"embeddings": queries, "ids": ["q1", "q2", "q3"]}, tmp_path / "queries.pt")
    out = str(tmp_path / "c")
    assert run_command(["index", "--out", out, "--encoding", "residual2", "--num-centroids", "16", "--device", "cpu",
                 str(tmp_path / "docs.npy"), "--lengths", str(tmp_path / "lengths.npy")]) == 0
    assert "training a residual2 codec on" in capsys.readouterr().err
    first = Corpus.load(out)
    assert first.encoding == "residual2" and first.codec.num_centroids == 16
    # float documents appended to the residual corpus are encoded with its codec
    assert run_command(["index", "--out", out, "--append", str(tmp_path / "more.pt"), "--quiet", "--device", "cpu"]) == 0
    corpus = Corpus.load(out)
    assert corpus.encoding == "residual2" and len(corpus) == 50 and len(corpus.segments) == 2
    assert torch.equal(corpus.codec.centroids, first.codec.centroids)
    assert torch.equal(corpus.document(40), Corpus.from_list(more, codec=first.codec).document(0))
    assert run_command(["search", "--corpus", out, "--queries", str(tmp_path / "queries.pt"), "-k", "6",
                 "--out", str(tmp_path / "run.jsonl"), "--no-progress", "--quiet", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    result = type("R", (), {})()
    result.scores = torch.tensor([r["scores"] for r in rows])
    result.indices = torch.tensor([r["docids"] for r in rows])  # ids are the positions here
    assert_topk(result, oracle_scores(queries, corpus), 6)
    with pytest.raises(TypeError, match="cannot append residual4 documents to the corpus .* of residual2"):
        run_command(["index", "--out", out, "--append", "--encoding", "residual4", str(tmp_path / "more.pt"), "--quiet"])
    capsys.readouterr()


def test_cli_plaid_search_of_a_residual_corpus(tmp_path, capsys):
    """search --corpus C --plaid: PLAID's candidate generation over the corpus's codes, refined
    from the float16 tokens stored beside them to the exact top-k; --plaid and --load lookup say
    in one line what they cannot hold."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = unit_docs(g, n=120)
    queries = unit_queries(g, (5, 4, 6))
    np.save(tmp_path / "docs.npy", torch.cat(docs).numpy())
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    (tmp_path / "ids.txt").write_text("".join(f"p{j}\n" for j in range(120)))
    torch.save({"embeddings": queries}, tmp_path / "queries.pt")
    out = str(tmp_path / "c")
    assert run_command(["index", "--out", out, "--encoding", "residual2", "--num-centroids", "8", "--device", "cpu",
                        "--refine", "float16", str(tmp_path / "docs.npy"), "--lengths", str(tmp_path / "lengths.npy"),
                        "--ids", str(tmp_path / "ids.txt"), "--quiet"]) == 0
    assert run_command(["search", "--corpus", out, "--plaid", "--refine", "--refine-factor", "40", "--queries",
                        str(tmp_path / "queries.pt"), "-k", "3", "--out", str(tmp_path / "run.jsonl"),
                        "--no-progress", "--device", "cpu"]) == 0
    assert "PLAID over a residual2 corpus" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    exact = Corpus.from_list(docs, ids=[f"p{j}" for j in range(120)]).search(queries, 3, device="cpu")
    assert [r["docids"] for r in rows] == exact.ids
    torch.testing.assert_close(torch.tensor([r["scores"] for r in rows]), exact.scores, atol=1e-3, rtol=0)
    int8 = str(tmp_path / "c8")
    assert run_command(["index", "--out", int8, "--encoding", "int8", str(tmp_path / "docs.npy"), "--lengths",
                        str(tmp_path / "lengths.npy"), "--quiet"]) == 0
    search = ["search", "--queries", str(tmp_path / "queries.pt"), "--out", str(tmp_path / "x.jsonl"), "--quiet",
              "--device", "cpu"]
    assert run_command(search + ["--corpus", int8, "--plaid"]) == 2
    assert "--plaid needs a residual corpus" in capsys.readouterr().err
    assert run_command(search + ["--corpus", out, "--load", "lookup"]) == 2
    assert "look-up layouts on a GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_encoding_names(tmp_path, capsys):
    np.save(tmp_path / "docs.npy", np.zeros((300, D), np.float32))
    np.save(tmp_path / "lengths.npy", np.full(30, 10))
    args = ["index", "--out", str(tmp_path / "c"), str(tmp_path / "docs.npy"), "--lengths", str(tmp_path / "lengths.npy"),
            "--quiet", "--device", "cpu"]
    with pytest.raises(ValueError, match="pq48 needs m=48 to divide d=32: use one of pq1, pq2, pq4, pq8, pq16, pq32"):
        run_command(args + ["--encoding", "pq48"])
    for bad in ("pq0", "residual3", "int4"):
        with pytest.raises(SystemExit):
            run_command(args + ["--encoding", bad])
        assert f"invalid choice: '{bad}'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_command(["index", "--help"])
    text = capsys.readouterr().out
    assert "residual2,residual4,residual8,pq<m>" in text and "--encoding residual2" in text
    assert run_command(args + ["--encoding", "int8", "--num-centroids", "4"]) == 2
    assert "--num-centroids is for" in capsys.readouterr().err
