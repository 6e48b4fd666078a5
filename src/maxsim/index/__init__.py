"""Read PLAID indexes (colbert-ai folders, fast-plaid / PyLate folders) and search them.

    index = maxsim.index.load("path/to/index")            # format detected from the files
    index = maxsim.index.from_corpus(residual_corpus)      # or from a residual maxsim.Corpus
    scores, pids, _ = index.search(Q, k=10)                 # Q [Lq, d] or [Nq, Lq, d]
"""

from __future__ import annotations

import os

import torch

from ..compressed.codec import ResidualCodec


class PlaidIndex:
    """A loaded PLAID index: codec, packed codes/residuals, document lengths, centroid->pid IVF.

    codes [T] int (int32 from colbert-ai, int64 from fast-plaid), residuals [T, packed_dim] uint8,
    doc_lengths [Nd] int64, cu_seqlens [Nd + 1] int64, ivf [sum(ivf_lengths)] int64 pids sorted
    per centroid (int32 from :func:`from_corpus`), ivf_lengths [C] int64. Large tensors are
    memory-mapped where the format allows. ``ids``: the passage ids a result carries (an int array
    or a list, as a ``maxsim.Corpus`` holds them); None: the positions.
    """

    def __init__(self, *, format, path, codec, codes, residuals, doc_lengths, ivf, ivf_lengths, metadata=None,
                 ids=None):
        self.format = format
        self.path = path
        self.codec = codec
        self.codes = codes
        self.residuals = residuals
        self.doc_lengths = doc_lengths
        self.cu_seqlens = torch.zeros(doc_lengths.numel() + 1, dtype=torch.int64, device=doc_lengths.device)
        torch.cumsum(doc_lengths, 0, out=self.cu_seqlens[1:])
        self.ivf = ivf
        self.ivf_lengths = ivf_lengths
        self.ivf_offsets = torch.zeros(ivf_lengths.numel() + 1, dtype=torch.int64, device=ivf_lengths.device)
        torch.cumsum(ivf_lengths, 0, out=self.ivf_offsets[1:])
        self.metadata = metadata or {}
        self.ids = ids

    def __len__(self):
        return self.doc_lengths.numel()

    @property
    def num_embeddings(self) -> int:
        return self.codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> "PlaidIndex":
        """A copy with every tensor on ``device``."""
        return PlaidIndex(
            format=self.format, path=self.path, codec=self.codec.to(device), codes=self.codes.to(device),
            residuals=self.residuals.to(device), doc_lengths=self.doc_lengths.to(device),
            ivf=self.ivf.to(device), ivf_lengths=self.ivf_lengths.to(device), metadata=self.metadata, ids=self.ids)

    def __repr__(self):
        return (f"PlaidIndex(format={self.format!r}, documents={len(self)}, embeddings={self.num_embeddings}, "
                f"centroids={self.codec.num_centroids}, d={self.codec.dim}, nbits={self.codec.nbits})")

    def search(self, Q, k=10, *, q_mask=None, subset=None, refine=None, refine_factor=4, ncells=None,
               centroid_score_threshold="default", ndocs=None, settings="colbert", decode_dtype=None):
        """PLAID search -> ``SearchResult(scores [Nq, k] fp32, indices [Nq, k] int64, ids)`` (the ids
        are the passage ids: ``ids`` where the index has them, else the positions); a 2-D Q gives
        [k] each. ``q_mask``, ``subset`` (passage ids) and ``refine`` (a Corpus of the same
        documents) mean what they mean in ``Corpus.search``.

        settings="colbert" (default): colbert-ai's defaults by k; "fast-plaid": 8 cells, 4096
        approximate scores, no threshold. Explicit ncells / centroid_score_threshold (None turns
        pruning off) / ndocs override them. See maxsim.index.search.search.
        """
        from .search import search

        return search(self, Q, k, q_mask=q_mask, subset=subset, refine=refine, refine_factor=refine_factor,
                      ncells=ncells, centroid_score_threshold=centroid_score_threshold, ndocs=ndocs,
                      settings=settings, decode_dtype=decode_dtype)


def detect_format(path) -> str:
    """'colbert' or 'fast-plaid', from the files in the folder."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"index folder not found: {path}")
    if os.path.exists(os.path.join(path, "centroids.pt")):
        return "colbert"
    if os.path.exists(os.path.join(path, "centroids.npy")):
        return "fast-plaid"
    raise ValueError(f"{path} is neither a colbert-ai index (no centroids.pt) nor a fast-plaid index "
                     "(no centroids.npy)")


def load(path, *, device=None) -> PlaidIndex:
    """Load a colbert-ai or fast-plaid (PyLate PLAID) index folder; ``device`` moves it there."""
    fmt = detect_format(path)
    if fmt == "colbert":
        from .colbert import read_colbert_index

        index = read_colbert_index(path)
    else:
        from .fast_plaid import read_fast_plaid_index

        index = read_fast_plaid_index(path)
    if device is not None and torch.device(device) != index.device:
        index = index.to(device)
    return index


def check_consistency(index: PlaidIndex, files: dict) -> None:
    """Shape checks shared by the readers; ``files`` names the file behind each tensor."""
    codec = index.codec
    total = int(index.doc_lengths.sum()) if index.doc_lengths.numel() else 0
    if bool((index.doc_lengths < 0).any()):
        raise ValueError(f"{files['doc_lengths']}: negative document length")
    if index.codes.dim() != 1 or index.codes.shape[0] != total:
        raise ValueError(f"{files['codes']} holds {tuple(index.codes.shape)} codes, the document lengths in "
                         f"{files['doc_lengths']} add up to {total}")
    if index.residuals.dim() != 2 or tuple(index.residuals.shape) != (total, codec.packed_dim):
        raise ValueError(f"{files['residuals']} holds shape {tuple(index.residuals.shape)}, expected "
                         f"({total}, {codec.packed_dim}) (d={codec.dim}, nbits={codec.nbits})")
    if index.residuals.dtype != torch.uint8:
        raise ValueError(f"{files['residuals']} must hold uint8, got {index.residuals.dtype}")
    if total:
        lo, hi = int(index.codes.min()), int(index.codes.max())
        if lo < 0 or hi >= codec.num_centroids:
            raise ValueError(f"{files['codes']} holds centroid ids in [{lo}, {hi}], the index has "
                             f"{codec.num_centroids} centroids")
    if index.ivf_lengths.numel() != codec.num_centroids:
        raise ValueError(f"{files['ivf']} has {index.ivf_lengths.numel()} lists for {codec.num_centroids} centroids")
    if bool((index.ivf_lengths < 0).any()) or index.ivf.numel() != int(index.ivf_lengths.sum()):
        raise ValueError(f"{files['ivf']}: list lengths add up to {int(index.ivf_lengths.sum())}, "
                         f"it holds {index.ivf.numel()} pids")
    if index.ivf.numel():
        lo, hi = int(index.ivf.min()), int(index.ivf.max())
        if lo < 0 or hi >= len(index):
            raise ValueError(f"{files['ivf']} holds pids in [{lo}, {hi}], the index has {len(index)} documents")


def from_corpus(corpus, *, device=None) -> PlaidIndex:
    """A PLAID index over a residual ``maxsim.Corpus``: its codes and codec as they are, the
    centroid -> passage lists built on ``device`` (:func:`maxsim.index.ivf.from_corpus`)."""
    from .ivf import from_corpus as build

    return build(corpus, device=device)


__all__ = ["PlaidIndex", "load", "from_corpus", "detect_format", "ResidualCodec"]
