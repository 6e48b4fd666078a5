"""Selection for the dense (padded) family: which forward kernel runs a call and with which tile,
which backward strategy and kernel tiles reduce its gradients.

The forward candidates are the Triton kernel and, on Hopper, the warp-specialized Gluon kernel
(:mod:`maxsim.dense.specs`). A kernel runs a call when its declaration supports it *and* a table
of :mod:`maxsim.tuning.tables` holds a measured tile for the call's bucket; the Triton table ends
with a default row, so it always runs what the Gluon kernel does not.
"""

from __future__ import annotations

import functools
import os

import torch

from maxsim._dispatch import interpreting
from maxsim.dense import specs
from maxsim.selection.common import Choice, auto_strategy, call_of, clamp, device_of, parse_tile_spec
from maxsim.tuning import is_big_corpus
from maxsim.tuning import tables as T
from maxsim.tuning.autotune import autotune_enabled, cuda_timer, neighbour_configs, pick_fastest, tuning_cache, tuning_key
from maxsim.tuning.configs import ForwardConfig
from maxsim.tuning.rules import first_match, next_pow2, tile_of

FORWARD_KERNELS = (specs.WARP_SPECIALIZED_FORWARD, specs.TRITON_FORWARD)


def query_rows_per_token(Q: torch.Tensor, D: torch.Tensor) -> int:
    """Query rows that share each document token of canonical ``Q [Nq, Lq, d]``, ``D [G, Nd, Ld, d]``:
    Nq Lq for documents shared by every query, Lq for candidate lists (what fp32's product rule reads)."""
    return Q.shape[1] * (Q.shape[0] if D.shape[0] == 1 else 1)


def features(Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, argmax: bool, big: bool,
             long_corpus: bool = False, precision: str = "ieee", masked: bool = False) -> dict:
    """The bucketed features the forward tables match on. ``dtype``: "16bit", "fp32" (IEEE / TF32
    dots) or "fp32-fp16x3" (fp32 tiles split on chip, ``precision`` "fp16x3": bandwidth tiles)."""
    seg = next_pow2(max(Lq, 1))
    rows = seg if candidates else seg * next_pow2(max(Nq, 1))
    word = "16bit" if dtype != torch.float32 else ("fp32-fp16x3" if precision == "fp16x3" else "fp32")
    return dict(dtype=word, d=d, rows=rows, seg=seg, big_corpus=big,
                argmax=argmax, candidates=candidates, lq=Lq, long_corpus=long_corpus, masked=masked,
                precision=precision if dtype == torch.float32 else None)


def forward_choice(Q: torch.Tensor, D: torch.Tensor, masked: bool, normalize: bool, argmax: bool,
                   family: str | None = None, exact_words: bool = False, precision: str = "ieee") -> Choice:
    """The forward kernel and tile for canonical ``Q [Nq, Lq, d]``, ``D [Nq|1, Nd, Ld, d]`` on the
    tensors' device (or as ``family`` would run it). Cached by bucket: a new Nd or Ld inside a
    bucket costs a dictionary look-up. ``exact_words``: rejections quote the call's own token
    count (``maxsim.explain``; not cached)."""
    Nq, Lq, d = Q.shape
    G, Nd, Ld = D.shape[0], D.shape[1], D.shape[2]
    family = family or device_of(Q)[1]
    ws_note = specs.WARP_SPECIALIZED_FORWARD.layout_check(Q, D) if G == 1 else None
    tokens = G * Nd * Ld
    key = (next_pow2(max(Nq, 1)), next_pow2(max(Lq, 1)), d, Q.dtype, G != 1, masked, normalize, argmax,
           is_big_corpus(tokens), tokens >= T.WS_ONE_BLOCK_MIN_TOKENS, precision)
    if exact_words:
        return _decide(*key, tokens, family, ws_note)
    return _forward_choice(*key, family, ws_note)


@functools.lru_cache(maxsize=1024)
def _forward_choice(nq_bucket, seg, d, dtype, candidates, masked, normalize, argmax, big, long_corpus,
                    precision, family, ws_note) -> Choice:
    return _decide(nq_bucket, seg, d, dtype, candidates, masked, normalize, argmax, big, long_corpus, precision,
                   None, family, ws_note)


def _decide(nq_bucket, seg, d, dtype, candidates, masked, normalize, argmax, big, long_corpus, precision, tokens,
            family, ws_note) -> Choice:
    f = features(nq_bucket, seg, d, dtype, candidates, argmax, big, long_corpus, precision, masked)
    layout = "candidates" if candidates else "cross"
    notes = ((specs.WARP_SPECIALIZED_FORWARD.name, ws_note),) if ws_note else ()
    call = call_of(dtype, d, layout, masked, normalize, argmax, family, notes)
    rejected = []
    ws = specs.WARP_SPECIALIZED_FORWARD
    why = ws.unsupported(call) or _ws_does_not_pay(f, masked, long_corpus, tokens)
    if why is None:
        rule = first_match(T.DENSE_FORWARD_WS_SM90, f)
        tile = tile_of(rule, f)
        config = ForwardConfig(BM=tile["BM"], BN=tile["BN"], BK=max(16, next_pow2(d)), num_warps=4,
                               num_stages=tile["num_stages"], waves=1, row_max=True, tma=True)
        rejected.append((specs.TRITON_FORWARD.name, "the warp-specialized kernel was measured faster on this bucket"))
        return Choice(ws, config, rule.name, rule.record, tuple(rejected))
    rejected.append((ws.name, why))
    triton_why = specs.TRITON_FORWARD.unsupported(call)
    if triton_why is not None:  # (the Triton kernel's declaration covers every valid call)
        raise RuntimeError(f"maxsim: no forward kernel runs this call: {triton_why}")
    rule = first_match(T.DENSE_FORWARD_SM90, f)
    config = ForwardConfig(**clamp(_with_defaults(tile_of(rule, f)), family))
    return Choice(specs.TRITON_FORWARD, config, rule.name, rule.record, tuple(rejected))


def _with_defaults(tile: dict) -> dict:
    return {"waves": 2, "row_max": False, "tma": False, **tile}


def _ws_does_not_pay(f: dict, masked: bool, long_corpus: bool, tokens: int) -> str | None:
    """Why no measured warp-specialized tile fits the call (None: one does)."""
    if masked:
        return ("the call has padding masks: its per-tile mask work spills registers and the Triton kernel "
                "was faster (record: results/ws-argmax-20261129-2019.log)")
    if not f["big_corpus"]:
        held = "fewer" if tokens is None else f"{tokens}, fewer"
        return (f"the documents hold {held} than {T.BIG_CORPUS_TOKENS} tokens (a big corpus): "
                "too few to repay its start-up")
    if f["d"] != 128:
        return f"d = {f['d']} runs correctly but was never timed against the Triton kernel"
    if f["rows"] >= 256:
        return None
    if f["rows"] == 128 and f["seg"] == 128:
        if f["argmax"]:
            return "one query block with the argmax (a training forward) was never timed on it"
        if not long_corpus:
            held = "fewer" if tokens is None else f"{tokens}"
            return (f"one query block needs {T.WS_ONE_BLOCK_MIN_TOKENS} document tokens for its two consumers "
                    f"to split; the call has {held}")
        return None
    return (f"{f['rows']} stacked query rows (fewer than 256, and not one 128-token query): bandwidth-bound, "
            "where the Triton kernel streams as fast")


# --- backward ----------------------------------------------------------------------------------

def strategy(backward: str, D: torch.Tensor, Lq: int) -> str:
    """The grad_D strategy for ``backward`` ("auto", "unified", "lowmem") on canonical D."""
    if backward != "auto":
        return backward
    return auto_strategy(D.shape[0] != 1, Lq, D.numel() * 4, one_hot_kernel=_one_hot_fits(D))[0]


def _one_hot_fits(D: torch.Tensor) -> bool:
    """Whether lowmem's one-hot kernel takes rows of D's width whole (wider ones go in chunks of
    columns, which normalize=True cannot: auto leaves them to unified)."""
    return next_pow2(D.shape[-1]) <= T.LISTS_MAX_BD


def strategy_choice(backward: str, Q: torch.Tensor, D: torch.Tensor) -> Choice:
    """The backward's kernel and tiles for a strategy (``strategy()``'s answer or the user's)."""
    Nq, Lq, d = Q.shape
    candidates = D.shape[0] != 1
    chosen = strategy(backward, D, Lq)
    _, why, why_not, record = auto_strategy(candidates, Lq, D.numel() * 4, one_hot_kernel=_one_hot_fits(D))
    reason = why if backward == "auto" else f"backward={backward!r} was asked for"
    lowmem = specs.LOWMEM_LISTS_BACKWARD if candidates else specs.LOWMEM_OWNED_BACKWARD
    kernel = specs.UNIFIED_BACKWARD if chosen == "unified" else lowmem
    other = lowmem if chosen == "unified" else specs.UNIFIED_BACKWARD
    config = backward_config(chosen, Q.shape, D.shape)
    other_words = why_not if backward == "auto" else "not asked for"
    return Choice(kernel, config, reason, record if backward == "auto" else "the caller's choice",
                  ((other.name, other_words),))


@functools.lru_cache(maxsize=1024)
def backward_config(strategy: str, q_shape: tuple, d_shape: tuple) -> dict:
    """Tiles of every kernel the backward launches: ``gather`` (BS, warps, rotate, KB), ``owned``
    (BE, warps) or ``lists`` (BN, BS, warps), ``jacobian`` (BR, warps), ``invert`` (BLOCK, warps)."""
    Nq, Lq, d = q_shape
    G, Ld = d_shape[0], d_shape[2]
    candidates = G != 1
    BD = max(16, next_pow2(d))
    unified = strategy == "unified"
    f = dict(candidates=candidates, scatter=unified, lq=Lq)
    g = tile_of(first_match(T.DENSE_GATHER_SM90, f), f)
    BS = max(1, min(g["BS"], next_pow2(Lq), 8192 // BD))  # registers: BS * BD gathered elements
    KB = max(1, min(g["KB"], 8192 // (BS * BD)))
    out = dict(gather=(BS, g["num_warps"], g["rotate"], KB), BD=BD)
    jac = tile_of(T.DENSE_JACOBIAN[0], {})
    out["jacobian"] = (max(1, jac["ELEMENTS"] // BD), jac["num_warps"])
    if not unified and candidates:
        lists = tile_of(T.DENSE_LISTS[0], {})
        BDC = min(BD, T.LISTS_MAX_BD)  # wider rows go in chunks of columns (shared memory)
        BN = max(16, min(64, lists["BN_ELEMENTS"] // BDC))
        out["lists"] = (BN, max(lists["BS_MIN"], min(lists["BS_MAX"], next_pow2(Lq))),
                        4 if BN * BDC <= lists["BN_ELEMENTS"] else 8, BDC)
    elif not unified:
        per_row = dict(per_row=Nq * Lq / max(Ld, 1))
        owned = tile_of(first_match(T.DENSE_OWNED_SM90, per_row), per_row)
        BE, warps = owned["BE"], owned["num_warps"]
        if BE * BD > T.OWNED_MAX_ELEMENTS:  # wide rows: fewer entries a pass, more warps (no spills)
            BE, warps = max(2, T.OWNED_MAX_ELEMENTS // BD), max(warps, 4)
        out["owned"] = (BE, warps)
        inv = tile_of(T.DENSE_INVERT[0], {})
        out["invert"] = (inv["BLOCK"], inv["num_warps"])
    return out


# --- what the ops call ---------------------------------------------------------------------------

class ForwardPlan:
    """The launch a forward call gets: ``config`` (the tile) and ``warp_specialized`` (the kernel)."""

    __slots__ = ("config", "warp_specialized")

    def __init__(self, config: ForwardConfig, warp_specialized: bool):
        self.config, self.warp_specialized = config, warp_specialized


def parse_tile(spec: str | None) -> tuple[ForwardConfig, bool] | None:
    """``"BM=128,BN=64,BK=128,num_warps=8,num_stages=3[,waves=2,row_max=1,tma=1,flat_walk=1,kernel=ws]"`` ->
    (tile, warp_specialized): the forced tile of ``MAXSIM_FORWARD_TILE`` (tuning sweeps:
    ``python -m maxsim bench --forward-tile``)."""
    if not spec:
        return None
    values, extra = parse_tile_spec(spec, "MAXSIM_FORWARD_TILE", ForwardConfig,
                                    ("BM", "BN", "BK", "num_warps", "num_stages"), extra=("kernel",))
    return ForwardConfig(**values), extra.get("kernel", "triton") in ("ws", "warp_specialized")


# A tile forced for every forward call of this process (read once, at import, like Triton's own
# environment switches): for tuning sweeps, never needed in use.
FORCED_TILE = parse_tile(os.environ.get("MAXSIM_FORWARD_TILE"))


def forward_plan(Q, D, q_mask, d_mask, normalize: bool, multiply: bool, argmax: bool,
                 precision: str = "ieee") -> ForwardPlan:
    """The kernel and tile for a forward call on canonical inputs; with ``MAXSIM_AUTOTUNE=1`` the
    fastest of the table tile's neighbours, timed once per bucket and kept on disk; with
    ``MAXSIM_FORWARD_TILE`` the forced tile (the Gluon kernel only where it can run the call)."""
    choice = forward_choice(Q, D, q_mask is not None or d_mask is not None, normalize, argmax, precision=precision)
    ws = choice.kernel is specs.WARP_SPECIALIZED_FORWARD
    if FORCED_TILE is not None:
        forced, forced_ws = FORCED_TILE
        return ForwardPlan(forced, forced_ws and ws)
    config = choice.config
    if autotune_enabled() and not interpreting() and not torch.cuda.is_current_stream_capturing():
        config = _autotuned(config, ws, Q, D, q_mask, d_mask, normalize, multiply, argmax, precision)
    return ForwardPlan(config, ws)


def _autotuned(config, ws, Q, D, q_mask, d_mask, normalize, multiply, argmax, precision) -> ForwardConfig:
    from maxsim.dense.forward import maxsim_forward  # (the launcher: tuning times real launches)

    Nq, Lq, d = Q.shape
    flags = (f"qm{int(q_mask is not None)}dm{int(d_mask is not None)}mul{int(multiply)}n{int(normalize)}"
             f"a{int(argmax)}ws{int(ws)}" + ("" if precision == "ieee" or Q.dtype != torch.float32 else precision))
    key = tuning_key("dense_forward", Nq, Lq, d, Q.dtype, D.shape[0] != 1, flags,
                     is_big_corpus(D.shape[0] * D.shape[1] * D.shape[2]))
    tuned = tuning_cache().get(key)
    if tuned is None:
        def run(cfg):
            return maxsim_forward(Q, D, q_mask, d_mask, config=cfg, warp_specialized=ws, normalize=normalize,
                                  multiply=multiply, save_argmax=argmax, precision=precision)

        tuned = pick_fastest(neighbour_configs(config, ws), run, cuda_timer)
        tuning_cache().put(key, tuned)
    return tuned
