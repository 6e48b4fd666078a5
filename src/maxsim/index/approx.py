"""PLAID's centroid-only (approximate) score of (query, document) pairs in one launch.

The search's second stage scores every candidate pair from the documents' centroid codes alone:
for each real query token, the max over the document's tokens of that token's centroid score,
summed. Done with PyTorch ops this gathers a ``[T, Lq]`` block of scores for every candidate token
and reduces it with a scatter, chunk by chunk from the host; here one program walks one pair's
codes and keeps the running max in registers, so nothing but the pair's score reaches memory.

The centroid scores are read as ``[Nq, C, Lq]`` (a code's Lq scores in one contiguous row) and the
pairs come sorted by query, so neighbouring programs read the same query's rows, which stay in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._dispatch import backend_for
from maxsim._kernels import max_nan
from maxsim._launch import launch
from maxsim.compressed.scoring import EMPTY_TOKEN_SCORE
from maxsim.tuning import next_pow2


@triton.jit(do_not_specialize=["num_codes", "query_len"])
def _plaid_approx_kernel(
    by_code_ptr,  # [Nq, C, Lq] fp32 centroid scores; -inf on masked query tokens
    keep_ptr,  # [Nq, C] bool: centroids kept by the threshold (KEEP only)
    codes_ptr,  # [T] int32 / int64 centroid code of each index token
    starts_ptr, lengths_ptr,  # [Nd] int64: each document's first token row and token count
    query_ptr, pid_ptr,  # [P] int64: the pairs
    real_ptr,  # [Nq, Lq] bool: real query tokens
    out_ptr,  # [P] fp32
    num_codes, query_len,
    BT: tl.constexpr, BLQ: tl.constexpr, KEEP: tl.constexpr, EMPTY: tl.constexpr,
):
    i_pair = tl.program_id(0)
    query = tl.load(query_ptr + i_pair)
    pid = tl.load(pid_ptr + i_pair)
    start = tl.load(starts_ptr + pid)
    length = tl.load(lengths_ptr + pid)
    o_q = tl.arange(0, BLQ)
    m_q = o_q < query_len
    p_rows = by_code_ptr + query * num_codes * query_len  # this query's [C, Lq]
    b_best = tl.full([BLQ], EMPTY, dtype=tl.float32)
    for t0 in range(0, length, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < length
        b_code = tl.load(codes_ptr + start + o_t, mask=m_t, other=0).to(tl.int64)  # [BT]
        if KEEP:
            m_t = m_t & (tl.load(keep_ptr + query * num_codes + b_code, mask=m_t, other=0) != 0)
        b_s = tl.load(p_rows + b_code[:, None] * query_len + o_q[None, :], mask=m_t[:, None] & m_q[None, :],
                      other=float("-inf"))  # [BT, BLQ]
        b_best = max_nan(b_best, tl.reduce(b_s, 0, max_nan))
    b_real = tl.load(real_ptr + query * query_len + o_q, mask=m_q, other=0) != 0
    tl.store(out_ptr + i_pair, tl.sum(tl.where(b_real, b_best, 0.0), axis=0))


def approx_scores_fused(by_code, keep, codes, starts, lengths, query, pids, real):
    """PLAID's approximate score [P] fp32 of each pair (query[p], pids[p]) as one launch, or None
    where the kernel does not run (the PyTorch path then does: the CPU, tensors on other devices).

    by_code [Nq, C, Lq] fp32 (-inf on masked query tokens), keep [Nq, C] bool or None, codes [T],
    starts / lengths [Nd] int64 (document rows of ``codes``), query / pids [P] int64 sorted by
    query, real [Nq, Lq] bool. A token whose centroid ``keep`` drops adds nothing; a query token
    that finds none scores EMPTY_TOKEN_SCORE; masked query tokens add 0.
    """
    device = by_code.device
    if backend_for(device) != "triton" or any(t.device != device for t in (codes, starts, lengths, query, pids)):
        return None
    num_queries, num_codes, query_len = by_code.shape
    out = torch.empty(pids.numel(), dtype=torch.float32, device=device)
    if pids.numel() == 0:
        return out
    keep_arg = keep if keep is not None else real  # (unread without KEEP)
    args = (by_code.contiguous(), keep_arg.contiguous(), codes.contiguous(), starts.contiguous(),
            lengths.contiguous(), query.contiguous(), pids.contiguous(), real.contiguous(), out, num_codes, query_len)
    constexprs = dict(BT=32, BLQ=max(16, next_pow2(query_len)), KEEP=keep is not None, EMPTY=EMPTY_TOKEN_SCORE)
    launch(_plaid_approx_kernel, (pids.numel(),), args, constexprs, num_warps=4, num_stages=2)
    return out
