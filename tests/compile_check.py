"""Compile every kernel variant maxsim launches for Hopper (sm_90) on a machine with no GPU.

Run it without TRITON_INTERPRET (the interpreter replaces the kernels with Python functions).

    python tests/compile_check.py          (tests/test_compile_sm90.py runs the same in CI)

Triton's front end and the ptxas it ships run on the CPU, so a compile error, a loop-carried
type change, or a tile that overflows shared memory or spills registers shows up here before any
device time is spent. Prints one row per variant: shared memory, registers and spills (ptxas -v),
and whether the tensor-core dot became wgmma. Exits non-zero if a variant fails to compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from maxsim.dense.backward import (
    _csr_count_kernel,
    _maxsim_bwd_gather_kernel,
    _maxsim_bwd_lists_kernel,
    _maxsim_bwd_owned_kernel,
    _normalize_jacobian_kernel,
)
from maxsim.dense.forward import MASK_ROW_LANES, _maxsim_fwd_kernel
from maxsim.dense.forward_ws import WS_MAXNREG, WS_SUB_TILES, _maxsim_fwd_ws_kernel
from maxsim.varlen.backward import _varlen_bwd_atomic_kernel, _varlen_bwd_owned_kernel
from maxsim.varlen.forward import _maxsim_pairs_kernel, _maxsim_varlen_cross_kernel
from maxsim.varlen.stream import _maxsim_varlen_stream_kernel
from maxsim.index.approx import _plaid_approx_kernel
from maxsim.compressed.residual_lut import _residual_lut_kernel, decoder_asm
from maxsim.compressed.residual_gluon import _residual_lut_gluon_kernel
from maxsim.compressed.pq_lut import _pq_lut_kernel
from maxsim.compressed.pq_gluon import _pq_lut_gluon_kernel
from maxsim.compressed.pq_encode import _pq_encode_kernel
from maxsim.chamfer.backward import _chamfer_bwd_atomic_kernel, _chamfer_bwd_owned_kernel
from maxsim.chamfer.forward import _chamfer_fwd_kernel
from maxsim.head.forward import _head_fwd_kernel

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_variant(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """Compile ``kernel`` with the given pointer element types and constexprs. Integers are i32,
    as Triton types them for values below 2**31 (it switches to i64 above)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            ty = pointers[name]  # an element type, or a whole TMA descriptor type
            signature[name] = ty if ty.startswith("tensordesc") else "*" + ty
        else:
            signature[name] = "i32"
    consts = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    # What Triton's launcher infers at run time for torch tensors and d = 128: 16-byte aligned
    # pointers, and strides (and dim) divisible by 16. Without it nothing is vectorised or pipelined.
    aligned = [name for name in kernel.arg_names
               if (name in pointers and not pointers[name].startswith("tensordesc")) or name == "dim"
               or (name.startswith("stride") and not name.startswith("stride_dm"))]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    src = source(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if kernel is _maxsim_fwd_ws_kernel:
        options["maxnreg"] = WS_MAXNREG  # as launched
    return triton.compile(src, target=TARGET, options=options)


def ptxas_report(ptx: str) -> str:
    """Registers and spill bytes of the kernel's PTX, from the bundled ptxas."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"regs {regs.group(1) if regs else '?':>3s}  spill {spills.group(1) if spills else '?':>4s} B"


def dense_forward_variants():
    base = dict(BM=256, BN=64, BK=128, NUM_K=1, SEG=32, HAS_QMASK=False, HAS_DMASK=False, MULTIPLY=False,
                NORMALIZE=False, SAVE_ARGMAX=False, EVEN_K=True, DOT_PRECISION="tf32", DOT_UPCAST=False,
                ROW_MAX=True, USE_TMA=False, FLOWING=False, QMASK_VALUES=False, DMASK_VALUES=False,
                MASK_LANES=0)
    ptrs = dict(q_ptr="fp16", d_ptr="fp16", d_desc="fp16", qmask_ptr="i1", dmask_ptr="i1", out_ptr="fp32",
                argmax_ptr="i32")

    def tma(consts, dt="fp16"):  # document tiles through a TMA descriptor [G, Nd*Ld, d], box [1, BN, BK]
        return dict(consts, USE_TMA=True), dict(ptrs, q_ptr=dt, d_ptr=dt, d_desc=f"tensordesc<{dt}[1,{consts['BN']},{consts['BK']}]>")

    yield "fwd short stacked (32q x 100K)", base, ptrs, 8, 3
    yield "fwd long query (ColPali)", dict(base, BN=128, SEG=256), ptrs, 8, 3
    yield "fwd 128 rows running max", dict(base, BM=128, SEG=128, ROW_MAX=False), ptrs, 8, 3
    yield "fwd one query (bandwidth)", dict(base, BM=32, BN=128, ROW_MAX=False), ptrs, 4, 3
    yield "fwd d=768", dict(base, BM=128, BN=128, BK=64, NUM_K=12, SEG=32), ptrs, 4, 3
    yield "fwd d=768 one query (BK=128)", dict(base, BM=32, BN=128, BK=128, NUM_K=6, SEG=32), ptrs, 4, 3
    yield "fwd masks+multiply+normalize", dict(base, HAS_QMASK=True, HAS_DMASK=True, MULTIPLY=True, NORMALIZE=True), ptrs, 8, 3
    # The padding-skipping walk (a document mask, exclusion): one-query reranks, in-batch training.
    yield "fwd padded rerank (walk to the last real token)", dict(base, BM=32, BN=128, ROW_MAX=False, HAS_QMASK=True,
                                                                  HAS_DMASK=True, MASK_LANES=MASK_ROW_LANES), ptrs, 4, 3
    yield "fwd padded in-batch argmax (int64 masks)", dict(base, BM=128, BN=64, SEG=32, SAVE_ARGMAX=True, HAS_QMASK=True,
                                                          HAS_DMASK=True, QMASK_VALUES=True, DMASK_VALUES=True,
                                                          MASK_LANES=MASK_ROW_LANES), \
        dict(ptrs, q_ptr="bf16", d_ptr="bf16", qmask_ptr="i64", dmask_ptr="i64"), 8, 3
    yield "fwd TMA padded ColPali", *tma(dict(base, BM=32, BN=128, HAS_DMASK=True, MASK_LANES=MASK_ROW_LANES)), 4, 3
    # flat_walk tiles: a small masked rerank's every tile, padded rows predicated off (no TMA)
    yield "fwd padded small rerank (flat walk)", dict(base, BM=32, BN=32, HAS_DMASK=True), ptrs, 2, 3
    yield "fwd argmax (training)", dict(base, SAVE_ARGMAX=True, HAS_DMASK=True), ptrs, 8, 3
    yield "fwd flowing argmax (PyLate's training: multiply)", dict(base, SAVE_ARGMAX=True, HAS_DMASK=True,
                                                                 MULTIPLY=True, FLOWING=True), ptrs, 8, 3
    yield "fwd number masks (int64 attention masks: PyLate's training)", dict(
        base, HAS_QMASK=True, HAS_DMASK=True, MULTIPLY=True, SAVE_ARGMAX=True, FLOWING=True, QMASK_VALUES=True,
        DMASK_VALUES=True), dict(ptrs, qmask_ptr="i64", dmask_ptr="i64"), 8, 3
    yield "fwd number masks (float, exclude)", dict(base, HAS_QMASK=True, HAS_DMASK=True, QMASK_VALUES=True,
                                                     DMASK_VALUES=True), dict(ptrs, qmask_ptr="fp32", dmask_ptr="fp32"), 8, 3
    yield "fwd argmax in-batch 128-token queries", dict(base, BN=64, SEG=128, SAVE_ARGMAX=True), \
        dict(ptrs, q_ptr="bf16", d_ptr="bf16"), 8, 3
    yield "fwd argmax d=768 normalize", dict(base, BM=128, BN=64, BK=64, NUM_K=12, SEG=32, SAVE_ARGMAX=True,
                                             NORMALIZE=True, HAS_QMASK=True, HAS_DMASK=True), \
        dict(ptrs, q_ptr="bf16", d_ptr="bf16"), 4, 3
    yield "fwd argmax running max", dict(base, BM=128, SEG=128, ROW_MAX=False, SAVE_ARGMAX=True), ptrs, 8, 3
    yield "fwd TMA short stacked (32q x 100K)", *tma(dict(base, BN=128)), 8, 3
    yield "fwd TMA long query in-batch", *tma(dict(base, BM=128, BN=128, SEG=128), "bf16"), 4, 2
    yield "fwd TMA ColPali-long", *tma(dict(base, BM=256, BN=64, SEG=256)), 8, 3
    yield "fwd TMA one query d=64 (big corpus)", *tma(dict(base, BM=32, BN=128, BK=64, ROW_MAX=False)), 4, 4
    yield "fwd TMA d=768", *tma(dict(base, BM=128, BN=128, BK=64, NUM_K=12, SEG=32)), 8, 3
    # Widths between the tiles: d 96 in a 128-wide box (TMA zero-fills), d 320 in five 64-wide chunks.
    yield "fwd TMA one query d=96 (box wider than the row)", *tma(dict(base, BM=32, BN=128, EVEN_K=False,
                                                                        ROW_MAX=False)), 4, 3
    yield "fwd TMA one query d=320 (BK=64)", *tma(dict(base, BM=32, BN=128, BK=64, NUM_K=5)), 4, 4
    yield "fwd TMA d=192 (d 64's split copy), 256-row blocks", *tma(dict(base, BM=256, BN=128, BK=64, NUM_K=3, SEG=64,
                                                                        HAS_QMASK=True, HAS_DMASK=True,
                                                                        MASK_LANES=MASK_ROW_LANES)), 8, 3
    yield "fwd TMA argmax masks+multiply+normalize", *tma(dict(base, BM=64, BN=128, SEG=64, SAVE_ARGMAX=True, HAS_QMASK=True,
                                                           HAS_DMASK=True, MULTIPLY=True, NORMALIZE=True), "bf16"), 4, 3
    # The widest embeddings (d 2560 / 4096: the selection's K-loop tile, 128-wide chunks).
    yield "fwd d=4096 argmax", dict(base, BM=32, BN=64, BK=128, NUM_K=32, SEG=32, SAVE_ARGMAX=True), \
        dict(ptrs, q_ptr="bf16", d_ptr="bf16"), 4, 3
    yield "fwd fp32 ieee", dict(base, BM=128, BN=32, BK=64, NUM_K=2, SEG=32, DOT_PRECISION="ieee", ROW_MAX=False), \
        dict(ptrs, q_ptr="fp32", d_ptr="fp32"), 4, 2
    # fp32 on the tensor cores (precision="tf32x3" / "tf32"): the 16-bit stacked tile, fp32 pointers.
    for precision in ("tf32x3", "tf32"):
        yield f"fwd fp32 {precision} stacked", dict(base, BM=128, BN=64, BK=64, NUM_K=2, SEG=32,
                                                    DOT_PRECISION=precision), \
            dict(ptrs, q_ptr="fp32", d_ptr="fp32"), 8, 2
        yield f"fwd fp32 {precision} argmax masks", dict(base, BM=128, BN=64, BK=64, NUM_K=2, SEG=32, SAVE_ARGMAX=True,
                                                         HAS_QMASK=True, HAS_DMASK=True, DOT_PRECISION=precision), \
            dict(ptrs, q_ptr="fp32", d_ptr="fp32"), 8, 2
    # fp32 split on chip (precision="fp16x3", few query rows a document token): one-query tiles
    for bm, bn, bk, warps, stages in ((32, 32, 64, 4, 2), (32, 64, 64, 4, 3), (32, 64, 128, 4, 3), (32, 128, 64, 8, 3),
                                      (64, 64, 64, 4, 3)):
        yield f"fwd fp32 fp16x3 BM={bm} BN={bn} BK={bk} w{warps} s{stages}", \
            dict(base, BM=bm, BN=bn, BK=bk, NUM_K=128 // bk, SEG=32, DOT_PRECISION="fp16x3", ROW_MAX=False,
                 HAS_DMASK=True), dict(ptrs, q_ptr="fp32", d_ptr="fp32"), warps, stages
    # ... and through TMA (the shipped tile: row max, one document at a time to its last real token),
    # for a 32- and a 48-token query, a d = 768 K-loop, and the products asked for by name.
    for bm, num_k, precision in ((32, 1, "fp16x3"), (64, 1, "fp16x3"), (32, 6, "fp16x3"), (32, 1, "tf32x3"),
                                 (32, 1, "tf32")):
        yield f"fwd fp32 {precision} TMA walk BM={bm} NUM_K={num_k}", \
            *tma(dict(base, BM=bm, BN=64, BK=128, NUM_K=num_k, SEG=bm, DOT_PRECISION=precision, HAS_QMASK=True,
                      HAS_DMASK=True, MASK_LANES=MASK_ROW_LANES), "fp32"), 4, 3
    # ... the in-batch training forward (2048 rows a token, argmax kept): 128-row blocks, 8 warps
    yield "fwd fp32 fp16x3 TMA in-batch argmax BM=128", \
        *tma(dict(base, BM=128, BN=64, BK=128, NUM_K=1, SEG=32, DOT_PRECISION="fp16x3", SAVE_ARGMAX=True,
                  HAS_QMASK=True, HAS_DMASK=True, MASK_LANES=MASK_ROW_LANES), "fp32"), 8, 3


def backward_variants():
    gptrs = dict(q_ptr="bf16", d_ptr="bf16", g_ptr="fp32", arg_ptr="i32", qinv_ptr="fp32", dinv_ptr="fp32",
                 gq_ptr="bf16", gd_ptr="fp32")
    for cand, norm, scatter in [(False, False, True), (False, True, True), (True, False, False), (True, True, False)]:
        c = dict(BS=16 if scatter else 2, BD=128, KB=1 if scatter else 16, CANDIDATES=cand, NORMALIZE=norm,
                 SCATTER_D=scatter)
        yield f"bwd gather cand={cand} norm={norm} scatter={scatter}", _maxsim_bwd_gather_kernel, c, gptrs, \
            4 if scatter else 2
    for norm in (False, True):  # lowmem's gather on the cross product: two documents a step
        yield f"bwd gather cross lowmem norm={norm}", _maxsim_bwd_gather_kernel, \
            dict(BS=16, BD=128, KB=2, CANDIDATES=False, NORMALIZE=norm, SCATTER_D=False), gptrs, 2
    yield "bwd gather d=1024", _maxsim_bwd_gather_kernel, dict(BS=8, BD=1024, KB=1, CANDIDATES=False, NORMALIZE=False,
                                                              SCATTER_D=True), gptrs, 8
    optrs = dict(q_ptr="bf16", d_ptr="bf16", g_ptr="fp32", order_ptr="i32", rowptr_ptr="i32", dinv_ptr="fp32",
                 qinv_ptr="fp32", gd_ptr="bf16")
    for norm in (False, True):
        for block, warps in ((16, 1), (32, 1), (64, 2)):  # owned_config's choices
            yield f"bwd owned BE={block} w{warps} norm={norm}", _maxsim_bwd_owned_kernel, \
                dict(BE=block, BD=128, NORMALIZE=norm), optrs, warps
    cptrs = dict(arg_ptr="i32", counts_ptr="i32", rowptr_ptr="i32", order_ptr="i32")
    for place in (False, True):
        yield f"bwd counting sort place={place}", _csr_count_kernel, dict(PLACE=place, BLOCK=1024), cptrs, 4
    lptrs = dict(q_ptr="bf16", d_ptr="bf16", g_ptr="fp32", arg_ptr="i32", qinv_ptr="fp32", dinv_ptr="fp32",
                 gd_ptr="bf16")
    for norm in (False, True):
        yield f"bwd lists one-hot norm={norm}", _maxsim_bwd_lists_kernel, dict(BN=64, BS=32, BD=128, NORMALIZE=norm,
                                                                              DOT_FP32=norm), lptrs, 4
    yield "bwd normalize Jacobian", _normalize_jacobian_kernel, dict(BR=32, BD=128), \
        dict(gd32_ptr="fp32", d_ptr="bf16", dinv_ptr="fp32", gd_ptr="bf16"), 4
    yield "bwd lists one-hot d=1024", _maxsim_bwd_lists_kernel, dict(BN=16, BS=32, BD=1024, NORMALIZE=False,
                                                                    DOT_FP32=False), lptrs, 8
    # d 2560 / 4096 (BD 4096), the tiles backward_config gives them
    yield "bwd gather d=4096", _maxsim_bwd_gather_kernel, dict(BS=2, BD=4096, KB=1, CANDIDATES=False, NORMALIZE=False,
                                                              SCATTER_D=True), gptrs, 4
    yield "bwd owned d=4096", _maxsim_bwd_owned_kernel, dict(BE=2, BD=4096, NORMALIZE=False), optrs, 4
    # (the one-hot lists kernel takes wider rows in column chunks of 1024: the d=1024 variant above)


def varlen_variants():
    vc = dict(BM=256, BN=64, BK=128, NUM_K=1, EVEN_K=True, DOT_PRECISION="tf32", DOT_UPCAST=False, SAVE_ARGMAX=False)
    cptrs = dict(q_ptr="fp16", d_ptr="fp16", cuq_ptr="i64", cud_ptr="i64", out_ptr="fp32", arg_ptr="i32")
    yield "varlen cross", _maxsim_varlen_cross_kernel, dict(vc, SEG=32), cptrs, 8
    yield "varlen cross argmax, d=768", _maxsim_varlen_cross_kernel, dict(vc, BM=128, BK=64, NUM_K=12, SEG=32,
                                                                         SAVE_ARGMAX=True), cptrs, 4
    yield "varlen cross fp32 tf32x3", _maxsim_varlen_cross_kernel, dict(vc, BM=128, BK=64, NUM_K=2, SEG=32,
                                                                       DOT_PRECISION="tf32x3"), \
        dict(cptrs, q_ptr="fp32", d_ptr="fp32"), 8
    sc = dict(vc, BM=32, SEG=32, SCALED=False, FP8=False, CHECK_BLOCK=1024, RESIDUAL=False, NBITS=1, NORMALIZE=False,
              QDOT=False, BP=16, PQ_SUB=0)
    del sc["SAVE_ARGMAX"]
    sptrs = dict(q_ptr="fp16", d_ptr="fp16", scale_ptr="fp32", qscale_ptr="fp32", cuq_ptr="i64", cud_ptr="i64",
                 out_ptr="fp32", codes_ptr="fp16", cent_ptr="fp16", w_ptr="fp16")
    yield "varlen stream 1 query", _maxsim_varlen_stream_kernel, sc, sptrs, 1
    yield "varlen stream int8", _maxsim_varlen_stream_kernel, dict(sc, SCALED=True), dict(sptrs, d_ptr="i8"), 1
    yield "varlen stream fp8 (bytes), 32 queries", _maxsim_varlen_stream_kernel, \
        dict(sc, BM=128, SCALED=True, FP8=True), dict(sptrs, d_ptr="u8"), 4
    one_byte = dict(sc, SCALED=True, QDOT=True)
    yield "varlen stream int8 x int8 query", _maxsim_varlen_stream_kernel, one_byte, \
        dict(sptrs, q_ptr="i8", d_ptr="i8"), 1
    yield "varlen stream e4m3 x e4m3 query", _maxsim_varlen_stream_kernel, dict(one_byte, FP8=True), \
        dict(sptrs, q_ptr="u8", d_ptr="u8"), 1
    yield "varlen stream int8 x int8, 32 queries", _maxsim_varlen_stream_kernel, dict(one_byte, BM=128), \
        dict(sptrs, q_ptr="i8", d_ptr="i8"), 4
    # product-quantised tokens decoded on chip (maxsim/compressed/pq.py), m = 32 sub-spaces of 4
    yield "pq stream one query", _maxsim_varlen_stream_kernel, dict(sc, BN=64, PQ_SUB=4), dict(sptrs, d_ptr="u8"), 1
    yield "pq stream 32 queries", _maxsim_varlen_stream_kernel, dict(sc, BM=128, PQ_SUB=4), \
        dict(sptrs, d_ptr="u8"), 4
    yield "pq stream fp32 tf32x3", _maxsim_varlen_stream_kernel, \
        dict(sc, BN=32, BK=64, NUM_K=2, PQ_SUB=4, DOT_PRECISION="tf32x3"), \
        dict(sptrs, q_ptr="fp32", d_ptr="u8", cent_ptr="fp32"), 4
    # the residual codec's nearest-centroid assignment (maxsim/compressed/codec.py): 128-point queries
    yield "codec assignment fp16 argmax", _maxsim_varlen_cross_kernel, dict(vc, SEG=128, SAVE_ARGMAX=True), cptrs, 8
    yield "codec assignment fp32 tf32x3 argmax", _maxsim_varlen_cross_kernel, \
        dict(vc, BM=128, BN=32, BK=64, NUM_K=2, SEG=128, SAVE_ARGMAX=True, DOT_PRECISION="tf32x3"), \
        dict(cptrs, q_ptr="fp32", d_ptr="fp32"), 4
    pptrs = dict(cptrs, pq_ptr="i64", pd_ptr="i64")
    yield "pairs", _maxsim_pairs_kernel, dict(vc, BM=32, BN=128), pptrs, 4
    yield "pairs argmax", _maxsim_pairs_kernel, dict(vc, BM=32, BN=128, SAVE_ARGMAX=True), pptrs, 4
    bptrs = dict(q_ptr="bf16", d_ptr="bf16", cuq_ptr="i64", cud_ptr="i64", pq_ptr="i64", pd_ptr="i64",
                 arg_ptr="i32", g_ptr="fp32", gq_ptr="fp32", gd_ptr="fp32")
    yield "varlen bwd atomic", _varlen_bwd_atomic_kernel, dict(BR=16, BD=128, CROSS=True), bptrs, 4
    optrs = dict(bptrs, order_ptr="i64", rowptr_ptr="i64", out_ptr="bf16")
    for to_q in (True, False):
        yield f"varlen bwd owned to_q={to_q}", _varlen_bwd_owned_kernel, dict(BD=128, CROSS=False, TO_Q=to_q), optrs, 1
    # d 2560 / 4096 (BD 4096), as backward_config gives them
    yield "varlen bwd atomic d=4096", _varlen_bwd_atomic_kernel, dict(BR=1, BD=4096, CROSS=True), bptrs, 4
    yield "varlen bwd owned d=4096", _varlen_bwd_owned_kernel, dict(BD=4096, CROSS=False, TO_Q=False), optrs, 4


def chamfer_variants():
    """The Chamfer family (maxsim/chamfer/): the direct and dot forwards, both backwards."""
    base = dict(D=3, BM=64, BN=64, BK=16, NUM_K=1, NORM=2, DOT=False, BOTH=True, DOT_PRECISION="ieee", DOT_UPCAST=False,
                UNROLL_D=True)
    fptrs = dict(x_ptr="fp32", y_ptr="fp32", xlen_ptr="i64", ylen_ptr="i64", bad_ptr="i1", dist_x_ptr="fp32",
                 idx_x_ptr="i32", dist_y_ptr="fp32", idx_y_ptr="i32")
    yield "chamfer fwd direct D=3 fp32", _chamfer_fwd_kernel, base, fptrs, 8
    yield "chamfer fwd direct L1 D=3 bf16", _chamfer_fwd_kernel, dict(base, NORM=1), dict(fptrs, x_ptr="bf16", y_ptr="bf16"), 4
    # wide L1 points: the coordinates as a loop (as chamfer_forward launches them past 16)
    yield "chamfer fwd direct L1 D=130 fp16", _chamfer_fwd_kernel, dict(base, D=130, NORM=1, UNROLL_D=False), \
        dict(fptrs, x_ptr="fp16", y_ptr="fp16"), 8
    yield "chamfer fwd dot D=128 bf16", _chamfer_fwd_kernel, dict(base, D=128, BM=128, BK=64, NUM_K=2, DOT=True,
                                                                  DOT_PRECISION="tf32"), \
        dict(fptrs, x_ptr="bf16", y_ptr="bf16"), 8
    yield "chamfer fwd dot D=64 fp32 ieee", _chamfer_fwd_kernel, dict(base, D=64, BN=32, BK=64, DOT=True), fptrs, 4
    bptrs = dict(src_ptr="fp32", tgt_ptr="fp32", idx_ptr="i32", g_ptr="fp32", gsrc_ptr="fp32", gtgt_ptr="fp32")
    yield "chamfer bwd atomic", _chamfer_bwd_atomic_kernel, dict(D=3, BR=64, BD=4, NORM=2, ACCUMULATE=True), bptrs, 4
    optrs = dict(p_ptr="bf16", q_ptr="bf16", idx_ptr="i32", gp_ptr="fp32", order_ptr="i64", rowptr_ptr="i64",
                 gq_ptr="fp32", out_ptr="bf16")
    yield "chamfer bwd owned", _chamfer_bwd_owned_kernel, dict(D=3, BR=64, BD=4, NORM=1, HAS_OWN=True,
                                                               HAS_ENTRIES=True), optrs, 4


def head_variants():
    """maxsim_from_hidden's fused head (maxsim/head/forward.py): one query, 128 rows with masks, fp32."""
    base = dict(BM=32, BN=128, BD=128, BKM=64, NUM_KM=12, SEG=32, HAS_QMASK=False, HAS_DMASK=False, HAS_BIAS=True,
                MULTIPLY=False, NORMALIZE=True, SAVE_ARGMAX=False, EVEN_KM=True, DOT_PRECISION="tf32",
                DOT_UPCAST=False)
    ptrs = dict(q_ptr="bf16", h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", qmask_ptr="i1", dmask_ptr="i1",
                out_ptr="fp32", argmax_ptr="i32")
    yield "head fwd one query d_model 768", _head_fwd_kernel, base, ptrs, 8, 2
    yield "head fwd 128 rows masks argmax", _head_fwd_kernel, dict(base, BM=128, BN=64, SEG=32, HAS_QMASK=True,
                                                                   HAS_DMASK=True, SAVE_ARGMAX=True), ptrs, 8, 2
    yield "head fwd fp32 ieee", _head_fwd_kernel, dict(base, BN=32, BKM=16, NUM_KM=48, DOT_PRECISION="ieee"), \
        {k: ("fp32" if v == "bf16" else v) for k, v in ptrs.items()}, 8, 2


def compressed_variants():
    """The packed stream kernel decoding residual tokens on chip (maxsim/varlen/stream.py, launched
    by maxsim/compressed/forward.py): one query against 1-, 2-, 4- and 8-bit indexes (d = 128),
    raw (no normalize), int64 codes, many stacked rows, fp32 decode."""
    base = dict(BM=32, BN=64, BK=16, NUM_K=8, SEG=32, EVEN_K=True, SCALED=False, FP8=False, DOT_PRECISION="tf32",
                DOT_UPCAST=False, CHECK_BLOCK=1024, RESIDUAL=True, NBITS=2, NORMALIZE=True, QDOT=False, BP=32, PQ_SUB=0)
    ptrs = dict(q_ptr="fp16", d_ptr="u8", scale_ptr="fp16", qscale_ptr="fp32", cuq_ptr="i64", cud_ptr="i64",
                out_ptr="fp32", codes_ptr="i32", cent_ptr="fp16", w_ptr="fp16")
    for nbits in (1, 2, 4, 8):  # planes of d * nbits / 8 columns (at least 16, the dot's K)
        yield f"residual stream one query nbits={nbits}", _maxsim_varlen_stream_kernel, \
            dict(base, NBITS=nbits, BP=max(16, 16 * nbits)), ptrs, 4, 2
    for bn, warps in ((32, 1), (16, 2), (32, 4), (128, 4)):  # the one-query tile, others of the sweep
        yield f"residual stream nbits=2 BN {bn} {warps}w", _maxsim_varlen_stream_kernel, dict(base, BN=bn), \
            ptrs, warps, 2
    yield "residual stream one query nbits=2 raw", _maxsim_varlen_stream_kernel, dict(base, NORMALIZE=False), \
        ptrs, 4, 2
    yield "residual stream int64 codes", _maxsim_varlen_stream_kernel, dict(base, NBITS=4, BP=64), \
        dict(ptrs, codes_ptr="i64"), 4, 2
    yield "residual stream 128 stacked rows", _maxsim_varlen_stream_kernel, dict(base, BM=128), ptrs, 4, 2
    yield "residual stream fp32 decode ieee", _maxsim_varlen_stream_kernel, \
        dict(base, BN=16, DOT_PRECISION="ieee"), dict(ptrs, q_ptr="fp32", cent_ptr="fp32", w_ptr="fp32"), 4, 2
    approx_ptrs = dict(by_code_ptr="fp32", keep_ptr="i1", codes_ptr="i64", starts_ptr="i64", lengths_ptr="i64",
                       query_ptr="i64", pid_ptr="i64", real_ptr="i1", out_ptr="fp32")
    for keep in (False, True):  # PLAID's approximate scores (maxsim/index/approx.py), as launched
        yield f"plaid approx scores keep={keep}", _plaid_approx_kernel, \
            dict(BT=32, BLQ=32, KEEP=keep, EMPTY=-9999.0), approx_ptrs, 4, 2



def residual_lut_variants():
    """The look-up residual scorer (maxsim/compressed/residual_lut.py): codes expanded by a byte
    permute into the int8 dot's register operand, 2 and 4 bits, as the probe launches it."""
    ptrs = dict(codes_ptr="u8", cid_ptr="i32", inv_ptr="fp32", cu_ptr="i64", q_ptr="i8", qs_ptr="fp32",
                tab_ptr="fp16", lut_ptr="i8", out_ptr="fp32")
    luts = {2: [-90, -30, 30, 90], 4: list(range(-120, 120, 15))}
    for nbits, bt in ((2, 128), (4, 128), (2, 64)):
        asms = {f"ASM{s}": decoder_asm(nbits, s % (4 if nbits == 2 else 2), luts[nbits]) for s in range(4)}
        consts = dict(DIM=128, NBITS=nbits, LQ=32, QPB=1, BT=bt, G=16, USE_ASM=True, NO_TABLE=False, ABLATE=0,
                      **asms)
        yield f"residual lut nbits={nbits} BT {bt}", _residual_lut_kernel, consts, ptrs, 4, 3
    gluon_ptrs = dict({k: v for k, v in ptrs.items() if k != "lut_ptr"}, gdoc_ptr="i32")
    for nbits in (2, 4):  # the Gluon scorer, as the probe measured it (BT 64)
        asms = {f"ASM{s}": decoder_asm(nbits, s % (4 if nbits == 2 else 2), luts[nbits]) for s in range(4)}
        for qpb in (1, 4):  # one query a program; four (32-query searches)
            yield f"residual lut gluon nbits={nbits} qpb={qpb}", _residual_lut_gluon_kernel, \
                dict(NBITS=nbits, LQ=32, QPB=qpb, BT=64, G=16, PAIRS=False, ABLATE=0, **asms), gluon_ptrs, 4, 1
        yield f"residual lut gluon nbits={nbits} qpb=1 pairs", _residual_lut_gluon_kernel, \
            dict(NBITS=nbits, LQ=32, QPB=1, BT=64, G=16, PAIRS=True, ABLATE=0, **asms), gluon_ptrs, 4, 1
        yield f"residual lut gluon nbits={nbits} qpb=4 pairs", _residual_lut_gluon_kernel, \
            dict(NBITS=nbits, LQ=32, QPB=4, BT=64, G=16, PAIRS=True, ABLATE=0, **asms), gluon_ptrs, 4, 1
    for ablate in (1, 2, 4, 7):  # the probe's ablations of the Gluon scorer
        yield f"residual lut gluon ablate={ablate}", _residual_lut_gluon_kernel, \
            dict(NBITS=2, LQ=32, QPB=1, BT=64, G=16, PAIRS=False, ABLATE=ablate, **asms), gluon_ptrs, 4, 1
    pq_ptrs = dict(codes_ptr="u8", cu_ptr="i64", q_ptr="i8", qs_ptr="fp32", words_ptr="i32", out_ptr="fp32")
    for qpb in (1, 2):  # the PQ look-up scorer (maxsim/compressed/pq_lut.py)
        yield f"pq lut qpb={qpb}", _pq_lut_kernel, dict(M=32, LQ=32, QPB=qpb, BT=128, G=16, ABLATE=0), pq_ptrs, 4, 3
    pq_gluon_ptrs = dict(pq_ptrs, gdoc_ptr="i32", scale_ptr="fp32")
    for qpb, bt, pairs in ((1, 128, False), (2, 128, False), (4, 64, False), (1, 128, True), (4, 64, True)):
        yield f"pq lut gluon qpb={qpb} BT {bt}{' pairs' if pairs else ''}", _pq_lut_gluon_kernel, \
            dict(M=32, LQ=32, QPB=qpb, BT=bt, G=16, PAIRS=pairs, ABLATE=0, INT8=False, FP8=False), pq_gluon_ptrs, 4, 1
    for m, s in ((32, 4), (16, 8)):  # PQ encoding on the GPU (maxsim/compressed/pq_encode.py)
        yield f"pq encode m={m}", _pq_encode_kernel, dict(M=m, S=s, BT=32), \
            dict(x_ptr="fp16", cb_ptr="fp32", out_ptr="u8"), 4, 1
    for qpb, bt, fp8, pairs in ((1, 128, False, False), (4, 64, False, False), (1, 128, True, False),
                                (1, 128, False, True), (4, 64, False, True), (1, 128, True, True),
                                (4, 64, True, True)):  # one-byte tokens (onebyte_gluon.py)
        yield f"{'fp8' if fp8 else 'int8'} gluon qpb={qpb} BT {bt}{' pairs' if pairs else ''}", _pq_lut_gluon_kernel, \
            dict(M=32, LQ=32, QPB=qpb, BT=bt, G=16, PAIRS=pairs, ABLATE=0, INT8=True, FP8=fp8), \
            dict(pq_gluon_ptrs, codes_ptr="i32", q_ptr="fp8e4nv" if fp8 else "i8"), 4, 1


# Variants whose dot must run on Hopper's wgmma (bf16/fp16 with at least 64 query rows).
EXPECT_WGMMA = {
    "fwd short stacked (32q x 100K)", "fwd long query (ColPali)", "fwd 128 rows running max", "fwd d=768",
    "fwd masks+multiply+normalize", "fwd argmax (training)", "fwd argmax in-batch 128-token queries",
    "fwd argmax running max", "fwd TMA short stacked (32q x 100K)", "fwd TMA long query in-batch",
    "fwd TMA ColPali-long", "fwd TMA d=768", "fwd TMA argmax masks+multiply+normalize", "varlen cross", "varlen cross argmax, d=768", "bwd lists one-hot norm=False",
    "chamfer fwd dot D=128 bf16", "head fwd 128 rows masks argmax", "residual stream 128 stacked rows",
    "fwd fp32 tf32x3 stacked", "fwd fp32 tf32x3 argmax masks", "fwd fp32 tf32 stacked", "fwd fp32 tf32 argmax masks",
    "varlen cross fp32 tf32x3", "varlen stream int8 x int8, 32 queries", "pq stream 32 queries",
    "codec assignment fp16 argmax", "residual lut nbits=2 BT 128", "residual lut nbits=4 BT 128",
    "residual lut nbits=2 BT 64", "residual lut gluon nbits=2 qpb=1", "residual lut gluon nbits=4 qpb=1",
    "residual lut gluon nbits=2 qpb=4", "residual lut gluon nbits=4 qpb=4", "residual lut gluon nbits=2 qpb=1 pairs",
    "residual lut gluon nbits=4 qpb=1 pairs", "pq lut qpb=1", "pq lut qpb=2", "pq lut gluon qpb=1 BT 128",
    "pq lut gluon qpb=2 BT 128", "pq lut gluon qpb=4 BT 64", "pq lut gluon qpb=1 BT 128 pairs",
    "pq lut gluon qpb=4 BT 64 pairs", "int8 gluon qpb=1 BT 128", "int8 gluon qpb=4 BT 64",
    "fp8 gluon qpb=1 BT 128", "int8 gluon qpb=1 BT 128 pairs", "int8 gluon qpb=4 BT 64 pairs",
    "fp8 gluon qpb=1 BT 128 pairs", "fp8 gluon qpb=4 BT 64 pairs", "residual lut gluon nbits=2 qpb=4 pairs", "residual lut gluon nbits=4 qpb=4 pairs",
    "residual lut gluon ablate=1", "residual lut gluon ablate=2", "residual lut gluon ablate=4",
    "residual lut gluon ablate=7",
}


def ws_variants():
    """The warp-specialized Gluon forward (maxsim/dense/forward_ws.py): its point is the producer and
    consumer partitions (setmaxnreg hands the consumers their registers) around wgmma, checked below."""
    flags = dict(HAS_QMASK=False, HAS_DMASK=False, MULTIPLY=False, SAVE_ARGMAX=False)
    for BN, d, dt, split, regs, extra in [
        (128, 128, "bf16", False, True, {}),                                   # in-batch, ColPali, 32 x 100K
        (128, 128, "fp16", True, True, {}),                                    # one row block: split documents
        (128, 128, "fp16", False, False, {}),                                  # query block from shared memory
        (128, 64, "fp16", False, True, {}),
        (128, 128, "bf16", False, True, dict(SAVE_ARGMAX=True)),               # training
        (128, 128, "bf16", False, True, dict(SAVE_ARGMAX=True, SUB=1)),        # training, one MMA a tile
        (64, 128, "bf16", False, True, dict(SAVE_ARGMAX=True)),
        (64, 128, "bf16", True, True, dict(HAS_QMASK=True, HAS_DMASK=True)),
        (64, 128, "bf16", False, True, dict(SAVE_ARGMAX=True, HAS_QMASK=True, HAS_DMASK=True, MULTIPLY=True)),
        (128, 128, "fp16", True, True, dict(SAVE_ARGMAX=True)),                # one row block, training
        (128, 128, "bf16", False, True, dict(SAVE_ARGMAX=True, HAS_QMASK=True, HAS_DMASK=True, MULTIPLY=True)),
        (128, 128, "bf16", False, True, dict(SAVE_ARGMAX=True, HAS_DMASK=True)),
    ]:
        layout = gl.NVMMASharedLayout.get_default_for([BN, d], gl.float16 if dt == "fp16" else gl.bfloat16)
        ptrs = dict(q_ptr=dt, qmask_ptr="i1", dmask_ptr="i1", out_ptr="fp32", argmax_ptr="i32",
                    d_desc=f"tensordesc<{dt}[{BN},{d}],{layout!r}>")
        consts = dict(BN=BN, BK=d, SEG=32, STAGES=4, SPLIT_DOCS=split, Q_IN_REGS=regs, num_warps=4,
                      **{**flags, "SUB": WS_SUB_TILES[bool(extra.get("SAVE_ARGMAX"))], **extra})
        tag = " ".join(k.lower() if v is True else f"{k.lower()}{v}" for k, v in extra.items() if v)
        name = f"fwd ws (Gluon) BN{BN} d{d} {dt}{' split' if split else ''}{'' if regs else ' q-smem'} {tag}"
        yield name.rstrip(), _maxsim_fwd_ws_kernel, consts, ptrs, 4


EXPECT_WS = {name for name, *_ in ws_variants()}


def varlen_selection_variants():
    """The packed forward's tile exactly as the selection gives it (maxsim.selection.varlen), at every
    width from 64 to 4096, one and many query rows, 16-bit and fp32: whatever it picks must fit
    Hopper's shared memory (the stream kernel holds its query block there)."""
    import torch

    from maxsim.selection import varlen as select_varlen
    from maxsim.varlen.specs import STREAM_FORWARD

    for dtype, dt in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        for d in (64, 96, 128, 256, 320, 384, 448, 512, 768, 1024, 2560, 4096):
            for rows in (32, 512):
                choice = select_varlen._forward_choice(rows, d, dtype, False, False, "sm90")
                c = choice.config
                seg = min(32, c["BM"])  # queries of 32 tokens
                consts = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], NUM_K=-(-d // c["BK"]), EVEN_K=d % c["BK"] == 0,
                              SEG=seg, DOT_PRECISION="tf32x3" if dtype == torch.float32 else "tf32", DOT_UPCAST=False)
                name = f"selected {choice.kernel.name} {dt} d={d} rows={rows}"
                pair_choice = select_varlen._forward_choice(rows, d, dtype, True, False, "sm90")
                pc = pair_choice.config
                pair_ptrs = dict(q_ptr=dt, d_ptr=dt, cuq_ptr="i64", cud_ptr="i64", out_ptr="fp32", arg_ptr="i32",
                                 pq_ptr="i64", pd_ptr="i64")
                yield f"selected {pair_choice.kernel.name} {dt} d={d} rows={rows}", _maxsim_pairs_kernel, \
                    dict(BM=pc["BM"], BN=pc["BN"], BK=pc["BK"], NUM_K=-(-d // pc["BK"]), EVEN_K=d % pc["BK"] == 0,
                         DOT_PRECISION=consts["DOT_PRECISION"], DOT_UPCAST=False, SAVE_ARGMAX=False), pair_ptrs, \
                    pc["num_warps"], pc["num_stages"]
                if choice.kernel is STREAM_FORWARD:
                    consts.update(SCALED=False, FP8=False, CHECK_BLOCK=1024, RESIDUAL=False, NBITS=1, NORMALIZE=False,
                                  QDOT=False, BP=16, PQ_SUB=0)
                    ptrs = dict(q_ptr=dt, d_ptr=dt, scale_ptr="fp32", qscale_ptr="fp32", cuq_ptr="i64", cud_ptr="i64",
                                out_ptr="fp32", codes_ptr=dt, cent_ptr=dt, w_ptr=dt)
                    yield name, _maxsim_varlen_stream_kernel, consts, ptrs, c["num_warps"], c["num_stages"]
                else:
                    ptrs = dict(q_ptr=dt, d_ptr=dt, cuq_ptr="i64", cud_ptr="i64", out_ptr="fp32", arg_ptr="i32")
                    yield name, _maxsim_varlen_cross_kernel, dict(consts, SAVE_ARGMAX=False), ptrs, \
                        c["num_warps"], c["num_stages"]


def all_variants():
    """(name, kernel, constexprs, pointer types, num_warps, num_stages) for every checked variant."""
    jobs = [(name, _maxsim_fwd_kernel, c, p, w, s) for name, c, p, w, s in dense_forward_variants()]
    jobs += [(name, k, c, p, w, 3) for name, k, c, p, w in backward_variants()]
    jobs += [(name, k, c, p, w, 3) for name, k, c, p, w in varlen_variants()]
    jobs += [(name, k, c, p, w, 3) for name, k, c, p, w in ws_variants()]
    jobs += [(name, k, c, p, w, 2) for name, k, c, p, w in chamfer_variants()]
    jobs += list(head_variants())
    jobs += list(compressed_variants())
    jobs += list(residual_lut_variants())
    jobs += list(varlen_selection_variants())
    return jobs


def main() -> int:
    """Compile every variant (or those whose name holds ``sys.argv[1]``)."""
    rows, failed = [], 0
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, kernel, consts, ptrs, warps, stages in all_variants():
        if only not in name:
            continue
        try:
            k = compile_variant(kernel, ptrs, consts, warps, stages)
            ptx = k.asm["ptx"]
            problems = []
            if ".target sm_90" not in ptx:
                problems.append("not built for sm_90")
            if k.metadata.shared > 227 * 1024:
                problems.append("over Hopper's 227 KB of shared memory per block")
            if name in EXPECT_WGMMA and "wgmma" not in ptx:
                problems.append("the dot no longer lowers to wgmma")
            if name in EXPECT_WS and ("setmaxnreg" not in ptx or "wgmma" not in ptx):
                problems.append("not warp-specialized around wgmma")
            status = "FAIL" if problems else "ok"
            failed += bool(problems)
            rows.append(f"{name:40s} {status:5s} smem {k.metadata.shared / 1024:6.1f} KB  {ptxas_report(ptx)}  "
                        f"wgmma {'yes' if 'wgmma' in ptx else 'no':3s} {'; '.join(problems)}")
        except Exception as e:  # noqa: BLE001 - report every failing variant, then fail
            failed += 1
            msg = str(e).strip().splitlines()
            rows.append(f"{name:40s} FAIL  {type(e).__name__}: {(msg[-1] if msg else '')[:150]}")
        print(rows[-1], flush=True)
    print(f"\n{len(rows) - failed} compiled, {failed} failed (target sm_90, triton {triton.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
