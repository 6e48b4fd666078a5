"""The dense (padded) MaxSim entry point: validation, backend dispatch, custom ops, autograd.

Two torch.library custom ops wrap the launchers so that autograd, ``torch.compile`` (no graph
break: the ops have fake implementations) and ``torch.library.opcheck`` see one opaque operator:

    maxsim::dense_forward(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, strategy, precision)
        -> (scores, argmax)          (strategy: the backward's grad_D reduction; autograd's
                                      setup_context reads it from the op's inputs; precision:
                                      the resolved fp32 product, "ieee" / "fp16x3" /
                                      "fp16x3-copy" / "tf32x3" / "tf32")
    maxsim::dense_backward(grad, Q, D, argmax, normalize, strategy) -> (grad_Q, grad_D)

Each op's body asks :mod:`maxsim.selection.dense` for its kernel and tiles, then calls the
launcher.

Outside ``torch.compile`` the dispatcher is skipped: inference calls the launcher directly, and
training goes through ``_DenseMaxSim``, a ``torch.autograd.Function`` with the same context and
backward as the ops' autograd registration (:mod:`maxsim._autograd`). Same kernels, less host time per call, which is what
sets the step time of small training shapes (the custom op's Python layers cost more than the GPU
work there).
"""

from __future__ import annotations

from typing import Optional

import torch

from maxsim import _checks, reference
from maxsim._autograd import argmax_or_empty, make_differentiable
from maxsim._dispatch import backend_for, interpreting, pytorch_backend, through_dispatcher
from maxsim._split import split_fp16x3, unscale
from maxsim.cpu import maxsim_cpu
from maxsim.dense import forward as _forward
from maxsim.dense.backward import maxsim_backward
from maxsim.selection import dense as select
from maxsim.selection.common import PRECISIONS, device_of, precision_choice
from maxsim.selection.common import STRATEGIES as BACKWARD_STRATEGIES
from maxsim.tuning import tables as T
from maxsim.tuning.autotune import autotune_enabled


def _run_forward(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, plan_key=None, precision="ieee"):
    """The selection's kernel and tile, launched (the eager and the op paths share it)."""
    if precision == "fp16x3-copy" and Q.dtype == torch.float32:
        return _run_forward_split(Q, D, q_mask, d_mask, normalize, multiply, save_argmax)
    plan = select.forward_plan(Q, D, q_mask, d_mask, normalize, multiply, bool(save_argmax), precision)
    return _forward.maxsim_forward(Q, D, q_mask, d_mask, config=plan.config, warp_specialized=plan.warp_specialized,
                                   normalize=normalize, multiply=multiply, save_argmax=save_argmax,
                                   precision=precision, plan_key=plan_key)


def _run_forward_split(Q, D, q_mask, d_mask, normalize, multiply, save_argmax):
    """fp32 Q [Nq, Lq, d], D [G, Nd, Ld, d] through the 16-bit kernels on their fp16 split
    (:mod:`maxsim._split`, width 3d), the documents in groups whose copy stays under
    ``split16_scratch_bytes`` (256 MB or 5 % of D). Same scores (to fp32 accuracy) and the same argmax."""
    q3, q_exp = split_fp16x3(Q, document=False, normalize=normalize)  # [Nq, Lq, 3d] fp16
    G, Nd, Ld, d = D.shape
    step = max(1, T.split16_scratch_bytes(D.numel() * 4) // max(1, G * Ld * 3 * d * 2))
    parts = []
    for start in range(0, max(Nd, 1), step):
        d3, d_exp = split_fp16x3(D[:, start:start + step], document=True, normalize=normalize)  # [G, n, Ld, 3d]
        mask = None if d_mask is None else d_mask[:, start:start + step]
        scores, argmax = _run_forward(q3, d3, q_mask, mask, False, multiply, save_argmax)
        del d3  # freed before the next group's copy: one copy at a time, or the peak is twice the bound
        parts.append((unscale(scores, q_exp, d_exp), argmax))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([s for s, _ in parts], 1), (torch.cat([a for _, a in parts], 1) if save_argmax else None)


def _forward_launch(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, strategy, precision):
    """The forward op's body (``strategy`` is for the backward only)."""
    scores, argmax = _run_forward(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, precision=precision)
    return scores, argmax_or_empty(argmax, Q.device)


def _backward_launch(grad, Q, D, argmax, normalize, strategy):
    """The backward op's body."""
    config = select.backward_config(strategy, tuple(Q.shape), tuple(D.shape))
    return maxsim_backward(grad, Q, D, argmax, normalize=normalize, strategy=strategy, config=config)


@torch.library.custom_op("maxsim::dense_forward", mutates_args=())
def dense_forward(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: Optional[torch.Tensor],
    d_mask: Optional[torch.Tensor],
    normalize: bool,
    multiply: bool,
    save_argmax: int,
    strategy: str,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q [Nq, Lq, d], D [Nq|1, Nd, Ld, d] -> scores [Nq, Nd] fp32, argmax [Nq, Nd, Lq] int32
    (an empty [0] tensor unless ``save_argmax``: 1 the winners, 2 the winners the backward routes
    through, see :func:`maxsim.dense.forward.maxsim_forward`)."""
    return _forward_launch(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, strategy, precision)


@dense_forward.register_fake
def _(Q, D, q_mask, d_mask, normalize, multiply, save_argmax, strategy, precision):
    Nq, Lq, _ = Q.shape
    Nd = D.shape[1]
    scores = Q.new_empty((Nq, Nd), dtype=torch.float32)
    argmax = Q.new_empty((Nq, Nd, Lq) if save_argmax else (0,), dtype=torch.int32)
    return scores, argmax


@torch.library.custom_op("maxsim::dense_backward", mutates_args=())
def dense_backward(
    grad: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    argmax: torch.Tensor,
    normalize: bool,
    strategy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad [Nq, Nd], argmax [Nq, Nd, Lq] -> grad_Q like Q, grad_D like D (same dtypes)."""
    return _backward_launch(grad, Q, D, argmax, normalize, strategy)


@dense_backward.register_fake
def _(grad, Q, D, argmax, normalize, strategy):
    return torch.empty_like(Q, memory_format=torch.contiguous_format), torch.empty(D.shape, dtype=D.dtype, device=D.device)


def _setup_context(ctx, inputs, output):
    Q, D, q_mask, d_mask, normalize, multiply, save_argmax, strategy, _precision = inputs
    _, argmax = output
    # The argmax output has no gradient: without this, autograd would hand the backward a zero
    # int32 tensor of the argmax's size (measured: one more argmax of memory at the peak).
    ctx.set_materialize_grads(False)
    ctx.has_argmax = save_argmax
    ctx.backward_args = (normalize, strategy)
    if save_argmax == 1 and multiply and d_mask is not None:
        # PyLate's rule: a masked winner (similarity forced to 0) passes no gradient. (With
        # save_argmax 2 the kernel applied it; 1: the caller gets the raw winners as well.)
        winner_real = torch.gather(d_mask.expand(Q.shape[0], -1, -1), 2, argmax.clamp_min(0).long()) != 0
        argmax = torch.where(winner_real, argmax, -1)
    ctx.save_for_backward(Q, D, argmax)


# Autograd for the op, and the eager training path: the same implementation and rule.
_DenseMaxSim = make_differentiable(
    "_DenseMaxSim", dense_forward, dense_backward, _setup_context, _forward_launch, _backward_launch, n_inputs=9
)


def maxsim(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    mask_mode: str = "exclude",
    return_argmax: bool = False,
    backward: str = "auto",
    q_lengths: torch.Tensor | None = None,
    d_lengths: torch.Tensor | None = None,
    precision: str = "auto",
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
            a document with no real token contributes 0. A number mask (an attention mask)
            holding a value other than 0 and 1 makes that sequence's scores NaN: it is checked
            on the device, with no host synchronisation.
        normalize: L2-normalise every token of Q and D inside the kernel (cosine similarity).
        mask_mode: ``"exclude"`` (default, the rule above) or ``"multiply"``, PyLate's rule: masked
            similarities become 0 and still take part in the max.
        return_argmax: also return, per query token, the index of the winning document token
            (int32, shape ``scores.shape + (Lq,)``; -1 where the token is masked or the document
            has no real token). Ties go to the lowest index.
        backward: how grad_D is reduced when Q or D requires grad: ``"unified"`` (fp32 atomics
            into an fp32 buffer the size of D: fastest, last bits vary run to run), ``"lowmem"``
            (each document token sums its own contributions: no atomics, no fp32 buffer,
            bitwise deterministic) or ``"auto"`` (lowmem for candidate lists with Lq <= 512, else unified
            unless its fp32 buffer would pass 2 GiB).
        q_lengths, d_lengths: instead of a mask, the number of real (leading) tokens of each
            sequence: int ``Q.shape[:-2]`` / ``D.shape[:-2]`` (``[Nq]``, ``[Nd]`` or ``[Nq, K]``).
            A length below 0 or above the padded length makes that sequence's scores NaN (no
            host synchronisation). Today they become the equivalent mask: the kernels still read
            the padded tail.
        precision: the products of fp32 inputs: ``"ieee"`` (IEEE FMAs on the CUDA cores, exact),
            ``"fp16x3"`` (each value split into two fp16 terms, three fp16 tensor-core products
            summed in fp32: fp32-accurate; on chip where few query rows share each document
            token, through the 16-bit kernels on a copy of 6 bytes a value where many do),
            ``"tf32x3"`` (the same idea with TF32 terms), ``"tf32"`` (one TF32 product,
            relative error near 1e-4: the peers' trade) or ``"auto"`` (fp16x3 on Hopper, IEEE
            on GPUs where no split was measured; ``maxsim.explain`` says which and why).
            16-bit inputs' products are exact whatever it says; the CPU backend computes IEEE fp32.

    Returns:
        fp32 scores (and the argmax when asked). Accumulation is fp32; fp32 inputs get
        fp32-accurate products. NaN in a participating token makes the score NaN.
        Differentiable in Q and D: the subgradient at the argmax (ties: the lowest index).

    Equivalent PyTorch (exclude mode, no masks)::

        torch.einsum("asd,btd->abst", Q.float(), D.float()).max(-1).values.sum(-1)

    CUDA tensors run the Triton kernels; CPU tensors run :mod:`maxsim.cpu` (docs/cpu.md; see
    ``MAXSIM_BACKEND`` in the README to force either). A call whose signature (shapes, strides,
    dtypes, devices, alignment, arguments) repeats an earlier inference call's replays that call's
    launch plan: no validation or configuration work on the host, only the launch.
    """
    # The Triton kernel reads a number mask (an attention mask) as it is and checks its values; the
    # other backends take bool masks, the values checked here on the device. (The backend is looked
    # up only where a mask is numbers: a repeated call's replay stays as short as it was.)
    q_numbers, d_numbers = _checks.number_mask(q_mask), _checks.number_mask(d_mask)
    kernel_numbers = (q_numbers or d_numbers) and isinstance(Q, torch.Tensor) and backend_for(Q.device) == "triton"
    convert_q = q_numbers and not kernel_numbers
    convert_d = d_numbers and not kernel_numbers
    if q_lengths is not None or d_lengths is not None or convert_q or convert_d:
        q_invalid = d_invalid = None
        if q_lengths is not None:
            q_mask, q_invalid = _checks.mask_from_lengths("q_lengths", q_lengths, Q, q_mask, "q_mask")
        elif convert_q:
            q_mask, q_invalid = _checks.bool_mask_and_invalid(q_mask)
        if d_lengths is not None:
            d_mask, d_invalid = _checks.mask_from_lengths("d_lengths", d_lengths, D, d_mask, "d_mask")
        elif convert_d:
            d_mask, d_invalid = _checks.bool_mask_and_invalid(d_mask)
        out = maxsim(Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode, return_argmax=return_argmax,
                     backward=backward, precision=precision)
        scores = out[0] if return_argmax else out
        scores = _checks.nan_where_invalid(scores, q_invalid, d_invalid, Q.dim(), D.dim())
        return (scores, out[1]) if return_argmax else scores
    plan_key = _inference_plan_key(Q, D, q_mask, d_mask, normalize, mask_mode, return_argmax, backward, precision)
    plan = _forward.plan_for(plan_key) if plan_key is not None else None
    if plan is not None:
        scores, argmax = plan(Q, D, q_mask, d_mask)
        squeeze_q, squeeze_d = Q.dim() == 2, D.dim() == 2
        if return_argmax:
            return _checks.unbatch(scores, squeeze_q, squeeze_d), _checks.unbatch(argmax, squeeze_q, squeeze_d)
        return _checks.unbatch(scores, squeeze_q, squeeze_d)
    p = _checks.check_inputs(Q, D, q_mask, d_mask, mask_mode=mask_mode, number_masks=kernel_numbers)
    _checks.check_bool("normalize", normalize)
    _checks.check_bool("return_argmax", return_argmax)
    _checks.check_choice("backward", backward, BACKWARD_STRATEGIES)
    _checks.check_choice("precision", precision, PRECISIONS)
    if backend_for(p.Q.device) == "reference":
        run = maxsim_cpu if pytorch_backend() == "cpu" else reference.maxsim_reference
        return run(Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode, return_argmax=return_argmax)
    multiply = mask_mode == "multiply"
    needs_grad = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    dot_precision = precision_choice(p.Q.dtype, precision, device_of(p.Q)[1],
                                     select.query_rows_per_token(p.Q, p.D), p.D.numel(), training=needs_grad)[0]
    compiling = through_dispatcher()
    if compiling or needs_grad:
        op = dense_forward if compiling else _DenseMaxSim.apply
        scores, argmax = op(
            p.Q, p.D, p.q_mask, p.d_mask, normalize, multiply, 1 if return_argmax else (2 if needs_grad else 0),
            select.strategy(backward, p.D, p.Q.shape[1]), dot_precision,
        )
    else:
        scores, argmax = _run_forward(p.Q, p.D, p.q_mask, p.d_mask, normalize, multiply, return_argmax, plan_key,
                                      dot_precision)
    if return_argmax:
        return p.unbatch(scores), p.unbatch(argmax)
    return p.unbatch(scores)


def _inference_plan_key(Q, D, q_mask, d_mask, normalize, mask_mode, return_argmax, backward, precision):
    """The signature under which an inference call's launch plan is kept (see
    :func:`maxsim.dense.forward.plan_for`), or None where the call must take the full path:
    anything but plain CUDA tensors and real masks, gradients, torch.compile, the reference
    backend, the interpreter, autotuning."""
    if type(Q) is not torch.Tensor or type(D) is not torch.Tensor or Q.device.type != "cuda":
        return None
    if not (type(normalize) is bool and type(return_argmax) is bool and type(mask_mode) is str
            and type(backward) is str and type(precision) is str):  # (wrong types: the full path names them)
        return None
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return None
    if through_dispatcher() or interpreting() or autotune_enabled() \
            or backend_for(Q.device) != "triton":
        return None
    masks = []
    for m in (q_mask, d_mask):
        if m is None:
            masks.append(None)
        elif type(m) is torch.Tensor and not m.dtype.is_complex:  # bool, or numbers the kernel checks
            masks.append((m.shape, m.stride(), m.dtype, m.device, m.data_ptr() % 16))
        else:
            return None
    return (Q.shape, Q.stride(), Q.dtype, Q.device, Q.data_ptr() % 16, D.shape, D.stride(), D.dtype, D.device,
            D.data_ptr() % 16, *masks, normalize, mask_mode, return_argmax, backward, precision,
            torch.cuda.current_device())
