"""Benchmark shapes, their deterministic inputs, and the roofline floor of each.

A shape is one MaxSim problem: Q ``[nq, lq, d]`` against D ``[nd, ld, d]`` -> scores ``[nq, nd]``.
The GPU set is the forward benchmark proper; the ``_cpu`` set keeps the same names and layouts,
scaled down so that a CPU run of every provider finishes in well under a minute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# H200 numbers measured on the machine the benchmark targets (not datasheet peaks):
HBM_BYTES_PER_S = 4.3e12  # device-to-device copy bandwidth
DENSE_FLOPS_PER_S = 790e12  # dense bf16 matmul throughput

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MASK_BYTES_PER_TOKEN = 1  # bool masks
SCORE_BYTES = 4  # fp32 output


@dataclass(frozen=True)
class Shape:
    """One benchmark problem. ``dtype`` is ``"fp16"``, ``"bf16"`` or ``"fp32"`` (a torch dtype is
    accepted and converted). ``masked`` adds random prefix masks to both sides."""

    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d: int = 128
    dtype: str = "fp16"
    masked: bool = False

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            object.__setattr__(self, "dtype", names[self.dtype])
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape {self.name}: dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)


GPU_SHAPES = [
    Shape("1q_x_100k", 1, 100_000, 32, 300),
    Shape("32q_x_100k", 32, 100_000, 32, 128),
    Shape("colpali_1x1k", 1, 1_000, 1024, 1024),
    Shape("1x1k_128x1024", 1, 1_000, 128, 1024),
    Shape("inbatch_128x128", 128, 128, 128, 1024, dtype="bf16"),
    Shape("masked_64x64", 64, 64, 32, 180, dtype="bf16", masked=True),
    Shape("d768_32x10k", 32, 10_000, 32, 128, d=768),
]

# Same layouts, about 1 GFLOP each, so a 2-core CPU runs all providers in well under a minute.
CPU_SHAPES = [
    Shape("1q_x_100k_cpu", 1, 500, 32, 300),
    Shape("32q_x_100k_cpu", 4, 500, 32, 128),
    Shape("colpali_1x1k_cpu", 1, 4, 1024, 1024),
    Shape("1x1k_128x1024_cpu", 1, 32, 128, 1024),
    Shape("inbatch_128x128_cpu", 8, 8, 128, 512, dtype="bf16"),
    Shape("masked_64x64_cpu", 16, 16, 32, 180, dtype="bf16", masked=True),
    Shape("d768_32x10k_cpu", 2, 100, 32, 128, d=768),
]


def default_shapes(device: str) -> list[Shape]:
    """The GPU set on ``"cuda"``, the scaled-down set otherwise."""
    return list(GPU_SHAPES if device == "cuda" else CPU_SHAPES)


def shapes_by_name(names: list[str]) -> list[Shape]:
    """Look names up in both sets (so a quick GPU smoke run can use the ``_cpu`` shapes)."""
    known = {s.name: s for s in GPU_SHAPES + CPU_SHAPES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def prefix_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """``lengths [N]`` -> bool ``[N, length]`` whose first ``lengths[i]`` entries are True."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


def make_inputs(shape: Shape, device: str, seed: int = 0):
    """Random inputs for ``shape`` on ``device``, identical in every process for one seed.

    Returns ``(Q [nq, lq, d], D [nd, ld, d], q_mask [nq, lq] | None, d_mask [nd, ld] | None)``.
    Values are standard normal in the shape's dtype, drawn on the device itself (no host copy of
    a 7 GB D). Masks are prefixes with lengths uniform in [1, L], the only kind that every
    provider accepts (flash-maxsim takes lengths, not masks).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = shape.torch_dtype
    Q = torch.randn(shape.nq, shape.lq, shape.d, generator=gen, device=device, dtype=dt)
    D = torch.randn(shape.nd, shape.ld, shape.d, generator=gen, device=device, dtype=dt)
    if not shape.masked:
        return Q, D, None, None
    q_len = torch.randint(1, shape.lq + 1, (shape.nq,), generator=gen, device=device)
    d_len = torch.randint(1, shape.ld + 1, (shape.nd,), generator=gen, device=device)
    return Q, D, prefix_mask(q_len, shape.lq), prefix_mask(d_len, shape.ld)


def io_bytes(shape: Shape) -> int:
    """Bytes that must cross HBM at least once: Q, D, the masks and the fp32 scores."""
    item = shape.torch_dtype.itemsize
    tokens = shape.nq * shape.lq + shape.nd * shape.ld
    total = tokens * shape.d * item + shape.nq * shape.nd * SCORE_BYTES
    if shape.masked:
        total += tokens * MASK_BYTES_PER_TOKEN
    return total


def flops(shape: Shape) -> int:
    """Multiply-adds of every (query token, doc token) dot product, counted as 2 FLOPs each."""
    return 2 * shape.nq * shape.nd * shape.lq * shape.ld * shape.d


def floor_seconds(shape: Shape) -> float:
    """Roofline lower bound on one forward call on an H200: memory-bound or compute-bound."""
    return max(io_bytes(shape) / HBM_BYTES_PER_S, flops(shape) / DENSE_FLOPS_PER_S)
