"""Benchmark shapes, their deterministic inputs, and the roofline floor of each.

A shape is one MaxSim problem: Q ``[nq, lq, d]`` against D ``[nd, ld, d]`` -> scores ``[nq, nd]``
(cross product), or with ``candidates`` against per-query lists D ``[nq, nd, ld, d]`` -> scores
``[nq, nd]`` (``nd`` = candidates per query), or with ``ragged`` against ``nd`` documents of at
most ``ld`` tokens whose lengths follow a named distribution (the ``varlen`` mode; the harness
packs them for the packed providers). Each mode has a GPU set, the benchmark proper, and a CPU set
with the same layouts, scaled down so that a CPU run finishes in well under a minute. Every name
says its dimensions: ``1q_x_500`` is 1 query x 500 documents, ``1x32_128x1024`` is 1 x 32
documents, Lq 128 x Ld 1024.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import itertools
import math

import torch


@dataclass(frozen=True)
class Roofline:
    """A GPU's limits for the ``% floor`` column: measured (benchmarks/roofline_probe.py), not
    datasheet peaks, unless ``source`` says how they were derived."""

    gpu: str  # matched against torch.cuda.get_device_name() (the first entry that matches)
    bytes_per_s: float  # device-to-device copy bandwidth (bytes read + written)
    flops_per_s: float  # dense bf16 matmul throughput (cuBLAS, 8192^3)
    source: str = "measured"


# Measured (BENCHMARKS.md, "Method"): the H200 and the H100 SXM (copy 3.02 TB/s, bf16 694 TFLOP/s;
# fp16 763). The H100 PCIe and NVL are not lent here: their datasheet peaks (2.0 / 3.9 TB/s,
# 756 / 835 dense TFLOP/s) times the SXM's measured fractions of its own (0.90 of 3.35 TB/s, 0.70 of
# 989 TFLOP/s). A GPU not listed has no floor: the table leaves the column out rather than divide
# by another GPU's limits.
H200 = Roofline("H200", bytes_per_s=4.3e12, flops_per_s=790e12)
H100_PCIE = Roofline("H100 PCIe", bytes_per_s=1.80e12, flops_per_s=530e12, source="derived from the datasheet")
H100_NVL = Roofline("H100 NVL", bytes_per_s=3.51e12, flops_per_s=585e12, source="derived from the datasheet")
H100_SXM = Roofline("H100", bytes_per_s=3.02e12, flops_per_s=694e12)  # "NVIDIA H100 80GB HBM3"
ROOFLINES = (H200, H100_PCIE, H100_NVL, H100_SXM)
HBM_BYTES_PER_S = H200.bytes_per_s
DENSE_FLOPS_PER_S = H200.flops_per_s

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MASK_BYTES_PER_TOKEN = 1  # bool masks
SCORE_BYTES = 4  # fp32 output


def roofline_for(device_name: str) -> Roofline | None:
    """The measured roofline of the GPU called ``device_name``, None when it has none (any CPU)."""
    return next((r for r in ROOFLINES if r.gpu.lower() in device_name.lower()), None)


# Document-length distributions of the varlen mode (lengths in [1, ld]): name -> what they model.
RAGGED_KINDS = {
    "uniform": "uniform in [ld/2, ld]",
    "hotpotqa": "exponential, mean ld * 150/512 (HotpotQA-like passages)",
    "ragged": "exponential, mean ld * 80/512",
}


@dataclass(frozen=True)
class Shape:
    """One benchmark problem. ``dtype`` is ``"fp16"``, ``"bf16"`` or ``"fp32"`` (a torch dtype is
    accepted and converted). ``masked`` adds random prefix masks to both sides. ``candidates``:
    D holds ``nd`` candidates per query, ``[nq, nd, ld, d]``, instead of ``nd`` shared documents.
    ``ragged``: a key of :data:`RAGGED_KINDS`; the documents' lengths follow that distribution
    (a document mask), the queries are full."""

    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d: int = 128
    dtype: str = "fp16"
    masked: bool = False
    candidates: bool = False
    ragged: str = ""

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            object.__setattr__(self, "dtype", names[self.dtype])
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape {self.name}: dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.ragged and self.ragged not in RAGGED_KINDS:
            raise ValueError(f"Shape {self.name}: ragged must be one of {sorted(RAGGED_KINDS)}; got {self.ragged!r}")
        if self.ragged and (self.masked or self.candidates):
            raise ValueError(f"Shape {self.name}: ragged documents take no masked= or candidates=")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def doc_rows(self) -> int:
        """Documents in D: ``nd`` shared ones, or ``nq * nd`` candidates."""
        return self.nq * self.nd if self.candidates else self.nd

    def to_dict(self) -> dict:
        return asdict(self)

    def dims(self) -> dict[str, str]:
        """The table's dimension columns: ``Nq x Nd``, ``Lq``, ``Ld``, ``d``, ``dtype``, ``masks``."""
        docs = f"{self.nq} x {self.nd}" + (" per q" if self.candidates else "")
        if self.ragged:
            masks = f"{self.ragged}, fill {doc_fill(self):.2f}"
        else:
            masks = "prefix" if self.masked else "-"
        ld = f"<={self.ld}" if self.ragged else str(self.ld)
        return {"Nq x Nd": docs, "Lq": str(self.lq), "Ld": ld, "d": str(self.d), "dtype": self.dtype, "masks": masks}


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

# The same layouts, in the same order, about 1 GFLOP each, so a 2-core CPU runs all providers in
# well under a minute.
CPU_SHAPES = [
    Shape("1q_x_500", 1, 500, 32, 300),
    Shape("4q_x_500", 4, 500, 32, 128),
    Shape("colpali_1x4", 1, 4, 1024, 1024),
    Shape("1x32_128x1024", 1, 32, 128, 1024),
    Shape("inbatch_8x8", 8, 8, 128, 512, dtype="bf16"),
    Shape("masked_16x16", 16, 16, 32, 180, dtype="bf16", masked=True),
    Shape("1x100_32x300", 1, 100, 32, 300),
    Shape("d768_2x100", 2, 100, 32, 128, d=768),
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

# The same layouts, a fraction of a GFLOP each: the CPU train run takes a few seconds.
TRAIN_CPU_SHAPES = [
    Shape("train_inbatch_8x8", 8, 8, 64, 256, dtype="bf16"),
    Shape("train_inbatch_16x16", 16, 16, 32, 180, dtype="bf16"),
    Shape("train_candidates_8x8", 8, 8, 32, 300, dtype="bf16", candidates=True),
    Shape("train_b4_256x512", 4, 4, 256, 512, dtype="bf16"),
]

# Ragged batches: 32 queries of 32 tokens against documents of at most 512 tokens, three length
# distributions (fill = mean length / 512: about 0.75, 0.3 and 0.16).
VARLEN_GPU_SHAPES = [Shape(f"varlen_{kind}_32x20k", 32, 20_000, 32, 512, ragged=kind) for kind in RAGGED_KINDS]
VARLEN_CPU_SHAPES = [Shape(f"varlen_{kind}_4x64", 4, 64, 32, 512, ragged=kind) for kind in RAGGED_KINDS]


def _sweep(target_s: float, max_nd: int, nqs, lqs, lds, ds) -> list[Shape]:
    """Every combination, with Nd set so that each shape's H200 floor is about ``target_s``."""
    shapes = []
    for nq, lq, ld, d in itertools.product(nqs, lqs, lds, ds):
        per_doc = max(ld * d * 2 / HBM_BYTES_PER_S, 2 * nq * lq * ld * d / DENSE_FLOPS_PER_S)
        nd = int(min(max_nd, max(16, math.ceil(target_s / per_doc))))
        shapes.append(Shape(f"sweep_q{nq}_lq{lq}_ld{ld}_d{d}", nq, nd, lq, ld, d=d))
    return shapes


# Issue 3's sweep: Lq x Ld x Nq x d, fp16, each shape sized to about 1 ms of floor on the H200.
SWEEP_GPU_SHAPES = _sweep(1e-3, 200_000, (1, 8, 32, 128), (32, 128, 1024), (128, 300, 1024), (64, 128, 768))
SWEEP_CPU_SHAPES = [Shape(s.name + "_nd4", s.nq, 4, s.lq, s.ld, d=s.d)
                    for s in _sweep(1e-3, 16, (1, 8), (32, 128), (128, 300), (64, 128))]


# Real models (their published configurations: embedding dim, query length, document or page
# length, the dtype they run in) in the regimes their users run: rerank (1 query x 1K documents),
# search (32 x 100K passages, 32 x 10K pages), an in-batch training step (64 x 64) and a
# candidate-list distillation step (32 queries x 32 candidates); padding masks on both sides; in
# the model's 16-bit dtype and in fp32 (what PyLate's encode and most numpy pipelines hand over).
# name: (d, Lq, Ld, 16-bit dtype, search corpus size)
MODELS = {
    "colbertv2": (128, 32, 180, "fp16", 100_000),  # colbert-ir/colbertv2.0, MS MARCO passages
    "answerai-small": (96, 32, 300, "fp16", 100_000),  # answerdotai/answerai-colbert-small-v1
    "jina-v2": (128, 32, 512, "bf16", 100_000),  # jinaai/jina-colbert-v2 (Matryoshka: 128, 96, 64)
    "jina-v2-d96": (96, 32, 512, "bf16", 100_000),
    "jina-v2-d64": (64, 32, 512, "bf16", 100_000),
    "gte-moderncolbert": (128, 32, 300, "bf16", 100_000),  # lightonai/GTE-ModernColBERT-v1
    "mxbai-edge-32m": (64, 48, 512, "bf16", 100_000),  # mixedbread-ai/mxbai-edge-colbert-v0-32m
    "colpali-v1.3": (128, 32, 1030, "bf16", 10_000),  # vidore: 1024 patches + 6 prefix tokens a page
    "colqwen2.5": (128, 32, 768, "bf16", 10_000),  # vidore/colqwen2.5: at most 768 visual tokens a page
}


def _model_shapes(train: bool) -> list[Shape]:
    shapes = []
    for model, (d, lq, ld, dtype16, n_search) in MODELS.items():
        for dtype in (dtype16, "fp32"):
            tag = f"{lq}x{ld}_d{d}_{dtype}"
            if train:
                shapes.append(Shape(f"m_{model}_train_64x64_{tag}", 64, 64, lq, ld, d=d, dtype=dtype, masked=True))
                shapes.append(Shape(f"m_{model}_distill_32x32_{tag}", 32, 32, lq, ld, d=d, dtype=dtype, masked=True,
                                    candidates=True))
            else:
                shapes.append(Shape(f"m_{model}_rerank_1x1k_{tag}", 1, 1_000, lq, ld, d=d, dtype=dtype, masked=True))
                n = f"{n_search // 1000}k"
                shapes.append(Shape(f"m_{model}_search_32x{n}_{tag}", 32, n_search, lq, ld, d=d, dtype=dtype,
                                    masked=True))
    return shapes


MODEL_SHAPES = _model_shapes(train=False)
MODEL_TRAIN_SHAPES = _model_shapes(train=True)

# fp32 inputs (issue 31's bar): the batched search shape the peers were first measured on, and
# every fp32 row of the models set.
FP32_SHAPES = [Shape("fp32_16x10k_32x180", 16, 10_000, 32, 180, dtype="fp32")] + \
    [s for s in MODEL_SHAPES if s.dtype == "fp32"]

# Padded one-query reranks (issue 31's padding bar): documents of a real length distribution padded
# to the longest, with a prefix mask; the floor counts only the real tokens.
PADDED_SHAPES = [
    Shape("padded_rerank_1x1k_32x220", 1, 1_000, 32, 220, ragged="hotpotqa"),
    Shape("padded_rerank_1x10k_32x300", 1, 10_000, 32, 300, ragged="hotpotqa"),
    Shape("padded_rerank_1x10k_32x512", 1, 10_000, 32, 512, ragged="ragged"),
]

# Every width (issue 31): one query against documents of 300 tokens, bandwidth-bound, fp16.
WIDTH_SHAPES = [Shape(f"width_1x{nd // 1000}k_32x300_d{d}", 1, nd, 32, 300, d=d)
                for d, nd in ((64, 10_000), (96, 10_000), (320, 10_000), (2560, 1_000), (4096, 1_000))]

SHAPE_SETS = {
    "forward": (GPU_SHAPES, CPU_SHAPES),
    "train": (TRAIN_GPU_SHAPES, TRAIN_CPU_SHAPES),
    "varlen": (VARLEN_GPU_SHAPES, VARLEN_CPU_SHAPES),
}
# Shape-set names ``--shapes`` accepts besides single shapes (forward mode).
NAMED_SETS = {"sweep": SWEEP_GPU_SHAPES, "sweep_cpu": SWEEP_CPU_SHAPES, "models": MODEL_SHAPES,
              "models_train": MODEL_TRAIN_SHAPES, "fp32": FP32_SHAPES, "padded": PADDED_SHAPES,
              "widths": WIDTH_SHAPES,
              "fp32_train": [s for s in MODEL_TRAIN_SHAPES if s.dtype == "fp32"]}


def default_shapes(device: str, mode: str = "forward") -> list[Shape]:
    """The mode's GPU set on ``"cuda"``, its scaled-down set otherwise."""
    gpu, cpu = SHAPE_SETS[mode]
    return list(gpu if device == "cuda" else cpu)


def shapes_by_name(names: list[str]) -> list[Shape]:
    """Look names up in every set, of every mode (so a quick GPU smoke run can use the CPU
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


def ragged_lengths(shape: Shape, seed: int = 0) -> torch.Tensor:
    """int64 ``[nd]`` document lengths in ``[1, ld]`` drawn from ``shape.ragged``'s distribution,
    on the CPU from ``seed`` (the same in every process and on every device)."""
    gen = torch.Generator().manual_seed(seed)
    if shape.ragged == "uniform":
        return torch.randint(shape.ld // 2, shape.ld + 1, (shape.nd,), generator=gen)
    mean = shape.ld * {"hotpotqa": 150, "ragged": 80}[shape.ragged] / 512
    lengths = torch.empty(shape.nd, dtype=torch.float64).exponential_(1.0 / mean, generator=gen)
    return lengths.round().clamp(1, shape.ld).long()


def doc_fill(shape: Shape) -> float:
    """Mean document length over ``ld`` (1 for every shape but the ragged ones)."""
    return float(ragged_lengths(shape).double().mean()) / shape.ld if shape.ragged else 1.0


def make_inputs(shape: Shape, device: str, seed: int = 0):
    """Random inputs for ``shape`` on ``device``, identical in every process for one seed.

    Returns ``(Q [nq, lq, d], D [nd, ld, d], q_mask [nq, lq] | None, d_mask [nd, ld] | None)``;
    with ``candidates``, D is ``[nq, nd, ld, d]`` and d_mask ``[nq, nd, ld]``.
    Values are standard normal in the shape's dtype, drawn on the device itself (no host copy of
    a 7 GB D). Masks are prefixes with lengths uniform in [1, L], the only kind that every
    provider accepts (flash-maxsim takes lengths, not masks); ragged shapes have a document mask
    from :func:`ragged_lengths` and no query mask.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = shape.torch_dtype
    Q = torch.randn(shape.nq, shape.lq, shape.d, generator=gen, device=device, dtype=dt)
    docs = (shape.nq, shape.nd) if shape.candidates else (shape.nd,)
    D = torch.randn(*docs, shape.ld, shape.d, generator=gen, device=device, dtype=dt)
    if shape.ragged:
        # Random values under the padding too: a provider that ignored the mask would show.
        return Q, D, None, prefix_mask(ragged_lengths(shape, seed).to(device), shape.ld)
    if not shape.masked:
        return Q, D, None, None
    q_len = torch.randint(1, shape.lq + 1, (shape.nq,), generator=gen, device=device)
    d_len = torch.randint(1, shape.ld + 1, docs, generator=gen, device=device)
    return Q, D, prefix_mask(q_len, shape.lq), prefix_mask(d_len, shape.ld)


def doc_tokens(shape: Shape) -> int:
    """Document tokens the problem holds: padded ones included, except for ragged shapes, whose
    work is their real tokens (what a packed kernel reads)."""
    if shape.ragged:
        return int(ragged_lengths(shape).sum())
    return shape.doc_rows * shape.ld


def io_bytes(shape: Shape) -> int:
    """Bytes that must cross HBM at least once: Q, D, the masks and the fp32 scores."""
    item = shape.torch_dtype.itemsize
    tokens = shape.nq * shape.lq + doc_tokens(shape)
    total = tokens * shape.d * item + shape.nq * shape.nd * SCORE_BYTES
    if shape.masked:
        total += tokens * MASK_BYTES_PER_TOKEN
    return total


def flops(shape: Shape) -> int:
    """Multiply-adds of every (query token, doc token) dot product, counted as 2 FLOPs each."""
    per_query_docs = doc_tokens(shape) // shape.nq if shape.candidates else doc_tokens(shape)
    return 2 * shape.nq * per_query_docs * shape.lq * shape.d


def grad_bytes(shape: Shape) -> int:
    """Bytes the backward must move at least: read Q and D, write grad_Q and grad_D (input dtype)."""
    tokens = shape.nq * shape.lq + doc_tokens(shape)
    return 2 * tokens * shape.d * shape.torch_dtype.itemsize


def floor_seconds(shape: Shape, mode: str = "forward", roofline: Roofline = H200) -> float:
    """Roofline lower bound on ``roofline``'s GPU (default the H200) of one forward call
    (memory-bound or compute-bound), or with ``mode="train"`` of one training step: the forward's
    floor plus the backward's bytes.

    The backward of a max is a gather (the winner's row, times the score's gradient), not a
    second matmul: its multiply-adds, ``4 nq nd lq d``, are 1/ld of the forward's and left out.
    The backward cannot start before every score is known, so the two floors add up."""
    forward = max(io_bytes(shape) / roofline.bytes_per_s, flops(shape) / roofline.flops_per_s)
    if mode in ("forward", "varlen"):
        return forward
    if mode == "train":
        return forward + grad_bytes(shape) / roofline.bytes_per_s
    raise ValueError(f"unknown mode {mode!r}")
