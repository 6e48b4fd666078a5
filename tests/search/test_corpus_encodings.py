"""int8 / fp8 corpora: search equals the top-k of maxsim_quantized_varlen's full score matrix, the
file keeps values and scales, appends keep one encoding, the index command takes --encoding."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from commands import run as run_command

from maxsim.compressed.quantized import dequantize_tokens, maxsim_quantized_varlen, quantize_tokens
from maxsim.tuning import tables
from placement import place, search_within_budget
from maxsim.search import Corpus
from maxsim.search import format as corpus_format

ENCODINGS = ["int8", "fp8"]
# e4m3 holds 448 (its largest) and every integer up to 16 exactly
_EXACT_MAX = {"int8": 127, "fp8": 448}
_EXACT_SMALL = {"int8": 127, "fp8": 8}


def sorted_topk(full, k):
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


def normalized_docs(n, d=32, longest=12):
    lengths = torch.randint(1, longest, (n,)).tolist()
    docs = [F.normalize(torch.randn(L, d), dim=-1) for L in lengths]
    docs[n // 3] = torch.zeros(0, d)  # an empty document scores 0
    return docs


def exact_docs(n, encoding, d=16, longest=7):
    """Integer tokens whose largest magnitude is the format's maximum: scale 1, the values exact,
    so every score is an exact integer in fp32; duplicates and an empty document make ties."""
    docs = []
    for L in torch.randint(1, longest, (n,)).tolist():
        x = torch.randint(-_EXACT_SMALL[encoding], _EXACT_SMALL[encoding] + 1, (L, d)).float()
        x[:, 0] = _EXACT_MAX[encoding] * (torch.randint(0, 2, (L,)) * 2 - 1)
        docs.append(x)
    docs[5] = docs[2].clone()
    docs[n - 1] = docs[2].clone()
    docs[n // 2] = torch.zeros(0, d)
    return docs


def full_scores(queries, corpus):
    """The reference: maxsim_quantized_varlen of every query against the whole corpus, [Nq, Nd]."""
    return maxsim_quantized_varlen(queries, corpus.embeddings, corpus.scales, torch.from_numpy(corpus.offsets))


def assert_topk(result, full, k, exact):
    want_scores, want_indices = sorted_topk(full, k)
    if exact:
        assert torch.equal(result.indices, want_indices) and torch.equal(result.scores, want_scores)
        return
    # A CPU chunk may round a score's last bit differently from the whole-corpus call: indices
    # may only differ where the two documents' reference scores are that close.
    torch.testing.assert_close(result.scores, want_scores, rtol=2e-6, atol=2e-6)
    differ = result.indices != want_indices
    gap = (full.gather(1, result.indices) - full.gather(1, want_indices))[differ]
    assert bool((gap.abs() <= 1e-5).all())


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("exact", [False, True])
def test_search_equals_full_quantized_matrix(tmp_path, encoding, exact):
    docs = exact_docs(90, encoding) if exact else normalized_docs(120)
    d = docs[0].shape[1]
    if exact:
        queries = [torch.randint(-2, 3, (L, d)).float() for L in (3, 1, 5, 2)]
    else:
        queries = [F.normalize(torch.randn(L, d), dim=-1) for L in (3, 1, 5, 2)]
    ids = [f"doc-{j}" for j in range(len(docs))]
    corpus = Corpus.from_list(docs, ids=ids, encoding=encoding)
    assert corpus.encoding == encoding and corpus.encoding.has_scales
    assert corpus.dtype == (torch.int8 if encoding == "int8" else torch.float8_e4m3fn)
    assert corpus.scales.shape == (corpus.num_tokens,) and corpus.scales.dtype == torch.float32
    assert encoding in repr(corpus)
    full = full_scores(queries, corpus)
    k = 25
    # Whole corpus, then tiny budgets: many chunks and query batches merged into the running top-k.
    for budget, batch in ((None, None), (6_000, None), (6_000, 1)):
        result = corpus.search(queries, k, gpu_memory=budget, batch_size=batch, progress=False, device="cpu")
        assert_topk(result, full, k, exact)
        assert result.ids == [[ids[j] for j in row] for row in result.indices.tolist()]
    corpus.save(tmp_path / "c")
    for mmap in (True, False):
        loaded = Corpus.load(tmp_path / "c", mmap=mmap)
        assert loaded.encoding == encoding and loaded.is_mapped == mmap
        assert torch.equal(loaded.embeddings.view(torch.uint8), corpus.embeddings.view(torch.uint8))
        assert torch.equal(loaded.scales, corpus.scales)
        assert_topk(loaded.search(queries, k, gpu_memory=6_000, progress=False, device="cpu"), full, k, exact)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_documents_dequantise_and_queries_of_any_float_dtype(encoding):
    docs = normalized_docs(12, d=16)
    corpus = Corpus.from_list(docs, encoding=encoding)
    values, scales = quantize_tokens(docs[1], "int8" if encoding == "int8" else "fp8_e4m3")
    assert corpus.document(1).dtype == torch.float32
    assert torch.equal(corpus.document(1), dequantize_tokens(values, scales))
    assert corpus.document(len(docs) // 3).shape == (0, 16)
    for dtype in (torch.float16, torch.bfloat16):
        queries = [F.normalize(torch.randn(3, 16), dim=-1).to(dtype)]
        result = corpus.search(queries, 5, progress=False, device="cpu")
        assert_topk(result, full_scores(queries, corpus), 5, exact=False)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32 queries"):
        corpus.search([torch.ones(2, 16, dtype=torch.float64)], 3)
    shards = [corpus.shard(r, 3) for r in range(3)]
    assert all(s.encoding == encoding for s in shards)
    assert torch.equal(torch.cat([s.scales for s in shards]), corpus.scales)


def test_triton_backend_scores_the_bytes(monkeypatch):
    # the stream kernel on the one-byte tokens: Triton's interpreter on the CPU, compiled on a GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    # the tokens widened to the query's dtype (exact here); the one-byte dot a GPU takes by
    # default is tested against its own oracle in tests/compressed/test_quantized.py
    monkeypatch.setattr(tables, "ONE_BYTE_DOT_FAMILIES", ())
    docs = exact_docs(12, "int8", d=16, longest=5)
    queries = [torch.randint(-2, 3, (L, 16)).float() for L in (2, 3)]
    corpus = Corpus.from_list(docs, encoding="int8")
    result = corpus.search([x.to(device) for x in queries], 6, progress=False, device=device)
    monkeypatch.setenv("MAXSIM_BACKEND", "cpu")
    result = type(result)(result.scores.cpu(), result.indices.cpu(), result.ids)
    assert_topk(result, full_scores(queries, corpus), 6, exact=True)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_corrupted_scale_is_refused_once_checked(monkeypatch, backend):
    # search checks a segment's scales once (not at every call): a negative or NaN one still stops it
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("MAXSIM_BACKEND", backend)
    docs = normalized_docs(10, d=16, longest=5)
    queries = [F.normalize(torch.randn(3, 16), dim=-1).to(device)]
    for bad in (-1.0, float("nan")):
        corpus = Corpus.from_list(docs, encoding="int8").to(device)
        corpus.segments[0].scales[2] = bad
        with pytest.raises(ValueError, match="scales must be finite and >= 0"):
            corpus.search(queries, 3, progress=False)
        with pytest.raises(ValueError, match="scales must be finite and >= 0"):  # and again: never marked checked
            corpus.search(queries, 3, progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("where", ["pinned", "host", "mmap", "device"])
def test_gpu_streaming_equals_full_matrix(tmp_path, encoding, where):
    docs = exact_docs(6000, encoding, d=128, longest=300)
    queries = [torch.randint(-2, 3, (32, 128), dtype=torch.float16, device="cuda") for _ in range(16)]
    corpus = Corpus.from_list(docs, encoding=encoding)
    want = sorted_topk(full_scores(queries, corpus.to("cuda")), 100)
    r = search_within_budget(place(corpus, where, tmp_path), queries, 100, 64 << 20, where)
    assert torch.equal(r.indices.cpu(), want[1].cpu()) and torch.equal(r.scores.cpu(), want[0].cpu())


def test_int8_recall_against_float32():
    # Per-token int8 keeps the ranking of normalized embeddings: the top-10 overlap averages about
    # 0.99 here, far above the bound.
    lengths = torch.randint(8, 24, (400,)).tolist()
    docs = [F.normalize(torch.randn(L, 64), dim=-1) for L in lengths]
    queries = [F.normalize(torch.randn(16, 64), dim=-1) for _ in range(16)]
    exact = Corpus.from_list(docs).search(queries, 10, progress=False, device="cpu").indices
    approx = Corpus.from_list(docs, encoding="int8").search(queries, 10, progress=False, device="cpu").indices
    overlap = [len(set(a) & set(b)) / 10 for a, b in zip(exact.tolist(), approx.tolist())]
    assert sum(overlap) / len(overlap) >= 0.9


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _scales_file(directory: Path) -> Path:
    return directory / _manifest(directory)["segments"][0]["files"]["scales"]["name"]


def test_manifest_and_scales_files_are_checked(tmp_path):
    Corpus.from_list(normalized_docs(20), encoding="fp8").save(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    assert (manifest["encoding"], manifest["dtype"], manifest["version"]) == ("fp8", "float8_e4m3fn", 2)
    scales = _scales_file(tmp_path / "c")
    data = scales.read_bytes()
    scales.write_bytes(data[:-5])
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{scales.name}.*truncated"):
        Corpus.load(tmp_path / "c", verify=False)
    scales.unlink()
    with pytest.raises(corpus_format.CorpusFormatError, match=f"{scales.name} is missing"):
        Corpus.load(tmp_path / "c")
    scales.write_bytes(data)
    Corpus.load(tmp_path / "c")
    del manifest["segments"][0]["files"]["scales"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(corpus_format.CorpusFormatError, match="no scales file for segment 0"):
        Corpus.load(tmp_path / "c")


def test_float_corpora_keep_version_1(tmp_path):
    docs = normalized_docs(15)
    Corpus.from_list([x.half() for x in docs]).save(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    assert (manifest["encoding"], manifest["dtype"], manifest["version"]) == ("float16", "float16", 1)
    assert "scales" not in manifest["segments"][0]["files"]
    # A manifest written before the encoding field existed reads as its dtype.
    del manifest["encoding"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.encoding == "float16" and loaded.scales is None and not loaded.encoding.has_scales
    assert torch.equal(loaded.document(0), docs[0].half())
    # encoding= also casts to a float dtype
    assert Corpus.from_list(docs, encoding="bfloat16").dtype == torch.bfloat16


def test_append_quantises_floats_and_refuses_other_encodings(tmp_path):
    docs = normalized_docs(10, d=16)
    corpus = Corpus.from_list(docs, encoding="int8")
    more = [F.normalize(torch.randn(4, 16), dim=-1).half()]
    corpus.append(more)
    assert corpus.encoding == "int8" and len(corpus) == 11
    assert torch.equal(corpus.document(10), dequantize_tokens(*quantize_tokens(more[0], "int8")))
    with pytest.raises(TypeError, match="fp8 documents to the corpus of int8: build them with encoding='int8'"):
        corpus.append(Corpus.from_list(docs, encoding="fp8"))
    with pytest.raises(TypeError, match="int8 documents to the corpus of float32"):
        Corpus.from_list(docs).append(Corpus.from_list(docs, encoding="int8"))
    with pytest.raises(ValueError, match="encoding must be one of"):
        Corpus.from_list(docs, encoding="int4")

    corpus.save(tmp_path / "c")
    ids = [f"x{j}" for j in range(3)]
    with pytest.raises(TypeError, match="fp8 embeddings to corpus .* of int8: build the documents with encoding='int8'"):
        Corpus.from_list(docs[:3], ids=ids, encoding="fp8").save(tmp_path / "c", append=True)
    with pytest.raises(TypeError, match="float32 embeddings to corpus .* of int8"):
        Corpus.from_list(docs[:3], ids=ids).save(tmp_path / "c", append=True)
    Corpus.from_list(docs[:3], encoding="int8", ids=np.arange(100, 103)).save(tmp_path / "c", append=True)
    loaded = Corpus.load(tmp_path / "c")
    assert len(loaded) == 14 and len(loaded.segments) == 2 and _manifest(tmp_path / "c")["version"] == 2
    assert torch.equal(loaded.document(12), corpus.document(1))


def test_interrupted_append_keeps_the_encoded_corpus(tmp_path, monkeypatch):
    docs = normalized_docs(20)
    queries = [F.normalize(torch.randn(3, 32), dim=-1)]
    Corpus.from_list(docs, encoding="int8").save(tmp_path / "c")
    before = Corpus.load(tmp_path / "c").search(queries, 5, progress=False, device="cpu")
    calls = {"n": 0}
    real = corpus_format._write_array

    def dies_at_the_scales(path, array):  # values, lengths, then the scales: a crash mid-write
        calls["n"] += 1
        if calls["n"] == 3:
            path.with_name(path.name + ".tmp").write_bytes(b"\x93NUMPY partial")
            raise KeyboardInterrupt
        real(path, array)

    monkeypatch.setattr(corpus_format, "_write_array", dies_at_the_scales)
    with pytest.raises(KeyboardInterrupt):
        Corpus.from_list(normalized_docs(5), encoding="int8", ids=np.arange(50, 55)).save(tmp_path / "c", append=True)
    monkeypatch.undo()
    after = Corpus.load(tmp_path / "c").search(queries, 5, progress=False, device="cpu")
    assert torch.equal(after.indices, before.indices) and torch.equal(after.scores, before.scores)


def test_cli_index_int8_then_search(tmp_path, capsys):
    docs = exact_docs(30, "int8", d=8)
    more = exact_docs(10, "int8", d=8)
    queries = [torch.randint(-2, 3, (L, 8)).float() for L in (2, 4, 3)]
    np.save(tmp_path / "docs.npy", torch.cat(docs).numpy())
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    torch.save({"embeddings": more, "ids": list(range(30, 40))}, tmp_path / "more.pt")
    torch.save({"embeddings": queries, "ids": ["q1", "q2", "q3"]}, tmp_path / "queries.pt")
    out = str(tmp_path / "c")
    assert run_command(["index", "--out", out, "--encoding", "int8", str(tmp_path / "docs.npy"),
                 "--lengths", str(tmp_path / "lengths.npy"), "--quiet"]) == 0
    # float documents appended to the int8 corpus are quantised like it
    assert run_command(["index", "--out", out, "--append", str(tmp_path / "more.pt"), "--quiet"]) == 0
    corpus = Corpus.load(out)
    assert corpus.encoding == "int8" and len(corpus) == 40
    assert run_command(["search", "--corpus", out, "--queries", str(tmp_path / "queries.pt"), "-k", "6",
                 "--out", str(tmp_path / "run.jsonl"), "--no-progress", "--quiet", "--device", "cpu"]) == 0
    values, order = sorted_topk(full_scores(queries, corpus), 6)
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["docids"] for r in rows] == order.tolist()
    assert [r["scores"] for r in rows] == values.tolist()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        run_command(["index", "--out", out, "--encoding", "int4", str(tmp_path / "docs.npy")])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
