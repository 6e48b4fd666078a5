"""Compile ahead of traffic: a server calls :func:`warmup` once at start-up so that no request
pays for a Triton compilation.

Which kernel variant a call uses depends only on the dtype, d, the power-of-two bucket of Lq,
the bucket of Nq x Lq (up to 256 stacked query rows), the layout, the flags (masks, normalize,
mask mode, argmax) and the corpus class (fewer or more than ``maxsim._tuning.BIG_CORPUS_TOKENS``
document tokens in the call; on Hopper one query of up to 128 tokens also has a class of its own
from ``maxsim._tuning.WS_ONE_BLOCK_MIN_TOKENS``); never on Nd or Ld otherwise. :func:`warmup`
compiles every class. Compiled kernels also persist on disk in Triton's cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a restarted process only loads them.
"""

from __future__ import annotations

import itertools

import torch


def warmup(
    *,
    query_lengths=(32,),
    num_queries=(1,),
    dims=(128,),
    dtypes=(torch.float16,),
    masks=(False, True),
    normalize=(False,),
    candidates=(False,),
    device="cuda",
) -> int:
    """Run ``maxsim.maxsim`` once on tiny inputs for every combination given; returns the number
    of combinations run.

    Example (a ColBERT server: 32-token queries, batches of 1 to 64, fp16, with document masks)::

        maxsim.warmup(query_lengths=(32,), num_queries=(1, 8, 64), masks=(True,))
    """
    from maxsim import maxsim

    count = 0
    for lq, nq, d, dtype, masked, norm, cand in itertools.product(
        query_lengths, num_queries, dims, dtypes, masks, normalize, candidates
    ):
        Q = torch.randn(nq, lq, d, device=device).to(dtype)
        D = torch.randn(*((nq, 2) if cand else (2,)), 3, d, device=device).to(dtype)
        qm = torch.ones(Q.shape[:-1], dtype=torch.bool, device=device) if masked else None
        dm = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if masked else None
        with torch.no_grad():
            maxsim(Q, D, qm, dm, normalize=norm)
            if torch.device(device).type == "cuda":
                _compile_big_corpus_variant(Q, D, qm, dm, norm, cand)
        count += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return count


def _compile_big_corpus_variant(Q, D, qm, dm, normalize, candidates):
    """Launch the big-corpus configuration on the same tiny inputs (it compiles the kernel variant
    that a call with a big corpus will use), when it differs from the small-corpus one."""
    from maxsim._dispatch import cuda_index
    from maxsim._tuning import forward_config
    from maxsim.dense.forward import maxsim_forward, warp_specialize_ok

    Nq, Lq, d = Q.shape
    D4 = D if candidates else D.unsqueeze(0)
    dm4 = None if dm is None else (dm if candidates else dm.unsqueeze(0))
    # (masked calls never take the warp-specialized kernel: _tuning.warp_specialize_pays)
    ws = warp_specialize_ok(Q, D4, normalize, False, cuda_index(Q)) and qm is None and dm is None
    small = forward_config(Nq, Lq, d, Q.dtype, candidates, big_corpus=False, warp_specialize=ws)
    big = forward_config(Nq, Lq, d, Q.dtype, candidates, big_corpus=True, warp_specialize=ws)
    if big != small:
        maxsim_forward(Q, D4, qm, dm4, normalize=normalize, config=big)
