"""Queries in any layout a search takes, packed: the one conversion every scorer that takes queries
as a list, padded with a mask, or packed with offsets shares (search, the compressed scorers)."""

from __future__ import annotations

import numpy as np
import torch

from maxsim import _checks
from maxsim.varlen.packing import pack, padded_to_packed


def _as_tensor(name: str, x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"maxsim: {name} must be a torch.Tensor or numpy array; got {type(x).__name__}")
    return x


def _bool_mask(name: str, mask, shape, device) -> torch.Tensor | None:
    """A mask given as a tensor or numpy array -> bool (``maxsim._checks.as_bool_mask``'s rules)."""
    return None if mask is None else _checks.as_bool_mask(name, _as_tensor(name, mask), tuple(shape), device)


def packed_queries(Q, q_mask=None, cu_seqlens_q=None):
    """Queries in any accepted layout -> ``(q [Tq, d], cu_q int64 [Nq + 1] on q's device, cu_q on
    the host (numpy), max_q)``.

    Accepts a padded ``[Nq, Lq, d]`` (with ``q_mask``) or one ``[Lq, d]`` query, a list of
    ``[L_i, d]`` tensors, or packed ``[Tq, d]`` with ``cu_seqlens_q``. Masked tokens are dropped
    (they add nothing to a score under the exclude rule).
    """
    if isinstance(Q, (list, tuple)):
        if q_mask is not None or cu_seqlens_q is not None:
            raise ValueError("maxsim: a list of queries takes no q_mask or cu_seqlens_q")
        Q = [_as_tensor("Q", x) for x in Q]
        q, cu, _ = pack(Q)
    else:
        Q = _as_tensor("Q", Q)
        if cu_seqlens_q is not None:
            if Q.dim() != 2:
                raise ValueError(f"maxsim: packed Q must be [total_tokens, d]; got {list(Q.shape)}")
            q, cu = Q, _as_tensor("cu_seqlens_q", cu_seqlens_q).to(Q.device, torch.int64)
        else:
            if Q.dim() == 2:
                Q = Q[None]
                q_mask = None if q_mask is None else _as_tensor("q_mask", q_mask)[None]
            if Q.dim() != 3:
                raise ValueError(f"maxsim: Q must be [Nq, Lq, d], [Lq, d], packed or a list; got {list(Q.shape)}")
            mask = _bool_mask("q_mask", q_mask, Q.shape[:2], Q.device)
            if mask is None:  # every token real: a view, the offsets known on the host (no device read)
                n, length = Q.shape[:2]
                cu_host = np.arange(n + 1, dtype=np.int64) * length
                return Q.reshape(n * length, Q.shape[2]), torch.from_numpy(cu_host).to(Q.device), cu_host, \
                    (length if n else 0)
            q, cu, _ = padded_to_packed(Q, mask)
    cu_host = cu.cpu().numpy().astype(np.int64)
    _check_offsets("cu_seqlens_q", cu_host, q.shape[0])
    max_q = int(np.diff(cu_host).max()) if cu_host.size > 1 else 0
    return q, cu, cu_host, max_q


def _check_offsets(name: str, offsets: np.ndarray, total: int) -> None:
    if offsets.ndim != 1 or offsets.size < 1:
        raise ValueError(f"maxsim: {name} must be 1-D [N + 1]; got shape {list(offsets.shape)}")
    if offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
        raise ValueError(f"maxsim: {name} must start at 0, never decrease and end at {total}")
