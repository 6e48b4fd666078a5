"""Benchmark shapes, their deterministic inputs, and the roofline floor of each.

A shape is one MaxSim problem: Q ``[nq, lq, d]`` against D ``[nd, ld, d]`` -> scores ``[nq, nd]``
(cross product), or with ``candidates`` against per-query lists D ``[nq, nd, ld, d]`` -> scores
``[nq, nd]`` (``nd`` = candidates per query). Each mode (``forward``, ``train``) has a GPU set, the
benchmark proper, and a ``_cpu`` set with the same names and layouts, scaled down so that a CPU
run of every provider finishes in well under a minute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import itertools
import math

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
    accepted and converted). ``masked`` adds random prefix masks to both sides. ``candidates``:
    D holds ``nd`` candidates per query, ``[nq, nd, ld, d]``, instead of ``nd`` shared documents."""

    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d: int = 128
    dtype: str = "fp16"
    masked: bool = False
    candidates: bool = False

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            object.__setattr__(self, "dtype", names[self.dtype])
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape {self.name}: dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def doc_rows(self) -> int:
        """Documents in D: ``nd`` shared ones, or ``nq * nd`` candidates."""
        return self.nq * self.nd if self.candidates else self.nd

    def to_dict(self) -> dict:
        return asdict(self)


GPU_SHAPES = [
    Shape("1q_x_100k", 1, 100_000, 32, 300),
    Shape("32q_x_100k", 32, 100_000, 32, 128),
    Shape("colpali_1x1k", 1, 1_000, 1024, 1024),
    Shape("1x1k_128x1024", 1, 1_000, 128, 1024),
    Shape("inbatch_128x128", 128, 128, 128, 1024, dtype="bf16"),
    Shape("masked_64x64", 64, 64, 32, 180, dtype="bf16", masked=True),
    Shape("1x1k_32x300", 1, 1_000, 32, 300),  # a small serving call: one query, one candidate page
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
    Shape("1x1k_32x300_cpu", 1, 100, 32, 300),
    Shape("d768_32x10k_cpu", 2, 100, 32, 128, d=768),
]


# Training step (forward + backward of a cross-entropy loss), bf16 as in training. In-batch
# shapes have nq == nd (query i's positive is document i); the candidate shape gives each query
# its own list whose first entry is the positive.
TRAIN_GPU_SHAPES = [
    Shape("train_inbatch_128x128", 128, 128, 128, 1024, dtype="bf16"),
    Shape("train_inbatch_256x256", 256, 256, 32, 180, dtype="bf16"),
    Shape("train_candidates_32x32", 32, 32, 32, 300, dtype="bf16", candidates=True),
    Shape("train_colpali_b128", 128, 128, 1024, 1024, dtype="bf16"),
]

# Same layouts, a fraction of a GFLOP each: the CPU train run of maxsim (three rows) and naive
# takes a few seconds.
TRAIN_CPU_SHAPES = [
    Shape("train_inbatch_128x128_cpu", 8, 8, 64, 256, dtype="bf16"),
    Shape("train_inbatch_256x256_cpu", 16, 16, 32, 180, dtype="bf16"),
    Shape("train_candidates_32x32_cpu", 8, 8, 32, 300, dtype="bf16", candidates=True),
    Shape("train_colpali_b128_cpu", 4, 4, 256, 512, dtype="bf16"),
]



def _sweep(target_s: float, max_nd: int, nqs, lqs, lds, ds) -> list[Shape]:
    """Every combination, with Nd set so that each shape's floor is about ``target_s``."""
    shapes = []
    for nq, lq, ld, d in itertools.product(nqs, lqs, lds, ds):
        per_doc = max(ld * d * 2 / HBM_BYTES_PER_S, 2 * nq * lq * ld * d / DENSE_FLOPS_PER_S)
        nd = int(min(max_nd, max(16, math.ceil(target_s / per_doc))))
        shapes.append(Shape(f"sweep_q{nq}_lq{lq}_ld{ld}_d{d}", nq, nd, lq, ld, d=d))
    return shapes


# Issue 3's sweep: Lq x Ld x Nq x d, fp16, each shape sized to about 1 ms of floor on the H200.
SWEEP_GPU_SHAPES = _sweep(1e-3, 200_000, (1, 8, 32, 128), (32, 128, 1024), (128, 300, 1024), (64, 128, 768))
SWEEP_CPU_SHAPES = [Shape(s.name + "_cpu", s.nq, 4, s.lq, s.ld, d=s.d)
                    for s in _sweep(1e-3, 16, (1, 8), (32, 128), (128, 300), (64, 128))]

SHAPE_SETS = {
    "forward": (GPU_SHAPES, CPU_SHAPES),
    "train": (TRAIN_GPU_SHAPES, TRAIN_CPU_SHAPES),
}
# Shape-set names ``--shapes`` accepts besides single shapes (forward mode).
NAMED_SETS = {"sweep": SWEEP_GPU_SHAPES, "sweep_cpu": SWEEP_CPU_SHAPES}


def default_shapes(device: str, mode: str = "forward") -> list[Shape]:
    """The mode's GPU set on ``"cuda"``, its scaled-down set otherwise."""
    gpu, cpu = SHAPE_SETS[mode]
    return list(gpu if device == "cuda" else cpu)


def shapes_by_name(names: list[str]) -> list[Shape]:
    """Look names up in every set, of every mode (so a quick GPU smoke run can use the ``_cpu``
    shapes, and the forward mode can time the training shapes)."""
    known = {s.name: s for sets in SHAPE_SETS.values() for shape_set in sets for s in shape_set}
    known.update({s.name: s for shape_set in NAMED_SETS.values() for s in shape_set})
    unknown = [n for n in names if n not in known and n not in NAMED_SETS]
    if unknown:
        sets = ", ".join(NAMED_SETS)
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; known: the sets {sets}, or {', '.join(known)}")
    return [s for n in names for s in (NAMED_SETS[n] if n in NAMED_SETS else [known[n]])]


def prefix_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """``lengths [...]`` -> bool ``[..., length]`` whose first ``lengths[i]`` entries are True."""
    return torch.arange(length, device=lengths.device) < lengths[..., None]


def make_inputs(shape: Shape, device: str, seed: int = 0):
    """Random inputs for ``shape`` on ``device``, identical in every process for one seed.

    Returns ``(Q [nq, lq, d], D [nd, ld, d], q_mask [nq, lq] | None, d_mask [nd, ld] | None)``;
    with ``candidates``, D is ``[nq, nd, ld, d]`` and d_mask ``[nq, nd, ld]``.
    Values are standard normal in the shape's dtype, drawn on the device itself (no host copy of
    a 7 GB D). Masks are prefixes with lengths uniform in [1, L], the only kind that every
    provider accepts (flash-maxsim takes lengths, not masks).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = shape.torch_dtype
    Q = torch.randn(shape.nq, shape.lq, shape.d, generator=gen, device=device, dtype=dt)
    docs = (shape.nq, shape.nd) if shape.candidates else (shape.nd,)
    D = torch.randn(*docs, shape.ld, shape.d, generator=gen, device=device, dtype=dt)
    if not shape.masked:
        return Q, D, None, None
    q_len = torch.randint(1, shape.lq + 1, (shape.nq,), generator=gen, device=device)
    d_len = torch.randint(1, shape.ld + 1, docs, generator=gen, device=device)
    return Q, D, prefix_mask(q_len, shape.lq), prefix_mask(d_len, shape.ld)


def io_bytes(shape: Shape) -> int:
    """Bytes that must cross HBM at least once: Q, D, the masks and the fp32 scores."""
    item = shape.torch_dtype.itemsize
    tokens = shape.nq * shape.lq + shape.doc_rows * shape.ld
    total = tokens * shape.d * item + shape.nq * shape.nd * SCORE_BYTES
    if shape.masked:
        total += tokens * MASK_BYTES_PER_TOKEN
    return total


def flops(shape: Shape) -> int:
    """Multiply-adds of every (query token, doc token) dot product, counted as 2 FLOPs each."""
    return 2 * shape.nq * shape.nd * shape.lq * shape.ld * shape.d


def grad_bytes(shape: Shape) -> int:
    """Bytes the backward must move at least: read Q and D, write grad_Q and grad_D (input dtype)."""
    tokens = shape.nq * shape.lq + shape.doc_rows * shape.ld
    return 2 * tokens * shape.d * shape.torch_dtype.itemsize


def floor_seconds(shape: Shape, mode: str = "forward") -> float:
    """Roofline lower bound on an H200 of one forward call (memory-bound or compute-bound), or
    with ``mode="train"`` of one training step: the forward's floor plus the backward's bytes.

    The backward of a max is a gather (the winner's row, times the score's gradient), not a
    second matmul: its multiply-adds, ``4 nq nd lq d``, are 1/ld of the forward's and left out.
    The backward cannot start before every score is known, so the two floors add up."""
    forward = max(io_bytes(shape) / HBM_BYTES_PER_S, flops(shape) / DENSE_FLOPS_PER_S)
    if mode == "forward":
        return forward
    if mode == "train":
        return forward + grad_bytes(shape) / HBM_BYTES_PER_S
    raise ValueError(f"unknown mode {mode!r}")
