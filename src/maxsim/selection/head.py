"""Selection for ``maxsim.maxsim_from_hidden``: the fused head kernel, or projecting once and scoring.

The fused kernel (:mod:`maxsim.head.forward`) projects each document tile on chip once per query
row block that reads it. With few row blocks that is no more work than projecting once, and it
saves writing D ``[Nd, Ld, d]`` and reading it back (and holding it); with many, the repeated
projections cost more than the memory they save, and the call projects once with ``F.linear`` +
``F.normalize`` and runs ``maxsim.maxsim``. Where the line falls is a table rule
(:data:`maxsim.tuning.tables.HEAD_FUSION_SM90`, on the number of row blocks).

``MAXSIM_HEAD_PATH`` (``auto`` | ``fused`` | ``unfused``, read on every call) forces either path,
for benchmarks and tests; ``MAXSIM_HEAD_TILE`` (``"BM=32,BN=128,BKM=64,num_warps=8,num_stages=2[,waves=2]"``)
forces the fused kernel's tile, for tuning sweeps (``benchmarks/head_bench.py --tiles``).
"""

from __future__ import annotations

import functools
import os

import torch

from maxsim.head import specs
from maxsim.head.specs import HeadConfig
from maxsim.selection.common import Choice, call_of, clamp, device_of, parse_tile_spec
from maxsim.tuning import tables as T
from maxsim.tuning.rules import first_match, next_pow2, tile_of

PATHS = ("auto", "fused", "unfused")


def forced_path() -> str:
    path = os.environ.get("MAXSIM_HEAD_PATH", "auto").strip().lower() or "auto"
    if path not in PATHS:
        raise ValueError(f"maxsim: MAXSIM_HEAD_PATH must be one of {', '.join(PATHS)}; got {path!r}")
    return path


def forced_tile() -> HeadConfig | None:
    """The fused kernel's tile ``MAXSIM_HEAD_TILE`` asks for (read on every call), or None."""
    spec = os.environ.get("MAXSIM_HEAD_TILE", "")
    if not spec.strip():
        return None
    values, _ = parse_tile_spec(spec, "MAXSIM_HEAD_TILE", HeadConfig, ("BM", "BN", "BKM", "num_warps", "num_stages"))
    return HeadConfig(**values)


def features(Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, argmax: bool) -> dict:
    """The bucketed features the tables match on (powers of two of Nq and Lq)."""
    seg = next_pow2(max(Lq, 1))
    rows = seg if candidates else seg * next_pow2(max(Nq, 1))
    return dict(dtype="fp32" if dtype == torch.float32 else "16bit", d=d, rows=rows, seg=seg, argmax=argmax,
                candidates=candidates, lq=Lq)


def row_blocks(Nq: int, Lq: int, BM: int, candidates: bool) -> int:
    """How many query row blocks read each document tile (each projects it once)."""
    seg = BM if candidates else min(next_pow2(max(Lq, 1)), BM)
    chunks = max(1, -(-Lq // seg))
    return chunks if candidates else max(1, -(-Nq // (BM // seg))) * chunks


def forward_choice(Nq: int, Lq: int, d: int, d_model: int, dtype: torch.dtype, candidates: bool, masked: bool,
                   normalize: bool, argmax: bool, family: str, path: str = "auto") -> Choice:
    """The path and tile for a call (cached by bucket: Nq and Lq as powers of two)."""
    return _choice(next_pow2(max(Nq, 1)), next_pow2(max(Lq, 1)), d, d_model, dtype, candidates, masked, normalize,
                   argmax, family, path, forced_tile())


@functools.lru_cache(maxsize=1024)
def _choice(nq, lq, d, d_model, dtype, candidates, masked, normalize, argmax, family, path,
            forced: HeadConfig | None = None) -> Choice:
    f = features(nq, lq, d, dtype, candidates, argmax)
    call = call_of(dtype, d, "candidates" if candidates else "cross", masked, normalize, argmax, family)
    fused, unfused = specs.FUSED_FORWARD, specs.PROJECT_THEN_SCORE
    rule = first_match(T.HEAD_FORWARD_SM90, f)
    tile = {"waves": 2, **tile_of(rule, f)}
    config = HeadConfig(**clamp(tile, family)) if forced is None else forced
    blocks = row_blocks(nq, lq, config.BM, candidates)
    why_not_fused = fused.unsupported(call)
    if why_not_fused is None and d > specs.MAX_FUSED_D:
        why_not_fused = (f"keeps a projected tile [BN, d] on chip for d <= {specs.MAX_FUSED_D}, not d = {d} "
                         "(it would spill)")
    fusion = first_match(T.HEAD_FUSION_SM90, dict(f, row_blocks=blocks))
    repeat = (f"{blocks} query row blocks read each document tile, so the fused kernel would project every "
              f"tile {blocks} times (2 x {d_model} x {d} products a token each time)")
    if path == "unfused" or (path == "auto" and (why_not_fused is not None or not fusion.tile["fuse"])):
        if path == "unfused":
            reason, record, why = "MAXSIM_HEAD_PATH=unfused was asked for", "-", "not asked for (MAXSIM_HEAD_PATH)"
        elif why_not_fused is not None:
            reason, record, why = "the fused kernel cannot run the call", "-", why_not_fused
        else:
            reason, record = fusion.name, fusion.record
            why = repeat + "; projecting once then scoring does less work"
        return Choice(unfused, dict(then="maxsim.maxsim"), reason, record, ((fused.name, why),))
    if path == "fused":
        if why_not_fused is not None:
            raise ValueError(f"maxsim: MAXSIM_HEAD_PATH=fused, but {fused.name} {why_not_fused}")
        reason, record, why = "MAXSIM_HEAD_PATH=fused was asked for", rule.record, "not asked for (MAXSIM_HEAD_PATH)"
        if forced is not None:
            reason += ", with the tile MAXSIM_HEAD_TILE asks for"
    else:
        reason = f"{fusion.name}; tile: {rule.name}"
        record = fusion.record
        why = (f"only {blocks} query row block{'s' if blocks > 1 else ''} read{'' if blocks > 1 else 's'} each "
               f"document tile: projecting on chip costs no more, and projecting once would write D [Nd, Ld, {d}] "
               "to memory, read it back twice and hold it")
    return Choice(fused, config, reason, record, ((unfused.name, why),))


def backward_choice(fused: bool, backward: str) -> Choice:
    """How the gradients are computed for the forward path chosen."""
    if not fused:
        return Choice(specs.UNFUSED_BACKWARD, dict(grad_D=f"maxsim.maxsim backward={backward!r}"),
                      "the forward projected once", "-", ((specs.WINNERS_BACKWARD.name, "the forward was not fused"),))
    deterministic = backward == "lowmem"
    words = ("backward='lowmem': a sorted segment sum per winning token (bitwise deterministic)" if deterministic
             else "fp32 atomics (index_add_) into a buffer the size of the winners "
                  "(backward='lowmem' for a deterministic sum)")
    return Choice(specs.WINNERS_BACKWARD, dict(reduction="segment_sum" if deterministic else "atomics"), words,
                  "not tuned")


def explain_from_hidden(Q, H, W, b=None, q_mask=None, d_mask=None, *, normalize: bool = True,
                        mask_mode: str = "exclude", return_argmax: bool = False, backward: str = "auto",
                        gpu: str | None = None):
    """What ``maxsim.maxsim_from_hidden(Q, H, W, b, ...)`` runs, and why not the other path
    (``gpu``: as a GPU family would, e.g. ``"sm90"`` from any machine). Returns a
    :class:`maxsim.selection.Explanation`; print it."""
    from maxsim._capability import dtype_name
    from maxsim._dispatch import backend_for, interpreting
    from maxsim.head._inputs import check_head_inputs
    from maxsim.selection import Explanation
    from maxsim.tuning import FAMILIES

    if gpu is not None and gpu not in FAMILIES:
        raise ValueError(f"maxsim: gpu must be one of {', '.join(FAMILIES)} or None; got {gpu!r}")
    p = check_head_inputs(Q, H, W, b, q_mask, d_mask, mask_mode)
    Nq, Lq, d = p.Q.shape
    masks = [n for n, m in (("q_mask", p.q_mask), ("d_mask", p.d_mask)) if m is not None]
    header = (f"maxsim.maxsim_from_hidden: Q {list(Q.shape)} {dtype_name(Q.dtype)}, H {list(H.shape)} "
              f"({'candidate lists' if p.candidates else 'documents shared by every query'}), W {list(W.shape)}, "
              f"bias {'yes' if b is not None else 'no'}, masks: {', '.join(masks) or 'none'}, normalize={normalize}")
    backend = backend_for(p.Q.device)
    family = gpu
    if family is None and backend == "triton":
        family = "interpreter" if interpreting() else device_of(p.Q)[1]
    if family is None:
        return Explanation(header, None, None, f"reference (tensors on {p.Q.device}: the chunked PyTorch backend "
                                               "runs; pass gpu='sm90' to see a GPU's plan)")
    fwd = forward_choice(Nq, Lq, d, p.H.shape[-1], p.Q.dtype, p.candidates, bool(masks), normalize, return_argmax,
                         family, forced_path())
    bwd = backward_choice(fwd.kernel is specs.FUSED_FORWARD, backward)
    return Explanation(header, fwd, bwd, "Triton kernels" + (f", as {family} would run them" if gpu else ""))
