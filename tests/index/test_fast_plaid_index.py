"""fast-plaid index folders (v1.7 merged_*.npy with padding rows, and older per-chunk files).

fast-plaid cannot be installed here (its wheels pin one torch version each), so these folders are
written in its layout (rust/index/create.rs, python/fast_plaid/search/load.py) from our encoder.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import maxsim.index
from maxsim.compressed import ResidualCodec
from maxsim.index.search import resolve_settings


def _write_fast_plaid(path, doc_lengths, chunk_sizes, *, nbits=2, dim=32, num_centroids=24, merged=False,
                      keep_chunks=True):
    os.makedirs(path, exist_ok=True)
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, dim), dim=-1).half()
    x = torch.nn.functional.normalize(torch.randn(sum(doc_lengths), dim), dim=-1)
    cutoffs = torch.sort(torch.randn((1 << nbits) - 1) * 0.05).values
    weights = torch.sort(torch.randn(1 << nbits) * 0.05).values
    codec = ResidualCodec(centroids.float(), weights, nbits, bucket_cutoffs=cutoffs)
    codes, residuals = codec.encode(x)
    codes = codes.long()
    np.save(os.path.join(path, "centroids.npy"), centroids.numpy())
    np.save(os.path.join(path, "bucket_cutoffs.npy"), cutoffs.numpy())
    np.save(os.path.join(path, "bucket_weights.npy"), weights.numpy())
    np.save(os.path.join(path, "avg_residual.npy"), torch.rand(dim).half().numpy())
    doc_offset = emb_offset = 0
    for chunk, num_docs in enumerate(chunk_sizes):
        lengths = doc_lengths[doc_offset:doc_offset + num_docs]
        n = sum(lengths)
        if keep_chunks:
            np.save(os.path.join(path, f"{chunk}.codes.npy"), codes[emb_offset:emb_offset + n].numpy())
            np.save(os.path.join(path, f"{chunk}.residuals.npy"), residuals[emb_offset:emb_offset + n].numpy())
        json.dump(lengths, open(os.path.join(path, f"doclens.{chunk}.json"), "w"))
        json.dump({"num_documents": num_docs, "num_embeddings": n, "embedding_offset": emb_offset},
                  open(os.path.join(path, f"{chunk}.metadata.json"), "w"))
        doc_offset, emb_offset = doc_offset + num_docs, emb_offset + n
    if merged:
        padding = max(doc_lengths) - doc_lengths[-1]
        junk_codes = torch.randint(0, num_centroids, (padding,))
        junk_res = torch.randint(0, 256, (padding, codec.packed_dim), dtype=torch.uint8)
        np.save(os.path.join(path, "merged_codes.npy"), torch.cat([codes, junk_codes]).numpy())
        np.save(os.path.join(path, "merged_residuals.npy"), torch.cat([residuals, junk_res]).numpy())
    # IVF: sorted unique pids per centroid, as optimize_ivf writes them
    pid_of_token = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    lists = [torch.unique(pid_of_token[codes == c]) for c in range(num_centroids)]
    np.save(os.path.join(path, "ivf.npy"), torch.cat(lists).long().numpy())
    np.save(os.path.join(path, "ivf_lengths.npy"), torch.tensor([len(v) for v in lists], dtype=torch.int32).numpy())
    json.dump({"num_chunks": len(chunk_sizes), "nbits": nbits, "num_partitions": num_centroids,
               "num_embeddings": emb_offset, "avg_doclen": emb_offset / len(doc_lengths),
               "num_documents": len(doc_lengths), "compress_only": False},
              open(os.path.join(path, "metadata.json"), "w"))
    return codes, residuals, centroids, weights


def _fast_plaid_decode(codes, residuals, centroids, weights, nbits):
    """fast-plaid's decompress_residuals: fp16 centroids + fp16 bucket weights (its table), fp16 sum."""
    per_byte = 8 // nbits
    mask = (1 << nbits) - 1
    rev = []
    for byte in range(256):  # byte_reversed_bits_map: reverse the bits of each nbits field
        out = 0
        for field in range(per_byte):
            seg = (byte >> (8 - (field + 1) * nbits)) & mask
            seg_rev = int(format(seg, f"0{nbits}b")[::-1], 2)
            out |= seg_rev << (8 - (field + 1) * nbits)
        rev.append(out)
    lookup = torch.tensor([[(b >> (k * nbits)) & mask for k in reversed(range(per_byte))] for b in range(256)])
    buckets = lookup[torch.tensor(rev)[residuals.long()]].reshape(codes.numel(), -1)
    return centroids.half()[codes] + weights.half()[buckets]


@pytest.mark.parametrize("layout", ["chunks", "merged", "merged_only"])
@pytest.mark.parametrize("nbits", [2, 4])
def test_reads_each_layout(tmp_path, layout, nbits):
    doc_lengths = torch.randint(1, 25, (23,)).tolist()
    doc_lengths[-1] = 1  # the merged files then carry max - 1 padding rows
    codes, residuals, centroids, weights = _write_fast_plaid(
        str(tmp_path), doc_lengths, [10, 13], nbits=nbits, merged=layout != "chunks",
        keep_chunks=layout != "merged_only")
    index = maxsim.index.load(tmp_path)
    assert index.format == "fast-plaid" and len(index) == 23
    assert index.doc_lengths.tolist() == doc_lengths
    assert torch.equal(index.codes, codes) and torch.equal(index.residuals, residuals)
    decoded = index.codec.decode(index.codes, index.residuals, normalize=False, dtype=torch.float16)
    assert torch.equal(decoded, _fast_plaid_decode(codes, residuals, centroids, weights, nbits))
    assert index.codec.centroids.dtype == torch.float16
    codec = ResidualCodec.from_fast_plaid(tmp_path)
    assert codec.nbits == nbits and torch.equal(codec.centroids.half(), centroids)


def test_stale_merged_file_is_ignored_for_changed_chunks(tmp_path):
    doc_lengths = [3, 5, 2]
    codes, residuals, _, _ = _write_fast_plaid(str(tmp_path), doc_lengths, [3], merged=True)
    json.dump({"0.codes.npy": {"rows": 10, "mtime": 1.0}}, open(tmp_path / "merged_codes.manifest.json", "w"))
    np.save(tmp_path / "merged_codes.npy", np.zeros(13, dtype=np.int64))  # stale content
    index = maxsim.index.load(tmp_path)
    assert torch.equal(index.codes, codes)


def test_search_settings_by_name_and_exhaustive_equivalence(tmp_path):
    doc_lengths = torch.randint(1, 12, (60,)).tolist()
    _write_fast_plaid(str(tmp_path), doc_lengths, [60], merged=True)
    index = maxsim.index.load(tmp_path)
    Q = torch.nn.functional.normalize(torch.randn(2, 5, 32), dim=-1)
    scores, pids, _ = index.search(Q, k=5, settings="fast-plaid")
    exhaustive, _, _ = index.search(Q, k=5, ncells=24, centroid_score_threshold=None, ndocs=4 * 60,
                                 decode_dtype=torch.float32)
    decoded = index.codec.decode(index.codes, index.residuals, dtype=torch.float16).float()
    for i in range(2):
        brute = torch.stack([(Q[i].half().float() @ decoded[index.cu_seqlens[j]:index.cu_seqlens[j + 1]].T)
                             .max(dim=1).values.sum() for j in range(60)])
        for score, pid in zip(scores[i].tolist(), pids[i].tolist()):
            assert brute[pid].item() == pytest.approx(score, abs=1e-3)
        torch.testing.assert_close(exhaustive[i], torch.sort(brute, descending=True).values[:5], atol=1e-2, rtol=0)


def test_one_search_call_for_an_index_and_a_corpus(tmp_path):
    # index.search takes Corpus.search's q_mask / subset / refine with the same meaning and returns
    # the same SearchResult; with every cell probed and every document kept, subset and refine give
    # the exact answers of the float corpus of the decoded tokens.
    import inspect

    from maxsim import Corpus

    doc_lengths = torch.randint(1, 12, (50,)).tolist()
    _write_fast_plaid(str(tmp_path), doc_lengths, [50], merged=True)
    index = maxsim.index.load(tmp_path)
    shared = ("q_mask", "subset", "refine", "refine_factor")
    for name in shared:
        assert inspect.signature(index.search).parameters[name].default == \
            inspect.signature(Corpus.search).parameters[name].default
    decoded = index.codec.decode(index.codes, index.residuals, normalize=True, dtype=torch.float32)
    full = Corpus.from_packed(decoded, index.cu_seqlens)
    Q = torch.nn.functional.normalize(torch.randn(3, 5, 32), dim=-1)
    everything = dict(ncells=24, centroid_score_threshold=None, ndocs=4 * 50, decode_dtype=torch.float32)
    subset = torch.randperm(50)[:12].tolist() + [77]  # an id the index does not hold matches nothing
    got = index.search(Q, k=4, subset=subset, **everything)
    want = full.search(Q, 4, subset=subset[:-1], device="cpu")
    assert torch.equal(got.indices, want.indices) and torch.equal(got.ids, got.indices)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    refined = index.search(Q, k=4, refine=full, refine_factor=50, **everything)
    exact = full.search(Q, 4, device="cpu")
    assert torch.equal(refined.indices, exact.indices)
    torch.testing.assert_close(refined.scores, exact.scores, rtol=1e-5, atol=1e-5)
    one = index.search(Q[0], k=4, refine=full, **everything)  # 2-D query: no query axis
    assert one.indices.shape == (4,) and torch.equal(one.indices, refined.indices[0])
    with pytest.raises(ValueError, match="no refine tokens"):
        index.search(Q, k=4, refine=True)
    with pytest.raises(ValueError, match="same documents"):
        index.search(Q, k=4, refine=Corpus.from_packed(decoded[:3], torch.tensor([0, 3])))
    with pytest.raises(TypeError, match="passage ids"):
        index.search(Q, k=4, subset=[0.5])


def test_errors_name_the_file(tmp_path):
    good = tmp_path / "good"
    _write_fast_plaid(str(good), [4, 2, 6], [2, 1])

    def broken(name):
        target = tmp_path / name
        shutil.copytree(good, target)
        return target

    missing = broken("missing")
    os.remove(missing / "1.codes.npy")
    with pytest.raises(FileNotFoundError, match="1.codes.npy"):
        maxsim.index.load(missing)
    no_lengths = broken("no_lengths")
    os.remove(no_lengths / "ivf_lengths.npy")
    with pytest.raises(FileNotFoundError, match="ivf_lengths.npy"):
        maxsim.index.load(no_lengths)
    short = broken("short")
    np.save(short / "merged_residuals.npy", np.zeros((5, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="merged_residuals.npy"):
        maxsim.index.load(short)
    wrong_meta = broken("wrong_meta")
    meta = json.load(open(wrong_meta / "metadata.json"))
    meta["num_embeddings"] = 99
    json.dump(meta, open(wrong_meta / "metadata.json", "w"))
    with pytest.raises(ValueError, match="metadata.json"):
        maxsim.index.load(wrong_meta)
    bad_ivf = broken("bad_ivf")
    np.save(bad_ivf / "ivf.npy", np.array([0, 1, 7], dtype=np.int64))
    with pytest.raises(ValueError, match="ivf.npy"):
        maxsim.index.load(bad_ivf)
    bad_nbits = broken("bad_nbits")
    meta = json.load(open(bad_nbits / "metadata.json"))
    meta["nbits"] = 3
    json.dump(meta, open(bad_nbits / "metadata.json", "w"))
    with pytest.raises(ValueError, match="nbits"):
        maxsim.index.load(bad_nbits)


@pytest.mark.gpu
def test_gpu_search_matches_cpu(tmp_path):
    doc_lengths = torch.randint(1, 200, (3000,)).tolist()
    _write_fast_plaid(str(tmp_path), doc_lengths, [1500, 1500], dim=128, num_centroids=512, merged=True)
    cpu = maxsim.index.load(tmp_path)
    gpu = maxsim.index.load(tmp_path, device="cuda")
    Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1)
    want = cpu.search(Q, k=10, settings="fast-plaid", decode_dtype=torch.float16)
    got = gpu.search(Q.cuda().half(), k=10, settings="fast-plaid")
    torch.testing.assert_close(got.scores.cpu(), want.scores, atol=2e-3, rtol=0)
    assert (got.indices.cpu() == want.indices).float().mean() >= 0.9


@pytest.mark.gpu
def test_gpu_batch_scores_each_query_as_searched_alone(tmp_path):
    # The exact stage runs each query of a batch through the fused scorer that one query uses, so a
    # batch's pids and scores are those of its queries searched one at a time, bit for bit.
    doc_lengths = torch.randint(1, 120, (4000,)).tolist()
    _write_fast_plaid(str(tmp_path), doc_lengths, [2000, 2000], dim=128, num_centroids=256, merged=True)
    index = maxsim.index.load(tmp_path, device="cuda")
    Q = torch.nn.functional.normalize(torch.randn(6, 32, 128, device="cuda"), dim=-1).half()
    scores, pids, _ = index.search(Q, k=10, settings="fast-plaid", ndocs=512)  # no mask: the same shapes alone
    assert torch.all(pids >= 0)
    for i in range(6):
        alone_scores, alone_pids, _ = index.search(Q[i], k=10, settings="fast-plaid", ndocs=512)
        assert torch.equal(pids[i], alone_pids), i
        assert torch.equal(scores[i], alone_scores), i


def test_search_command_reads_an_index(tmp_path):
    # python -m maxsim search --index: the same ids and scores as index.search, as a TREC run.
    from maxsim.cli import main

    _write_fast_plaid(tmp_path / "idx", [5, 3, 7, 2, 6, 4] * 5, [12, 18, 30], dim=32)
    index = maxsim.index.load(tmp_path / "idx")
    queries = [torch.nn.functional.normalize(torch.randn(n, 32), dim=-1) for n in (4, 6, 3)]
    torch.save(queries, tmp_path / "q.pt")
    assert main(["search", "--index", str(tmp_path / "idx"), "--queries", str(tmp_path / "q.pt"), "-k", "5",
                 "--out", str(tmp_path / "run.trec"), "--device", "cpu", "--quiet"]) == 0
    lines = (tmp_path / "run.trec").read_text().splitlines()
    Q, q_mask = maxsim.pad(queries)
    scores, pids, _ = index.search(Q, k=5, q_mask=q_mask)
    want = [f"{qi} Q0 {int(p)} {rank} {float(s):.6f} maxsim" for qi in range(3)
            for rank, (p, s) in enumerate(zip(pids[qi], scores[qi]), 1)]
    assert lines == want


def _reference_search(index, q, k, ncells, threshold, ndocs, dtype):
    """One query's PLAID search written out plainly (loops over candidates): the batched search's
    oracle. q [L, d] real tokens. Returns (scores [<= k], pids [<= k]) best first."""
    S = (index.codec.centroids.float() @ q.float().T)  # [C, L]
    cells = S.argmax(0) if ncells == 1 else S.topk(min(ncells, S.shape[0]), dim=0).indices.flatten()
    pids = sorted({int(p) for c in torch.unique(cells).tolist()
                   for p in index.ivf[index.ivf_offsets[c]:index.ivf_offsets[c + 1]].tolist()})
    if not pids:
        return torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    keep_code = S.amax(1) >= threshold if threshold is not None else torch.ones(S.shape[0], dtype=torch.bool)

    def approx(pid, prune):
        codes = index.codes[index.cu_seqlens[pid]:index.cu_seqlens[pid + 1]].long()
        if prune:
            codes = codes[keep_code[codes]]
        if codes.numel() == 0:
            return -9999.0 * q.shape[0]
        return float(S[codes].amax(0).sum())

    def best(cands, scores, n):  # score descending, then the higher pid
        ranked = sorted(zip(scores, cands), key=lambda t: (-t[0], -t[1]))[:n]
        return [p for _, p in ranked], [s for s, _ in ranked]

    pids, scores = best(pids, [approx(p, threshold is not None) for p in pids], ndocs)
    if threshold is not None:
        scores = [approx(p, False) for p in pids]
    pids, _ = best(pids, scores, max(1, ndocs // 4))
    decoded = index.codec.decode(index.codes, index.residuals, normalize=True, dtype=dtype).double()
    qd = q.to(dtype).double()
    exact = [float((qd @ decoded[index.cu_seqlens[p]:index.cu_seqlens[p + 1]].T).amax(1).sum()) for p in pids]
    order = sorted(range(len(pids)), key=lambda i: -exact[i])[:k]  # stable: ties keep the approximate order
    return torch.tensor([exact[i] for i in order], dtype=torch.float64), torch.tensor([pids[i] for i in order])


@pytest.mark.parametrize("settings,extra", [("fast-plaid", {}), ("colbert", {}), ("colbert", dict(ncells=3)),
                                            ("colbert", dict(ndocs=8))], ids=["fast-plaid", "colbert", "3-cells",
                                                                             "ndocs-8"])
def test_batched_search_equals_each_query_searched_alone(tmp_path, settings, extra):
    # Every query of the batch through every stage at once: the same pids and scores as the plain
    # per-query pipeline, with masked query tokens, a query with no real token and k beyond the
    # candidates (padded with -inf / -1).
    doc_lengths = torch.randint(0, 14, (80,)).tolist()
    _write_fast_plaid(str(tmp_path), doc_lengths, [50, 30], merged=True, num_centroids=24)
    index = maxsim.index.load(tmp_path)
    Q = torch.nn.functional.normalize(torch.randn(5, 6, 32), dim=-1)
    q_mask = torch.rand(5, 6) > 0.3
    q_mask[:, 0] = True
    q_mask[3] = False
    k = 7
    scores, pids, _ = index.search(Q, k=k, q_mask=q_mask, settings=settings, decode_dtype=torch.float32, **extra)
    ncells, threshold, ndocs = resolve_settings(k, settings, extra.get("ncells"), "default", extra.get("ndocs"))
    for i in range(5):
        if not q_mask[i].any():
            assert torch.all(pids[i] == -1) and torch.all(scores[i] == float("-inf"))
            continue
        want_scores, want_pids = _reference_search(index, Q[i][q_mask[i]], k, ncells, threshold, ndocs, torch.float32)
        n = want_pids.numel()
        torch.testing.assert_close(scores[i, :n].double(), want_scores, atol=1e-5, rtol=1e-5)
        gaps = (want_scores[:-1] - want_scores[1:]).abs() > 1e-4  # near-ties may swap places
        same = torch.ones(n, dtype=torch.bool)
        same[:-1] &= gaps
        same[1:] &= gaps
        assert torch.equal(pids[i, :n][same], want_pids[same])
        assert torch.all(pids[i, n:] == -1) and torch.all(scores[i, n:] == float("-inf"))
