"""What each packed (varlen) kernel supports; checked by :mod:`maxsim.selection.varlen`."""

from __future__ import annotations

from maxsim._capability import KernelSpec

CROSS_FORWARD = KernelSpec(
    "varlen.cross_forward",
    "Triton: stacked packed queries against every packed document, work proportional to real tokens",
    layouts=("packed",), masks=False, normalize=False,
)
STREAM_FORWARD = KernelSpec(
    "varlen.stream_forward",
    "Triton: stacked packed queries against a run of documents read as one token stream (a "
    "segmented max: a tile holds several documents' tokens); int8 / fp8 tokens widened on chip",
    layouts=("packed",), masks=False, normalize=False, argmax=False,
    max_dims=(1024, 512),  # tests/compile_check.py: the tiles of the stream table fit shared memory up to these
)
PAIRS_FORWARD = KernelSpec(
    "varlen.pairs_forward",
    "Triton: one program walks a run of (query, document) pairs of the packed batches",
    layouts=("pairs",), masks=False, normalize=False,
)
UNIFIED_BACKWARD = KernelSpec(
    "varlen.unified_backward",
    "grad_q and grad_d by fp32 atomics into buffers of q's and d's size",
    layouts=("packed", "pairs"), masks=False, normalize=False,
)
LOWMEM_BACKWARD = KernelSpec(
    "varlen.lowmem_backward",
    "destination-owned: (pair, token) entries sorted by destination row, each row sums its own",
    layouts=("packed", "pairs"), masks=False, normalize=False,
)
