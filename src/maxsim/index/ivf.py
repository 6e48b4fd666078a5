"""A PLAID index from a residual ``maxsim.Corpus``: its codes, residuals and codec as they are, and
the centroid -> passage inverted lists (IVF) PLAID's candidate generation reads, built here.

    index = maxsim.index.from_corpus(corpus)        # corpus: encoding "residual2" / "residual4"
    result = index.search(Q, 10, refine=fp16_or_int8_corpus, refine_factor=8)

The exhaustive ``Corpus.search`` reads every code; the index reads the passages of the cells
nearest each query token, which is what keeps a search fast past ~10M passages.
"""

from __future__ import annotations

import numpy as np
import torch

# Tokens whose (centroid, passage) keys are deduplicated at once: bounds the int64 keys and the
# sort's scratch (about 40 bytes a token) while the lists are built.
_KEY_BLOCK = 1 << 25


def build_ivf(codes: torch.Tensor, doc_lengths: torch.Tensor, num_centroids: int):
    """(ivf [n] int32 passage positions, ivf_lengths [C] int64): for each centroid, every passage
    holding a token of that code, once, in increasing order (the lists back to back). codes [T]
    int32 / int64, doc_lengths [Nd] int64, on one device (the work runs there)."""
    num_docs, total, owned = doc_lengths.numel(), codes.numel(), int(doc_lengths.sum())
    device = codes.device
    if total != owned:
        raise ValueError(f"{total} codes, but the document lengths add up to {owned}")
    cu = torch.zeros(num_docs + 1, dtype=torch.int64, device=device)
    torch.cumsum(doc_lengths.to(device), 0, out=cu[1:])
    keys = []
    for start in range(0, total, _KEY_BLOCK):
        token = torch.arange(start, min(total, start + _KEY_BLOCK), device=device)  # [b]
        passage = torch.searchsorted(cu, token, right=True) - 1  # [b]: empty passages own no token
        keys.append(torch.unique(codes[start:start + _KEY_BLOCK].long() * num_docs + passage))
    keys = torch.unique(torch.cat(keys)) if keys else torch.zeros(0, dtype=torch.int64, device=device)  # sorted
    ivf_lengths = torch.bincount(keys // max(num_docs, 1), minlength=num_centroids)
    return (keys % max(num_docs, 1)).to(torch.int32), ivf_lengths


def from_corpus(corpus, *, device=None):
    """A :class:`maxsim.index.PlaidIndex` over a residual ``maxsim.Corpus`` (encoding "residual2"
    or "residual4"): the corpus's codec, codes [T] int32 and residuals [T, d * nbits / 8] uint8
    (shared, not copied, when the corpus has one segment), its document lengths, and the IVF
    built by :func:`build_ivf` on ``device`` (default: where the codes are; the index lives
    there). Results carry the corpus's ids. A corpus with deleted documents must be compacted
    first (``corpus.compact()``). Several segments are joined into one copy on ``device``: on the
    GPU that needs their bytes again in one block (a corpus appended slice by slice to 10M
    passages: 23 GB for residual2); from a host copy, ``from_corpus(corpus.to("cpu"),
    device="cuda")``, the GPU holds only the index."""
    from maxsim.search.encodings import Residual

    from . import PlaidIndex

    encoding = corpus.encoding
    if not isinstance(encoding, Residual):
        raise ValueError(f"maxsim.index.from_corpus needs a residual corpus, this one is {encoding}: build it with "
                         "encoding='residual2' or 'residual4'")
    if corpus.num_deleted:
        raise ValueError(f"the corpus has {corpus.num_deleted} deleted documents: corpus.compact() them away "
                         "before building an index")
    segments = corpus.segments
    target = torch.device(device) if device is not None else segments[0].embeddings.device
    codes = _joined([s.embeddings for s in segments], target)  # [T] int32
    residuals = _joined([s.residuals for s in segments], target)  # [T, P] uint8
    doc_lengths = torch.from_numpy(np.diff(corpus.offsets)).to(target)  # [Nd] int64
    codec = corpus.codec.to(target)
    ivf, ivf_lengths = build_ivf(codes, doc_lengths, codec.num_centroids)
    return PlaidIndex(format="corpus", path=corpus.path, codec=codec, codes=codes, residuals=residuals,
                      doc_lengths=doc_lengths, ivf=ivf, ivf_lengths=ivf_lengths, ids=corpus.ids,
                      metadata={"encoding": str(encoding)})


def _allocate(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _joined(pieces: list, target: torch.device) -> torch.Tensor:
    """The segments' rows back to back on ``target``: one piece as it is, several copied one at a
    time into one allocation (never a second copy of all of them); that allocation failing is one
    line that names the ways out."""
    if len(pieces) == 1:
        return pieces[0].to(target)
    rows = sum(p.shape[0] for p in pieces)
    shape = (rows, *pieces[0].shape[1:])
    try:
        out = _allocate(shape, pieces[0].dtype, target)
    except torch.OutOfMemoryError:
        nbytes = rows * pieces[0][:1].numel() * pieces[0].element_size()
        raise MemoryError(
            f"maxsim.index.from_corpus: joining the corpus's {len(pieces)} segments needs {nbytes / 1e9:.1f} GB in one "
            f"block on {target}, and that is not free: start Python with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "(a fragmented cache), or free the device copy first: corpus = corpus.to('cpu'); "
            "index = maxsim.index.from_corpus(corpus, device='cuda')") from None
    start = 0
    for piece in pieces:
        out[start:start + piece.shape[0]].copy_(piece)
        start += piece.shape[0]
    return out


__all__ = ["build_ivf", "from_corpus"]
