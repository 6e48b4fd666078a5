"""``maxsim_from_hidden`` in plain PyTorch: the CPU backend and the tests' oracle (with float64).

    D = H @ W.T + b                       # [Nd, Ld, d], fp32
    D = D / max(|D|_2, 1e-12)             # normalize=True (F.normalize's rule), per token
    score = maxsim_reference(Q, D, ...)   # Q as given

Documents are projected a chunk at a time so that the fp32 copies of H and D stay within
``max_chunk_bytes`` (MAXSIM_REFERENCE_CHUNK_MB, 256 by default). Plain autograd runs through it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from maxsim.reference import maxsim_reference

_DEFAULT_CHUNK_MB = 256


def project(H: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, normalize: bool) -> torch.Tensor:
    """``[..., d_model]`` hidden states -> ``[..., d]`` fp32 document tokens (normalised or not)."""
    D = F.linear(H.float(), W.float(), None if b is None else b.float())
    return F.normalize(D, dim=-1) if normalize else D


def head_reference(Q, H, W, b, q_mask, d_mask, *, normalize: bool, multiply: bool, return_argmax: bool,
                   candidates: bool, max_chunk_bytes: int | None = None):
    """Canonical inputs (see :func:`maxsim.head.ops.check_head_inputs`): Q ``[Nq, Lq, d]``,
    H ``[Nq|1, Nd, Ld, d_model]``, masks ``[Nq, Lq]`` / ``[Nq|1, Nd, Ld]`` bool or None ->
    scores ``[Nq, Nd]`` fp32 (and argmax ``[Nq, Nd, Lq]`` int32)."""
    Nq, Lq, d = Q.shape
    Nd, Ld, d_model = H.shape[1], H.shape[2], H.shape[3]
    budget = max_chunk_bytes or int(os.environ.get("MAXSIM_REFERENCE_CHUNK_MB", _DEFAULT_CHUNK_MB)) * 2**20
    per_doc = H.shape[0] * max(Ld, 1) * (d_model + 2 * d) * 4  # fp32 H and D of one document (all groups)
    step = max(1, min(max(Nd, 1), budget // max(per_doc, 1)))
    Qf = Q.float()
    mask_mode = "multiply" if multiply else "exclude"
    scores, argmaxes = [], []
    for j0 in range(0, max(Nd, 1), step):
        Hc = H[:, j0:j0 + step]  # [Nq|1, n, Ld, d_model]
        Dc = project(Hc, W, b, normalize)
        dm = None if d_mask is None else d_mask[:, j0:j0 + step]
        if not candidates:
            Dc, dm = Dc[0], (None if dm is None else dm[0])
        out = maxsim_reference(Qf, Dc, q_mask, dm, mask_mode=mask_mode, return_argmax=return_argmax,
                               max_chunk_bytes=max_chunk_bytes)
        if return_argmax:
            out, arg = out
            argmaxes.append(arg)
        scores.append(out)
    scores = torch.cat(scores, dim=1) if len(scores) > 1 else scores[0]
    if return_argmax:
        return scores, (torch.cat(argmaxes, dim=1) if len(argmaxes) > 1 else argmaxes[0])
    return scores
