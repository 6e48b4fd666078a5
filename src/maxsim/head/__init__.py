"""A fused document head: ``maxsim_from_hidden(Q, H, W, b)`` = MaxSim of Q against
``normalize(H @ W.T + b)`` without writing the projected documents (docs/head.md). Which path a
call takes, and why: :func:`maxsim.selection.head.explain_from_hidden`."""

from maxsim.head.ops import maxsim_from_hidden, maxsim_from_hidden_varlen

__all__ = ["maxsim_from_hidden", "maxsim_from_hidden_varlen"]
