"""Input validation for every public entry point, and the error messages users see.

Bad input gets a ``ValueError`` or ``TypeError`` that names the argument, what was expected and
what came; never a crash inside a kernel or a silently wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_MODES = ("exclude", "multiply")


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


@dataclass
class Prepared:
    """Inputs brought to one canonical layout.

    Q: ``[Nq, Lq, d]``; D: ``[Nq, Nd, Ld, d]`` for candidate lists or ``[1, Nd, Ld, d]`` when all
    queries share the documents (a view, no copy); masks bool ``[Nq, Lq]`` and ``[Nq|1, Nd, Ld]``
    or None. ``unbatch`` turns a canonical ``[Nq, Nd, ...]`` result back into the caller's layout.
    """

    Q: torch.Tensor
    D: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    candidates: bool
    squeeze_q: bool
    squeeze_d: bool

    def unbatch(self, out: torch.Tensor, trailing: int = 0) -> torch.Tensor:
        """``[Nq, Nd, *trailing]`` -> the caller's shape (drops the axes of 2-D inputs)."""
        return unbatch(out, self.squeeze_q, self.squeeze_d)


def unbatch(out: torch.Tensor, squeeze_q: bool, squeeze_d: bool) -> torch.Tensor:
    """``[Nq, Nd, ...]`` -> without the query axis (2-D Q) and/or the document axis (2-D D)."""
    if squeeze_d:
        out = out.squeeze(1)
    if squeeze_q:
        out = out.squeeze(0)
    return out


def check_dtype(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"maxsim: {name} must be float16, bfloat16 or float32; got {str(t.dtype).replace('torch.', '')}"
        )


def as_bool_mask(name: str, mask, expected_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Validate a mask and return it as a bool tensor of ``expected_shape``.

    Bool masks pass as they are; integer or float masks are accepted when every value is 0 or 1
    (tokenizers' attention masks are int64), anything else is an error.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor or None; got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(expected_shape):
        want = "[" + ", ".join(str(s) for s in expected_shape) + "]"
        raise ValueError(f"maxsim: {name} must have shape {want}; got {shape_str(mask)}")
    if mask.device != device:
        raise ValueError(f"maxsim: {name} is on {mask.device} but Q and D are on {device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_complex:
        raise TypeError(f"maxsim: {name} must be bool (or 0/1 numbers); got {mask.dtype}")
    if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ValueError(
            f"maxsim: {name} must be boolean (True = real token) or hold only 0 and 1; found the value {bad}"
        )
    return mask != 0


def check_inputs(Q, D, q_mask=None, d_mask=None, *, mask_mode: str = "exclude") -> Prepared:
    """Validate ``Q``, ``D``, masks and mask_mode; return them in the canonical layout."""
    check_dtype("Q", Q)
    check_dtype("D", D)
    if mask_mode not in MASK_MODES:
        raise ValueError(f"maxsim: mask_mode must be 'exclude' or 'multiply'; got {mask_mode!r}")
    if Q.dim() not in (2, 3):
        raise ValueError(f"maxsim: Q must have shape [Nq, Lq, d] or [Lq, d]; got {shape_str(Q)}")
    if D.dim() not in (2, 3, 4):
        raise ValueError(
            f"maxsim: D must have shape [Nd, Ld, d], [Nq, K, Ld, d] or [Ld, d]; got {shape_str(D)}"
        )
    if Q.dtype != D.dtype:
        raise TypeError(
            f"maxsim: Q and D must have the same dtype; got Q {str(Q.dtype).replace('torch.', '')} "
            f"and D {str(D.dtype).replace('torch.', '')}"
        )
    if Q.device != D.device:
        raise ValueError(f"maxsim: Q and D must be on the same device; got Q on {Q.device} and D on {D.device}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(
            f"maxsim: Q and D must have the same embedding dim d; got Q {shape_str(Q)} (d={Q.shape[-1]}) "
            f"and D {shape_str(D)} (d={D.shape[-1]})"
        )
    if Q.shape[-1] == 0:
        raise ValueError(f"maxsim: the embedding dim d must be at least 1; got Q {shape_str(Q)}")

    squeeze_q = Q.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze_q else Q  # [Nq, Lq, d]
    Nq, Lq, _ = Q3.shape
    candidates = D.dim() == 4
    squeeze_d = D.dim() == 2
    if candidates:
        if squeeze_q:
            raise ValueError(
                f"maxsim: a 4-D D [Nq, K, Ld, d] needs a 3-D Q [Nq, Lq, d]; got Q {shape_str(Q)}"
            )
        if D.shape[0] != Nq:
            raise ValueError(
                f"maxsim: D [Nq, K, Ld, d] must have one candidate list per query (Nq={Nq}); got D {shape_str(D)}"
            )
        D4 = D
    elif squeeze_d:
        D4 = D[None, None]
    else:
        D4 = D.unsqueeze(0)  # [1, Nd, Ld, d]: shared by every query

    qm = None
    if q_mask is not None:
        qm = as_bool_mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device)
        qm = qm.unsqueeze(0) if squeeze_q else qm
    dm = None
    if d_mask is not None:
        dm = as_bool_mask("d_mask", d_mask, tuple(D.shape[:-1]), D.device)
        dm = dm[None, None] if squeeze_d else (dm if candidates else dm.unsqueeze(0))
    return Prepared(Q3, D4, qm, dm, candidates, squeeze_q, squeeze_d)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"maxsim: {name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"maxsim: {name} must be True or False; got {value!r}")


