"""Reader for fast-plaid index folders (also PyLate's PLAID index, which is one).

Layout (fast-plaid rust/index/create.rs and python/fast_plaid/search/load.py):
  metadata.json              {"num_chunks", "nbits", "num_partitions", "num_embeddings",
                              "avg_doclen", "num_documents", ...}
  centroids.npy              [C, d] (read as fp16, as fast-plaid does)
  bucket_cutoffs.npy         [2^n - 1]      bucket_weights.npy [2^n]      avg_residual.npy [d]
  {i}.codes.npy              [T_i] int64    {i}.residuals.npy [T_i, d / 8 * nbits] uint8
  doclens.{i}.json           [num_documents_i]           {i}.metadata.json
  ivf.npy                    [sum(lengths)] int64 pids   ivf_lengths.npy [C] int32
  merged_codes.npy, merged_residuals.npy (version 1.7, written at load time): the chunks
      concatenated, then max(doclens) - doclens[-1] padding rows at the end, with a
      merged_{codes,residuals}.manifest.json of each chunk's rows and mtime.
"""

from __future__ import annotations

import os

import torch

from ..compressed.codec import ResidualCodec, _read_json
from . import PlaidIndex, check_consistency


def _load_npy(path, *, mmap=False):
    import numpy as np

    if not os.path.exists(path):
        raise FileNotFoundError(f"fast-plaid index file missing: {path}")
    try:
        # copy-on-write map: torch gets a writable view and nothing is read up front
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except Exception as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    return torch.from_numpy(array)


def _merged_is_current(path, suffix, num_chunks):
    """False when the merge manifest shows a chunk file changed after merged_{suffix}.npy was written."""
    manifest_path = os.path.join(path, f"merged_{suffix}.manifest.json")
    if not os.path.exists(manifest_path):
        return True
    try:
        manifest = _read_json(manifest_path)
    except ValueError:
        return True
    for chunk in range(num_chunks):
        name = f"{chunk}.{suffix}.npy"
        chunk_path = os.path.join(path, name)
        if os.path.exists(chunk_path) and name in manifest:
            if os.stat(chunk_path).st_mtime != manifest[name].get("mtime"):
                return False
    return True


def _read_rows(path, suffix, num_chunks, total, dtype):
    """The [total, ...] rows of merged_{suffix}.npy (padding trimmed) or of the chunk files."""
    merged_path = os.path.join(path, f"merged_{suffix}.npy")
    chunk_paths = [os.path.join(path, f"{chunk}.{suffix}.npy") for chunk in range(num_chunks)]
    chunks_present = all(os.path.exists(p) for p in chunk_paths)
    if os.path.exists(merged_path) and (not chunks_present or _merged_is_current(path, suffix, num_chunks)):
        merged = _load_npy(merged_path, mmap=True)
        if merged.shape[0] < total:
            raise ValueError(f"{merged_path} holds {merged.shape[0]} rows, the documents have {total} tokens")
        return merged[:total].to(dtype) if merged.dtype != dtype else merged[:total], merged_path
    if not chunks_present:
        missing = next(p for p in chunk_paths if not os.path.exists(p))
        raise FileNotFoundError(f"fast-plaid index file missing: {missing} (and no merged_{suffix}.npy)")
    parts = [_load_npy(p, mmap=True) for p in chunk_paths]
    if len(parts) == 1:
        rows = parts[0]
    elif parts:
        rows = torch.cat(parts)
    else:
        rows = None
    where = os.path.join(path, f"{{i}}.{suffix}.npy")
    if rows is None:
        return None, where
    return (rows.to(dtype) if rows.dtype != dtype else rows), where


def read_fast_plaid_index(path) -> PlaidIndex:
    path = os.fspath(path)
    meta_path = os.path.join(path, "metadata.json")
    metadata = _read_json(meta_path)
    for key in ("num_chunks", "nbits"):
        if key not in metadata:
            raise ValueError(f"{meta_path} has no {key!r}")
    num_chunks = int(metadata["num_chunks"])
    codec = ResidualCodec.from_fast_plaid(path)
    # fast-plaid keeps every codec tensor in fp16
    codec = ResidualCodec(codec.centroids.half(), codec.bucket_weights.half(), codec.nbits,
                          bucket_cutoffs=None if codec.bucket_cutoffs is None else codec.bucket_cutoffs.half(),
                          avg_residual=codec.avg_residual)

    doclens = []
    for chunk in range(num_chunks):
        doclens_path = os.path.join(path, f"doclens.{chunk}.json")
        data = _read_json(doclens_path)
        if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
            raise ValueError(f"{doclens_path} must hold a JSON list of integers")
        doclens.extend(data)
    doc_lengths = torch.tensor(doclens, dtype=torch.int64)
    total = sum(doclens)
    if "num_embeddings" in metadata and int(metadata["num_embeddings"]) != total:
        raise ValueError(f"{meta_path} says {metadata['num_embeddings']} embeddings, the doclens files add up "
                         f"to {total}")

    codes, codes_file = _read_rows(path, "codes", num_chunks, total, torch.int64)
    residuals, residuals_file = _read_rows(path, "residuals", num_chunks, total, torch.uint8)
    if codes is None:
        codes = torch.zeros(0, dtype=torch.int64)
        residuals = torch.zeros(0, codec.packed_dim, dtype=torch.uint8)

    ivf_path = os.path.join(path, "ivf.npy")
    ivf_lengths_path = os.path.join(path, "ivf_lengths.npy")
    if metadata.get("compress_only") and not os.path.exists(ivf_path):
        raise ValueError(f"{path} was built with compress_only=True: it has no ivf.npy to search with")
    ivf = _load_npy(ivf_path).to(torch.int64).reshape(-1)
    ivf_lengths = _load_npy(ivf_lengths_path).to(torch.int64).reshape(-1)

    index = PlaidIndex(format="fast-plaid", path=path, codec=codec, codes=codes, residuals=residuals,
                       doc_lengths=doc_lengths, ivf=ivf, ivf_lengths=ivf_lengths, metadata=metadata)
    check_consistency(index, {"codes": codes_file, "residuals": residuals_file,
                              "doc_lengths": os.path.join(path, "doclens.{i}.json"),
                              "ivf": f"{ivf_path} / {ivf_lengths_path}"})
    return index


__all__ = ["read_fast_plaid_index"]
