"""What each path of ``maxsim.maxsim_from_hidden`` supports, declared as data (no kernel imports:
:mod:`maxsim.selection.head` checks calls against these declarations)."""

from __future__ import annotations

from dataclasses import dataclass

from maxsim._capability import KernelSpec

# The fused kernel keeps one projected document tile [BN, d] (fp32) on chip: d up to this many
# dims (padded to a power of two); wider heads project once, then score.
MAX_FUSED_D = 256

FUSED_FORWARD = KernelSpec(
    "head.fused_forward",
    "Triton: each hidden-state tile projected (H @ W^T + b), L2-normalised and scored on chip; "
    "the projected documents never reach memory",
    layouts=("cross", "candidates"),
)
PROJECT_THEN_SCORE = KernelSpec(
    "head.project_then_score",
    "F.linear + F.normalize once over all documents (D [Nd, Ld, d] in memory), then maxsim.maxsim",
    layouts=("cross", "candidates"),
)
WINNERS_BACKWARD = KernelSpec(
    "head.winners_backward",
    "PyTorch: the winning H rows gathered and projected again, the normalisation's Jacobian there, "
    "grad_H written at those rows only (buffers the size of the winners)",
    layouts=("cross", "candidates"),
)
UNFUSED_BACKWARD = KernelSpec(
    "head.unfused_backward",
    "autograd through F.linear and F.normalize around maxsim.maxsim's own backward",
    layouts=("cross", "candidates"),
)


@dataclass(frozen=True)
class HeadConfig:
    """Tile of the fused forward: BM query rows a program, BN document tokens a tile, BKM dims of
    d_model a step of the projection's K-loop, warps, pipeline stages, waves (programs per SM)."""

    BM: int
    BN: int
    BKM: int
    num_warps: int
    num_stages: int
    waves: int = 2
