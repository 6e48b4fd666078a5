"""``maxsim.maxsim_from_hidden``: validation, backend dispatch, the path the selection chose,
autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from maxsim import _checks
from maxsim._dispatch import backend_for
from maxsim.head import specs
from maxsim.head._inputs import check_head_inputs
from maxsim.head.backward import head_backward
from maxsim.head.forward import head_forward
from maxsim.head.reference import head_reference
from maxsim.selection import head as select
from maxsim.selection.common import STRATEGIES, device_of


def project(H: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, normalize: bool) -> torch.Tensor:
    """The unfused head, in the input dtype: ``F.normalize(F.linear(H, W, b), dim=-1)``."""
    D = F.linear(H, W, b)
    return F.normalize(D, dim=-1) if normalize else D


class _FusedHead(torch.autograd.Function):
    """The fused forward (saving the argmax) and the winners' backward."""

    @staticmethod
    def forward(ctx, Q, H, W, b, q_mask, d_mask, normalize, multiply, config, deterministic):
        scores, argmax = head_forward(Q, H, W, b, q_mask, d_mask, config=config, normalize=normalize,
                                      multiply=multiply, save_argmax=True)
        ctx.mark_non_differentiable(argmax)
        ctx.set_materialize_grads(False)
        winners = argmax
        if multiply and d_mask is not None:
            # PyLate's rule: a masked winner (similarity forced to 0) passes no gradient.
            real = torch.gather(d_mask.expand(Q.shape[0], -1, -1), 2, argmax.clamp_min(0).long())
            winners = torch.where(real, argmax, -1)
        ctx.save_for_backward(Q, H, W, b, winners)
        ctx.options = (normalize, deterministic)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        if grad_scores is None:
            return (None,) * 10
        Q, H, W, b, winners = ctx.saved_tensors
        normalize, deterministic = ctx.options
        needs = tuple(ctx.needs_input_grad[:4])
        gq, gh, gw, gb = head_backward(grad_scores, Q, H, W, b, winners, normalize=normalize,
                                       deterministic=deterministic, needs=needs)
        return gq, gh, gw, gb, None, None, None, None, None, None


def maxsim_from_hidden(
    Q: torch.Tensor,
    H: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None = None,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
    mask_mode: str = "exclude",
    return_argmax: bool = False,
    backward: str = "auto",
):
    """MaxSim of queries against documents given as hidden states, through a linear head:

        D = H @ W.T + b                                  # [Nd, Ld, d]
        D = D / max(|D|_2, 1e-12)   (normalize=True)     # each document token, F.normalize's rule
        scores = maxsim.maxsim(Q, D, q_mask, d_mask, mask_mode=mask_mode)

    On CUDA the fused kernel projects each document tile on chip and never writes D, where that
    pays (few query row blocks share each tile); otherwise the head runs once (``F.linear`` +
    ``F.normalize``) and then ``maxsim.maxsim`` (:func:`maxsim.explain_from_hidden` says which).

    Args:
        Q: queries ``[Nq, Lq, d]`` (or ``[Lq, d]``), used as given: ``normalize`` does not touch
            them (normalise queries with the query encoder, as ColBERT does).
        H: hidden states ``[Nd, Ld, d_model]`` shared by every query (-> ``[Nq, Nd]``), candidate
            lists ``[Nq, K, Ld, d_model]`` (-> ``[Nq, K]``) or one document ``[Ld, d_model]``.
        W: ``[d, d_model]`` (a ``torch.nn.Linear(d_model, d).weight``).  b: ``[d]`` or None.
            Q, H, W and b share one dtype: float16, bfloat16 or float32.
        q_mask, d_mask: ``Q.shape[:-1]``, ``H.shape[:-1]``; True = real token (as maxsim.maxsim).
        normalize: L2-normalise the projected document tokens.
        mask_mode: ``"exclude"`` or ``"multiply"`` (PyLate's rule), as maxsim.maxsim.
        return_argmax: also return the winning document token per query token (int32, -1 where none).
        backward: ``"auto"``/``"unified"`` (fp32 atomics into a buffer the size of the winners) or
            ``"lowmem"`` (deterministic); on the unfused path it is maxsim.maxsim's.

    Returns:
        fp32 scores ``[Nq, Nd]`` (``[Nq, K]``; 2-D inputs drop their axis), and the argmax when asked.
        Empty documents score 0; NaN propagates; ties go to the lowest index. Differentiable in Q,
        H, W and b.
    """
    p = check_head_inputs(Q, H, W, b, q_mask, d_mask, mask_mode)
    _checks.check_bool("normalize", normalize)
    _checks.check_bool("return_argmax", return_argmax)
    _checks.check_choice("backward", backward, STRATEGIES)
    multiply = mask_mode == "multiply"
    if backend_for(p.Q.device) == "reference":
        out = head_reference(p.Q, p.H, W, b, p.q_mask, p.d_mask, normalize=normalize, multiply=multiply,
                             return_argmax=return_argmax, candidates=p.candidates)
        return (p.unbatch(out[0]), p.unbatch(out[1])) if return_argmax else p.unbatch(out)
    Nq, Lq, d = p.Q.shape
    masked = p.q_mask is not None or p.d_mask is not None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (Q, H, W, b))
    choice = select.forward_choice(Nq, Lq, d, p.H.shape[-1], p.Q.dtype, p.candidates, masked, normalize,
                                   needs_grad or return_argmax, device_of(p.Q)[1], select.forced_path())
    if choice.kernel is specs.PROJECT_THEN_SCORE:
        from maxsim.dense.ops import maxsim as maxsim_dense

        return maxsim_dense(Q, project(H, W, b, normalize), q_mask, d_mask, mask_mode=mask_mode,
                            return_argmax=return_argmax, backward=backward)
    if needs_grad:
        scores, argmax = _FusedHead.apply(p.Q, p.H, W, b, p.q_mask, p.d_mask, normalize, multiply, choice.config,
                                          backward == "lowmem")
    else:
        scores, argmax = head_forward(p.Q, p.H, W, b, p.q_mask, p.d_mask, config=choice.config, normalize=normalize,
                                      multiply=multiply, save_argmax=return_argmax)
    if return_argmax:
        return p.unbatch(scores), p.unbatch(argmax)
    return p.unbatch(scores)


def maxsim_from_hidden_varlen(q, h, W, b=None, cu_seqlens_q=None, cu_seqlens_d=None, max_seqlen_q=None,
                              max_seqlen_d=None, *, normalize: bool = True, backward: str = "auto",
                              validate: bool = False):
    """:func:`maxsim.maxsim_varlen` of packed queries against packed hidden states through a head:

        D = h @ W.T + b                                  # [Td, d]
        D = D / max(|D|_2, 1e-12)   (normalize=True)     # each document token
        scores = maxsim.maxsim_varlen(q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d)

    A packed corpus holds no padding, so the head runs once over the real tokens only (``F.linear``
    + ``F.normalize``: ``[Td, d]`` in memory, ``d / d_model`` of the hidden states' size) and the
    packed kernels score them; there is no fused packed kernel (``explain_from_hidden`` says the
    same for padded calls that choose this path).

    Args:
        q: packed queries ``[Tq, d]`` or a list of ``[Lq_i, d]``.
        h: packed hidden states ``[Td, d_model]`` or a list of ``[Ld_j, d_model]``.
        W: ``[d, d_model]``; b: ``[d]`` or None; q, h, W and b share one dtype and device.
        cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, backward, validate: as
            :func:`maxsim.maxsim_varlen` (the offsets index rows of ``q`` and ``h``).

    Returns:
        ``[Nq, Nd]`` fp32, differentiable in q, h (through a list's tensors too), W and b.
    """
    from maxsim.varlen.ops import maxsim_varlen
    from maxsim.varlen.packing import pack

    _checks.check_bool("normalize", normalize)
    if isinstance(h, (list, tuple)):
        if cu_seqlens_d is not None:
            raise ValueError("maxsim: pass either a list of hidden states or packed h with cu_seqlens_d, not both")
        h, cu_seqlens_d, longest = pack(h)
        max_seqlen_d = longest if max_seqlen_d is None else max_seqlen_d
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        got = _checks.shape_str(h) if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"maxsim: h must be packed hidden states [Td, d_model] or a list of [Ld, d_model]; got {got}")
    q_first = q[0] if isinstance(q, (list, tuple)) and len(q) else q
    if not isinstance(q_first, torch.Tensor) or q_first.dim() != 2:
        raise ValueError("maxsim: q must be packed queries [Tq, d] or a list of [Lq, d]")
    # The padded entry's checks (dtypes, devices, W [d, d_model], b [d]) on one query and the packed h.
    check_head_inputs(q_first, h, W, b, None, None, "exclude")
    D = project(h, W, b, normalize)  # [Td, d]
    return maxsim_varlen(q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d,
                         backward=backward, validate=validate)
