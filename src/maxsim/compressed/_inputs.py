"""Checks every compressed-corpus scorer shares (residual, int8 / fp8, product quantisation): the
query, masks, packed offsets and chunk sizes, with one wording of each error."""

from __future__ import annotations

import torch

from maxsim._checks import as_bool_mask

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def describe(x) -> str:
    return f"{x.dtype} tensor of shape {tuple(x.shape)}" if torch.is_tensor(x) else type(x).__name__


def check_query(Q, dim: int, of: str, name: str = "Q") -> None:
    """Q ``[Nq, Lq, dim]`` or ``[Lq, dim]`` in a query dtype; ``of`` names where ``dim`` comes from."""
    if not torch.is_tensor(Q) or Q.dtype not in QUERY_DTYPES:
        raise TypeError(f"maxsim: {name} must be a float16, bfloat16 or float32 tensor, got "
                        f"{Q.dtype if torch.is_tensor(Q) else type(Q).__name__}")
    if Q.dim() not in (2, 3) or Q.shape[-1] != dim:
        raise ValueError(f"maxsim: {name} must have shape [Nq, Lq, {dim}] or [Lq, {dim}] (d of {of}), got "
                         f"{tuple(Q.shape)}")


def check_mask(mask, shape, name: str, device) -> torch.Tensor | None:
    """A mask of ``shape`` (bool, or 0/1 numbers), on any device -> bool on ``device``, or None
    (``maxsim._checks.as_bool_mask``'s rules once it is there)."""
    if mask is None:
        return None
    return as_bool_mask(name, mask.to(device) if torch.is_tensor(mask) else mask, tuple(shape), device)


def check_q_mask(q_mask, Q: torch.Tensor) -> torch.Tensor | None:
    return check_mask(q_mask, Q.shape[:-1], "q_mask", Q.device)


def check_d_mask(d_mask, d_lengths, shape, device) -> torch.Tensor | None:
    """The real tokens of padded documents of ``shape`` ``(Nd, Ld)``, given as ``d_mask [Nd, Ld]``
    (True = real) or ``d_lengths [Nd]`` (each a prefix), not both, as ``maxsim.maxsim`` takes them
    -> bool ``[Nd, Ld]`` on ``device``, or None (every token real)."""
    if d_mask is not None and d_lengths is not None:
        raise ValueError("maxsim: give d_mask or d_lengths, not both")
    if d_lengths is None:
        return check_mask(d_mask, shape, "d_mask", device)
    num_docs, doc_len = shape
    if not torch.is_tensor(d_lengths) or tuple(d_lengths.shape) != (num_docs,) or d_lengths.is_floating_point() \
            or d_lengths.dtype == torch.bool or d_lengths.is_complex():
        raise ValueError(f"maxsim: d_lengths must be an integer tensor of shape [{num_docs}] (the documents), got "
                         f"{describe(d_lengths)}")
    lengths = d_lengths.to(device, torch.int64)
    if num_docs and bool(((lengths < 0) | (lengths > doc_len)).any()):
        raise ValueError(f"maxsim: d_lengths must lie in [0, {doc_len}] (the padded length)")
    return torch.arange(doc_len, device=device) < lengths[:, None]


def check_cu_seqlens(cu_seqlens_d, total: int, name: str = "cu_seqlens_d", *, on_host: bool = True) -> torch.Tensor:
    """Offsets ``[Nd + 1]`` -> int64, checked: start at 0, never decrease, end at ``total``. On the
    host (a copy), or with ``on_host=False`` where they live, checked there with one read of a flag
    (a million offsets on the GPU cost no copy to the host and back)."""
    if not torch.is_tensor(cu_seqlens_d) or cu_seqlens_d.dim() != 1 or cu_seqlens_d.numel() == 0 \
            or cu_seqlens_d.is_floating_point() or cu_seqlens_d.dtype == torch.bool or cu_seqlens_d.is_complex():
        raise ValueError(f"maxsim: {name} must be a 1-D integer tensor [Nd + 1], got {describe(cu_seqlens_d)}")
    cu = cu_seqlens_d.to("cpu" if on_host else cu_seqlens_d.device, torch.int64)
    if bool((cu[0] != 0) | (cu[-1] != total) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"maxsim: {name} must start at 0, never decrease and end at the number of tokens "
                         f"({total}), got [{int(cu[0])}, ..., {int(cu[-1])}]")
    return cu


def check_chunk_documents(chunk_documents) -> None:
    if chunk_documents is None:
        return
    if isinstance(chunk_documents, bool) or not isinstance(chunk_documents, int):
        raise TypeError(f"maxsim: chunk_documents must be None or an int, got {type(chunk_documents).__name__}")
    if chunk_documents < 1:
        raise ValueError(f"maxsim: chunk_documents must be >= 1, got {chunk_documents}")


def check_codec(codec) -> None:
    """``codec`` is a :class:`maxsim.compressed.ResidualCodec`."""
    from .codec import ResidualCodec

    if not isinstance(codec, ResidualCodec):
        raise TypeError(f"codec must be a maxsim.compressed.ResidualCodec, got {type(codec).__name__}")


def decode_dtype(Q, decode_dtype):
    """The dtype residual tokens are decoded into: ``decode_dtype`` (fp16 or fp32), else fp16 for
    an fp16 Q and fp32 otherwise."""
    if decode_dtype is None:
        return torch.float16 if Q.dtype == torch.float16 else torch.float32
    if decode_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"decode_dtype must be torch.float16 or torch.float32 (bf16 decode loses "
                         f"several times more precision), got {decode_dtype}")
    return decode_dtype
