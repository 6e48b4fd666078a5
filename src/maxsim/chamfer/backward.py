"""Chamfer backward through the saved argmin: kernels and launchers.

Each nearest-neighbour distance depends on two points only, its source and its winner, so with
``g_x = dL/d dist_x`` and ``g_y = dL/d dist_y``

    grad_x[i] = g_x[i] phi(x_i - y_nn(i))  +  sum_{j : nn(j) = i} g_y[j] phi(x_i - y_j)
    grad_y[j] = g_y[j] phi(y_j - x_nn(j))  +  sum_{i : nn(i) = j} g_x[i] phi(y_j - x_i)

with ``phi(v) = 2 v`` (norm 2) or ``sign(v)`` (norm 1; 0 at 0). The first term of each is owned by
its point; the sums scatter into the winners. Points with index -1 (padding, or an empty other
cloud) add nothing.

Two ways to reduce the sums (:mod:`maxsim.selection.chamfer` picks by ``deterministic``):

- atomic: one program per block of source points computes its own term, stores it (first
  direction) or adds it (second direction: the buffer already holds the first one's scatter), and
  adds the negated term into the winner's row by fp32 atomics. Two launches (one a direction) into
  fp32 buffers, then one cast to the input dtype. The order of the atomic adds, and so the last
  bits, vary run to run.
- owned: the argmin of each direction is inverted by a stable sort (:func:`maxsim._csr.group_by_row`);
  one program per block of destination points sums its own term and then its entries, in
  ascending entry order, in fp32 registers, and writes once in the input dtype. No atomics, no
  fp32 buffer, bitwise deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim import _outputs
from maxsim._csr import group_by_row
from maxsim._launch import launch


@triton.jit
def _phi(b_diff, NORM: tl.constexpr):
    """d dist / d source for a difference source - target (fp32)."""
    if NORM == 1:
        return tl.where(b_diff > 0, 1.0, tl.where(b_diff < 0, -1.0, 0.0))
    else:
        return 2.0 * b_diff


@triton.jit(do_not_specialize=["S", "T", "stride_sb", "stride_tb"])
def _chamfer_bwd_atomic_kernel(
    src_ptr, tgt_ptr, idx_ptr, g_ptr, gsrc_ptr, gtgt_ptr,
    S, T,
    stride_sb, stride_sn,  # source cloud [B, S, D], unit stride on D
    stride_tb, stride_tn,  # target cloud [B, T, D]
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Program (block, b): BR source points. gsrc [B, S, D] and gtgt [B, T, D] are fp32."""
    i_b = tl.program_id(1).to(tl.int64)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    o_d = tl.arange(0, BD)
    m_r = o_r < S
    m_d = (o_d < D)[None, :]
    b_idx = tl.load(idx_ptr + i_b * S + o_r, mask=m_r, other=-1)  # [BR]
    m_win = m_r & (b_idx >= 0)
    b_g = tl.load(g_ptr + i_b * S + o_r, mask=m_win, other=0.0).to(tl.float32)  # [BR]
    b_src = tl.load(src_ptr + i_b * stride_sb + o_r.to(tl.int64)[:, None] * stride_sn + o_d[None, :],
                    mask=m_win[:, None] & m_d, other=0.0).to(tl.float32)  # [BR, BD]
    b_tgt = tl.load(tgt_ptr + i_b * stride_tb + b_idx.to(tl.int64)[:, None] * stride_tn + o_d[None, :],
                    mask=m_win[:, None] & m_d, other=0.0).to(tl.float32)  # [BR, BD]
    b_term = b_g[:, None] * _phi(b_src - b_tgt, NORM)
    b_term = tl.where(m_win[:, None], b_term, 0.0)
    p_own = gsrc_ptr + (i_b * S + o_r.to(tl.int64))[:, None] * D + o_d[None, :]
    if ACCUMULATE:
        b_term_own = b_term + tl.load(p_own, mask=m_r[:, None] & m_d, other=0.0)
    else:
        b_term_own = b_term
    tl.store(p_own, b_term_own, mask=m_r[:, None] & m_d)
    p_win = gtgt_ptr + (i_b * T + b_idx.to(tl.int64))[:, None] * D + o_d[None, :]
    tl.atomic_add(p_win, -b_term, mask=m_win[:, None] & m_d, sem="relaxed")


@triton.jit(do_not_specialize=["P", "Q", "stride_pb", "stride_qb"])
def _chamfer_bwd_owned_kernel(
    p_ptr, q_ptr, idx_ptr, gp_ptr, order_ptr, rowptr_ptr, gq_ptr, out_ptr,
    P, Q,
    stride_pb, stride_pn,  # this cloud [B, P, D], unit stride on D
    stride_qb, stride_qn,  # the other cloud [B, Q, D]
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
    HAS_OWN: tl.constexpr, HAS_ENTRIES: tl.constexpr,
):
    """Program (block, b): the gradient of BR points of this cloud, written once in out's dtype.
    Own term from idx/gp (this cloud's winners); entries: the other cloud's points whose winner is
    here, ``order[rowptr[r]:rowptr[r + 1]]`` (flat ids b * Q + j, ascending), weighted by gq."""
    i_b = tl.program_id(1).to(tl.int64)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    o_d = tl.arange(0, BD)
    m_r = o_r < P
    m_d = (o_d < D)[None, :]
    b_p = tl.load(p_ptr + i_b * stride_pb + o_r.to(tl.int64)[:, None] * stride_pn + o_d[None, :],
                  mask=m_r[:, None] & m_d, other=0.0).to(tl.float32)  # [BR, BD]
    b_acc = tl.zeros([BR, BD], dtype=tl.float32)
    p_q = q_ptr + i_b * stride_qb
    if HAS_OWN:
        b_idx = tl.load(idx_ptr + i_b * P + o_r, mask=m_r, other=-1)
        m_win = m_r & (b_idx >= 0)
        b_g = tl.load(gp_ptr + i_b * P + o_r, mask=m_win, other=0.0).to(tl.float32)
        b_q = tl.load(p_q + b_idx.to(tl.int64)[:, None] * stride_qn + o_d[None, :], mask=m_win[:, None] & m_d,
                      other=0.0).to(tl.float32)
        b_acc += tl.where(m_win[:, None], b_g[:, None] * _phi(b_p - b_q, NORM), 0.0)
    if HAS_ENTRIES:
        o_flat = i_b * P + o_r  # [BR] destination rows
        b_start = tl.load(rowptr_ptr + o_flat, mask=m_r, other=0)
        # [BR, 1] columns throughout: one layout with the [BR, BD] blocks they meet
        b_start = b_start[:, None]
        b_count = tl.load(rowptr_ptr + o_flat + 1, mask=m_r, other=0)[:, None] - b_start  # [BR, 1]
        n_steps = tl.max(tl.max(b_count, axis=1), axis=0)
        for step in range(0, n_steps):
            m_e = step < b_count  # [BR, 1]
            o_e = tl.where(m_e, b_start + step, 0)
            b_ent = tl.load(order_ptr + o_e, mask=m_e, other=0)  # [BR, 1] flat ids b * Q + j
            b_ge = tl.load(gq_ptr + b_ent, mask=m_e, other=0.0).to(tl.float32)  # [BR, 1]
            b_qe = tl.load(p_q + (b_ent - i_b * Q) * stride_qn + o_d[None, :], mask=m_e & m_d,
                           other=0.0).to(tl.float32)  # [BR, BD]
            b_acc += tl.where(m_e, b_ge * _phi(b_p - b_qe, NORM), 0.0)
    p_out = out_ptr + (i_b * P + o_r.to(tl.int64))[:, None] * D + o_d[None, :]
    tl.store(p_out, b_acc.to(out_ptr.dtype.element_ty), mask=m_r[:, None] & m_d)


def _bd(D: int) -> int:
    return max(2, triton.next_power_of_2(D))


def chamfer_backward(grad_dist_x, grad_dist_y, x, y, idx_x, idx_y, *, norm: int, deterministic: bool,
                     config: dict):
    """grad_x [B, N, D] and grad_y [B, M, D] (the inputs' dtype) of ``sum(g_x dist_x) + sum(g_y dist_y)``.

    Args:
        grad_dist_x: ``[B, N]`` or None (zeros).  grad_dist_y: ``[B, M]`` or None (zeros; always
            None for a single direction, where idx_y is None).
        x, y: the forward's clouds.  idx_x ``[B, N]``, idx_y ``[B, M]`` int32: the saved argmin.
        deterministic: the owned kernels (else atomics).  config: ``BR, num_warps``.
    """
    B, N, D = x.shape
    M = y.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    both = idx_y is not None
    g_x = _as_grad(grad_dist_x, (B, N), x.device)
    g_y = _as_grad(grad_dist_y, (B, M), x.device) if both else None
    BR, BD, warps = config["BR"], _bd(D), config["num_warps"]
    consts = dict(D=D, BR=BR, BD=BD, NORM=norm)
    if deterministic:
        return _owned(x, y, idx_x, idx_y, g_x, g_y, consts, warps)
    grad_x = _outputs.empty((B, N, D), torch.float32, x.device)  # the first launch writes every row
    grad_y = torch.zeros((B, M, D), dtype=torch.float32, device=x.device)  # takes atomics from it
    if B * N and M:
        launch(_chamfer_bwd_atomic_kernel, (triton.cdiv(N, BR), B),
               (x, y, idx_x, g_x, grad_x, grad_y, N, M, x.stride(0), x.stride(1), y.stride(0), y.stride(1)),
               dict(consts, ACCUMULATE=False), num_warps=warps)
    elif B * N:
        grad_x.zero_()
    if both and B * M and N:
        launch(_chamfer_bwd_atomic_kernel, (triton.cdiv(M, BR), B),
               (y, x, idx_y, g_y, grad_y, grad_x, M, N, y.stride(0), y.stride(1), x.stride(0), x.stride(1)),
               dict(consts, ACCUMULATE=True), num_warps=warps)
    return grad_x.to(x.dtype), grad_y.to(y.dtype)


def _as_grad(g, shape, device):
    if g is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return g.contiguous()


def _inverse(idx: torch.Tensor, n_dest: int):
    """CSR of the entries ``[B, S]`` (flat ids b * S + s) grouped by their winner's flat row
    ``b * n_dest + idx`` (index -1: a sentinel row past the end)."""
    B, S = idx.shape
    base = torch.arange(B, device=idx.device, dtype=torch.int64)[:, None] * n_dest
    dest = torch.where(idx >= 0, base + idx.long(), B * n_dest).reshape(-1)
    return group_by_row(dest, B * n_dest)


def _owned(x, y, idx_x, idx_y, g_x, g_y, consts, warps):
    B, N, D = x.shape
    M = y.shape[1]
    both = idx_y is not None
    BR = consts["BR"]
    grad_x = _outputs.empty((B, N, D), x.dtype, x.device)
    grad_y = _outputs.empty((B, M, D), y.dtype, y.device)
    # grad_x: own terms (x -> y) and the y points whose winner is in x (y -> x).
    if B * N:
        if both:
            order, rowptr = _inverse(idx_y, N)
        else:
            order = rowptr = idx_x  # (unused)
        launch(_chamfer_bwd_owned_kernel, (triton.cdiv(N, BR), B),
               (x, y, idx_x, g_x, order, rowptr, g_y if both else g_x, grad_x, N, M, x.stride(0), x.stride(1),
                y.stride(0), y.stride(1)),
               dict(consts, HAS_OWN=M > 0, HAS_ENTRIES=both and M > 0), num_warps=warps)
    # grad_y: own terms (y -> x, both directions only) and the x points whose winner is in y.
    if B * M:
        order, rowptr = _inverse(idx_x, M)
        launch(_chamfer_bwd_owned_kernel, (triton.cdiv(M, BR), B),
               (y, x, idx_y if both else idx_x, g_y if both else g_x, order, rowptr, g_x, grad_y, M, N, y.stride(0),
                y.stride(1), x.stride(0), x.stride(1)),
               dict(consts, HAS_OWN=both and N > 0, HAS_ENTRIES=N > 0), num_warps=warps)
    return grad_x, grad_y
