"""What each path of ``maxsim.maxsim_residual`` / ``maxsim_residual_varlen`` supports, declared as
data (no kernel imports: :mod:`maxsim.selection.compressed` checks calls against these)."""

from __future__ import annotations

import torch

from maxsim._capability import KernelSpec

# The decode dtypes (the tiles the kernel decodes into and scores in). Never bf16: its decode
# error is several times larger, close to 1e-3 of a score.
DECODE_DTYPES = (torch.float16, torch.float32)

# The stream kernel decodes whole tokens on chip (a [BN, next_pow2(d)] tile: the L2 norm needs every
# dimension at once), so d is bounded by the registers that tile takes.
MAX_FUSED_D = 1024

FUSED_FORWARD = KernelSpec(
    "compressed.stream_forward",
    "Triton: the packed stream kernel on residual tokens: each tile's codes and residual bytes read, "
    "unpacked in registers, centroids gathered (L2), decoded, optionally L2-normalised and scored on "
    "chip; no decoded corpus in memory",
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
