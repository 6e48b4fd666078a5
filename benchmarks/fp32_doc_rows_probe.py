"""Probe: the fp32 one-query rerank with document tokens as the product's rows (H200 only).

The shipped fp32 one-query tile puts the query's 32 rows on the product's M side: a 32-row block
is below wgmma's 64, so the three fp16 products run as mma.sync, and the split document tile goes
back through shared memory to reach the operand layout. Transposed, ``S^T = D_tile @ Q^T``: the
document tile (64 or 128 tokens) is wgmma's M side, its split may stay in registers (wgmma's A
operand), and the query's split halves are the shared B operand, made once. This script times
that kernel (no masks, fixed Ld) beside maxsim's default and the peers on the same inputs, and
checks its scores against float64. (What it found is in BENCHMARKS.md; the library's form of it is
the transposed product in ``maxsim._kernels.mma``, whose L1-norm row scale gives Triton the layout
the Gluon kernel here sets by hand.)

    python benchmarks/fp32_doc_rows_probe.py [--docs 1000] [--lq 32] [--ld 180,512,768,1030] [--d 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from maxsim._kernels import _row_pow2, _split16


@triton.jit
def split_rows_of(b_x):
    """fp32 ``[R, K]`` -> (hi, lo) fp16 ``[R, K]`` and ``down [R]``: ``b_x = (hi + lo) * down``
    (each row scaled by its max's power of two, as ``maxsim._kernels.mma`` scales query rows)."""
    up, down = _row_pow2(b_x)
    b_h, b_l = _split16(b_x, up)
    return b_h, b_l, down


@triton.jit
def _doc_rows_kernel(q_ptr, d_desc, out_ptr, Nd, Ld, docs_per_program,
                     LQ: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one query ``[LQ, D]`` against documents ``[Nd * Ld, D]`` (a TMA descriptor, boxes
    ``[BN, D]``): a program walks ``docs_per_program`` documents, tile by tile, one flat loop."""
    pid = tl.program_id(0)
    o_q = tl.arange(0, LQ)
    o_k = tl.arange(0, D)
    o_n = tl.arange(0, BN)
    b_q = tl.load(q_ptr + o_q[:, None] * D + o_k[None, :])  # [LQ, D] fp32
    if PRECISION != "tf32":
        qh, ql, q_down = split_rows_of(b_q)
        qh_t = tl.trans(qh)  # [D, LQ]
        ql_t = tl.trans(ql)
    else:
        q_t = tl.trans(b_q)
    n_tiles = tl.cdiv(Ld, BN)
    doc0 = pid * docs_per_program
    n_docs = tl.minimum(docs_per_program, Nd - doc0)
    b_max = tl.full([BN, LQ], float("-inf"), dtype=tl.float32)
    for it in range(0, n_docs * n_tiles):
        j = doc0 + it // n_tiles
        i_t = it % n_tiles
        b_d = d_desc.load([j * Ld + i_t * BN, 0])  # [BN, D] fp32
        if PRECISION == "fp16x3":
            dh, dl, d_down = split_rows_of(b_d)  # [BN, D] x 2, [BN]
            acc = tl.dot(dh, ql_t)
            acc = tl.dot(dl, qh_t, acc)
            acc = tl.dot(dh, qh_t, acc)  # [BN, LQ]
            s = acc * d_down[:, None] * q_down[None, :]
        elif PRECISION == "fp16x3-fixed":
            # One scale for every document (2^13: right for unit-norm tokens only). Without a
            # per-row max the split stays in wgmma's register layout: the bound the layout costs.
            b_xs = b_d * 8192.0
            dh = b_xs.to(tl.float16)
            dl = (b_xs - dh.to(tl.float32)).to(tl.float16)
            acc = tl.dot(dh, ql_t)
            acc = tl.dot(dl, qh_t, acc)
            acc = tl.dot(dh, qh_t, acc)  # [BN, LQ]
            s = acc * (1.0 / 8192.0) * q_down[None, :]
        else:
            s = tl.dot(b_d, q_t, input_precision="tf32")
        s = tl.where((i_t * BN + o_n < Ld)[:, None], s, float("-inf"))
        b_max = tl.maximum(b_max, s)
        if i_t == n_tiles - 1:
            tl.store(out_ptr + j, tl.sum(tl.max(b_max, axis=0), axis=0))
            b_max = tl.full([BN, LQ], float("-inf"), dtype=tl.float32)


@gluon.jit
def _pow2_of(b_amax):
    """(2^k, 2^-k) with ``b_amax * 2^k`` in [2^13, 2^14) (as maxsim._kernels._row_pow2)."""
    b_e = (b_amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    b_k = gl.minimum(267 - b_e, 253)
    return (b_k << 23).to(gl.float32, bitcast=True), ((254 - b_k) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _doc_rows_gluon_kernel(q_ptr, d_desc, out_ptr, Nd, Ld, docs_per_program,
                           LQ: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    """As _doc_rows_kernel (fp16x3), with the layouts chosen: each document tile is read from
    shared memory straight into wgmma's register operand layout, scaled and split there (no
    round trip of the split tile through shared memory); the query's split halves are wgmma's
    shared operand, made once. One warpgroup; STAGES tiles in flight by TMA."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, LQ, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    o_q = gl.arange(0, LQ, gl.SliceLayout(1, load_layout))
    o_k = gl.arange(0, D, gl.SliceLayout(0, load_layout))
    b_q = gl.load(q_ptr + o_q[:, None] * D + o_k[None, :])  # [LQ, D] fp32
    q_up, q_down = _pow2_of(gl.max(gl.abs(b_q), axis=1))
    b_qs = b_q * q_up[:, None]
    b_qh = b_qs.to(gl.float16)
    b_ql = (b_qs - b_qh.to(gl.float32)).to(gl.float16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([LQ, D], gl.float16)
    qh_smem = gl.allocate_shared_memory(gl.float16, [LQ, D], q_layout)
    ql_smem = gl.allocate_shared_memory(gl.float16, [LQ, D], q_layout)
    qh_smem.store(b_qh)
    ql_smem.store(b_ql)
    fence_async_shared()
    q_down_cols = gl.convert_layout(q_down, gl.SliceLayout(0, mma_layout))  # [LQ]

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BN, D], d_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    n_tiles = gl.cdiv(Ld, BN)
    doc0 = pid * docs_per_program
    n_docs = gl.minimum(docs_per_program, Nd - doc0)
    total = n_docs * n_tiles
    for s in gl.static_range(STAGES - 1):
        live = s < total
        mbarrier.expect(ready.index(s), d_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(d_desc, [(doc0 + s // n_tiles) * Ld + (s % n_tiles) * BN, 0],
                                        ready.index(s), d_smem.index(s), pred=live)
    o_n = gl.arange(0, BN, gl.SliceLayout(1, mma_layout))
    zero = gl.zeros([BN, LQ], gl.float32, mma_layout)
    b_max = gl.full([BN, LQ], float("-inf"), gl.float32, mma_layout)
    for t in range(0, total):
        # The slot read at t - 1 takes tile t + STAGES - 1 (every warp is past its read first).
        gl.thread_barrier()
        nxt = t + STAGES - 1
        live = nxt < total
        slot_n = nxt % STAGES
        mbarrier.expect(ready.index(slot_n), d_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(d_desc, [(doc0 + nxt // n_tiles) * Ld + (nxt % n_tiles) * BN, 0],
                                        ready.index(slot_n), d_smem.index(slot_n), pred=live)
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        b_x = d_smem.index(slot).load(a_layout)  # [BN, D] fp32, wgmma's A layout
        d_up, d_down = _pow2_of(gl.max(gl.abs(b_x), axis=1))  # [BN]
        b_xs = b_x * d_up[:, None]
        b_dh = b_xs.to(gl.float16)
        b_dl = (b_xs - b_dh.to(gl.float32)).to(gl.float16)
        acc = warpgroup_mma(b_dh, ql_smem.permute((1, 0)), zero, use_acc=False)
        acc = warpgroup_mma(b_dl, qh_smem.permute((1, 0)), acc)
        acc = warpgroup_mma(b_dh, qh_smem.permute((1, 0)), acc)  # [BN, LQ]
        d_down_rows = gl.convert_layout(d_down, gl.SliceLayout(1, mma_layout))
        b_s = acc * d_down_rows[:, None] * q_down_cols[None, :]
        i_t = t % n_tiles
        b_s = gl.where((i_t * BN + o_n < Ld)[:, None], b_s, float("-inf"))
        b_max = gl.maximum(b_max, b_s)
        if i_t == n_tiles - 1:
            gl.store(out_ptr + doc0 + t // n_tiles, gl.sum(gl.max(b_max, axis=0), axis=0))
            b_max = gl.full([BN, LQ], float("-inf"), gl.float32, mma_layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


def doc_rows_gluon_scores(Q, D, BN=64, num_stages=3, waves=4):
    """The Gluon kernel: ``Q [Lq, d]`` fp32, ``D [Nd, Ld, d]`` fp32 -> ``[Nd]`` fp32."""
    Nd, Ld, d = D.shape
    out = torch.empty(Nd, device=D.device, dtype=torch.float32)
    layout = gl.NVMMASharedLayout.get_default_for([BN, d], gl.float32)
    desc = GluonTensorDescriptor(D, [Nd * Ld, d], [d, 1], [BN, d], layout)
    sms = torch.cuda.get_device_properties(D.device).multi_processor_count
    per = max(1, triton.cdiv(Nd, sms * waves))
    _doc_rows_gluon_kernel[(triton.cdiv(Nd, per),)](Q, desc, out, Nd, Ld, per, LQ=Q.shape[0], D=d, BN=BN,
                                                     STAGES=num_stages, num_warps=4)
    return out


def doc_rows_scores(Q, D, BN=64, num_warps=4, num_stages=3, waves=4, precision="fp16x3"):
    """``Q [Lq, d]`` fp32, ``D [Nd, Ld, d]`` fp32 -> ``[Nd]`` fp32 scores (no masks)."""
    Nd, Ld, d = D.shape
    out = torch.empty(Nd, device=D.device, dtype=torch.float32)
    desc = TensorDescriptor(D, [Nd * Ld, d], [d, 1], [BN, d])
    sms = torch.cuda.get_device_properties(D.device).multi_processor_count
    per = max(1, triton.cdiv(Nd, sms * waves))
    _doc_rows_kernel[(triton.cdiv(Nd, per),)](Q, desc, out, Nd, Ld, per, LQ=Q.shape[0], D=d, BN=BN,
                                               PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out


def _table_note(args) -> str:
    return (f"one query of {args.lq} tokens x {args.docs} documents of Ld tokens, d {args.d}, fp32, unit-norm, "
            f"no masks; ms: median over {args.rounds} interleaved rounds of triton's do_bench (L2 cleared "
            "before each call); rel err: max |out - ref| / max |ref| against float64")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", default="180,512,768,1030")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median reported)")
    ap.add_argument("--configs", default="64:4:3:4,64:4:3:8,64:4:4:4,128:8:3:4,128:4:3:4",
                    help="BN:num_warps:num_stages:waves,...")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp32_doc_rows_probe: needs a CUDA GPU (run it on the H200)", file=sys.stderr)
        return 2
    import maxsim

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    try:
        import flash_maxsim  # noqa: F401
        peer = True
    except ImportError:
        peer = False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{_table_note(args)}\n{'Ld':>5} {'provider':<44} {'ms':>7} {'rel err (f64)':>14}")
    for Ld in (int(x) for x in args.ld.split(",")):
        g = torch.Generator(device="cuda").manual_seed(Ld)
        Q = torch.nn.functional.normalize(torch.randn(args.lq, args.d, device="cuda", generator=g), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(args.docs, Ld, args.d, device="cuda", generator=g), dim=-1)
        ref = (torch.einsum("qk,nlk->nql", Q.double(), D.double()).amax(-1).sum(-1))  # [Nd]
        scale = ref.abs().max().item()

        rows = {"maxsim (default)": lambda: maxsim.maxsim(Q[None], D)[0]}
        if peer:
            from flash_maxsim import flash_maxsim as fm
            lengths = torch.full((args.docs,), Ld, device="cuda", dtype=torch.int32)
            rows["flash-maxsim"] = lambda: fm(Q, D, lengths).float()
        for cfg in args.configs.split(","):
            BN, w, s, waves = (int(x) for x in cfg.split(":"))
            if w == 4:
                rows[f"doc rows gluon fp16x3 BN{BN} s{s} waves{waves}"] = (
                    lambda BN=BN, s=s, waves=waves: doc_rows_gluon_scores(Q, D, BN, s, waves))
            for prec in ("fp16x3", "fp16x3-fixed", "tf32"):
                rows[f"doc rows {prec} BN{BN} w{w} s{s} waves{waves}"] = (
                    lambda BN=BN, w=w, s=s, waves=waves, prec=prec: doc_rows_scores(Q, D, BN, w, s, waves, prec))
        errors, times = {}, {name: [] for name in rows}
        for name, fn in list(rows.items()):
            try:
                errors[name] = (fn().double() - ref).abs().max().item() / scale
            except Exception as exc:  # a config that does not compile is a row that says so
                print(f"{Ld:>5} {name:<44} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                del rows[name]
        for _ in range(args.rounds):  # interleaved rounds: a clock or neighbour drift hits every row alike
            for name, fn in rows.items():
                times[name].append(triton.testing.do_bench(fn, warmup=10, rep=40))
        for name in rows:
            print(f"{Ld:>5} {name:<44} {statistics.median(times[name]):7.4f} {errors[name]:14.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
