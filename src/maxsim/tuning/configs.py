"""The configuration types the launchers take (plain data: the selection layer fills them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardConfig:
    """Tile shape and launch parameters of the dense forward kernels.

    BM: query rows per program (several queries stacked, or a chunk of a long query).
    BN: document tokens per tile.  BK: embedding dims per ``tl.dot`` (d > BK loops over d).
    waves: programs launched per multiprocessor; sets how many documents each program walks.
    row_max: reduce each tile to a per-row max at once instead of a running [BM, BN] max.
    tma: load document tiles through the tensor-memory accelerator (16-bit D whose tokens form
        one strided run of rows per query group; other inputs fall back to pointer loads).
    flat_walk: with a document mask (exclusion rule), walk every tile in one flat loop, padded
        rows predicated off, instead of each document only up to its last real token (read from
        its mask row first): no mask row -> extent -> tile chain, for calls of about a document a
        program, where that chain is the call's latency.
    For the warp-specialized kernel, BM is 256 (two consumers of 128 rows) or 128 (one block,
    split documents) and num_stages its ring of document tiles.
    """

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    waves: int = 2
    row_max: bool = False
    tma: bool = False
    flat_walk: bool = False
