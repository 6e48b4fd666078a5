"""Tile tables and cost thresholds, per GPU family: the data the selection layer reads.

Each rule names the benchmark record it came from (``record``: a raw file under
``benchmarks/results/``, whose numbers and story are in BENCHMARKS.md and benchmarks/HISTORY.md).
Hopper (``sm90``) was measured on the H200 and the H100 (the records name each). Other GPUs
(``unmeasured``, said once by an ``UntunedGPUWarning``) take the sm90 choice clamped to what every
CUDA GPU from sm80 on holds (:data:`UNMEASURED_CLAMP`): no TMA, at most 128 x 64 tiles, 2 pipeline
stages. The interpreter (CI) runs one program at a time: small tiles,
no pipelining (:data:`INTERPRETER_CLAMP`).
"""

from __future__ import annotations

from maxsim.tuning.rules import INF, Rule, When

# --- cost thresholds -------------------------------------------------------------------------

# A call with at least this many document tokens (all query groups together) is a big corpus: long
# enough for the tiles that stream fastest (TMA, one program per SM) to repay their start-up.
BIG_CORPUS_TOKENS = 2**17
# One query of up to 128 tokens runs the warp-specialized kernel only from this many document
# tokens: below, its two consumers have too little to split (results/onequery-20261129-2125.log).
WS_ONE_BLOCK_MIN_TOKENS = 2**18
# backward="auto": candidate lists up to this query length go to lowmem's one-hot kernel
# (results/lists-threshold-20261130-0136.log).
LISTS_MAX_LQ = 512
# Widest row the one-hot lists kernel holds whole: [BN, BD] and [BS, BD] tiles within shared memory
# (tests/compile_check.py: BD 4096 needs 513 KB). Wider rows go in column chunks of this width.
LISTS_MAX_BD = 1024
# Gathered query elements (BE x BD) of one pass of the owned grad_D kernel: at d 4096, BE 16 on one
# warp spilled 21 KB a thread (tests/compile_check.py); above this, BE shrinks and warps grow.
OWNED_MAX_ELEMENTS = 8192
# backward="auto": the largest fp32 grad buffer unified may allocate before lowmem is taken.
UNIFIED_MAX_FP32_BYTES = 2 * 2**30
# lowmem's inverse-map scratch per chunk of documents: a fraction of what the step holds anyway
# (gradients and argmax), between a floor (few launches) and a cap.
LOWMEM_SCRATCH_FRACTION = 0.06
LOWMEM_MIN_CHUNK_BYTES = 2 * 2**20
LOWMEM_MAX_CHUNK_BYTES = 64 * 2**20

# fp32 inputs on the tensor cores: the GPU families where the split (tf32x3) was measured to beat
# IEEE FMAs within the accuracy bound; there precision="auto" takes it, elsewhere IEEE FMAs. An
# explicit precision word runs everywhere. None yet (the split is untuned).
SPLIT_FP32_FAMILIES: tuple[str, ...] = ()
# fp32 inputs through the 16-bit kernels on an fp16 split copy (maxsim._split, "fp16x3"): the
# families where precision="auto" takes it, for calls where at least SPLIT16_MIN_ROWS query rows
# share each document token (the product, not the read, sets the time; the copy costs 6 bytes a
# value). The documents are split in groups of at most SPLIT16_CHUNK_BYTES of copy.
SPLIT16_FAMILIES: tuple[str, ...] = ("sm90",)
SPLIT16_MIN_ROWS = 64
# ... and at least this many products (query rows x document values): below it the copy's four
# extra launches cost more host time than its faster product saves. A forward that feeds a
# backward (a training step's scorer) keeps the split on chip up to SPLIT16_MIN_PRODUCTS_TRAINING:
# there the copy and its d x 3 argmax forward cost more than the split (64 x 64 in-batch steps,
# Ld 512-1030: results/fp32-train-split-20261204-2117.log).
SPLIT16_MIN_PRODUCTS = 1 << 33
SPLIT16_MIN_PRODUCTS_TRAINING = 1 << 36
# The copy's scratch stays within max(SPLIT16_CHUNK_BYTES, SPLIT16_SCRATCH_FRACTION x the fp32
# documents' bytes) (issue 56: at most 256 MB or 5 % of the inputs): padded documents are split in
# groups of that many bytes of copy; packed documents are split whole, so auto copies no more.
SPLIT16_CHUNK_BYTES = 256 << 20
SPLIT16_SCRATCH_FRACTION = 0.05


def split16_scratch_bytes(document_bytes: int) -> int:
    """The most bytes of fp16 split copy a call of fp32 documents of ``document_bytes`` may hold."""
    return max(SPLIT16_CHUNK_BYTES, int(SPLIT16_SCRATCH_FRACTION * document_bytes))

# --- dense forward, warp-specialized (Gluon) kernel ------------------------------------------
# tile: BM (query rows a program), BN (document tokens a tile), num_stages (its ring of tiles).

DENSE_FORWARD_WS_SM90 = (
    Rule("many query rows, big corpus", When(rows=(256, INF), big_corpus=True, d=(128, 128)),
         dict(BM=256, BN=128, num_stages=4), record="results/sweep-20261129-2224.log"),
    Rule("one 128-token query block, split documents", When(rows=(128, 128), seg=(128, 128), long_corpus=True,
                                                           d=(128, 128), argmax=False),
         dict(BM=128, BN=64, num_stages=6), record="results/onequery-20261129-2125.log"),
)

# --- dense forward, Triton kernel --------------------------------------------------------------
# tile: BM, BN, BK (dims a dot; d > BK loops), num_warps, num_stages, waves (programs per SM),
# row_max (reduce each tile to a row max at once), tma (document tiles through TMA).

_T = dict  # (readability)
DENSE_FORWARD_SM90 = (
    Rule("fp32 split on chip into fp16 terms, d 128, >= 128 rows a document token (in-batch training forwards)",
         When(dtype="fp32-fp16x3", rows=(128, INF), d=(128, 128)),
         _T(BM=128, BN=64, BK=128, num_warps=8, num_stages=3, row_max=True, tma=True),
         record="results/fp32-train-onchip-tiles-20261204-2130.log"),
    Rule("fp32 split on chip into fp16 terms (few rows a document token: bandwidth)", When(dtype="fp32-fp16x3"),
         _T(BM="rows<=64", BN=64, BK="d<=128", num_warps=4, num_stages=3, waves=4, row_max=True, tma=True),
         record="results/fp32-tma-sweep-20261204-1630.log"),
    Rule("fp32, one TF32 product, few rows a document token (bandwidth)",
         When(dtype="fp32", precision="tf32", rows=(1, 32), d=(1, 128)),
         _T(BM="rows<=32", BN=32, BK="d<=128", num_warps=2, num_stages=3, waves=8, row_max=True, tma=True),
         record="results/fp32-tma-sweep-20261204-1630.log"),
    Rule("fp32, one TF32 product, 33-64 rows a document token (bandwidth)",
         When(dtype="fp32", precision="tf32", rows=(33, 64), d=(1, 128)),
         _T(BM="rows<=64", BN=32, BK="d<=128", num_warps=4, num_stages=3, waves=8, row_max=True, tma=True),
         record="results/fp32-tma-sweep-20261204-1630.log"),
    Rule("fp32 (IEEE dots on the FMA units)", When(dtype="fp32"),
         _T(BM="rows<=128", BN=32, BK="d<=64", num_warps=4, num_stages=2)),
    Rule("d > 128, >= 128 rows, argmax", When(d=(129, INF), rows=(128, INF), argmax=True),
         _T(BM=128, BN=64, BK=64, num_warps=8, num_stages=3, row_max=True, tma=True),
         record="results/ws-train-20261129-1904.log"),
    Rule("d 129-192 (d 64's fp16 split copy), >= 256 rows: 256-row blocks", When(d=(129, 192), rows=(256, INF)),
         _T(BM=256, BN=128, BK=64, num_warps=8, num_stages=3, row_max=True, tma=True),
         record="results/fp32-split-d64-tiles-20261204-2117.log"),
    Rule("d > 128, >= 128 rows", When(d=(129, INF), rows=(128, INF)),
         _T(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, row_max=True, tma=True),
         record="results/tune-stages-20261129-1510.log"),
    Rule("d > 128, <= 32 rows, argmax", When(d=(129, INF), rows=(1, 32), argmax=True),
         _T(BM="rows", BN=64, BK=128, num_warps=4, num_stages=3, waves=8, row_max=True),
         record="results/ws-train-20261129-1904.log"),
    Rule("d > 128, argmax", When(d=(129, INF), argmax=True),
         _T(BM="rows", BN=64, BK=64, num_warps=4, num_stages=3, waves=8, row_max=True),
         record="results/ws-train-20261129-1904.log"),
    Rule("d 257-383 (ColQwen's 320), <= 32 rows: whole 64-wide chunks, through TMA",
         When(d=(257, 383), rows=(1, 32)),
         _T(BM="rows", BN=128, BK=64, num_warps=4, num_stages=4, waves=8, row_max=True, tma=True),
         record="results/widths-sweep-20261204-1924.log"),
    Rule("d > 128, <= 32 rows (one short query)", When(d=(129, INF), rows=(1, 32)),
         _T(BM="rows", BN=128, BK=128, num_warps=4, num_stages=3, waves=8, row_max=True),
         record="results/tune-stages-20261129-1510.log"),
    Rule("d > 128", When(d=(129, INF)),
         _T(BM="rows", BN=128, BK=64, num_warps=4, num_stages=3, waves=8, row_max=True),
         record="results/tune-stages-20261129-1510.log"),
    Rule("training forward, long queries stacked", When(rows=(256, INF), seg=(128, INF), argmax=True),
         _T(BM=64, BN=128, BK="d", num_warps=4, num_stages=3, waves=1, row_max=True, tma=True),
         record="results/ws-train-20261129-1904.log"),
    Rule("training forward, short queries stacked", When(rows=(256, INF), argmax=True),
         _T(BM=256, BN=64, BK="d", num_warps=8, num_stages=3, waves=8, row_max=True),
         record="results/ws-train-20261129-1904.log"),
    Rule("ColPali-long queries (>= 512 tokens)", When(rows=(256, INF), seg=(512, INF)),
         _T(BM=256, BN=64, BK="d", num_warps=8, num_stages=3, row_max=True, tma=True),
         record="results/tune-tma-20261129-1516.log"),
    Rule("long queries stacked (>= 128 tokens)", When(rows=(256, INF), seg=(128, INF)),
         _T(BM=128, BN=128, BK="d", num_warps=4, num_stages=2, row_max=True, tma=True),
         record="results/tune-tma-20261129-1516.log"),
    Rule("short queries stacked, d 65-128, big corpus", When(rows=(256, INF), d=(65, 128), big_corpus=True,
                                                            argmax=False),
         _T(BM=256, BN=128, BK="d", num_warps=8, num_stages=3, waves=1, row_max=True, tma=True),
         record="results/probe-20261129-1608.log"),
    Rule("short queries stacked, d 65-128", When(rows=(256, INF), d=(65, 128)),
         _T(BM=256, BN=64, BK="d", num_warps=8, num_stages=2, row_max=True),
         record="results/probe-20261129-1608.log"),
    Rule("short queries stacked, d <= 64", When(rows=(256, INF)),
         _T(BM=256, BN=64, BK="d", num_warps=8, num_stages=3, waves=8, row_max=True),
         record="results/probe-20261129-1608.log"),
    Rule("one block of 128-255 rows", When(rows=(128, 255)),
         _T(BM=128, BN=64, BK="d", num_warps=8, num_stages=3),
         record="results/sweep-20261129-2224.log"),
    Rule("few rows, d <= 64, big corpus", When(d=(1, 64), big_corpus=True, argmax=False),
         _T(BM="rows", BN=128, BK="d", num_warps=4, num_stages=4, tma=True),
         record="results/sweep-20261129-2224.log"),
    Rule("training forward on candidate lists", When(argmax=True, candidates=True),
         _T(BM="rows", BN=64, BK="d", num_warps=4, num_stages=3, waves=4),
         record="results/lists-20261130-0047.log"),
    Rule("few rows, masked documents, d <= 64 (a short walk a document: lean programs, many resident)",
         When(masked=True, rows=(1, 64), d=(1, 64)),
         _T(BM="rows", BN=128, BK="d", num_warps=4, num_stages=3, waves=4, row_max=True, tma=True),
         record="results/rerank-tiles-20261203-1905.csv"),
    Rule("few rows, masked documents (a short walk a document: lean programs, many resident)",
         When(masked=True, rows=(1, 64)),
         _T(BM="rows", BN=32, BK="d", num_warps=2, num_stages=3, waves=8, row_max=True, tma=True),
         record="results/rerank-tiles-20261203-1905.csv"),
    Rule("few rows, d 65-127 (TMA fills the power-of-two box's extra columns with zeros)", When(d=(65, 127)),
         _T(BM="rows", BN=128, BK="d", num_warps=4, num_stages=3, tma=True),
         record="results/widths-sweep-20261204-1924.log"),
    Rule("few rows (bandwidth-bound)", When(),
         _T(BM="rows", BN=128, BK="d", num_warps=4, num_stages=3),
         record="results/sweep-20261129-2224.log"),
)

# --- dense backward ----------------------------------------------------------------------------

# The gather kernel (grad_Q; with scatter, grad_D's atomics too): BS query tokens a program, warps,
# rotate (stagger each program's first document), KB documents a step.
DENSE_GATHER_SM90 = (
    Rule("candidate lists, atomics", When(candidates=True, scatter=True),
         _T(BS=32, num_warps=4, rotate=1, KB=1), record="results/lists-20261130-0038.log"),
    Rule("candidate lists, lowmem", When(candidates=True),
         _T(BS=2, num_warps=2, rotate=1, KB=16), record="results/lists-20261130-0047.log"),
    Rule("cross product, Lq >= 1024", When(lq=(1024, INF)),
         _T(BS=16, num_warps=2, rotate=0, KB=1), record="results/cross-gather-scatter-20261130-0152.log"),
    Rule("cross product, atomics, Lq >= 128", When(scatter=True, lq=(128, INF)),
         _T(BS=4, num_warps=4, rotate=0, KB=1), record="results/bwd-gather-20261129-2020.log"),
    Rule("cross product, atomics", When(scatter=True),
         _T(BS=16, num_warps=4, rotate=1, KB=1), record="results/bwd-gather-20261129-2020.log"),
    Rule("cross product, lowmem, Lq >= 128", When(lq=(128, INF)),
         _T(BS=16, num_warps=2, rotate=0, KB=2), record="results/cross-gather-20261130-0152.log"),
    Rule("cross product, lowmem", When(),
         _T(BS=4, num_warps=2, rotate=1, KB=2), record="results/cross-gather-20261130-0152.log"),
)

# lowmem's owned kernel (cross product): BE entries summed at once by a program a document token.
DENSE_OWNED_SM90 = (
    Rule("<= 16 entries a row", When(per_row=(0, 16)), _T(BE=16, num_warps=1),
         record="results/lowmem-20261130-0139.log"),
    Rule("<= 64 entries a row", When(per_row=(0, 64)), _T(BE=32, num_warps=1),
         record="results/lowmem-20261130-0139.log"),
    Rule("more entries a row", When(), _T(BE=64, num_warps=2), record="results/lowmem-colpali-20261130-0145.log"),
)

# lowmem's one-hot kernel (candidate lists) and the small helper kernels: fixed starting points,
# bounded by registers (BN * BD <= 8192 elements a tile).
DENSE_LISTS = (Rule("one-hot tiles", When(), _T(BN_ELEMENTS=8192, BS_MIN=16, BS_MAX=64)),)
DENSE_INVERT = (Rule("counting sort", When(), _T(BLOCK=1024, num_warps=4)),)
DENSE_JACOBIAN = (Rule("normalize's Jacobian", When(), _T(ELEMENTS=4096, num_warps=4)),)

# --- packed (varlen) ---------------------------------------------------------------------------
# Starting points taken from the dense kernel's sweeps; not yet swept for the packed kernels.

VARLEN_FORWARD_SM90 = (
    Rule("fp32", When(dtype="fp32"), _T(BM="rows<=128", BN=32, BK="d<=64", num_warps=4, num_stages=3)),
    Rule("d > 128", When(d=(129, INF)), _T(BM="rows<=128", BN=64, BK=64, num_warps=4, num_stages=3)),
    Rule("many rows", When(rows=(256, INF)), _T(BM=256, BN=64, BK="d", num_warps=8, num_stages=3)),
    Rule("<= 64 rows", When(rows=(1, 64)), _T(BM="rows", BN=128, BK="d", num_warps=4, num_stages=3)),
    Rule("65-255 rows", When(), _T(BM="rows", BN=64, BK="d", num_warps=8, num_stages=3)),
)
# The token-stream forward (varlen/stream.py, inference): BN tokens a tile shared by whatever
# documents they belong to; waves = programs per multiprocessor (documents vary in length, so
# many small runs balance the tail). Few warps: each document's max and sum reduce across the
# warps that hold the query rows, once per document.
_STREAM_RECORD = "BENCHMARKS.md, Exhaustive scoring of short packed documents (benchmarks/stream_bench.py, 2026-12-01)"
# The stream kernel keeps its query block (BM rows x d) in shared memory: wider rows take fewer
# stacked rows a program (tests/compile_check.py compiles the tile this table gives at every width
# up to the stream spec's max_dims; past those the per-document kernel runs).
VARLEN_STREAM_SM90 = (
    Rule("fp32, d > 256", When(dtype="fp32", d=(257, INF)),
         _T(BM="rows<=32", BN=32, BK="d<=64", num_warps=4, num_stages=2, waves=8)),
    Rule("fp32, d > 128", When(dtype="fp32", d=(129, INF)),
         _T(BM="rows<=64", BN=32, BK="d<=64", num_warps=4, num_stages=2, waves=8)),
    Rule("fp32", When(dtype="fp32"), _T(BM="rows<=128", BN=32, BK="d<=64", num_warps=4, num_stages=2, waves=8)),
    Rule("d > 512", When(d=(513, INF)), _T(BM="rows<=32", BN=64, BK=64, num_warps=4, num_stages=2, waves=8)),
    Rule("d > 384", When(d=(385, INF)), _T(BM="rows<=64", BN=64, BK=64, num_warps=4, num_stages=2, waves=8)),
    Rule("d > 128", When(d=(129, INF)), _T(BM="rows<=128", BN=64, BK=64, num_warps=4, num_stages=2, waves=8)),
    Rule("one query (<= 32 rows)", When(rows=(1, 32)),
         _T(BM="rows", BN=64, BK="d", num_warps=1, num_stages=2, waves=8), _STREAM_RECORD),
    Rule("33-64 rows", When(rows=(33, 64)), _T(BM="rows", BN=64, BK="d", num_warps=2, num_stages=2, waves=8)),
    Rule("stacked queries", When(), _T(BM="rows<=128", BN=64, BK="d", num_warps=4, num_stages=2, waves=8),
         _STREAM_RECORD),
)
# One-byte corpora (int8, fp8 e4m3): the GPU families where quantising the query too, so that the
# tensor cores multiply the bytes (int8 x int8 -> int32; e4m3 x e4m3), was measured to beat
# widening the tokens to the query's dtype. quantize_query=None takes it there. Ranking cost,
# measured on MiniLM tokens (BENCHMARKS.md, ranking fidelity): none at top-10.
ONE_BYTE_DOT_FAMILIES: tuple[str, ...] = ("sm90",)
VARLEN_ATOMIC_BACKWARD = (Rule("atomics", When(), _T(BR_MAX=16, ELEMENTS=4096, PAIRS_MAX=64, num_warps=4)),)
VARLEN_OWNED_BACKWARD = (Rule("d <= 128", When(d=(1, 128)), _T(num_warps=1)), Rule("wider", When(), _T(num_warps=4)))

# --- fused document head (maxsim_from_hidden) ----------------------------------------------

# BM: query rows a program; BN: document tokens a tile (its projection [BN, d] stays on chip, fp32);
# BKM: d_model dims a step of the projection's K-loop. BN is wide so that each read of W (from L2)
# serves many tokens.

_T = dict
HEAD_FORWARD_SM90 = (
    # fp32: IEEE dots on the FMA units; at 32 x 32 tiles the fp32 operands still spill a little
    # (tests/compile_check.py), bigger blocks spill more.
    Rule("fp32 (IEEE dots on the FMA units)", When(dtype="fp32"),
         _T(BM=32, BN=32, BKM=16, num_warps=8, num_stages=2)),
    Rule("stacked query rows", When(rows=(128, INF)), _T(BM=128, BN=64, BKM=64, num_warps=8, num_stages=2)),
    Rule("few query rows", When(), _T(BM="rows", BN=128, BKM=64, num_warps=8, num_stages=2)),
)

# --- fused or project once -----------------------------------------------------------------------
# The fused kernel projects every document tile once per query row block that reads it (2 d_model d
# flops a token each time); projecting once instead writes D [Nd, Ld, d] and reads it back two
# or three times (F.normalize, maxsim), and holds it. On Hopper one projection of a token at
# d_model 768, d 128 costs about what that memory traffic does, so fusion starts out allowed up
# to two row blocks. A starting point, to be measured.

HEAD_FUSION_SM90 = (
    Rule("one or two query row blocks read each document tile", When(row_blocks=(1, 2)), _T(fuse=True)),
    Rule("many query row blocks would each project every document tile", When(), _T(fuse=False)),
)

# --- Chamfer distance ---------------------------------------------------------------------------

# norm 2 up to this many coordinates runs the direct-difference kernel (2 D flops a pair, exact
# in fp32); wider points run the tl.dot kernel (tensor cores for 16-bit inputs).
CHAMFER_DIRECT_MAX_D = 16

_T = dict  # (readability)

# The direct kernel: BM points of the source cloud a program against BN-point tiles of the other;
# the running min and its tile index are [BM, BN] (elementwise: three instructions a pair).
CHAMFER_DIRECT_SM90 = (
    Rule("few coordinates (3-D points)", When(d=(1, 8)), _T(BM=64, BN=64, num_warps=8, num_stages=2)),
    Rule("wider points", When(), _T(BM=64, BN=32, num_warps=4, num_stages=2)),
)

# The dot kernel: BK coordinates a dot ("d<=64": the next power of two, 16 to 64; wider loops).
CHAMFER_DOT_SM90 = (
    Rule("fp32 (IEEE dots on the FMA units)", When(dtype="fp32"),
         _T(BM=64, BN=32, BK="d<=64", num_warps=4, num_stages=2)),
    Rule("16-bit (tensor cores)", When(), _T(BM=128, BN=64, BK="d<=64", num_warps=8, num_stages=3)),
)

# The backward kernels: BR points a program (a [BR, BD] block of coordinates).
CHAMFER_BACKWARD = (
    Rule("points", When(), _T(BR=64, num_warps=4)),
)

# Other GPUs than Hopper: the sm90 choice clamped; the interpreter: small tiles, so that the CPU
# tests cross tile edges with small clouds.
CHAMFER_UNMEASURED_CLAMP = dict(BM_MAX=64, BN_MAX=64, STAGES_MAX=2)
CHAMFER_INTERPRETER_CLAMP = dict(BM_MAX=16, BN_MAX=16, BR_MAX=16, num_warps=4, num_stages=1)

# --- residual decode on chip (maxsim_residual_varlen) -------------------------------------------

# The packed stream kernel on residual tokens, decoded plane by plane (maxsim/compressed/forward.py):
# each plane [BN, d * nbits / 8] stays in registers beside the query's planes, and
# BN * next_pow2(d) <= COMPRESSED_TILE_ELEMENTS. One query: the sweep's best tile (BENCHMARKS.md,
# PLAID residual scoring); stacked queries and fp32 decode: starting points without spills in
# tests/compile_check.py, not yet swept.
_RESIDUAL_RECORD = "BENCHMARKS.md, PLAID residual scoring (benchmarks/compressed_bench.py --sweep, 2026-12-02)"
COMPRESSED_STREAM_SM90 = (
    Rule("fp32 decode (IEEE dots on the FMA units)", When(dtype="fp32"),
         _T(BM="rows<=128", BN=16, BK="d", num_warps=4, num_stages=2, waves=8)),
    Rule("one query (<= 32 rows)", When(rows=(1, 32)),
         _T(BM="rows<=128", BN=32, BK="d", num_warps=1, num_stages=2, waves=8), _RESIDUAL_RECORD),
    Rule("16-bit decode", When(), _T(BM="rows<=128", BN=64, BK="d", num_warps=4, num_stages=2, waves=8)),
)
COMPRESSED_TILE_ELEMENTS = 8192

# The look-up residual scorer (maxsim.compressed.residual_lut / residual_gluon). rows: the batch's
# stacked query rows (queries x 32). qpb: queries a program (the MMA's N = 32 qpb); BT: tokens a
# tile; waves: programs an SM. Gluon for queries of up to 32 tokens on Hopper, Triton otherwise.
_LOOKUP_RECORD = "BENCHMARKS.md, PLAID residual codes on the int8 tensor cores (benchmarks/residual_probe.py, 2026-12-06)"
LOOKUP_GLUON_SM90 = (
    Rule("one query (128 registers: 4 programs an SM)", When(rows=(1, 32)), _T(qpb=1, BT=64, waves=8, maxnreg=128),
         _LOOKUP_RECORD),
    Rule("two or three queries", When(rows=(33, 96)), _T(qpb=2, BT=64, waves=8), _LOOKUP_RECORD),
    Rule("four queries or more (N 128; row pairs reduced before the tile's maxima)", When(),
         _T(qpb=4, BT=64, waves=8, pairs=True), _LOOKUP_RECORD),
)
LOOKUP_TRITON_SM90 = (
    Rule("one query", When(rows=(1, 32)), _T(qpb=1, BT=128, num_warps=4, num_stages=3, waves=8), _LOOKUP_RECORD),
    Rule("several queries", When(), _T(qpb=2, BT=128, num_warps=4, num_stages=3, waves=8), _LOOKUP_RECORD),
)

# The PQ look-up scorer (maxsim.compressed.pq_lut), same knobs as the residual's Triton scorer.
_PQ_LOOKUP_RECORD = "BENCHMARKS.md, PQ codes on the int8 tensor cores (benchmarks/pq_probe.py, 2026-12-06)"
PQ_LOOKUP_GLUON_SM90 = (
    Rule("one query (row pairs reduced before the tile's maxima; 128 registers: 4 programs an SM, 3 rounds)",
         When(rows=(1, 32)), _T(qpb=1, BT=128, waves=12, maxnreg=128, pairs=True), _PQ_LOOKUP_RECORD),
    Rule("two queries", When(rows=(33, 64)), _T(qpb=2, BT=128, waves=8, pairs=True), _PQ_LOOKUP_RECORD),
    Rule("three queries or more (N 128; 168 registers: 3 programs an SM)", When(),
         _T(qpb=4, BT=64, waves=8, maxnreg=168, pairs=True), _PQ_LOOKUP_RECORD),
)
# The one-byte Gluon scorer: the PQ kernel with the token's own words in the A fragment.
_ONEBYTE_RECORD = "BENCHMARKS.md, One-byte tokens through the same Gluon kernel (benchmarks/pq_probe.py, 2026-12-06)"
ONEBYTE_GLUON_SM90 = (
    Rule("one query (row pairs, 168 registers: 3 programs an SM; 9 a SM, whole rounds)", When(rows=(1, 32)),
         _T(qpb=1, BT=128, waves=9, maxnreg=168, pairs=True), _ONEBYTE_RECORD),
    Rule("two queries (not measured: as PQ's)", When(rows=(33, 64)), _T(qpb=2, BT=128, waves=8, pairs=True),
         "not tuned"),
    Rule("three queries or more (4 a program, 168 registers)", When(),
         _T(qpb=4, BT=64, waves=8, maxnreg=168, pairs=True), _ONEBYTE_RECORD),
)
PQ_LOOKUP_SM90 = (
    Rule("one query", When(rows=(1, 32)), _T(qpb=1, BT=128, num_warps=4, num_stages=3, waves=8), _PQ_LOOKUP_RECORD),
    Rule("several queries", When(), _T(qpb=2, BT=128, num_warps=4, num_stages=3, waves=8), _PQ_LOOKUP_RECORD),
)

# --- families ----------------------------------------------------------------------------------

# Applied to the sm90 choice on GPUs nobody measured: what every CUDA GPU from sm80 on holds.
UNMEASURED_CLAMP = dict(BM_MAX=128, BN_MAX=64, STAGES_MAX=2, tma=False)
# The interpreter runs one program at a time: few, small programs, no pipelining.
INTERPRETER_CLAMP = dict(BM_MAX=64, BN_MAX=64, num_warps=4, num_stages=1, waves=1)
VARLEN_INTERPRETER_CLAMP = dict(BM_MAX=64, BN_MAX=32, num_warps=4, num_stages=1)
