"""grad_D of the cross product without atomics or an fp32 buffer: each program owns a block of R
rows of one document and finds its own contributions by scanning that document's argmax (GPU probe).

Why. At in-batch 128 x 128 (Lq 128, Ld 1024) the unified backward takes about 0.41 ms, plus a
67 MB fp32 buffer to zero and to cast (~0.05 ms). Its grad_D half is 268M fp32 atomics (1 GB of
read-modify-write in L2). This probe's kernel reads Q rows instead (512 MB of bf16, as the grad_Q
gather reads D rows), writes grad_D once in bf16, and is bitwise deterministic:

- program (document j, row block r0 .. r0 + R) scans the Nq * Lq entries (i, s) of document j in
  chunks of CH, in entry order;
- the entries whose winner t*(i, j, s) falls in its block are compacted (a prefix sum) into the
  program's own scratch row, with their local row, then summed BE at a time as a one-hot matmul on
  the tensor cores: ``acc[R, d] += onehot[R, BE] @ (g[i, j] * Q[i, s])[BE, d]``;
- g * Q is fp32: it enters the matmul as two bf16 parts (hi, and the remainder lo), so each term
  keeps 16 bits, well past the bf16 gradient's 8.

If grad_D here plus lowmem's grad_Q gather come to well under unified's backward, this replaces the
counting sort of lowmem on the cross product and could make it the default (no fp32 buffer, no
atomics, deterministic). Checked in the interpreter (--check-only: it matches unified's grad_D,
bitwise the same run to run) and compiled for sm_90 (255 registers, no spill, the dots on wgmma at
R = 64 and 128).

Result (H200, 2026-11-30 01:17 UTC, results/scan-owned-20261130-0117.log; in-batch 128 x 128):
correct on the GPU (rel err 1.1e-4 against unified, bitwise run to run), but slow. The best tile
(R 64, CH 4096, BE 64, 4 warps) took 728 us for grad_D alone, the others 815-853; with lowmem's
grad_Q gather (219 us) that is 947 us, against 418 for unified's whole backward and 898 for
lowmem's. Each program runs one dependent chain (scan, compact, read back, gather Q rows, dot) at
two programs an SM (255 registers), so it is latency-bound. Not taken into the library.

    python benchmarks/probe_scan_owned.py            (GPU: check, then time against the library)
    TRITON_INTERPRET=1 python benchmarks/probe_scan_owned.py --check-only   (CPU: a small check)
"""

import argparse

import torch
import triton
import triton.language as tl

import maxsim.dense.backward as B
from maxsim._dispatch import interpreting
from maxsim._launch import launch


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld"])
def _grad_d_scan_kernel(q_ptr, g_ptr, arg_ptr, scratch_ptr, gd_ptr, Nq, Nd, Lq, Ld, dim,
                        R: tl.constexpr, CH: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                        DOT_FP32: tl.constexpr):
    """Q [Nq, Lq, d] bf16 contiguous; g [Nq, Nd] fp32; argmax [Nq, Nd, Lq] int32 (-1: none);
    scratch [programs, CH] int32; grad_D [Nd, Ld, d] bf16. Program (j, row block). DOT_FP32: one
    IEEE fp32 matmul instead of the two bf16 parts (the interpreter's bf16 dot is wrong)."""
    j = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * R
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    p_scratch = scratch_ptr + pid.to(tl.int64) * CH
    o_d = tl.arange(0, BD)
    m_d = o_d < dim
    o_r = tl.arange(0, R)
    acc = tl.zeros([R, BD], dtype=tl.float32)
    n_entries = Nq * Lq
    for e0 in range(0, n_entries, CH):
        e = e0 + tl.arange(0, CH)  # [CH] entries i * Lq + s, in order
        m_e = e < n_entries
        i = e // Lq
        t = tl.load(arg_ptr + (i.to(tl.int64) * Nd + j) * Lq + e % Lq, mask=m_e, other=-1)  # [CH] winners
        hit = m_e & (t >= r0) & (t < r0 + R)
        pos = tl.cumsum(hit.to(tl.int32), axis=0) - 1  # [CH] place among this chunk's hits
        n_hit = tl.sum(hit.to(tl.int32), axis=0)
        tl.store(p_scratch + pos, e * R + (t - r0), mask=hit)  # entry and local row, packed
        tl.debug_barrier()  # the block's stores visible to the block's loads
        for k0 in range(0, n_hit, BE):
            k = k0 + tl.arange(0, BE)
            m_k = k < n_hit
            packed = tl.load(p_scratch + k, mask=m_k, other=0)  # [BE]
            ek = packed // R
            rk = packed % R
            ik = ek // Lq
            gk = tl.load(g_ptr + ik.to(tl.int64) * Nd + j, mask=m_k, other=0.0)  # [BE]
            qk = tl.load(q_ptr + ek.to(tl.int64)[:, None] * dim + o_d[None, :], mask=m_k[:, None] & m_d[None, :],
                         other=0.0)  # [BE, BD] (Q rows i * Lq + s = the entry id)
            gq = gk[:, None] * qk.to(tl.float32)  # [BE, BD] fp32 terms
            onehot = (rk[None, :] == o_r[:, None]) & m_k[None, :]  # [R, BE]
            if DOT_FP32:
                acc = tl.dot(onehot.to(tl.float32), gq, acc, input_precision="ieee")
            else:
                hi = gq.to(tl.bfloat16, fp_downcast_rounding="rtne")
                lo = (gq - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
                acc = tl.dot(onehot.to(tl.bfloat16), hi, acc)
                acc = tl.dot(onehot.to(tl.bfloat16), lo, acc)
        tl.debug_barrier()  # every load of this chunk's scratch done before the next chunk's stores
    rows = r0 + o_r
    tl.store(gd_ptr + (j * Ld + rows.to(tl.int64))[:, None] * dim + o_d[None, :],
             acc.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=(rows < Ld)[:, None] & m_d[None, :])


def grad_d_scan(g, Q, argmax, Ld, R=64, CH=2048, BE=64, warps=4):
    """grad_D [Nd, Ld, d] bf16 of the cross product (no masks, no normalize) by _grad_d_scan_kernel."""
    Nq, Lq, d = Q.shape
    Nd = argmax.shape[1]
    n_blocks = -(-Ld // R)
    scratch = torch.empty(Nd * n_blocks, CH, dtype=torch.int32, device=Q.device)
    out = torch.empty(Nd, Ld, d, dtype=Q.dtype, device=Q.device)
    launch(_grad_d_scan_kernel, (Nd, n_blocks),
           (Q, g, argmax, scratch, out, Nq, Nd, Lq, Ld, d),
           dict(R=R, CH=CH, BE=BE, BD=triton.next_power_of_2(d), DOT_FP32=interpreting()),
           num_warps=warps, num_stages=2)
    return out


def check(nq, nd, lq, ld, d, device, **kw) -> bool:
    """Against the library's unified grad_D (fp32 atomics), and bitwise run to run."""
    from maxsim.dense.forward import maxsim_forward

    torch.manual_seed(0)
    Q = torch.randn(nq, lq, d, device=device).to(torch.bfloat16)
    D = torch.randn(1, nd, ld, d, device=device).to(torch.bfloat16)
    _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
    g = torch.randn(nq, nd, device=device)
    _, ref = B.maxsim_backward(g, Q, D, arg, normalize=False, strategy="unified")
    a = grad_d_scan(g, Q, arg, ld, **kw)
    b = grad_d_scan(g, Q, arg, ld, **kw)
    err = ((a.float() - ref[0].float()).norm() / ref.float().norm()).item()
    ok = torch.equal(a, b) and err < 5e-3
    print(f"check ({nq}, {nd}, {lq}, {ld}, {d}) {kw}: rel err against unified {err:.2e}, "
          f"bitwise run to run {torch.equal(a, b)} -> {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="unified only, two tiles")
    args = ap.parse_args()
    if args.check_only:
        ok = check(3, 4, 24, 150, 32, "cpu", R=64, CH=32, BE=16)
        raise SystemExit(0 if ok else 1)
    from maxsim.bench.timing import cold_ms
    from maxsim.dense.forward import maxsim_forward

    torch.manual_seed(0)
    nq = nd = 128
    Q = torch.randn(nq, 128, 128, device="cuda").to(torch.bfloat16)
    D = torch.randn(1, nd, 1024, 128, device="cuda").to(torch.bfloat16)
    _, arg = maxsim_forward(Q, D, None, None, save_argmax=True)
    g = torch.randn(nq, nd, device="cuda")
    for strategy in ("unified",) if args.quick else ("unified", "lowmem"):
        ms = cold_ms(lambda: B.maxsim_backward(g, Q, D, arg, normalize=False, strategy=strategy))  # noqa: B023
        print(f"library {strategy} backward: {1e3 * ms:.0f} us", flush=True)
    # lowmem's grad_Q gather alone (no scatter), as the library launches it
    gq = torch.empty_like(Q)
    fn = lambda: B.launch_gather(g, Q, D, arg, g, g, gq, None, False,  # noqa: E731
                                 B.gather_config(128, 128, False, scatter=False))
    print(f"grad_Q gather alone: {1e3 * cold_ms(fn):.0f} us", flush=True)
    tiles = [(64, 2048, 64, 4), (128, 2048, 64, 8), (64, 1024, 32, 4), (64, 4096, 64, 4), (128, 4096, 128, 8)]
    for R, CH, BE, warps in tiles[:2] if args.quick else tiles:
        try:
            check(16, 8, 128, 1024, 128, "cuda", R=R, CH=CH, BE=BE, warps=warps)
            ms = cold_ms(lambda: grad_d_scan(g, Q, arg, 1024, R=R, CH=CH, BE=BE, warps=warps))  # noqa: B023
            print(f"scan-owned grad_D R {R} CH {CH} BE {BE} warps {warps}: {1e3 * ms:.0f} us", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"scan-owned grad_D R {R} CH {CH} BE {BE} warps {warps}: {type(e).__name__} {e}", flush=True)


if __name__ == "__main__":
    main()
