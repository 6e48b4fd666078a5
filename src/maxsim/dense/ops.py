"""The dense (padded) MaxSim entry point: validation, backend dispatch, output layout."""

from __future__ import annotations

import torch

from maxsim import _checks, reference
from maxsim._dispatch import backend_for
from maxsim.dense.forward import maxsim_forward


def maxsim(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    mask_mode: str = "exclude",
    return_argmax: bool = False,
):
    """Late-interaction (MaxSim) scores, fused: the similarity tensor is never written to memory.

    ``score[i, j] = sum_{s: q_mask[i,s]} max_{t: d_mask[j,t]} <Q[i,s], D[j,t]>``

    Args:
        Q: queries ``[Nq, Lq, d]`` (or ``[Lq, d]`` for one query); float16, bfloat16 or float32.
        D: documents, same dtype and d as Q, in one of three layouts:
            ``[Nd, Ld, d]`` shared by all queries (cross product) -> scores ``[Nq, Nd]``;
            ``[Nq, K, Ld, d]`` a candidate list per query (reranking, distillation) -> ``[Nq, K]``;
            ``[Ld, d]`` one document -> ``[Nq]``.
        q_mask: ``Q.shape[:-1]``, True = real query token (bool, or 0/1 numbers). Masked tokens
            add nothing to the score.
        d_mask: ``D.shape[:-1]``, True = real document token. Masked tokens never win the max;
            a document with no real token contributes 0.
        normalize: L2-normalise every token of Q and D inside the kernel (cosine similarity).
        mask_mode: ``"exclude"`` (default, the rule above) or ``"multiply"``, PyLate's rule: masked
            similarities become 0 and still take part in the max.
        return_argmax: also return, per query token, the index of the winning document token
            (int32, shape ``scores.shape + (Lq,)``; -1 where the token is masked or the document
            has no real token). Ties go to the lowest index.

    Returns:
        fp32 scores (and the argmax when asked). Accumulation is fp32; fp32 inputs get
        fp32-accurate products. NaN in a participating token makes the score NaN.

    Equivalent PyTorch (exclude mode, no masks)::

        torch.einsum("asd,btd->abst", Q.float(), D.float()).max(-1).values.sum(-1)

    CUDA tensors run the Triton kernel; CPU tensors run :mod:`maxsim.reference` (see
    ``MAXSIM_BACKEND`` in the README to force either).
    """
    p = _checks.check_inputs(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    _checks.check_bool("normalize", normalize)
    _checks.check_bool("return_argmax", return_argmax)
    if backend_for(p.Q.device) == "reference":
        return reference.maxsim_reference(
            Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode, return_argmax=return_argmax
        )
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        raise NotImplementedError(
            "maxsim: the Triton backend has no backward yet; call it under torch.no_grad() or pass "
            "detached tensors (MAXSIM_BACKEND=reference differentiates through plain PyTorch)"
        )
    scores, argmax = maxsim_forward(
        p.Q, p.D, p.q_mask, p.d_mask,
        normalize=normalize, multiply=mask_mode == "multiply", save_argmax=return_argmax,
    )
    if return_argmax:
        return p.unbatch(scores), p.unbatch(argmax)
    return p.unbatch(scores)
