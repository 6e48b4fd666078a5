"""What the top-k search kernels support, declared as data (no kernel imports: the selection
layer, :mod:`maxsim.selection.search`, checks calls against these declarations).

``maxsim.topk`` has two paths. The fused kernel (:mod:`maxsim.search.fused_topk`) folds the top-k
into the dense forward's epilogue; the chunked path (:mod:`maxsim.search.topk`) scores a chunk of
documents with the public ``maxsim.maxsim`` / ``maxsim_varlen`` into an ``[Nq, chunk]`` buffer and
merges a running top-k. The chunked path runs every valid call (any backend, layout, mask rule,
``subset=``): it is the CPU backend, the tests' oracle and the fallback.
"""

from __future__ import annotations

from maxsim._capability import KernelSpec

FUSED_TOPK = KernelSpec(
    "search.fused_topk",
    "the dense Triton forward with a top-k epilogue: each program keeps its best k (score, document) "
    "keys per query in registers, one torch.topk merges the programs' candidates (no [Nq, Nd] scores)",
    layouts=("cross",), argmax=False,
)
CHUNKED_TOPK = KernelSpec(
    "search.chunked_topk",
    "a chunk of documents scored by maxsim.maxsim (or maxsim_varlen) into an [Nq, chunk] buffer, "
    "merged into a running top-k by an exact (score, index) key",
    layouts=("cross", "candidates", "packed"), argmax=False,
)
