"""What each dense (padded) kernel supports. The selection layer (:mod:`maxsim.selection.dense`)
checks every call against these declarations; nothing here imports a kernel, so the Gluon
kernel's declaration stands even where Gluon cannot be imported."""

from __future__ import annotations

import torch

from maxsim._capability import SIXTEEN_BIT, KernelSpec


def tma_rows_ready(D: torch.Tensor) -> bool:
    """Whether ``D [Nd, Ld, d]`` can be read as TMA rows ``[Nd * Ld, d]`` in place: 16-bit elements,
    a unit stride on d, the tokens of all documents one strided run (stride_dn == Ld * stride_dl),
    16-byte aligned rows and row coordinates that fit int32."""
    Nd, Ld, d = D.shape
    return (D.element_size() == 2 and D.stride(2) == 1 and (Nd == 1 or D.stride(0) == Ld * D.stride(1))
            and D.stride(1) % 8 == 0 and D.data_ptr() % 16 == 0 and Nd * Ld + 256 < 2**31)


def _ws_layout(Q: torch.Tensor, D: torch.Tensor) -> str | None:
    """D [1, Nd, Ld, d] must be TMA rows in place (the kernel would copy D otherwise)."""
    if not tma_rows_ready(D[0]):
        return "needs the documents' tokens as one 16-byte-aligned strided run of rows (it would copy D)"
    return None


TRITON_FORWARD = KernelSpec(
    "dense.triton_forward",
    "Triton: a block of stacked query rows against streamed document tiles, max and sum fused",
)
WARP_SPECIALIZED_FORWARD = KernelSpec(
    "dense.warp_specialized_forward",
    "Gluon: a TMA producer warp and two consumer warpgroups taking turns on the tensor cores",
    dtypes=SIXTEEN_BIT, dims=(64, 128), layouts=("cross",), normalize=False, families=("sm90",),
    triton=((3, 6),), layout_check=_ws_layout,
)
UNIFIED_BACKWARD = KernelSpec(
    "dense.unified_backward",
    "grad_Q by a gather at the argmax; grad_D added by fp32 atomics into a buffer of D's size",
)
LOWMEM_OWNED_BACKWARD = KernelSpec(
    "dense.lowmem_owned_backward",
    "grad_D destination-owned: the argmax inverted by a counting sort, each token sums its own rows",
    layouts=("cross",),
)
LOWMEM_LISTS_BACKWARD = KernelSpec(
    "dense.lowmem_lists_backward",
    "grad_D of candidate lists as a one-hot matmul per document tile (no inverse map, no atomics)",
    layouts=("candidates",),
)
