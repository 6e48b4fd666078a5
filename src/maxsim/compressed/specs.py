"""What each path of ``maxsim.compressed.maxsim_residual`` / ``maxsim_residual_varlen`` supports, declared as
data (no kernel imports: :mod:`maxsim.selection.compressed` checks calls against these)."""

from __future__ import annotations

import dataclasses

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

# The look-up scorer (:mod:`maxsim.compressed.residual_lut`): a query quantised to int8 a row, the
# codes expanded in registers, int8 tensor-core products. It reads the corpus's look-up layout
# (built once per corpus, :func:`maxsim.compressed.residual_lut.build_layout`), so it serves
# searches of a stored corpus, not one-off calls on raw codes.
LOOKUP_DIM = 128
LOOKUP_NBITS = (2, 4)
LOOKUP_GLUON = KernelSpec(
    "compressed.lookup_gluon",
    "Gluon (Hopper): the look-up scorer with explicit layouts: code words loaded into the wgmma's register "
    "operand and expanded there by byte permutes (int8 bucket weights), the query quantised per row in "
    "shared memory, the centroid term a row of the per-query Q @ C^T table, each token's stored norm",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    dims=(LOOKUP_DIM,),
    layouts=("packed",),
    argmax=False,
    families=("sm90",),
    triton=((3, 6),),
)
LOOKUP_TRITON = KernelSpec(
    "compressed.lookup_triton",
    "Triton: the look-up scorer (query quantised per row, codes expanded by byte permutes, int8 "
    "tensor-core products, the centroid term from the per-query Q @ C^T table, stored norms)",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    dims=(LOOKUP_DIM,),
    layouts=("packed",),
    argmax=False,
)

# The PQ look-up scorer (:mod:`maxsim.compressed.pq_lut`): 4 dimensions a code, d 128 (m 32); the
# codebooks int8 with one scale a sub-space, the query quantised per row. It reads the corpus's
# padded layout (:func:`maxsim.compressed.pq_lut.build_layout`), so it serves searches of a stored
# corpus.
PQ_LOOKUP_GLUON = KernelSpec(
    "compressed.pq_lookup_gluon",
    "Gluon (Hopper): the PQ look-up scorer with the int8 codebooks in shared memory, each code's 4 "
    "coordinates gathered as one word straight into the wgmma's register operand, the query quantised "
    "per row in shared memory",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    dims=(128,),
    layouts=("packed",),
    argmax=False,
    families=("sm90",),
    triton=((3, 6),),
)
# The same Gluon kernel with each token's own words in the register operand: the same reach.
ONEBYTE_GLUON = dataclasses.replace(
    PQ_LOOKUP_GLUON, name="compressed.onebyte_gluon",
    summary="Gluon (Hopper): one-byte tokens (int8 / e4m3) scored on the 8-bit tensor cores, each token's "
            "bytes loaded straight into the wgmma's register operand, the query quantised per row the same way")
PQ_LOOKUP = KernelSpec(
    "compressed.pq_lookup",
    "Triton: the PQ look-up scorer (each code's 4 int8 coordinates gathered as one 32-bit word of the "
    "quantised codebooks, split in registers, int8 tensor-core products against the query quantised "
    "per row)",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    dims=(128,),
    layouts=("packed",),
    argmax=False,
)
