"""Reader for colbert-ai (0.2.x) index folders.

Layout (colbert/indexing/collection_indexer.py, index_saver.py, utils.optimize_ivf):
  metadata.json              {"config": {"dim", "nbits", ...}, "num_chunks", "num_partitions",
                              "num_embeddings", "avg_doclen"}
  centroids.pt               [C, d] fp16
  buckets.pt                 (bucket_cutoffs [2^n - 1], bucket_weights [2^n])
  avg_residual.pt
  {i}.codes.pt               [T_i] int32 centroid ids of chunk i
  {i}.residuals.pt           [T_i, d / 8 * nbits] uint8
  doclens.{i}.json           [num_passages_i] token counts
  {i}.metadata.json          {"passage_offset", "num_passages", "num_embeddings", "embedding_offset"}
  ivf.pid.pt                 (ivf [>= sum(lengths)] pids, zero-padded at the end; ivf_lengths [C])
  ivf.pt                     older indexes: the same over embedding ids instead of pids
"""

from __future__ import annotations

import os

import torch

from ..compressed.codec import ResidualCodec, _colbert_nbits_dim, _read_json, _torch_load
from . import PlaidIndex, check_consistency


def _read_doclens(path):
    data = _read_json(path)
    if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise ValueError(f"{path} must hold a JSON list of integers")
    return data


def _embedding_ivf_to_pid_ivf(ivf, ivf_lengths, doc_lengths):
    """colbert-ai's optimize_ivf: embedding ids -> unique sorted pids per centroid."""
    emb_to_pid = torch.repeat_interleave(torch.arange(doc_lengths.numel()), doc_lengths)
    pids = emb_to_pid[ivf.long()]
    lists, lengths = [], []
    offset = 0
    for length in ivf_lengths.tolist():
        unique = torch.unique(pids[offset:offset + length])
        lists.append(unique)
        lengths.append(unique.numel())
        offset += length
    return (torch.cat(lists) if lists else torch.zeros(0, dtype=torch.int64)), torch.tensor(lengths, dtype=torch.int64)


def read_colbert_index(path) -> PlaidIndex:
    path = os.fspath(path)
    meta_path = os.path.join(path, "metadata.json")
    metadata = _read_json(meta_path)
    if "num_chunks" not in metadata:
        raise ValueError(f"{meta_path} has no 'num_chunks'")
    num_chunks = int(metadata["num_chunks"])
    _colbert_nbits_dim(path)
    codec = ResidualCodec.from_colbert(path)

    doclens, codes, residuals = [], [], []
    for chunk in range(num_chunks):
        chunk_doclens = _read_doclens(os.path.join(path, f"doclens.{chunk}.json"))
        codes_path = os.path.join(path, f"{chunk}.codes.pt")
        residuals_path = os.path.join(path, f"{chunk}.residuals.pt")
        chunk_codes = _torch_load(codes_path, mmap=True)
        chunk_residuals = _torch_load(residuals_path, mmap=True)
        if not torch.is_tensor(chunk_codes) or chunk_codes.dim() != 1 or chunk_codes.dtype.is_floating_point:
            raise ValueError(f"{codes_path} must hold a 1-D integer tensor")
        if not torch.is_tensor(chunk_residuals) or chunk_residuals.dim() != 2:
            raise ValueError(f"{residuals_path} must hold a 2-D uint8 tensor")
        if chunk_codes.shape[0] != sum(chunk_doclens):
            raise ValueError(f"{codes_path} holds {chunk_codes.shape[0]} codes, doclens.{chunk}.json adds up to "
                             f"{sum(chunk_doclens)}")
        if chunk_residuals.shape[0] != chunk_codes.shape[0]:
            raise ValueError(f"{residuals_path} holds {chunk_residuals.shape[0]} rows, {codes_path} "
                             f"{chunk_codes.shape[0]} codes")
        chunk_meta_path = os.path.join(path, f"{chunk}.metadata.json")
        if os.path.exists(chunk_meta_path):
            chunk_meta = _read_json(chunk_meta_path)
            if "num_embeddings" in chunk_meta and int(chunk_meta["num_embeddings"]) != chunk_codes.shape[0]:
                raise ValueError(f"{chunk_meta_path} says {chunk_meta['num_embeddings']} embeddings, "
                                 f"{codes_path} holds {chunk_codes.shape[0]}")
        doclens.extend(chunk_doclens)
        codes.append(chunk_codes)
        residuals.append(chunk_residuals)
    if num_chunks == 0:
        codes = torch.zeros(0, dtype=torch.int32)
        residuals = torch.zeros(0, codec.packed_dim, dtype=torch.uint8)
    elif num_chunks == 1:  # keep the memory map
        codes, residuals = codes[0], residuals[0]
    else:
        codes, residuals = torch.cat(codes), torch.cat(residuals)
    doc_lengths = torch.tensor(doclens, dtype=torch.int64)
    if "num_embeddings" in metadata and int(metadata["num_embeddings"]) != codes.shape[0]:
        raise ValueError(f"{meta_path} says {metadata['num_embeddings']} embeddings, the chunks hold {codes.shape[0]}")

    pid_ivf_path = os.path.join(path, "ivf.pid.pt")
    emb_ivf_path = os.path.join(path, "ivf.pt")
    if os.path.exists(pid_ivf_path):
        ivf_file = pid_ivf_path
        loaded = _torch_load(pid_ivf_path)
    elif os.path.exists(emb_ivf_path):
        ivf_file = emb_ivf_path
        loaded = _torch_load(emb_ivf_path)
    else:
        raise FileNotFoundError(f"colbert-ai index file missing: {pid_ivf_path} (nor the older ivf.pt)")
    if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2):
        raise ValueError(f"{ivf_file} must hold (ivf, ivf_lengths)")
    ivf, ivf_lengths = loaded
    ivf_lengths = torch.as_tensor(ivf_lengths).to(torch.int64)
    ivf = torch.as_tensor(ivf).to(torch.int64)
    used = int(ivf_lengths.sum())
    if ivf.numel() < used:
        raise ValueError(f"{ivf_file} holds {ivf.numel()} entries, its lengths add up to {used}")
    ivf = ivf[:used]  # optimize_ivf pads with zeros at the end for strided access
    if ivf_file == emb_ivf_path:
        if ivf.numel() and int(ivf.max()) >= codes.shape[0]:
            raise ValueError(f"{ivf_file} holds embedding ids past the {codes.shape[0]} embeddings")
        ivf, ivf_lengths = _embedding_ivf_to_pid_ivf(ivf, ivf_lengths, doc_lengths)

    index = PlaidIndex(format="colbert", path=path, codec=codec, codes=codes, residuals=residuals,
                       doc_lengths=doc_lengths, ivf=ivf, ivf_lengths=ivf_lengths, metadata=metadata)
    check_consistency(index, {
        "codes": os.path.join(path, "{i}.codes.pt"), "residuals": os.path.join(path, "{i}.residuals.pt"),
        "doc_lengths": os.path.join(path, "doclens.{i}.json"), "ivf": ivf_file,
    })
    return index


__all__ = ["read_colbert_index"]
