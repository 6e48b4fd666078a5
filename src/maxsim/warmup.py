"""Compile ahead of traffic: a server calls :func:`warmup` once at start-up so that no request
pays for a Triton compilation.

Which kernel variant a call uses depends only on the dtype, d, the power-of-two bucket of Lq,
the bucket of Nq x Lq (up to 256 stacked query rows), the layout, the flags (masks, normalize,
mask mode, argmax) and the corpus class (fewer or more than ``maxsim.tuning.tables.BIG_CORPUS_TOKENS``
document tokens in the call; on Hopper one query of up to 128 tokens also has a class of its own
from ``maxsim.tuning.tables.WS_ONE_BLOCK_MIN_TOKENS``); never on Nd or Ld otherwise. :func:`warmup`
compiles every class. Compiled kernels also persist on disk in Triton's cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a restarted process only loads them.
"""

from __future__ import annotations

import itertools
import math

import torch

from maxsim.tuning.tables import BIG_CORPUS_TOKENS, WS_ONE_BLOCK_MIN_TOKENS


def warmup(
    *,
    query_lengths=(32,),
    num_queries=(1,),
    dims=(128,),
    dtypes=(torch.float16,),
    masks=(False, True),
    normalize=(False,),
    candidates=(False,),
    device=None,
) -> int:
    """Run ``maxsim.maxsim`` once on tiny inputs for every combination given and, on CUDA, once more
    at the first size of each larger corpus class (``BIG_CORPUS_TOKENS`` and
    ``WS_ONE_BLOCK_MIN_TOKENS`` document tokens, in documents of 128 tokens: 32 and 64 MB at fp16,
    d = 128); returns the number of combinations run.

    ``device``: None takes the current CUDA device, or, on a machine without one, returns 0 at
    once: CPU tensors run the PyTorch reference, which compiles nothing. Asking for a CUDA device
    where there is none raises RuntimeError.

    Example (a ColBERT server: 32-token queries, batches of 1 to 64, fp16, with document masks)::

        maxsim.warmup(query_lengths=(32,), num_queries=(1, 8, 64), masks=(True,))
    """
    from maxsim import maxsim

    if device is None:
        if not torch.cuda.is_available():
            return 0
        device = "cuda"
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise RuntimeError("maxsim.warmup: device='cuda' but this machine has no CUDA device "
                           "(CPU calls run the PyTorch reference and need no warm-up)")
    count = 0
    for lq, nq, d, dtype, masked, norm, cand in itertools.product(
        query_lengths, num_queries, dims, dtypes, masks, normalize, candidates
    ):
        Q = torch.randn(nq, lq, d, device=device).to(dtype)
        qm = torch.ones(Q.shape[:-1], dtype=torch.bool, device=device) if masked else None
        with torch.no_grad():
            for D in _document_sets(nq, d, dtype, cand, device, corpus_classes=on_cuda):
                dm = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if masked else None
                maxsim(Q, D, qm, dm, normalize=norm)
        count += 1
    if on_cuda:
        torch.cuda.synchronize(device)
    return count


# Document length of the corpus-class warm-up calls (a length the GPU tests cover in every kernel).
_CLASS_DOC_LEN = 128


def _document_sets(nq: int, d: int, dtype, candidates: bool, device, corpus_classes: bool):
    """Tiny documents ``[(nq,) 2, 3, d]``; with ``corpus_classes``, also a set at the first size
    of each larger corpus class (:mod:`maxsim.tuning.tables`), which the same call shape would meet in
    traffic. The values do not matter: only the kernel variant the call compiles."""
    lead = (nq,) if candidates else ()
    yield torch.randn(*lead, 2, 3, d, device=device).to(dtype)
    if corpus_classes:
        for tokens in (BIG_CORPUS_TOKENS, WS_ONE_BLOCK_MIN_TOKENS):
            n_docs = -(-tokens // (math.prod(lead) * _CLASS_DOC_LEN))
            yield torch.zeros(*lead, n_docs, _CLASS_DOC_LEN, d, dtype=dtype, device=device)
