"""Backward of packed (varlen) MaxSim: kernels and launcher.

The forward saves, per pair p and query token s, the winning token t* inside the document
(int32 ``[P, max_q]``, -1 where nothing flows). With ``i, j`` the pair's query and document:

    grad_q[cu_q[i] + s]   += g[p] * d[cu_d[j] + t*]
    grad_d[cu_d[j] + t*]  += g[p] * q[cu_q[i] + s]

- ``unified``: one kernel walks every (pair, query token) once and adds both contributions into
  fp32 buffers with atomics (fastest; last bits vary run to run).
- ``lowmem``: destination-owned on both sides: the (pair, token) entries are sorted by destination
  row (a stable sort, so a fixed order) and one program per row sums its entries and writes them
  once in the input dtype. No atomics, no fp32 buffers; bitwise deterministic. Its scratch is
  16 bytes per (pair, query token) entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._csr import group_by_row
from maxsim._launch import DEFAULT_STAGES, launch
from maxsim.varlen.forward import pair_of


@triton.jit(do_not_specialize=["Nq", "Nd", "P", "max_q", "pairs_per_program"])
def _varlen_bwd_atomic_kernel(
    q_ptr, d_ptr, cuq_ptr, cud_ptr, pq_ptr, pd_ptr, arg_ptr, g_ptr, gq_ptr, gd_ptr,
    Nq, Nd, P, max_q, dim, pairs_per_program,
    BR: tl.constexpr, BD: tl.constexpr, CROSS: tl.constexpr,
):
    """Program (pair run, block of BR query tokens). gq [Tq, d], gd [Td, d] fp32 get atomic adds."""
    n_rblocks = tl.cdiv(max_q, BR)
    i_pid = tl.program_id(0)
    o_s = (i_pid % n_rblocks) * BR + tl.arange(0, BR)  # [BR] query tokens
    p0 = ((i_pid // n_rblocks) * pairs_per_program).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < dim
    for pp in range(0, tl.minimum(pairs_per_program, P - p0)):
        p = p0 + pp  # int64
        i, j, ok = pair_of(p, pq_ptr, pd_ptr, Nq, Nd, CROSS)
        b_t = tl.load(arg_ptr + p * max_q + o_s, mask=o_s < max_q, other=-1)  # [BR]
        m_win = (b_t >= 0) & ok
        g = tl.load(g_ptr + p)
        o_qrow = tl.load(cuq_ptr + i) + o_s  # [BR] int64
        o_drow = tl.load(cud_ptr + j) + tl.maximum(b_t, 0)
        m = m_win[:, None] & m_d[None, :]
        b_d = tl.load(d_ptr + o_drow[:, None] * dim + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_q = tl.load(q_ptr + o_qrow[:, None] * dim + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.atomic_add(gq_ptr + o_qrow[:, None] * dim + o_d[None, :], g * b_d, mask=m, sem="relaxed")
        tl.atomic_add(gd_ptr + o_drow[:, None] * dim + o_d[None, :], g * b_q, mask=m, sem="relaxed")


@triton.jit(do_not_specialize=["Nq", "Nd", "max_q"])
def _varlen_bwd_owned_kernel(
    q_ptr, d_ptr, cuq_ptr, cud_ptr, pq_ptr, pd_ptr, arg_ptr, g_ptr, order_ptr, rowptr_ptr, out_ptr,
    Nq, Nd, max_q, dim,
    BD: tl.constexpr, CROSS: tl.constexpr, TO_Q: tl.constexpr,
):
    """One program per destination row (a query row if TO_Q, else a document row): sums its
    entries (ids p * max_q + s, sorted) in order and writes the row once in out's dtype."""
    r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < dim
    e0 = tl.load(rowptr_ptr + r)
    e1 = tl.load(rowptr_ptr + r + 1)
    b_acc = tl.zeros([BD], dtype=tl.float32)
    for e in range(e0, e1):
        ent = tl.load(order_ptr + e)  # int64
        p = ent // max_q
        i, j, ok = pair_of(p, pq_ptr, pd_ptr, Nq, Nd, CROSS)
        w = tl.load(g_ptr + p)
        if TO_Q:
            src = d_ptr + (tl.load(cud_ptr + j) + tl.load(arg_ptr + ent)) * dim
        else:
            src = q_ptr + (tl.load(cuq_ptr + i) + ent % max_q) * dim
        b_acc += w * tl.load(src + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * dim + o_d, b_acc.to(out_ptr.dtype.element_ty), mask=m_d)


def varlen_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    pair_q: torch.Tensor | None,
    pair_d: torch.Tensor | None,
    argmax: torch.Tensor,
    strategy: str,
    config: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad ``[Nq, Nd]`` (cross product) or ``[P]`` (pairs), argmax ``[P, max_q]`` ->
    (grad_q like q, grad_d like d). ``config``: the kernel's tile from
    ``maxsim.selection.varlen.backward_config``."""
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    cross = pair_q is None
    # Upstream gradient in pair order (cross product: pair p = query p % Nq, document p // Nq).
    g = (grad.t() if cross else grad).reshape(-1).to(torch.float32).contiguous()
    P, max_q = argmax.shape
    dim = q.shape[1]
    BD = config["BD"]
    pq = pair_q if pair_q is not None else cu_q
    pd = pair_d if pair_d is not None else cu_d
    if P == 0 or max_q == 0:
        return torch.zeros_like(q), torch.zeros_like(d)
    if strategy == "unified":
        gq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        gd = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
        BR, pairs_per_program = config["BR"], config["pairs_per_program"]
        n_rblocks = -(-max_q // BR)
        launch(
            _varlen_bwd_atomic_kernel, (n_rblocks * -(-P // pairs_per_program),),
            (q, d, cu_q, cu_d, pq, pd, argmax, g, gq, gd, Nq, Nd, P, max_q, dim, pairs_per_program),
            dict(BR=BR, BD=BD, CROSS=cross), num_warps=config["num_warps"], num_stages=DEFAULT_STAGES,
        )
        return gq.to(q.dtype), gd.to(d.dtype)
    # lowmem: entries e = p * max_q + s, keyed by their destination row on each side.
    p_idx = torch.arange(P, device=q.device)
    # (Clamped: a pair with a bad index has no valid entry, but must not index out of range.)
    qi = p_idx % Nq if cross else pair_q.clamp(0, max(Nq - 1, 0))
    dj = p_idx // Nq if cross else pair_d.clamp(0, max(Nd - 1, 0))
    s_idx = torch.arange(max_q, device=q.device)
    valid = argmax >= 0  # [P, max_q]
    grads = []
    for to_q, n_rows, key in (
        (True, q.shape[0], cu_q[qi][:, None] + s_idx[None, :]),
        (False, d.shape[0], cu_d[dj][:, None] + argmax.long()),
    ):
        key = torch.where(valid, key, n_rows).flatten()  # sentinel row n_rows for no entry
        order, rowptr = group_by_row(key, n_rows)
        out = torch.empty(q.shape if to_q else d.shape, dtype=q.dtype, device=q.device)
        if n_rows:
            launch(
                _varlen_bwd_owned_kernel, (n_rows,),
                (q, d, cu_q, cu_d, pq, pd, argmax, g, order, rowptr, out, Nq, Nd, max_q, dim),
                dict(BD=BD, CROSS=cross, TO_Q=to_q), num_warps=config["num_warps"], num_stages=DEFAULT_STAGES,
            )
        grads.append(out)
        del key, order
    return grads[0], grads[1]
