"""Candidates for the backward's gather kernel: documents BJ at a time, and a narrow start window.

The shipped kernel (maxsim/dense/backward.py, ``_maxsim_bwd_gather_kernel``) walks one document
per step. Each step loads that document's winners (argmax), and only then gathers the winning
rows, so a step costs two dependent memory round trips. In the PTX (Triton 3.6, sm_90) nothing is
pipelined across steps. At in-batch 128 x 128 the gather alone took 236 us
(results/backward-profile-20261129-1320.log), about 3x what its 512 MB of row reads need from L2.
- BJ: load the winners of BJ documents at once, then gather their BJ x BS rows at once. Timed at
  18:20 on 2026-11-29 (results/ws-train-20261129-1815.log): 20 % faster on candidate lists, 4 %
  in-batch 128 x 128, 6 % slower at 256 x 256. Not folded into the library.
- span: query i starts at document i % span (the kernel used to rotate by i: span = Nd). With a
  small span the grad_D rows being written at one time are few enough to stay in L2. Timed at
  19:20 (results/ws-bwd-20261129-1919.log), in-batch 128 x 128: span 1 or 4 with BJ 1, BS 4,
  4 warps took 416 us against 453 for the kernel as it was; span 1 is now the library's rule for
  long queries in the cross product (``gather_config``'s rotate = 0). Without grad_D's atomics
  the best configuration took 260 us: the gather alone is latency-bound (2 TB/s from L2).

- PREFETCH (the next step's winners loaded before this step's rows): timed at 20:03-20:20
  (results/bwd-prefetch-20261129-2003.log, bwd-gather-20261129-2020.log). The gather alone got
  1.7x faster (155 against 260 us at in-batch 128 x 128), but with grad_D's atomics the whole
  backward only 1-3 % (406-413 against 417-425 us); candidate lists 22 % (115 against 148 us), where
  auto runs lowmem (80 us).
- SPLIT_ROLES (even programs gather, odd ones scatter): never among the best on the cross product.

Kept out of the library: where auto runs it, it gains 1-3 %. It covers the unified strategy
without normalize (cross product and candidate lists).

    TRITON_INTERPRET=1 python benchmarks/probe_backward_gather.py --check   (CPU: exactness)
    python benchmarks/probe_backward_gather.py                              (GPU: timings)
"""

import argparse
import itertools

import torch
import triton
import triton.language as tl

from maxsim.dense import backward as B


@triton.jit
def _winners(g_ptr, arg_ptr, i_q, j0, o_j, o_s, m_s, Nd, Lq, span):
    """Documents j0 .. j0 + BJ of query i_q's walk: (document [BJ], real [BJ], g [BJ], winners [BJ, BS])."""
    m_j = j0 + o_j < Nd  # [BJ]
    j = ((j0 + o_j + i_q % span) % Nd).to(tl.int64)  # [BJ] (queries start at span different documents)
    g = tl.load(g_ptr + i_q * Nd + j, mask=m_j, other=0.0)  # [BJ]
    b_t = tl.load(arg_ptr + ((i_q * Nd + j) * Lq)[:, None] + o_s[None, :],
                  mask=m_j[:, None] & m_s[None, :], other=-1)  # [BJ, BS] winners
    return j, m_j, g, b_t


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld", "span"])
def _gather_blocked_kernel(
    q_ptr, d_ptr, g_ptr, arg_ptr, gq_ptr, gd_ptr,
    Nq, Nd, Lq, Ld, dim, span,
    stride_dq, stride_dn, stride_dl,  # D [Nq|1, Nd, Ld, d], unit stride on d
    BJ: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, CANDIDATES: tl.constexpr, SCATTER_D: tl.constexpr,
    PREFETCH: tl.constexpr, SPLIT_ROLES: tl.constexpr,
):
    """As ``_maxsim_bwd_gather_kernel`` (no normalize), BJ documents per step. Query i starts at
    document i % span (the shipped kernel: span = Nd, or 1 for long queries). PREFETCH: the next
    step's winners are loaded before this step's rows, so a step waits on one memory round trip
    instead of two (the winners' load, then the rows' that it addresses). SPLIT_ROLES: twice the
    programs; even ones gather grad_Q, odd ones scatter grad_D, so the two run side by side
    instead of taking turns in each step."""
    i_pid = tl.program_id(0)
    gathers = True
    scatters = SCATTER_D
    if SPLIT_ROLES:
        gathers = i_pid % 2 == 0
        scatters = i_pid % 2 == 1
        i_pid = i_pid // 2
    n_sblocks = tl.cdiv(Lq, BS)
    i_q = (i_pid // n_sblocks).to(tl.int64)
    o_s = (i_pid % n_sblocks) * BS + tl.arange(0, BS)  # [BS]
    o_d = tl.arange(0, BD)
    o_j = tl.arange(0, BJ)
    m_s = o_s < Lq
    m_d = o_d < dim
    m_sd = m_s[:, None] & m_d[None, :]
    b_q = tl.load(q_ptr + (i_q * Lq + o_s)[:, None] * dim + o_d[None, :], mask=m_sd, other=0.0).to(tl.float32)
    b_acc = tl.zeros([BS, BD], dtype=tl.float32)
    i_dq = i_q if CANDIDATES else 0
    if PREFETCH:
        j_n, m_j_n, g_n, b_t_n = _winners(g_ptr, arg_ptr, i_q, 0, o_j, o_s, m_s, Nd, Lq, span)
    for j0 in range(0, Nd, BJ):
        if PREFETCH:
            j, m_j, g, b_t = j_n, m_j_n, g_n, b_t_n
            j_n, m_j_n, g_n, b_t_n = _winners(g_ptr, arg_ptr, i_q, j0 + BJ, o_j, o_s, m_s, Nd, Lq, span)
        else:
            j, m_j, g, b_t = _winners(g_ptr, arg_ptr, i_q, j0, o_j, o_s, m_s, Nd, Lq, span)
        m_win = b_t >= 0
        b_t = tl.maximum(b_t, 0).to(tl.int64)
        p_rows = d_ptr + i_dq * stride_dq + (j * stride_dn)[:, None, None] + (b_t * stride_dl)[:, :, None] \
            + o_d[None, None, :]
        m_wd = m_win[:, :, None] & m_d[None, None, :]
        if gathers:
            b_dw = tl.load(p_rows, mask=m_wd, other=0.0).to(tl.float32)  # [BJ, BS, BD]
            b_acc += tl.sum(g[:, None, None] * b_dw, axis=0)
        if scatters:
            o_row = ((i_dq * Nd + j) * Ld)[:, None] + b_t  # [BJ, BS]
            tl.atomic_add(gd_ptr + o_row[:, :, None] * dim + o_d[None, None, :], g[:, None, None] * b_q[None, :, :],
                          mask=m_wd, sem="relaxed")
    if gathers:
        tl.store(gq_ptr + (i_q * Lq + o_s)[:, None] * dim + o_d[None, :], b_acc.to(gq_ptr.dtype.element_ty), mask=m_sd)


def backward_blocked(g, Q, D4, argmax, BJ, BS, warps, span=None, scatter=True, prefetch=False, split=False):
    """unified grad_Q, grad_D (no normalize) with the candidate kernel; span None = Nd."""
    Nq, Lq, d = Q.shape
    Nd, Ld = D4.shape[1], D4.shape[2]
    candidates = D4.shape[0] != 1
    grad_Q = torch.empty_like(Q)
    gd32 = torch.zeros(D4.shape, dtype=torch.float32, device=D4.device)
    BS = min(BS, triton.next_power_of_2(Lq))
    _gather_blocked_kernel[((2 if split else 1) * Nq * triton.cdiv(Lq, BS),)](
        Q, D4, g.float().contiguous(), argmax, grad_Q, gd32, Nq, Nd, Lq, Ld, d, span or Nd,
        D4.stride(0) if candidates else 0, D4.stride(1), D4.stride(2),
        BJ=BJ, BS=BS, BD=triton.next_power_of_2(d), CANDIDATES=candidates, SCATTER_D=scatter, PREFETCH=prefetch,
        SPLIT_ROLES=split, num_warps=warps)
    return grad_Q, gd32.to(D4.dtype)


def inputs(nq, nd, lq, ld, d, candidates, device, dtype):
    from maxsim.dense.forward import maxsim_forward

    Q = torch.randn(nq, lq, d, device=device).to(dtype)
    D4 = torch.randn(nq if candidates else 1, nd, ld, d, device=device).to(dtype)
    _, arg = maxsim_forward(Q, D4, None, None, save_argmax=True)
    return Q, D4, arg, torch.randn(nq, nd, device=device)


def check():
    """CPU (interpreter): the candidate's gradients against the shipped kernel's."""
    for (nq, nd, lq, ld, cand, BJ, BS, span), prefetch in itertools.product(
            [(3, 5, 20, 33, False, 4, 8, None), (2, 7, 16, 40, True, 8, 16, None), (4, 3, 9, 17, False, 2, 4, None),
             (5, 6, 16, 40, False, 1, 16, 2), (5, 6, 16, 40, True, 2, 8, 1)], (False, True)):
      for split in (False, True):
        Q, D4, arg, g = inputs(nq, nd, lq, ld, 32, cand, "cpu", torch.float32)
        ref_q, ref_d = B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy="unified")
        gq, gd = backward_blocked(g, Q, D4, arg, BJ, BS, 4, span, prefetch=prefetch, split=split)
        err = max(float((gq - ref_q).abs().max()), float((gd - ref_d).abs().max()))
        print(f"({nq}, {nd}, {lq}, {ld}) candidates={cand} BJ={BJ} BS={BS} span={span} prefetch={prefetch} "
              f"split={split}: max |diff| {err:.2e}")
        assert err < 1e-4


def time_gpu(names=None):
    from maxsim.bench.shapes import TRAIN_GPU_SHAPES

    for shape in TRAIN_GPU_SHAPES[:3]:
        if names and shape.name not in names:
            continue
        Q, D4, arg, g = inputs(shape.nq, shape.nd, shape.lq, shape.ld, shape.d, shape.candidates, "cuda", torch.bfloat16)
        ref_q, ref_d = B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy="unified")
        ship = triton.testing.do_bench(
            lambda: B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy="unified"), return_mode="median")
        rows = []
        # span: how many different documents the queries start at. The shipped kernel spreads them
        # over all Nd (fewer atomics on one row at a time); a small span keeps the grad_D rows being
        # written few enough to stay in L2 (in-batch 128 x 128: a 67 MB fp32 buffer, 50 MB of L2).
        lowmem = triton.testing.do_bench(
            lambda: B.maxsim_backward(g, Q, D4, arg, normalize=False, strategy="lowmem"), return_mode="median")
        for BJ, BS, warps, span, pre, split in itertools.product((1, 2), (4, 16, 32), (4,), (1,), (False, True),
                                                                (False, True)):
            try:
                fn = lambda: backward_blocked(g, Q, D4, arg, BJ, BS, warps, span, prefetch=pre, split=split)  # noqa: E731
                gq, gd = fn()
                ok = torch.allclose(gq.float(), ref_q.float(), rtol=2e-2, atol=2e-2) and \
                    torch.allclose(gd.float(), ref_d.float(), rtol=2e-2, atol=2e-2)
                rows.append((triton.testing.do_bench(fn, return_mode="median"), BJ, BS, warps, span, pre, split, ok))
            except Exception as e:  # noqa: BLE001
                rows.append((float("inf"), BJ, BS, warps, span, pre, split, repr(e)[:60]))
        rows.sort(key=lambda r: r[0])
        best = rows[0]
        gq_only = triton.testing.do_bench(
            lambda: backward_blocked(g, Q, D4, arg, *best[1:5], scatter=False, prefetch=best[5]), return_mode="median")
        print(f"{shape.name}: shipped unified backward {ship * 1e3:.0f} us, lowmem {lowmem * 1e3:.0f} us; blocked best: "
              + "; ".join(f"BJ{bj} BS{bs} w{w} span{sp} prefetch{int(pre)} split{int(sl)} {ms * 1e3:.0f}us ok={ok}"
                          for ms, bj, bs, w, sp, pre, sl, ok in rows[:8])
              + f"; the best without grad_D's atomics {gq_only * 1e3:.0f}us", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exactness on the CPU (set TRITON_INTERPRET=1)")
    ap.add_argument("--shapes", default="", help="comma-separated training shape names (default: the first three)")
    args = ap.parse_args()
    check() if args.check else time_gpu([n for n in args.shapes.split(",") if n])
