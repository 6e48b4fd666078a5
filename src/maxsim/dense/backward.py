"""Fused MaxSim backward over padded tensors: kernels and launchers.

The forward saves, per (query, document, query token), the winning document token ``t*`` (int32,
-1 when the token contributes nothing). The score is linear in Q and D at that winner, so

    grad_Q[i, s]    = sum_j  g[i, j] * D[j, t*(i, j, s)]
    grad_D[j, t]    = sum_{(i, s) : t*(i, j, s) = t}  g[i, j] * Q[i, s]

With ``normalize`` the same sums run over unit vectors (giving G, the gradient with respect to the
unit vector), then the normalisation's Jacobian: ``grad_x = (G - (G . x_hat) x_hat) / |x|``.

Two strategies for grad_D:
- ``unified``: one kernel walks every (i, s) row once, gathers ``D[j, t*]`` for grad_Q and adds
  ``g * Q[i, s]`` into an fp32 grad_D buffer with atomics. Fastest; the order of the atomic adds,
  and so the last bits of grad_D, vary run to run.
- ``lowmem``: grad_Q from the same gather kernel without the scatter; grad_D destination-owned,
  written once in the input dtype, with no floating-point atomics and no fp32 buffer of D's size,
  bitwise deterministic:
  - cross product: the argmax is inverted by a counting sort (integer atomics count and place
    each entry under its destination row, a chunk of documents at a time, so the scratch stays
    small) and one program per document token sums its own contributions in ascending entry
    order, whatever order the placement left them in;
  - candidate lists: each document belongs to one query, so a tile of its tokens is a one-hot
    matmul over that query's tokens, on the tensor cores, with no inverse map at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._dispatch import interpreting
from maxsim._launch import DEFAULT_STAGES, launch
from maxsim.tuning import next_pow2
from maxsim.tuning import tables as T

# Bytes of lowmem's inverse-map scratch: an entry's int32 id in the order; a destination row's
# int32 count and int32 offset (the chunk budget itself is a tuning rule: maxsim.tuning.tables).
LOWMEM_BYTES_PER_ENTRY = 4
LOWMEM_BYTES_PER_ROW = 8


@triton.jit
def _through_normalization(b_g, b_unit, b_inv):
    """Rows of G, the gradient with respect to unit vectors x / |x|, taken back to x:
    ``(G - (G . x_hat) x_hat) / |x|``. b_g, b_unit [R, BD] fp32; b_inv [R] = 1 / |x|."""
    return b_inv[:, None] * (b_g - tl.sum(b_g * b_unit, axis=1)[:, None] * b_unit)


@triton.jit(do_not_specialize=["Nq", "Nd", "Lq", "Ld"])
def _maxsim_bwd_gather_kernel(
    q_ptr, d_ptr, g_ptr, arg_ptr, qinv_ptr, dinv_ptr, gq_ptr, gd_ptr,
    Nq, Nd, Lq, Ld, dim, rotate,
    stride_dq, stride_dn, stride_dl,  # D [Nq|1, Nd, Ld, d], unit stride on d
    BS: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
    CANDIDATES: tl.constexpr, NORMALIZE: tl.constexpr, SCATTER_D: tl.constexpr,
):
    """One program per (query i, block of BS query tokens): walks every document j, from
    document i * rotate (rotate 0 or 1), KB documents a step (their winners' loads all in flight at
    once: a short walk, as in candidate lists, is otherwise a chain of dependent loads).

    Q [Nq, Lq, d] contiguous; g [Nq, Nd] fp32; argmax [Nq, Nd, Lq] int32; qinv [Nq, Lq] and
    dinv [Nq|1, Nd, Ld] fp32 inverse norms (NORMALIZE); grad_Q [Nq, Lq, d] in Q's dtype;
    with SCATTER_D, grad_D [Nq|1, Nd, Ld, d] fp32 receives atomic adds (of G for unit vectors
    when NORMALIZE: the Jacobian is applied afterwards).
    """
    i_pid = tl.program_id(0)
    n_sblocks = tl.cdiv(Lq, BS)
    i_q = (i_pid // n_sblocks).to(tl.int64)
    o_s = (i_pid % n_sblocks) * BS + tl.arange(0, BS)  # [BS]
    o_d = tl.arange(0, BD)
    m_s = o_s < Lq
    m_d = o_d < dim
    m_sd = m_s[:, None] & m_d[None, :]
    b_q = tl.load(q_ptr + (i_q * Lq + o_s)[:, None] * dim + o_d[None, :], mask=m_sd, other=0.0).to(tl.float32)
    if NORMALIZE:
        b_qinv = tl.load(qinv_ptr + i_q * Lq + o_s, mask=m_s, other=0.0)  # [BS]
        b_q = b_q * b_qinv[:, None]  # unit vectors
    b_acc = tl.zeros([BS, BD], dtype=tl.float32)
    i_dq = i_q if CANDIDATES else 0  # which document set: this query's own, or the shared one
    o_kb = tl.arange(0, KB)
    for j0 in range(0, Nd, KB):
        # rotate = 1: each query starts at another document, so concurrent programs' atomics
        # spread out; 0: all walk the documents in step, so the grad_D rows being written at one
        # time are few and stay in L2 (the gather tile table, maxsim.tuning.tables, says which is faster where).
        m_j = j0 + o_kb < Nd  # [KB]
        j = ((j0 + o_kb + i_q * rotate) % Nd).to(tl.int64)  # [KB] documents
        g = tl.load(g_ptr + i_q * Nd + j, mask=m_j, other=0.0)[:, None, None]  # [KB, 1, 1]
        b_t = tl.load(arg_ptr + (i_q * Nd + j)[:, None] * Lq + o_s[None, :], mask=m_j[:, None] & m_s[None, :],
                      other=-1)  # [KB, BS] winners
        m_win = b_t >= 0
        b_t = tl.maximum(b_t, 0).to(tl.int64)
        p_rows = d_ptr + i_dq * stride_dq + (j * stride_dn)[:, None, None] + (b_t * stride_dl)[:, :, None] \
            + o_d[None, None, :]
        m_wd = m_win[:, :, None] & m_d[None, None, :]
        b_dw = tl.load(p_rows, mask=m_wd, other=0.0).to(tl.float32)  # [KB, BS, BD] gathered winners
        o_row = (i_dq * Nd + j)[:, None] * Ld + b_t  # [KB, BS] winner's row in grad_D
        if NORMALIZE:
            b_dw = b_dw * tl.load(dinv_ptr + o_row, mask=m_win, other=0.0)[:, :, None]
        b_acc += tl.sum(g * b_dw, axis=0)
        if SCATTER_D:
            tl.atomic_add(gd_ptr + o_row[:, :, None] * dim + o_d[None, None, :], g * b_q[None, :, :], mask=m_wd,
                          sem="relaxed")
    if NORMALIZE:
        # G . q_hat, then the Jacobian of q / |q|.
        b_acc = _through_normalization(b_acc, b_q, b_qinv)
    tl.store(gq_ptr + (i_q * Lq + o_s)[:, None] * dim + o_d[None, :], b_acc.to(gq_ptr.dtype.element_ty), mask=m_sd)


@triton.jit(do_not_specialize=["Nd", "Lq", "Ld", "row0", "n_docs", "n_entries"])
def _csr_count_kernel(arg_ptr, counts_ptr, rowptr_ptr, order_ptr, Nd, Lq, Ld, row0, n_docs, n_entries,
                      PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """Counting sort of a chunk's entries by destination row (cross product, lowmem), BLOCK entries
    a program. Entry e = (i * n_docs + doc) * Lq + s stands for query i's token s in document
    row0 + doc; its destination row is doc * Ld + argmax[i, row0 + doc, s] (none where that is -1).

    argmax [Nq, Nd, Lq] int32; counts [n_docs * Ld] int32. Pass 1 (PLACE false) counts each row's
    entries. Pass 2, given rowptr [n_docs * Ld + 1] int32 (the counts' exclusive prefix sum),
    counts them back down and writes each entry id into ``order`` at rowptr[row] + (its count - 1):
    every row's ids land in its own segment, in an order the atomics decide."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] entry ids
    m = e < n_entries
    per_query = n_docs * Lq
    i_q = e // per_query
    rest = e % per_query  # doc * Lq + s
    b_t = tl.load(arg_ptr + (i_q * Nd + row0) * Lq + rest, mask=m, other=-1)  # [BLOCK] winners
    live = m & (b_t >= 0)
    key = (rest // Lq) * Ld + b_t  # destination rows
    if PLACE:
        c = tl.atomic_add(counts_ptr + key, -1, mask=live, sem="relaxed")
        pos = tl.load(rowptr_ptr + key, mask=live, other=0) + c - 1
        tl.store(order_ptr + pos, e.to(tl.int32), mask=live)
    else:
        tl.atomic_add(counts_ptr + key, 1, mask=live, sem="relaxed")


@triton.jit
def _smallest_of_both(a, b, BE: tl.constexpr):
    """The BE smallest of two [BE] int32 vectors, ascending."""
    both = tl.sort(tl.reshape(tl.join(a, b), [2 * BE]))  # [2 BE] ascending
    lo, _ = tl.split(tl.permute(tl.reshape(both, [2, BE]), (1, 0)))
    return lo


@triton.jit(do_not_specialize=["Nd", "Lq", "Ld", "row0", "n_docs"])
def _maxsim_bwd_owned_kernel(
    q_ptr, d_ptr, g_ptr, order_ptr, rowptr_ptr, dinv_ptr, qinv_ptr, gd_ptr,
    Nd, Lq, Ld, dim, row0, n_docs,
    stride_dn, stride_dl,
    BE: tl.constexpr, BD: tl.constexpr, NORMALIZE: tl.constexpr,
):
    """Cross product, lowmem grad_D: one program per document token of a chunk of ``n_docs``
    documents starting at ``row0``, summing its contributions ``g[i, doc] * Q[i, s]``.

    order [E] int32: entry ids grouped by destination (entry = (i * n_docs + doc) * Lq + s), in any
    order within a row; rowptr [n_docs * Ld + 1] int32: CSR offsets. Each pass takes the BE
    smallest ids above the last pass's and sums them as one sorted block, so the sum runs in
    ascending entry order whatever order the placement left: bitwise deterministic (a row of c
    entries costs ceil(c / BE)^2 merges; rows hold about Nq * Lq / Ld). grad_D [1, Nd, Ld, d] in
    D's dtype, written once per row.
    """
    BIG: tl.constexpr = 2**31 - 1
    r = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < dim
    o_e = tl.arange(0, BE)
    doc = (row0 + r // Ld).to(tl.int64)
    t = r % Ld
    p_row = d_ptr + doc * stride_dn + t * stride_dl
    e0 = tl.load(rowptr_ptr + r)
    e1 = tl.load(rowptr_ptr + r + 1)
    n_blocks = tl.cdiv(e1 - e0, BE)
    b_acc = tl.zeros([BD], dtype=tl.float32)
    last = -1
    for _pass in range(n_blocks):
        best = tl.full([BE], BIG, tl.int32)  # the BE smallest ids above `last`, ascending
        for blk in range(n_blocks):
            o = e0 + blk * BE + o_e
            x = tl.load(order_ptr + o, mask=o < e1, other=BIG)
            best = _smallest_of_both(best, tl.where(x > last, x, BIG), BE)
        valid = best != BIG
        ent = best.to(tl.int64)
        s = ent % Lq
        i_q = ent // (n_docs * Lq)
        w = tl.load(g_ptr + i_q * Nd + doc, mask=valid, other=0.0)  # [BE]
        b_q = tl.load(q_ptr + (i_q * Lq + s)[:, None] * dim + o_d[None, :],
                      mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BE, BD]
        if NORMALIZE:
            b_q = b_q * tl.load(qinv_ptr + i_q * Lq + s, mask=valid, other=0.0)[:, None]
        b_acc += tl.sum(w[:, None] * b_q, axis=0)
        last = tl.max(tl.where(valid, best, -1), axis=0)
    if NORMALIZE:
        # G . d_hat, then the Jacobian of d / |d|.
        dinv = tl.load(dinv_ptr + doc * Ld + t)
        b_dh = tl.load(p_row + o_d, mask=m_d, other=0.0).to(tl.float32) * dinv  # [BD] unit vector
        b_acc = dinv * (b_acc - tl.sum(b_acc * b_dh, axis=0) * b_dh)
    tl.store(gd_ptr + (doc * Ld + t) * dim + o_d, b_acc.to(gd_ptr.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["K", "Lq", "Ld"])
def _maxsim_bwd_lists_kernel(
    q_ptr, d_ptr, g_ptr, arg_ptr, qinv_ptr, dinv_ptr, gd_ptr,
    K, Lq, Ld, dim,
    stride_dq, stride_dn, stride_dl,  # D [Nq, K, Ld, d], unit stride on d
    BN: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Candidate lists, lowmem grad_D: one program per tile of BN tokens of one document and BD
    columns of the embedding (program_id(2): wide embeddings in chunks that fit shared memory;
    with NORMALIZE one chunk holds the whole row, whose dot the Jacobian needs).

    Document (i, k) belongs to query i alone, so its gradient is a one-hot matmul over that query's
    Lq tokens, ``grad_D[i, k, t] = g[i, k] * sum_{s : t*(i, k, s) = t} Q[i, s]``, summed on the
    tensor cores in a fixed order: no atomics, no scratch, bitwise deterministic, each row written
    once in D's dtype. The one-hot factor is exact in any dtype, so the sums are exact fp32 sums of
    the inputs (fp32 and normalised queries take the IEEE fp32 dot).

    Q [Nq, Lq, d] contiguous; g [Nq, K] fp32; argmax [Nq, K, Lq] int32; qinv [Nq, Lq] and
    dinv [Nq, K, Ld] fp32 (NORMALIZE); grad_D [Nq, K, Ld, d] contiguous.
    """
    r = tl.program_id(0).to(tl.int64)  # document (i, k), flattened
    i_q = r // K
    o_t = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] this program's document tokens
    m_t = o_t < Ld
    o_d = tl.program_id(2) * BD + tl.arange(0, BD)  # [BD] this program's embedding columns
    m_d = o_d < dim
    b_acc = tl.zeros([BN, BD], dtype=tl.float32)
    for s0 in range(0, Lq, BS):
        o_s = s0 + tl.arange(0, BS)  # [BS] query tokens
        m_s = o_s < Lq
        b_win = tl.load(arg_ptr + r * Lq + o_s, mask=m_s, other=-1)  # [BS] winners (-1: none)
        b_q = tl.load(q_ptr + (i_q * Lq + o_s)[:, None] * dim + o_d[None, :],
                      mask=m_s[:, None] & m_d[None, :], other=0.0)  # [BS, BD]
        b_hit = b_win[None, :] == o_t[:, None]  # [BN, BS] one-hot
        if DOT_FP32:
            b_qf = b_q.to(tl.float32)
            if NORMALIZE:
                b_qf = b_qf * tl.load(qinv_ptr + i_q * Lq + o_s, mask=m_s, other=0.0)[:, None]
            b_acc = tl.dot(b_hit.to(tl.float32), b_qf, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_hit.to(b_q.dtype), b_q, b_acc)
    b_acc = b_acc * tl.load(g_ptr + r)
    if NORMALIZE:
        # G . d_hat, then the Jacobian of d / |d|.
        b_dinv = tl.load(dinv_ptr + r * Ld + o_t, mask=m_t, other=0.0)  # [BN]
        p_d = d_ptr + i_q * stride_dq + (r % K) * stride_dn + o_t.to(tl.int64)[:, None] * stride_dl + o_d[None, :]
        b_dh = tl.load(p_d, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32) * b_dinv[:, None]
        b_acc = _through_normalization(b_acc, b_dh, b_dinv)
    p_out = gd_ptr + (r * Ld + o_t.to(tl.int64))[:, None] * dim + o_d[None, :]
    tl.store(p_out, b_acc.to(gd_ptr.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["n_rows", "Nd", "Ld"])
def _normalize_jacobian_kernel(
    gd32_ptr, d_ptr, dinv_ptr, gd_ptr,
    n_rows, Nd, Ld, dim,
    stride_dq, stride_dn, stride_dl,  # D [Nq|1, Nd, Ld, d], unit stride on d
    BR: tl.constexpr, BD: tl.constexpr,
):
    """unified with normalize: ``grad_D = (G - (G . d_hat) d_hat) / |d|`` for a block of BR rows of
    the fp32 buffer G, written in D's dtype, in one pass (no fp32 copies of D).

    gd32 [n_rows, d] fp32 and grad_D [n_rows, d] contiguous over the rows of D; dinv [n_rows] fp32.
    """
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # [BR] flattened rows of D
    m_r = o_r < n_rows
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d < dim)[None, :]
    doc = o_r // Ld
    p_d = d_ptr + (doc // Nd) * stride_dq + (doc % Nd) * stride_dn + (o_r % Ld) * stride_dl
    b_dinv = tl.load(dinv_ptr + o_r, mask=m_r, other=0.0)  # [BR]
    b_dh = tl.load(p_d[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32) * b_dinv[:, None]
    b_g = tl.load(gd32_ptr + o_r[:, None] * dim + o_d[None, :], mask=m, other=0.0)  # [BR, BD]
    b_g = _through_normalization(b_g, b_dh, b_dinv)
    tl.store(gd_ptr + o_r[:, None] * dim + o_d[None, :], b_g.to(gd_ptr.dtype.element_ty), mask=m)


def launch_gather(g, Q, D, argmax, qinv, dinv, grad_Q, gd32, normalize, config):
    """The gather kernel on canonical inputs (as :func:`maxsim_backward` prepares them): writes
    grad_Q ``[Nq, Lq, d]`` and, given ``gd32`` (fp32, D's shape, zeroed), adds grad_D into it by
    atomics. ``config``: (BS, warps, rotate, KB), as ``maxsim.selection.dense.backward_config``
    returns it under ``"gather"``."""
    BS, warps, rotate, KB = config
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    candidates = D.shape[0] != 1
    launch(
        _maxsim_bwd_gather_kernel, (Nq * -(-Lq // BS),),
        (Q, D, g, argmax, qinv, dinv, grad_Q, g if gd32 is None else gd32, Nq, Nd, Lq, Ld, d, rotate,
         D.stride(0) if candidates else 0, D.stride(1), D.stride(2)),
        dict(BS=BS, BD=max(16, next_pow2(d)), KB=KB, CANDIDATES=candidates, NORMALIZE=normalize,
             SCATTER_D=gd32 is not None),
        num_warps=warps, num_stages=DEFAULT_STAGES,
    )


def _inverse_norms(x: torch.Tensor) -> torch.Tensor:
    """1 / max(|x|, 1e-12) over the last dim, in fp32, without an fp32 copy of x."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).clamp_min(1e-12).reciprocal().contiguous()


def maxsim_backward(
    grad: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    argmax: torch.Tensor,
    *,
    normalize: bool,
    strategy: str,
    config: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad * scores)`` with respect to Q and D.

    Args:
        grad: ``[Nq, Nd]`` upstream gradient.  Q: ``[Nq, Lq, d]``.  D: ``[Nq|1, Nd, Ld, d]``.
        argmax: ``[Nq, Nd, Lq]`` int32 from the forward, -1 where nothing flows (masked query
            token, empty document, or, in multiply mode, a masked winner).
        strategy: ``"unified"`` or ``"lowmem"`` (see the module docstring).
        config: every kernel's tile (``maxsim.selection.dense.backward_config``).

    Returns:
        grad_Q ``[Nq, Lq, d]`` in Q's dtype and grad_D in D's dtype and shape.
    """
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    candidates = D.shape[0] != 1
    if Nq == 0 or Nd == 0 or Lq == 0 or Ld == 0:
        return torch.zeros_like(Q, memory_format=torch.contiguous_format), torch.zeros(D.shape, dtype=D.dtype, device=D.device)
    grad_Q = torch.empty_like(Q, memory_format=torch.contiguous_format)  # the gather kernel writes every row
    Q = Q.contiguous()
    D = D if D.stride(-1) == 1 else D.contiguous()
    g = grad.to(torch.float32).contiguous()
    argmax = argmax.contiguous()
    qinv = _inverse_norms(Q) if normalize else g  # any tensor when unused
    dinv = _inverse_norms(D) if normalize else g
    BD = config["BD"]
    unified = strategy == "unified"
    gd32 = torch.zeros(D.shape, dtype=torch.float32, device=D.device) if unified else None
    launch_gather(g, Q, D, argmax, qinv, dinv, grad_Q, gd32, normalize, config["gather"])
    if unified:
        if not normalize:
            return grad_Q, gd32.to(D.dtype)
        grad_D = torch.empty(D.shape, dtype=D.dtype, device=D.device)
        n_rows = D.shape[0] * Nd * Ld
        BR, warps = config["jacobian"]
        launch(
            _normalize_jacobian_kernel, (-(-n_rows // BR),),
            (gd32, D, dinv, grad_D, n_rows, Nd, Ld, d, D.stride(0), D.stride(1), D.stride(2)),
            dict(BR=BR, BD=BD), num_warps=warps, num_stages=DEFAULT_STAGES,
        )
        return grad_Q, grad_D
    if candidates:
        return grad_Q, _grad_d_lists(g, Q, D, argmax, qinv, dinv, normalize, config["lists"])
    return grad_Q, _grad_d_owned(g, Q, D, argmax, qinv, dinv, normalize, BD, config)


def _grad_d_lists(g, Q, D, argmax, qinv, dinv, normalize, tile):
    """lowmem grad_D for candidate lists: the one-hot matmul kernel, a program per document tile."""
    Nq, Lq, d = Q.shape
    K, Ld = D.shape[1], D.shape[2]
    grad_D = torch.empty(D.shape, dtype=D.dtype, device=D.device)  # every row is written once
    BN, BS, warps, BD = tile  # BD: the columns a program (the whole row, or a chunk of a wide one)
    if normalize and BD < d:
        raise ValueError(f"maxsim: backward='lowmem' on candidate lists with normalize=True takes d <= {BD} "
                         f"(got d={d}): use backward='unified', or normalise the embeddings before the call")
    launch(
        _maxsim_bwd_lists_kernel, (Nq * K, -(-Ld // BN), -(-d // BD)),
        (Q, D, g, argmax, qinv, dinv, grad_D, K, Lq, Ld, d, D.stride(0), D.stride(1), D.stride(2)),
        dict(
            BN=BN, BS=BS, BD=BD, NORMALIZE=normalize,
            # fp32 and normalised inputs need fp32 products; the interpreter's bf16 dot is wrong.
            DOT_FP32=normalize or Q.dtype == torch.float32 or interpreting(),
        ),
        num_warps=warps, num_stages=DEFAULT_STAGES,
    )
    return grad_D


def _grad_d_owned(g, Q, D, argmax, qinv, dinv, normalize, BD, config):
    """lowmem grad_D for the cross product: invert the argmax a chunk of documents at a time (a
    counting sort), then one program per document token."""
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    grad_D = torch.empty(D.shape, dtype=D.dtype, device=D.device)  # every row is written once
    must_hold = Q.numel() * Q.element_size() + D.numel() * D.element_size() + argmax.numel() * 4
    budget = min(T.LOWMEM_MAX_CHUNK_BYTES, max(T.LOWMEM_MIN_CHUNK_BYTES, int(T.LOWMEM_SCRATCH_FRACTION * must_hold)))
    chunk = max(1, min(Nd, budget // (LOWMEM_BYTES_PER_ENTRY * Nq * Lq + LOWMEM_BYTES_PER_ROW * Ld)))
    counts = torch.zeros(chunk * Ld, dtype=torch.int32, device=D.device)  # back to 0 after each chunk
    rowptr = torch.zeros(chunk * Ld + 1, dtype=torch.int32, device=D.device)
    order = torch.empty(Nq * chunk * Lq, dtype=torch.int32, device=D.device)
    for row0 in range(0, Nd, chunk):
        n_docs = min(chunk, Nd - row0)
        invert_argmax(argmax, row0, n_docs, Ld, counts, rowptr, order, config["invert"])
        sum_owned_rows(g, Q, D, order, rowptr, qinv, dinv, grad_D, row0, n_docs, normalize, BD, config["owned"])
    return grad_D


def invert_argmax(argmax, row0, n_docs, Ld, counts, rowptr, order, tile):
    """The inverse map of documents row0 .. row0 + n_docs (cross product): ``order`` holds entry ids
    (_csr_count_kernel's numbering) grouped by destination row, ``rowptr [n_docs * Ld + 1]`` int32
    their CSR offsets; within a row the order is the atomics'. counts: int32 zeros, left zero.
    tile: (BLOCK entries a program, warps)."""
    Nq, Nd, Lq = argmax.shape
    n_entries, n_rows = Nq * n_docs * Lq, n_docs * Ld
    BLOCK, warps = tile
    for place in (False, True):
        if place:
            torch.cumsum(counts[:n_rows], 0, dtype=torch.int32, out=rowptr[1:n_rows + 1])
        launch(
            _csr_count_kernel, (-(-n_entries // BLOCK),),
            (argmax, counts, rowptr, order, Nd, Lq, Ld, row0, n_docs, n_entries),
            dict(PLACE=place, BLOCK=BLOCK), num_warps=warps, num_stages=DEFAULT_STAGES,
        )


def sum_owned_rows(g, Q, D, order, rowptr, qinv, dinv, grad_D, row0, n_docs, normalize, BD, tile):
    """grad_D's rows of documents row0 .. row0 + n_docs from their inverse map (invert_argmax).
    tile: (BE entries summed at once, warps)."""
    Nq, Lq, d = Q.shape
    Nd, Ld = D.shape[1], D.shape[2]
    BE, warps = tile
    launch(
        _maxsim_bwd_owned_kernel, (n_docs * Ld,),
        (Q, D, g, order, rowptr, dinv, qinv, grad_D, Nd, Lq, Ld, d, row0, n_docs, D.stride(1), D.stride(2)),
        dict(BE=BE, BD=BD, NORMALIZE=normalize), num_warps=warps, num_stages=DEFAULT_STAGES,
    )
