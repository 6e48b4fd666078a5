"""What each path of ``maxsim.maxsim_residual`` / ``maxsim_residual_varlen`` supports, declared as
data (no kernel imports: :mod:`maxsim.selection.compressed` checks calls against these)."""

from __future__ import annotations

import torch

from maxsim._capability import KernelSpec

# The decode dtypes (the tiles the kernel decodes into and scores in). Never bf16: its decode
# error is several times larger, close to 1e-3 of a score.
DECODE_DTYPES = (torch.float16, torch.float32)

# The stream kernel holds the query's bit planes ([BM, d * nbits / 8] each, all of d) on chip for
# its lifetime and each token tile's planes beside them, so d is bounded by the registers they take.
MAX_FUSED_D = 1024

FUSED_FORWARD = KernelSpec(
    "compressed.stream_forward",
    "Triton: the packed stream kernel on residual tokens: each tile's codes and residual bytes read "
    "and scored plane by plane (a bit field of every byte, its weights plus the gathered centroids' "
    "same dimensions, against the query's), each token's norm dividing its column after the dot; no "
    "decoded corpus in memory",
    dtypes=DECODE_DTYPES,
    layouts=("packed",),
    argmax=False,
)
CHUNKED_DECODE = KernelSpec(
    "compressed.chunked_decode",
    "PyTorch: ResidualCodec.decode a bounded chunk (64 MB) at a time, then maxsim.maxsim / maxsim_varlen",
    dtypes=DECODE_DTYPES,
    layouts=("padded", "packed"),
)
