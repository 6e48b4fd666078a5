"""Autograd plumbing shared by the op families (dense, varlen).

Each family has a forward op returning ``(scores, argmax)`` and a backward op
``backward(grad_scores, *saved_tensors, *ctx.backward_args) -> (grad_a, grad_b)`` for its first two
inputs. Its ``setup_context`` saves the tensors and sets ``ctx.has_argmax`` and
``ctx.backward_args``; from there the rule is the same for both:

- under the dispatcher (``torch.compile``): the forward op's registered autograd calls the
  backward op;
- eagerly: a ``torch.autograd.Function`` calls the same launchers with the same context, without
  the custom ops' Python layers (more host time a step than small training shapes' kernels take).

:func:`make_differentiable` sets up both.
"""

from __future__ import annotations

import torch


def argmax_or_empty(argmax: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An op must return a tensor: the argmax, or an empty int32 one when it was not saved."""
    return argmax if argmax is not None else torch.empty(0, dtype=torch.int32, device=device)


def grads(ctx, grad_scores, backward_fn, n_inputs: int) -> tuple:
    """Gradients of the forward's ``n_inputs`` inputs: the first two from ``backward_fn``
    (the backward op or its launcher), None for the rest."""
    if not ctx.has_argmax:
        raise RuntimeError("maxsim: the forward ran without saving the argmax; it cannot be differentiated")
    if grad_scores is None:  # the scores took no part in the loss
        return (None,) * n_inputs
    grad_a, grad_b = backward_fn(grad_scores, *ctx.saved_tensors, *ctx.backward_args)
    return (grad_a, grad_b) + (None,) * (n_inputs - 2)


def make_differentiable(name: str, forward_op, backward_op, setup_context, forward_launch, backward_launch,
                        n_inputs: int):
    """Register the autograd rule on ``forward_op`` (used under the dispatcher) and return the eager
    ``torch.autograd.Function`` named ``name`` with the same rule around the launchers
    (``forward_launch``/``backward_launch``: the ops' bodies)."""

    def backward_through_op(ctx, grad_scores, _grad_argmax):
        return grads(ctx, grad_scores, backward_op, n_inputs)

    forward_op.register_autograd(backward_through_op, setup_context=setup_context)

    # The eager forward takes ``ctx`` itself: a separate ``setup_context`` would make ``apply``
    # bind the arguments through ``inspect`` on every call.
    def forward(ctx, *inputs):
        output = forward_launch(*inputs)
        ctx.mark_non_differentiable(output[1])
        setup_context(ctx, inputs, output)
        return output

    def backward(ctx, grad_scores, _grad_argmax):
        return grads(ctx, grad_scores, backward_launch, n_inputs)

    # type() rather than a class statement: autograd names the graph node after the class
    # ("<name>Backward") when the class is created.
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
