"""Triton helpers shared by the operator families' kernels."""

import triton
import triton.language as tl


@triton.jit
def max_nan(a, b):
    """max that propagates NaN: a NaN taking part in a max makes it NaN (IEEE fmax would drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def stacked_rows(i_pid, Nq, n_chunks, BM: tl.constexpr, SEG: tl.constexpr):
    """Which query rows program ``i_pid`` owns when queries are stacked into blocks of BM rows.

    Each query takes SEG rows of a block (SEG a power of two >= its length: BM // SEG queries per
    block), or, when queries are longer than BM, one query is cut into ``n_chunks`` chunks of
    SEG = BM rows. Row blocks vary fastest in the program id, so the programs reading one run of
    documents run together and share it through L2.

    Returns (document-run index, query group, chunk, query of each row [BM], token of each row [BM]).
    """
    QPB: tl.constexpr = BM // SEG
    n_mblocks = tl.cdiv(Nq, QPB) * n_chunks
    i_m = i_pid % n_mblocks
    i_qgroup = i_m // n_chunks
    i_chunk = i_m % n_chunks
    o_r = tl.arange(0, BM)
    return i_pid // n_mblocks, i_qgroup, i_chunk, i_qgroup * QPB + o_r // SEG, i_chunk * SEG + o_r % SEG
