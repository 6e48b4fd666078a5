"""MaxSim on residual-compressed (PLAID) documents, decoded on chip: the decode tables and the
launcher of the packed stream kernel's residual form.

A document token is stored as a centroid code and ``P = d * nbits / 8`` residual bytes
(:mod:`maxsim.compressed.codec`). The packed stream kernel (:mod:`maxsim.varlen.stream`) walks a
run of whole documents as one stream of tiles; for residual tokens each tile's codes ``[BN]`` and
bytes ``[BN, P]`` are read and scored plane by plane: plane k (k < 8 / nbits) is the field at the
same shift in every byte, dimensions ``k, k + 8/nbits, k + 2 * 8/nbits, ...``, so it is a shift and
a mask of the byte tile itself, with no shuffle of bits between threads. The kernel adds each
plane's bucket weights to the same dimensions of the gathered centroids (one rounding to the decode
dtype, as ``ResidualCodec.decode``) and multiplies the plane with the same dimensions of the query
on the tensor cores. The dot product does not depend on the order of the dimensions, so the query
and the centroid table are stored plane by plane (:func:`to_planes`) and every plane is a
contiguous slice. With ``normalize`` each token's norm is summed over the planes and divides its
column of scores after the dot (one division a token, not one a dimension; the norm rounded to the
decode dtype as the codec rounds it). No decoded token ever reaches memory.

Bit layout (codec.py): bucket bit j of dimension f is stream bit ``f * nbits + j``, and stream bit
p is bit ``7 - p % 8`` of byte ``p // 8``. For nbits in {1, 2, 4, 8} dimension f lies in byte
``f // (8 / nbits)``, as the field ``(byte >> (8 - nbits * (k + 1))) & (2**nbits - 1)`` with
``k = f % (8 / nbits)`` (a shift and a mask), whose bits are the bucket's reversed. The reversal is
folded into the weight table the kernel reads: ``weights_by_field[v] = bucket_weights[reverse(v)]``.
"""

from __future__ import annotations

import weakref

import torch


# ---------------------------------------------------------------------- decode tables
def _reverse_bits(v: int, nbits: int) -> int:
    return int(f"{v:0{nbits}b}"[::-1], 2)


# id(codec.centroids) -> (a weak reference to that tensor, {(dtype, device, versions, weights): tables}).
# Keyed by id, checked by identity: tensors compare elementwise, so they cannot be dict keys.
_TABLES: dict = {}


def _tables_of(centroids: torch.Tensor) -> dict:
    key = id(centroids)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not centroids:
        entry = _TABLES[key] = (weakref.ref(centroids, lambda _ref, key=key: _TABLES.pop(key, None)), {})
    return entry[1]


def to_planes(x: torch.Tensor, nbits: int) -> torch.Tensor:
    """``x [..., d]`` with its dimensions in plane order: plane k (k < 8 / nbits) holds dimensions
    ``k, k + 8/nbits, ...`` as the contiguous columns ``k * P : (k + 1) * P`` (``P = d * nbits / 8``).
    A dot product of two vectors in plane order equals theirs in dimension order."""
    per_byte = 8 // nbits
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // per_byte, per_byte).transpose(-1, -2).reshape(x.shape).contiguous()


def decode_tables(codec, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [C, d] in ``dtype`` and plane order (:func:`to_planes`), weights_by_field
    [2**nbits] in ``dtype``) on ``device``, as the kernel reads them: the bucket weights indexed by
    the raw bit field (bit order reversed), both rounded to the decode dtype once, as the codec
    rounds them. Cached per codec tensors."""
    device = torch.device(device)
    per_codec = _tables_of(codec.centroids)
    key = (dtype, str(device), codec.centroids._version, codec.bucket_weights.data_ptr(),
           codec.bucket_weights._version, codec.nbits)
    tables = per_codec.get(key)
    if tables is None:
        per_codec.clear()  # one entry per codec tensor: a new version replaces the old
        order = torch.tensor([_reverse_bits(v, codec.nbits) for v in range(1 << codec.nbits)], dtype=torch.int64)
        weights = codec.bucket_weights.to(dtype).cpu()[order].to(device)
        centroids = to_planes(codec.centroids.to(device=device, dtype=dtype), codec.nbits)
        tables = per_codec[key] = (centroids, weights)
    return tables


# ---------------------------------------------------------------------- launcher
def residual_stream_forward(q, cu_q, max_q, codes, residuals, cu_d, codec, dtype, normalize, *, config, max_d=None):
    """Inference scores ``[Nq, Nd]`` fp32 of packed queries ``q [Tq, d]`` (in the decode dtype,
    fp16 or fp32; ``cu_q [Nq + 1]``, ``max_q``) against packed residual documents: codes ``[T]``,
    residuals ``[T, d * nbits / 8]`` uint8, ``cu_d [Nd + 1]`` int64, all on q's device. The
    packed stream kernel (:mod:`maxsim.varlen.stream`) decodes each tile of tokens on chip as
    ``codec.decode(..., dtype=dtype, normalize=normalize)`` does and scores it; no decoded token
    reaches memory. A document holding a code outside [0, C) scores NaN; an empty one 0."""
    from maxsim.varlen.stream import stream_forward  # (the packed family's launcher)

    centroids, weights = decode_tables(codec, dtype, q.device)
    return stream_forward(to_planes(q, codec.nbits), residuals.contiguous(), cu_q, cu_d, max_q, config=config,
                          max_d=max_d, residual=(codes.contiguous(), centroids, weights, codec.nbits, normalize))
