"""Conversions between ragged lists, padded tensors with masks, and packed tensors.

    packed [T, d] + cu_seqlens [N + 1]   (FlashAttention's convention: sequence i is rows
                                          cu_seqlens[i]:cu_seqlens[i + 1])
    padded [N, L, d] + mask [N, L]        (True = real token)
    ragged list of N tensors [L_i, d]     (what PyLate's encode returns, per document)
"""

from __future__ import annotations

import torch


def pack(seqs, checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Ragged list of ``[L_i, d]`` tensors -> ``(packed [sum L_i, d], cu_seqlens int64 [N + 1], max L_i)``.
    ``checked``: ``seqs`` is already :func:`check_sequences`'s list."""
    seqs, lengths = (seqs, None) if checked else _checked(seqs)
    if lengths is None:
        lengths = [s.shape[0] for s in seqs]
    lengths = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return torch.cat(seqs, 0), cu.to(seqs[0].device), int(lengths.max())


def check_sequences(seqs) -> list[torch.Tensor]:
    """A ragged list's items, checked: non-empty list of 2-D tensors sharing d, dtype and device."""
    return _checked(seqs)[0]


def _checked(seqs) -> tuple[list[torch.Tensor], list[int] | None]:
    """:func:`check_sequences`'s list, and the items' lengths where its pass read them (CPU lists)."""
    seqs = list(seqs)
    if not seqs:
        raise ValueError("maxsim: cannot pack an empty list of sequences (no dtype, d or device to take)")
    first = seqs[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2:
        # one pass of cheap attributes (a torch.device a tensor costs more than the check it serves;
        # on the CPU, is_cpu alone settles the device and a method call an item is most of the cost)
        d, dtype = first.shape[1], first.dtype
        try:
            if first.is_cpu:
                lengths = cpu_lengths(seqs, d, dtype)
                if lengths is not None:
                    return seqs, lengths
            else:
                index, cuda = first.get_device(), first.is_cuda
                if all(s.dim() == 2 and s.shape[1] == d and s.dtype is dtype and s.get_device() == index
                       and s.is_cuda == cuda for s in seqs):
                    return seqs, None
        except (AttributeError, TypeError):
            pass  # an item that is not a tensor: named below
    for k, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() != 2:
            got = f"shape {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"maxsim: every sequence must be a 2-D tensor [L, d]; item {k} is {got}")
        if s.shape[1] != seqs[0].shape[1] or s.dtype != seqs[0].dtype or s.device != seqs[0].device:
            raise ValueError(
                f"maxsim: sequences must share d, dtype and device; item {k} has d={s.shape[1]}, "
                f"{s.dtype}, {s.device} but item 0 has d={seqs[0].shape[1]}, {seqs[0].dtype}, {seqs[0].device}"
            )
    return seqs, None


def cpu_lengths(seqs, d: int, dtype: torch.dtype, no_grad: bool = False) -> list[int] | None:
    """Each item's length where every item of ``seqs`` is a 2-D CPU tensor of ``d`` columns and
    ``dtype`` (and, with ``no_grad``, none requires grad); else None (:func:`check_sequences`
    names the item). One pass of cheap attributes, in a plain loop (a generator's frame switch an
    item, or a method call, costs more than the check it serves)."""
    lengths = []
    add = lengths.append
    try:
        for s in seqs:
            shape = s.shape
            if not (s.is_cpu and s.dtype is dtype and len(shape) == 2 and shape[1] == d) or (no_grad and s.requires_grad):
                return None
            add(shape[0])
    except AttributeError:  # not a tensor
        return None
    return lengths


def pad(seqs, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged list of ``[L_i, d]`` -> ``(padded [N, L, d] zero-filled, mask [N, L] bool)``."""
    packed, cu, max_len = pack(seqs)
    return packed_to_padded(packed, cu, max_len if length is None else length)


def packed_to_padded(packed: torch.Tensor, cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed [T, d]``, ``cu_seqlens [N + 1]`` -> ``(padded [N, length, d], mask [N, length])``."""
    n = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(device=packed.device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]  # [N]
    pos = torch.arange(length, device=packed.device)
    mask = pos[None, :] < lengths[:, None]  # [N, length]
    rows = (cu[:-1, None] + pos[None, :]).clamp_max(max(packed.shape[0] - 1, 0))  # [N, length]
    padded = packed.new_zeros((n, length, packed.shape[1]))
    if packed.shape[0]:
        padded[mask] = packed[rows[mask]]
    return padded, mask


def padded_to_packed(padded: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``padded [N, L, d]``, ``mask [N, L]`` -> ``(packed [T, d], cu_seqlens [N + 1], max length)``.

    Real tokens keep their order; holes in a mask are squeezed out."""
    mask = mask.to(torch.bool)
    lengths = mask.sum(1)
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=padded.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return padded[mask], cu, int(lengths.max()) if lengths.numel() else 0
