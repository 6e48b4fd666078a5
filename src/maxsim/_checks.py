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

    def unbatch(self, out: torch.Tensor) -> torch.Tensor:
        """``[Nq, Nd, ...]`` -> the caller's shape (drops the axes of 2-D inputs)."""
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


def as_bool_mask(name: str, mask, expected_shape: tuple[int, ...], device: torch.device,
                 keep_numbers: bool = False) -> torch.Tensor:
    """Validate a mask and return it as a bool tensor of ``expected_shape``.

    Bool masks pass as they are; integer or float masks are accepted when every value is 0 or 1
    (tokenizers' attention masks are int64), anything else is an error. ``keep_numbers``: a number
    mask is returned as it is, its values unread (the kernel that takes it checks them).
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
    if keep_numbers:
        return mask
    if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ValueError(
            f"maxsim: {name} must be boolean (True = real token) or hold only 0 and 1; found the value {bad}"
        )
    return mask != 0


def number_mask(mask) -> bool:
    """Whether ``mask`` is a tensor of numbers (a tokenizer's int64 attention mask, a float mask):
    :func:`bool_mask_and_invalid` brings it to bool on the device."""
    return isinstance(mask, torch.Tensor) and mask.dim() >= 1 and mask.dtype != torch.bool \
        and not mask.dtype.is_complex


def bool_mask_and_invalid(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A number mask ``[..., L]`` -> (bool ``[..., L]``, invalid ``[...]``: the sequences holding a
    value other than 0 and 1), with no host synchronisation: a training step's scorer call must not
    wait for the GPU, so a bad value makes that sequence's scores NaN instead of raising."""
    real = mask != 0
    return real, (real & (mask != 1)).any(-1)


def mask_from_lengths(name: str, lengths, x, mask, mask_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths ``x.shape[:-2]`` (the real tokens of each sequence of ``x [..., L, d]``) ->
    ``(mask x.shape[:-1] bool, invalid x.shape[:-2] bool)``, with no host synchronisation: a length
    below 0 or above L is not read on the host but marked invalid (its outputs become NaN)."""
    if mask is not None:
        raise ValueError(f"maxsim: give {mask_name} or {name}, not both")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"maxsim: {name} needs a tensor of tokens [..., L, d] beside it")
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.as_tensor(lengths, device=x.device)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"maxsim: {name} must be an integer tensor (or sequence); got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"maxsim: {name} must hold integers; got {lengths.dtype}")
    want = tuple(x.shape[:-2])
    if tuple(lengths.shape) != want:
        raise ValueError(f"maxsim: {name} must have shape [{', '.join(str(s) for s in want)}] (one length a "
                         f"sequence); got {shape_str(lengths)}")
    if lengths.device != x.device:
        raise ValueError(f"maxsim: {name} is on {lengths.device} but the tokens are on {x.device}")
    L = x.shape[-2]
    positions = torch.arange(L, device=x.device)  # [L]
    return positions < lengths[..., None], (lengths < 0) | (lengths > L)


def nan_where_invalid(scores: torch.Tensor, q_invalid, d_invalid, q_dims: int, d_dims: int) -> torch.Tensor:
    """Scores with NaN where a query's or a document's length was invalid (``mask_from_lengths``).
    ``scores`` is the public output of a ``q_dims``-D Q against a ``d_dims``-D D."""
    bad = None
    if d_invalid is not None:
        bad = d_invalid  # [Nd] / [Nq, K] / []: broadcasts over the query axis of a cross product
    if q_invalid is not None:
        q_bad = q_invalid[:, None] if q_dims == 3 and d_dims != 2 else q_invalid  # [Nq, 1] / [Nq] / []
        bad = q_bad if bad is None else bad | q_bad
    return scores if bad is None else scores.masked_fill(bad, float("nan"))


def check_inputs(Q, D, q_mask=None, d_mask=None, *, mask_mode: str = "exclude", number_masks: bool = False
                 ) -> Prepared:
    """Validate ``Q``, ``D``, masks and mask_mode; return them in the canonical layout.
    ``number_masks``: number masks stay numbers, their values unread (for the dense Triton kernel,
    which reads them itself); otherwise every mask comes back bool."""
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
        qm = as_bool_mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device, number_masks)
        qm = qm.unsqueeze(0) if squeeze_q else qm
    dm = None
    if d_mask is not None:
        dm = as_bool_mask("d_mask", d_mask, tuple(D.shape[:-1]), D.device, number_masks)
        dm = dm[None, None] if squeeze_d else (dm if candidates else dm.unsqueeze(0))
    return Prepared(Q3, D4, qm, dm, candidates, squeeze_q, squeeze_d)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"maxsim: {name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"maxsim: {name} must be True or False; got {value!r}")


# --- packed (varlen) inputs ---------------------------------------------------------------------

def _check_packed_tensor(name: str, x: torch.Tensor) -> None:
    check_dtype(name, x)
    if x.dim() != 2:
        raise ValueError(f"maxsim: {name} must be packed as [total_tokens, d]; got {shape_str(x)}")


def _check_cu_seqlens(name: str, cu, total: int, device: torch.device, check_values: bool) -> torch.Tensor:
    """Validate cu_seqlens and return it as int64 on ``device``.

    Values (starts at 0, monotone, ends at ``total``) are checked only when ``check_values``: that
    reads them on the host, a synchronisation the caller avoids by giving the max lengths.
    """
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor; got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"maxsim: {name} must be int32 or int64; got {str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"maxsim: {name} must be 1-D [N + 1]; got {shape_str(cu)}")
    if cu.device != device:
        raise ValueError(f"maxsim: {name} is on {cu.device} but the packed tensors are on {device}")
    if check_values:
        first, last = int(cu[0]), int(cu[-1])
        if first != 0:
            raise ValueError(f"maxsim: {name} must start at 0; got {first}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            k = int(torch.nonzero(cu[1:] < cu[:-1])[0])
            raise ValueError(f"maxsim: {name} must be non-decreasing; {name}[{k + 1}] = {int(cu[k + 1])} < {int(cu[k])}")
        if last != total:
            raise ValueError(f"maxsim: {name} must end at the packed length {total}; got {last}")
    return cu.to(torch.int64)


def check_packed(q, d, cu_seqlens_q, cu_seqlens_d, *, check_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate packed ``q [Tq, dim]``, ``d [Td, dim]`` and their cu_seqlens; return the cu_seqlens
    as int64. Their values are read on the host only with ``check_values``."""
    _check_packed_tensor("q", q)
    _check_packed_tensor("d", d)
    if q.dtype != d.dtype:
        raise TypeError(f"maxsim: q and d must have the same dtype; got q {q.dtype} and d {d.dtype}")
    if q.device != d.device:
        raise ValueError(f"maxsim: q and d must be on the same device; got q on {q.device} and d on {d.device}")
    if q.shape[1] != d.shape[1]:
        raise ValueError(f"maxsim: q and d must have the same embedding dim d; got {q.shape[1]} and {d.shape[1]}")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, check_values)
    cu_d = _check_cu_seqlens("cu_seqlens_d", cu_seqlens_d, d.shape[0], d.device, check_values)
    return cu_q, cu_d


def check_pairs(pair_q, pair_d, Nq: int, Nd: int, device: torch.device, *, check_values: bool) -> None:
    """Validate pair index tensors ``[P]``; their range is read on the host only with ``check_values``."""
    for name, idx, n in (("pair_q", pair_q, Nq), ("pair_d", pair_d, Nd)):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            raise TypeError(f"maxsim: {name} must be a 1-D int32/int64 tensor")
        if idx.device != device:
            raise ValueError(f"maxsim: {name} is on {idx.device} but the packed tensors are on {device}")
        if check_values and idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"maxsim: {name} must index 0..{n - 1}; got values in [{lo}, {hi}]")
    if pair_q.shape != pair_d.shape:
        raise ValueError(f"maxsim: pair_q and pair_d must have the same length; got {pair_q.numel()} and {pair_d.numel()}")


def check_max_length(name: str, value) -> int | None:
    """A ``max_seqlen_*`` argument: None, or a non-negative int (checked on the host: no tensor is read)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
            value = int(value)  # (a host read the caller chose by passing a tensor)
        else:
            raise TypeError(f"maxsim: {name} must be an int or None; got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"maxsim: {name} must be >= 0; got {value}")
    return value


def check_lengths_fit(name: str, cu: torch.Tensor, max_len: int) -> None:
    """Raise when a sequence of ``cu`` (int64, values already checked) is longer than ``max_len`` (a host read)."""
    if cu.numel() > 1:
        lengths = cu[1:] - cu[:-1]
        longest = int(lengths.max())
        if longest > max_len:
            k = int(torch.argmax(lengths))
            raise ValueError(f"maxsim: sequence {k} of {name.replace('max_seqlen', 'cu_seqlens')} has "
                             f"{longest} tokens, more than {name} = {max_len}")


def sequences_valid(cu: torch.Tensor, total: int, max_len: int | None) -> torch.Tensor:
    """bool ``[N]`` on cu's device, no host read: sequence i (rows ``cu[i]:cu[i+1]``) lies inside
    the packed data (``0 <= cu[i] <= cu[i+1] <= total``) and is at most ``max_len`` long. The rule of
    the trusted path: an output that involves an invalid sequence is NaN."""
    start, end = cu[:-1], cu[1:]
    ok = (start >= 0) & (end >= start) & (end <= total)
    if max_len is not None:
        ok &= (end - start) <= max_len
    return ok


def pairs_valid(pair_q: torch.Tensor, pair_d: torch.Tensor, q_ok: torch.Tensor, d_ok: torch.Tensor) -> torch.Tensor:
    """bool ``[P]``, no host read: both indices in range (-1 does not wrap) and both sequences valid."""
    Nq, Nd = q_ok.numel(), d_ok.numel()
    in_range = (pair_q >= 0) & (pair_q < Nq) & (pair_d >= 0) & (pair_d < Nd)
    if Nq == 0 or Nd == 0:
        return in_range
    return in_range & q_ok[pair_q.clamp(0, Nq - 1)] & d_ok[pair_d.clamp(0, Nd - 1)]
