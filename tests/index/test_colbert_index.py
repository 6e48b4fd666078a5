"""colbert-ai index folders: the reader, bit-exact decode, and search against colbert-ai's Searcher."""

import json
import os
import shutil

import pytest
import torch

import maxsim.index
from colbert_built import colbert_built_index  # noqa: F401  (the fixture: an index colbert-ai built)
from maxsim.compressed import ResidualCodec


def test_reader_and_decode_match_colbert_loader(colbert_built_index):
    from colbert.indexing.codecs.residual import ResidualCodec as ColbertCodec
    from colbert.indexing.codecs.residual_embeddings import ResidualEmbeddings

    path, _ = colbert_built_index
    index = maxsim.index.load(path)
    assert index.format == "colbert" and index.codec.nbits == 2 and index.codec.dim == 128
    doclens = json.load(open(os.path.join(path, "doclens.0.json")))
    assert len(index) == len(doclens) and index.doc_lengths.tolist() == doclens
    assert torch.equal(index.codes, torch.load(os.path.join(path, "0.codes.pt")))
    assert torch.equal(index.residuals, torch.load(os.path.join(path, "0.residuals.pt")))
    ivf, ivf_lengths = torch.load(os.path.join(path, "ivf.pid.pt"))
    assert torch.equal(index.ivf, ivf[: int(ivf_lengths.sum())].long())
    assert torch.equal(index.ivf_lengths, ivf_lengths.long())
    assert index.cu_seqlens[-1] == index.num_embeddings
    theirs = ColbertCodec.load(path)
    expected = theirs.decompress(ResidualEmbeddings(index.codes, index.residuals))
    assert torch.equal(index.codec.decode(index.codes, index.residuals, dtype=torch.float32), expected)


def test_search_top10_matches_colbert_searcher(colbert_built_index):
    path, answers = colbert_built_index
    index = maxsim.index.load(path)
    same = 0
    for Q, pids in answers:
        _, ours, _ = index.search(Q[0], k=10)
        same += ours.tolist() == pids
    assert same >= 0.95 * len(answers), f"{same} of {len(answers)} top-10 lists equal colbert-ai's"
    # batched queries give the same answers as one at a time
    Q_all = torch.cat([Q for Q, _ in answers[:4]])
    scores, pids, _ = index.search(Q_all, k=10)
    assert scores.shape == (4, 10) and pids.dtype == torch.int64
    for i in range(4):
        assert torch.equal(pids[i], index.search(answers[i][0][0], k=10)[1])
        assert torch.all(scores[i, :-1] >= scores[i, 1:])


def test_exact_scores_are_the_decoded_maxsim(colbert_built_index):
    path, answers = colbert_built_index
    index = maxsim.index.load(path)
    Q = answers[0][0][0]  # [32, 128]
    scores, pids, _ = index.search(Q, k=5)
    decoded = index.codec.decode(index.codes, index.residuals, dtype=torch.float32)
    for score, pid in zip(scores.tolist(), pids.tolist()):
        doc = decoded[index.cu_seqlens[pid]:index.cu_seqlens[pid + 1]]
        assert score == pytest.approx((Q @ doc.T).max(dim=1).values.sum().item(), abs=1e-4)


def _write_colbert_layout(path, nbits, doc_lengths, chunk_sizes, dim=64, num_centroids=32):
    """An index folder written by colbert-ai's own codec, ResidualEmbeddings and optimize_ivf."""
    from colbert.indexing.codecs.residual import ResidualCodec as ColbertCodec
    from colbert.indexing.utils import optimize_ivf
    from colbert.infra import ColBERTConfig

    os.makedirs(path, exist_ok=True)
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim), dim=-1).half().float()
    embeddings = torch.nn.functional.normalize(torch.randn(sum(doc_lengths), dim), dim=-1).half()
    residual = embeddings.float() - centroids[(centroids @ embeddings.float().T).argmax(0)]
    quantiles = torch.arange(1 << nbits) / (1 << nbits)
    cutoffs = residual.flatten().quantile(quantiles[1:])
    weights = residual.flatten().quantile(quantiles + 0.5 / (1 << nbits))
    config = ColBERTConfig(nbits=nbits, dim=dim)
    codec = ColbertCodec(config, centroids, avg_residual=residual.abs().mean(), bucket_cutoffs=cutoffs,
                         bucket_weights=weights)
    codec.save(index_path=path)
    all_codes, doc_offset, emb_offset = [], 0, 0
    for chunk, num_docs in enumerate(chunk_sizes):
        lengths = doc_lengths[doc_offset:doc_offset + num_docs]
        n = sum(lengths)
        compressed = codec.compress(embeddings[emb_offset:emb_offset + n])
        compressed.save(os.path.join(path, str(chunk)))
        all_codes.append(compressed.codes)
        json.dump(lengths, open(os.path.join(path, f"doclens.{chunk}.json"), "w"))
        json.dump({"passage_offset": doc_offset, "num_passages": num_docs, "num_embeddings": n,
                   "embedding_offset": emb_offset}, open(os.path.join(path, f"{chunk}.metadata.json"), "w"))
        doc_offset, emb_offset = doc_offset + num_docs, emb_offset + n
    codes = torch.cat(all_codes).long()
    sorted_codes = codes.sort()
    ivf_lengths = torch.bincount(sorted_codes.values, minlength=num_centroids)
    optimize_ivf(sorted_codes.indices, ivf_lengths, path, verbose=0)
    json.dump({"config": config.export(), "num_chunks": len(chunk_sizes), "num_partitions": num_centroids,
               "num_embeddings": emb_offset, "avg_doclen": emb_offset / len(doc_lengths)},
              open(os.path.join(path, "metadata.json"), "w"))
    return embeddings, codec


@pytest.fixture
def colbert_layout_or_skip():
    for module in ("colbert", "faiss"):
        pytest.importorskip(module, reason=f"{module} not installed (colbert-ai test tier)")
    if torch.cuda.is_available():
        pytest.skip("colbert-ai's CPU codec path is taken only without a visible GPU")


@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_written_layout_multi_chunk_reads_and_decodes_bit_exactly(tmp_path, nbits, colbert_layout_or_skip):
    from colbert.indexing.codecs.residual import ResidualCodec as ColbertCodec
    from colbert.indexing.codecs.residual_embeddings import ResidualEmbeddings
    from colbert.search.index_loader import IndexLoader

    doc_lengths = torch.randint(1, 20, (30,)).tolist()
    _write_colbert_layout(str(tmp_path), nbits, doc_lengths, chunk_sizes=[12, 7, 11])
    index = maxsim.index.load(tmp_path)
    loader = IndexLoader(str(tmp_path), use_gpu=False)
    assert index.doc_lengths.tolist() == doc_lengths == loader.doclens.tolist()
    total = sum(doc_lengths)
    assert torch.equal(index.codes, loader.embeddings.codes[:total])  # colbert-ai pads 512 rows
    assert torch.equal(index.residuals, loader.embeddings.residuals[:total])
    ivf, ivf_lengths = torch.load(tmp_path / "ivf.pid.pt")
    assert ivf.numel() >= index.ivf.numel() == int(ivf_lengths.sum())
    assert torch.equal(index.ivf, ivf[: index.ivf.numel()].long())
    for c in range(index.codec.num_centroids):  # every list: the sorted pids having a token of that code
        lo, hi = index.ivf_offsets[c], index.ivf_offsets[c + 1]
        pids = torch.repeat_interleave(torch.arange(len(doc_lengths)), index.doc_lengths)[index.codes.long() == c]
        assert index.ivf[lo:hi].tolist() == torch.unique(pids).tolist()
    theirs = ColbertCodec.load(str(tmp_path))
    assert torch.equal(index.codec.decode(index.codes, index.residuals, dtype=torch.float32),
                       theirs.decompress(ResidualEmbeddings(loader.embeddings.codes[:total],
                                                            loader.embeddings.residuals[:total])))
    assert torch.equal(ResidualCodec.from_colbert(tmp_path).centroids, index.codec.centroids)


def test_reader_errors_name_the_file(tmp_path, colbert_layout_or_skip):
    good = tmp_path / "good"
    _write_colbert_layout(str(good), 2, [3, 4, 5, 2], chunk_sizes=[2, 2])
    maxsim.index.load(good)

    def broken(name):
        target = tmp_path / name
        shutil.copytree(good, target)
        return target

    missing = broken("missing")
    os.remove(missing / "1.residuals.pt")
    with pytest.raises(FileNotFoundError, match="1.residuals.pt"):
        maxsim.index.load(missing)
    no_ivf = broken("no_ivf")
    os.remove(no_ivf / "ivf.pid.pt")
    with pytest.raises(FileNotFoundError, match="ivf.pid.pt"):
        maxsim.index.load(no_ivf)
    wrong_doclens = broken("wrong_doclens")
    json.dump([3, 5], open(wrong_doclens / "doclens.0.json", "w"))
    with pytest.raises(ValueError, match="0.codes.pt"):
        maxsim.index.load(wrong_doclens)
    bad_codes = broken("bad_codes")
    codes = torch.load(bad_codes / "0.codes.pt")
    codes[0] = 10_000
    torch.save(codes, bad_codes / "0.codes.pt")
    with pytest.raises(ValueError, match="centroid ids"):
        maxsim.index.load(bad_codes)
    with pytest.raises(FileNotFoundError, match="not found"):
        maxsim.index.load(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="neither"):
        maxsim.index.load(tmp_path / "empty")


def test_search_with_all_cells_and_no_pruning_is_exhaustive(tmp_path, colbert_layout_or_skip):
    doc_lengths = torch.randint(0, 15, (40,)).tolist()
    _write_colbert_layout(str(tmp_path), 4, doc_lengths, chunk_sizes=[40])
    index = maxsim.index.load(tmp_path)
    Q = torch.nn.functional.normalize(torch.randn(3, 6, 64), dim=-1)
    scores, pids, _ = index.search(Q, k=7, ncells=index.codec.num_centroids, centroid_score_threshold=None,
                                ndocs=4 * len(index))
    decoded = index.codec.decode(index.codes, index.residuals, dtype=torch.float32)
    for i in range(3):
        brute = torch.tensor([
            (Q[i] @ decoded[index.cu_seqlens[j]:index.cu_seqlens[j + 1]].T).max(dim=1).values.sum().item()
            if doc_lengths[j] else float("-inf") for j in range(len(index))])
        # documents with no token are never in the IVF: compare against those that are
        top = torch.sort(brute, descending=True).values[:7]
        torch.testing.assert_close(scores[i], top, atol=1e-5, rtol=0)
        for score, pid in zip(scores[i].tolist(), pids[i].tolist()):
            assert brute[pid].item() == pytest.approx(score, abs=1e-5)


def test_search_arguments(tmp_path, colbert_layout_or_skip):
    _write_colbert_layout(str(tmp_path), 2, [4, 5, 6], chunk_sizes=[3])
    index = maxsim.index.load(tmp_path)
    Q = torch.randn(5, 64)
    scores, pids, _ = index.search(Q, k=10, ncells=32, centroid_score_threshold=None)
    assert scores.shape == (10,) and pids[3:].tolist() == [-1] * 7 and torch.isinf(scores[3:]).all()
    with pytest.raises(ValueError, match="k"):
        index.search(Q, k=0)
    with pytest.raises(ValueError, match="settings"):
        index.search(Q, settings="nope")
    with pytest.raises(ValueError, match="ncells"):
        index.search(Q, ncells=0)
    with pytest.raises(ValueError, match="Q"):
        index.search(torch.randn(5, 32))
    masked = index.search(Q, k=3, q_mask=torch.tensor([True, True, False, False, True]), ncells=32)
    plain = index.search(Q[[0, 1, 4]], k=3, ncells=32)
    assert torch.equal(masked[1], plain[1])


def test_colbert_defaults_by_k():
    from maxsim.index.search import colbert_defaults, resolve_settings

    assert colbert_defaults(10) == (1, 0.5, 256)
    assert colbert_defaults(11) == (2, 0.45, 1024) == colbert_defaults(100)
    assert colbert_defaults(101) == (4, 0.4, 4096)
    assert colbert_defaults(2000) == (4, 0.4, 8000)
    assert resolve_settings(10, "fast-plaid") == (8, None, 4096)
    assert resolve_settings(10, "colbert", centroid_score_threshold=None) == (1, None, 256)
