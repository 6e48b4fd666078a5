"""Fixed-point sums: integer sums are exact in any order, where a GPU's floating-point atomics and
scans are not, so k-means trained on a GPU is the same run to run."""

from __future__ import annotations

import math

import torch


def fixed_point(values, count, *, signed=False, return_scale=False):
    """values (fp32, finite) as int64 multiples of a power of two ``1 / scale``, scaled so that
    any sum of ``count`` of them fits in 62 bits: integer sums are exact in any order, where a
    GPU's floating-point atomics and scans are not. At most 52 fraction bits below the largest
    value's exponent (float64's own precision), about 2^-(45 - log2 count) relative for 65K
    values. Returns the int64 tensor (and the float64 scale)."""
    scale = fixed_point_scale(values, count, signed=signed)
    fixed = torch.round(values.double() * scale).to(torch.int64)
    return (fixed, scale) if return_scale else fixed


def fixed_point_scale(values, count, *, signed=False):
    """The float64 scalar tensor :func:`fixed_point` multiplies ``values`` by: a caller that converts
    row blocks with it (``torch.round(block.double() * scale)``) gets the same integers without
    holding all of them (and their float64 copy) at once."""
    largest = values.abs().amax().double().clamp_min(2.0**-100)
    bits = min(52, 62 - math.ceil(math.log2(max(count, 2))) - (1 if signed else 0))
    return torch.exp2(bits - torch.ceil(torch.log2(largest)))  # |value| * scale <= 2^bits
