"""Selection for the packed (varlen) family: the forward kernel (cross product or pair list) and
its tile, the backward strategy and its kernel's tiles."""

from __future__ import annotations

import dataclasses
import functools

import torch

from maxsim.selection.common import Choice, auto_strategy, call_of, clamp, device_of
from maxsim.tuning import tables as T
from maxsim.tuning.rules import first_match, next_pow2, tile_of
from maxsim.varlen import specs


def query_rows_per_token(q, max_q: int, pairs: bool) -> int:
    """Query rows that share each packed document token: every query token ``q [Tq, d]`` for the
    cross product, one query's (at most ``max_q``) for pairs (what fp32's product rule reads)."""
    return max_q if pairs else q.shape[0]


def forward_choice(q: torch.Tensor, Nq: int, max_q: int, pairs: bool, argmax: bool,
                   family: str | None = None) -> Choice:
    """Kernel and tile (a dict: BM, BN, BK, num_warps, num_stages) for packed ``q [Tq, dim]``."""
    family = family or device_of(q)[1]
    seg_q = next_pow2(max_q)
    rows = seg_q if pairs else seg_q * next_pow2(Nq)
    return _forward_choice(rows, q.shape[1], q.dtype, pairs, argmax, family)


@functools.lru_cache(maxsize=256)
def _forward_choice(rows: int, dim: int, dtype: torch.dtype, pairs: bool, argmax: bool, family: str) -> Choice:
    call = call_of(dtype, dim, "pairs" if pairs else "packed", False, False, argmax, family)
    f = dict(dtype="fp32" if dtype == torch.float32 else "16bit", d=dim, rows=rows)
    if pairs:
        kernel, others, table = specs.PAIRS_FORWARD, (specs.STREAM_FORWARD, specs.CROSS_FORWARD), T.VARLEN_FORWARD_SM90
    elif specs.STREAM_FORWARD.unsupported(call) is None:
        # The stream reads each document tile once however short the documents; the per-document
        # kernel only where the stream cannot run (the argmax, for training).
        kernel, others, table = specs.STREAM_FORWARD, (specs.CROSS_FORWARD, specs.PAIRS_FORWARD), T.VARLEN_STREAM_SM90
    else:
        kernel, others, table = specs.CROSS_FORWARD, (specs.STREAM_FORWARD, specs.PAIRS_FORWARD), T.VARLEN_FORWARD_SM90
    why = kernel.unsupported(call)
    if why is not None:
        raise RuntimeError(f"maxsim: {kernel.name} cannot run this call: {why}")
    rule = first_match(table, f)
    config = clamp(tile_of(rule, f), family, varlen=True)
    why_not = tuple((o.name, o.unsupported(call) or "the stream runs this call") for o in others)
    return Choice(kernel, config, rule.name, rule.record, why_not)


def pq_forward_choice(q: torch.Tensor, Nq: int, max_q: int, family: str | None = None) -> Choice:
    """The stream kernel's tile for product-quantised tokens decoded on chip: the packed tile, with
    at least 4 warps, as the per-dimension look-ups of a [BN, d] tile spill the registers of fewer
    (tests/compile_check.py reports them; not yet timed on a GPU)."""
    choice = forward_choice(q, Nq, max_q, False, False, family)
    config = dict(choice.config, num_warps=max(4, choice.config["num_warps"]))
    return dataclasses.replace(choice, config=config, rule=f"{choice.rule}, product-quantised: >= 4 warps")


def strategy(backward: str, q: torch.Tensor, d: torch.Tensor, max_q: int) -> str:
    """The strategy for ``backward``: the dense family's rule (``auto_strategy``), where the packed
    family declares no one-hot kernel, so only the fp32 buffers' size can send it to lowmem."""
    if backward != "auto":
        return backward
    return auto_strategy(False, max_q, (q.numel() + d.numel()) * 4, one_hot_kernel=False)[0]


def strategy_choice(backward: str, q: torch.Tensor, d: torch.Tensor, max_q: int, n_pairs: int) -> Choice:
    chosen = strategy(backward, q, d, max_q)
    _, why, why_not, record = auto_strategy(False, max_q, (q.numel() + d.numel()) * 4, one_hot_kernel=False)
    kernel = specs.UNIFIED_BACKWARD if chosen == "unified" else specs.LOWMEM_BACKWARD
    other = specs.LOWMEM_BACKWARD if chosen == "unified" else specs.UNIFIED_BACKWARD
    reason = why if backward == "auto" else f"backward={backward!r} was asked for"
    return Choice(kernel, backward_config(chosen, max_q, q.shape[1], n_pairs), reason,
                  record if backward == "auto" else "the caller's choice",
                  ((other.name, why_not if backward == "auto" else "not asked for"),))


@functools.lru_cache(maxsize=256)
def backward_config(strategy: str, max_q: int, dim: int, n_pairs: int) -> dict:
    """unified: (BR rows a program, pairs a program, warps); lowmem: (warps,) of the owned kernel."""
    BD = max(16, next_pow2(dim))
    if strategy == "unified":
        t = tile_of(T.VARLEN_ATOMIC_BACKWARD[0], {})
        BR = max(1, min(t["BR_MAX"], next_pow2(max_q), t["ELEMENTS"] // BD))
        return dict(BD=BD, BR=BR, pairs_per_program=max(1, min(t["PAIRS_MAX"], n_pairs)), num_warps=t["num_warps"])
    f = dict(d=BD)
    return dict(BD=BD, num_warps=tile_of(first_match(T.VARLEN_OWNED_BACKWARD, f), f)["num_warps"])


def quantize_query(explicit: bool | None, family: str) -> tuple[bool, str]:
    """For one-byte corpora: whether the query is quantised too (the one-byte tensor-core dot), and
    why. ``explicit``: the caller's ``quantize_query`` (None: this rule)."""
    if explicit is not None:
        return explicit, f"quantize_query={explicit} was asked for"
    if family in T.ONE_BYTE_DOT_FAMILIES:
        return True, f"the one-byte dot was measured faster on {family} (ranking unchanged at top-10)"
    return False, f"the one-byte dot is not measured on {family}: the tokens are widened to the query's dtype"
