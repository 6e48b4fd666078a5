"""The checks of ``maxsim.maxsim_from_hidden``'s inputs (shared by the op and the selection's
``explain``): the canonical layout they are brought to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maxsim import _checks


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass
class HeadPrepared:
    """Inputs in the canonical layout: Q ``[Nq, Lq, d]``, H ``[Nq|1, Nd, Ld, d_model]`` (a view),
    masks bool ``[Nq, Lq]`` / ``[Nq|1, Nd, Ld]`` or None; ``unbatch`` undoes 2-D inputs' axes."""

    Q: torch.Tensor
    H: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    candidates: bool
    squeeze_q: bool
    squeeze_d: bool

    def unbatch(self, out: torch.Tensor) -> torch.Tensor:
        return _checks.unbatch(out, self.squeeze_q, self.squeeze_d)


def check_head_inputs(Q, H, W, b, q_mask, d_mask, mask_mode: str) -> HeadPrepared:
    """Validate the arguments of :func:`maxsim_from_hidden`; return them in the canonical layout."""
    for name, t in (("Q", Q), ("H", H), ("W", W)):
        _checks.check_dtype(name, t)
    if b is not None:
        _checks.check_dtype("b", b)
    _checks.check_choice("mask_mode", mask_mode, _checks.MASK_MODES)
    if Q.dim() not in (2, 3):
        raise ValueError(f"maxsim: Q must have shape [Nq, Lq, d] or [Lq, d]; got {_checks.shape_str(Q)}")
    if H.dim() not in (2, 3, 4):
        raise ValueError("maxsim: H must have shape [Nd, Ld, d_model], [Nq, K, Ld, d_model] or [Ld, d_model]; "
                         f"got {_checks.shape_str(H)}")
    if W.dim() != 2:
        raise ValueError(f"maxsim: W must have shape [d, d_model]; got {_checks.shape_str(W)}")
    named = [("Q", Q), ("H", H), ("W", W)] + ([("b", b)] if b is not None else [])
    for name, t in named[1:]:
        if t.dtype != Q.dtype:
            raise TypeError(f"maxsim: Q, H, W and b must share one dtype; got Q {_dtype(Q)} and {name} "
                            f"{_dtype(t)}")
        if t.device != Q.device:
            raise ValueError(f"maxsim: Q, H, W and b must be on one device; got Q on {Q.device} and {name} "
                             f"on {t.device}")
    d, d_model = Q.shape[-1], H.shape[-1]
    if d == 0 or d_model == 0:
        raise ValueError(f"maxsim: d and d_model must be at least 1; got Q {_checks.shape_str(Q)}, "
                         f"H {_checks.shape_str(H)}")
    if tuple(W.shape) != (d, d_model):
        raise ValueError(f"maxsim: W must have shape [d, d_model] = [{d}, {d_model}] (Q's d, H's d_model); "
                         f"got {_checks.shape_str(W)}")
    if b is not None and tuple(b.shape) != (d,):
        raise ValueError(f"maxsim: b must have shape [d] = [{d}]; got {_checks.shape_str(b)}")
    squeeze_q = Q.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze_q else Q
    Nq = Q3.shape[0]
    candidates, squeeze_d = H.dim() == 4, H.dim() == 2
    if candidates:
        if squeeze_q:
            raise ValueError("maxsim: a 4-D H [Nq, K, Ld, d_model] needs a 3-D Q [Nq, Lq, d]; "
                             f"got Q {_checks.shape_str(Q)}")
        if H.shape[0] != Nq:
            raise ValueError(f"maxsim: H [Nq, K, Ld, d_model] must have one candidate list per query (Nq={Nq}); "
                             f"got H {_checks.shape_str(H)}")
        H4 = H
    else:
        H4 = H[None, None] if squeeze_d else H.unsqueeze(0)
    qm = dm = None
    if q_mask is not None:
        qm = _checks.as_bool_mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device)
        qm = qm.unsqueeze(0) if squeeze_q else qm
    if d_mask is not None:
        dm = _checks.as_bool_mask("d_mask", d_mask, tuple(H.shape[:-1]), Q.device)
        dm = dm[None, None] if squeeze_d else (dm if candidates else dm.unsqueeze(0))
    return HeadPrepared(Q3, H4, qm, dm, candidates, squeeze_q, squeeze_d)
