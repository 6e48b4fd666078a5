"""Kernel configurations: chosen by shape from a fixed rule, never autotuned at run time.

A rule (rather than ``triton.autotune``) keeps the hot path free of tuning runs and makes the
compiled-variant count small: only power-of-two buckets of Lq and d and the dtype enter the choice
of constexprs, so a new batch size or document length never compiles again. The rule's constants
come from sweeps on an H200 (``benchmarks/tune_forward.py``; numbers in BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclass(frozen=True)
class ForwardConfig:
    """Tile shape and launch parameters of the dense forward kernel.

    BM: query rows per program (several queries stacked, or a chunk of a long query).
    BN: document tokens per tile.  BK: embedding dims per ``tl.dot`` (d > BK loops over d).
    waves: programs launched per multiprocessor; sets how many documents each program walks.
    row_max: reduce each tile to a per-row max at once instead of a running [BM, BN] max.
    tma: load document tiles through the tensor-memory accelerator (16-bit D whose tokens form
        one strided run of rows per query group; other inputs fall back to pointer loads).
    warp_specialized: run the Gluon kernel of ``maxsim/dense/forward_ws.py`` instead (Hopper): a
        TMA producer warp and two consumer warpgroups of 128 rows each (BM = 256) taking turns on
        the tensor cores; num_stages is its ring of document tiles.
    """

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    waves: int = 2
    row_max: bool = False
    tma: bool = False
    warp_specialized: bool = False


@functools.lru_cache(maxsize=16)
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# A call whose documents hold at least this many tokens (all query groups together) is a "big
# corpus": long enough that the tiles which stream it fastest (TMA, one program per
# multiprocessor) pay back their start-up and the ~20 us of host time a TMA launch adds.
BIG_CORPUS_TOKENS = 2**17


def is_big_corpus(doc_tokens: int) -> bool:
    return doc_tokens >= BIG_CORPUS_TOKENS


# One query of up to 128 tokens (one row block) runs the warp-specialized kernel only against at least
# this many document tokens; below, its two consumers have too little to split. On the H200, one
# 128-token query against 0.51M / 1.02M / 2.05M tokens took 37.2 / 67.1 / 133.2 µs there against
# 40.4 / 76.9 / 149.6 with the Triton kernel, 256K tokens 23.0 against 23.9 (cold clean L2,
# benchmarks/probe_one_query.py, results/onequery-20261129-2125.log). The threshold was 2^22 while
# the Gluon kernel's launch took 100-150 µs of host time; it now goes through maxsim._launch.
WS_ONE_BLOCK_MIN_TOKENS = 2**18


def warp_specialize_pays(Nq: int, Lq: int, doc_tokens: int, masked: bool = False) -> bool:
    """Whether a call the Gluon kernel can run is worth running there: never with masks (at in-batch
    128 x 128 with prefix masks on both sides the Triton kernel took 1.15 ms against 1.27, and 1.22
    against 1.92 with the argmax: the Gluon kernel's per-tile mask work spills registers;
    benchmarks/results/ws-argmax-20261129-2*.log); otherwise always for several queries or a
    longer one, for one query of up to 128 tokens from WS_ONE_BLOCK_MIN_TOKENS document tokens."""
    return not masked and (Nq > 1 or Lq > 128 or doc_tokens >= WS_ONE_BLOCK_MIN_TOKENS)


@functools.lru_cache(maxsize=1024)
def forward_config(Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, interpret: bool = False,
                   argmax: bool = False, big_corpus: bool = False, warp_specialize: bool = False) -> ForwardConfig:
    """The forward tile configuration for a shape: depends on power-of-two buckets of Lq, Nq and d,
    the dtype, the layout and whether the corpus is big (``big_corpus``: at least
    ``BIG_CORPUS_TOKENS`` document tokens), so new batch sizes and document lengths compile at most
    once per corpus class (``maxsim.warmup`` compiles both). ``warp_specialize``: the call can run
    the Gluon kernel (``maxsim.dense.forward.warp_specialize_ok``: a Hopper GPU, documents shared,
    fp16/bf16, d in {64, 128}, no normalize).

    From sweeps on an H200 (BENCHMARKS.md; benchmarks/tune_forward.py, probe_configs.py, ws_bench.py):
    - many query rows (>= 256) on a big corpus at d = 128, where the Gluon kernel can run: the warp-specialized
      kernel, BN=128 (also with the argmax: its state is 16 registers a thread), a ring of 4
      tiles, one program per multiprocessor: in-batch 128 x 128 0.660 against 0.904 ms, ColPali
      1 x 1K 0.342 against 0.477, 32 x 100K 4.98 against 6.05, with the argmax 0.91-0.92 against
      1.07-1.13 (0.99 with the former winning-tile argmax at BN=64); masked calls never (the caller's
      :func:`warp_specialize_pays`);
    - long queries stacked (>= 128 tokens, in-batch training): BM=BN=128, 4 warps, 2 stages, document
      tiles through TMA (``tma``), per-tile row max (``row_max``: only the accumulator lives in
      registers). Two programs share a multiprocessor, so one's max epilogue runs during the
      other's MMAs: 0.85-0.88 against 0.958 ms at in-batch 128 x 128;
    - ColPali-long queries (>= 512 tokens): BM=256, BN=64, 8 warps, 3 stages, TMA: within 1 % of the
      best probed tile at 1 x 1K (1024, 1024) and the fastest at Ld = 128 and 300 (1.34-1.82 ms
      against 1.37-2.31 for BN=128; BN=256 was 2.2x slower there);
    - d > 128 with >= 128 rows: BK=64 chunks (shared memory caps wider ones), BM=BN=128, 8 warps,
      TMA (3.51 against 3.77 ms at d=768, 32 x 10K); with <= 32 rows (one short query,
      bandwidth-bound) BK=128: half the K-loop trips, 6-9 % faster at d=768;
    - short queries stacked to >= 256 rows: BM=256, pointer loads; 2 stages, BN=64 and 2 programs
      per multiprocessor for d=128 (24 against 35 us at masked 64 x 64), 3 stages and 8 for
      d <= 64. On a big corpus, d > 64: TMA, BN=128, 3 stages, one program per multiprocessor
      (32 x 100K 5.57 against 5.99 ms; 32 x 10K 0.578 against 0.605; 32 x 2K 0.119 against 0.140;
      but 31 against 24.5 us at masked 64 x 64, hence the corpus class);
    - one block of 128 rows (one 128-token query): where the Gluon kernel can run and the call is
      long enough for its host path (the caller's :func:`warp_specialize_pays`), the
      warp-specialized kernel with split documents, BN=64, a ring of 6: 0.99-1.08 against
      1.12-1.23 ms against 16.8M tokens; otherwise BM=128, BN=64, running [BM, BN] max, pointer
      loads (TMA was no faster at 1 x 1K and adds host time);
    - fewer rows (one short query, or candidate lists): bandwidth-bound, BM=16-64, BN=128; on a
      big corpus at d <= 64, TMA with 4 stages (0.96 against 1.05 ms at 1 x 520K (32, 300)); with
      the argmax on candidate lists (training), BN=64 and 4 waves (25.9 against 31.3 us at 32 x 32
      candidates (32, 300), the best of 216 configurations: benchmarks/probe_lists_gather.py);
    - with the argmax (training), long queries: BM=64, BN=128, TMA: the row-max variant also holds
      the winning tile [BM, BN] and BM=64 keeps both in registers (1.07 against 1.38 ms at in-batch
      128 x 128; a training step 1.55 against 1.86 ms); short queries: BM=256, BN=64, 3 stages,
      8 programs per multiprocessor. The corpus class does not apply.
    """
    seg = next_pow2(max(Lq, 1))
    rows = seg if candidates else seg * next_pow2(max(Nq, 1))
    bk = max(16, next_pow2(d))
    compute_bound = rows >= 256  # many query rows share each document tile
    if warp_specialize and compute_bound and big_corpus and d == 128 and not interpret:
        # (d = 64 runs correctly in the kernel (GPU-tested) but was not timed: Triton's tile there.)
        return ForwardConfig(BM=256, BN=128, BK=bk, num_warps=4, num_stages=4, waves=1,
                             row_max=True, tma=True, warp_specialized=True)
    if warp_specialize and rows == 128 and seg == 128 and big_corpus and d == 128 and not argmax and not interpret:
        # One 128-token query: its two consumers split the documents; BN=64 and a ring of 6.
        return ForwardConfig(BM=128, BN=64, BK=bk, num_warps=4, num_stages=6, waves=1,
                             row_max=True, tma=True, warp_specialized=True)
    big_corpus = big_corpus and not argmax
    if dtype == torch.float32:
        # IEEE fp32 dots run on the FMA units: modest tiles, a running max.
        cfg = ForwardConfig(BM=min(128, max(16, rows)), BN=32, BK=min(64, bk), num_warps=4, num_stages=2)
    elif d > 128 and rows >= 128:
        cfg = ForwardConfig(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, waves=2, row_max=True, tma=True)
    elif d > 128:
        cfg = ForwardConfig(BM=max(16, rows), BN=128, BK=128 if rows <= 32 else 64, num_warps=4, num_stages=3,
                            waves=8, row_max=True)
    elif compute_bound and seg >= 512:
        cfg = ForwardConfig(BM=256, BN=64, BK=bk, num_warps=8, num_stages=3, waves=2, row_max=True, tma=True)
    elif compute_bound and seg >= 128:
        cfg = ForwardConfig(BM=128, BN=128, BK=bk, num_warps=4, num_stages=2, waves=2, row_max=True, tma=True)
    elif compute_bound and d > 64 and big_corpus:
        cfg = ForwardConfig(BM=256, BN=128, BK=bk, num_warps=8, num_stages=3, waves=1, row_max=True, tma=True)
    elif compute_bound and d > 64:
        cfg = ForwardConfig(BM=256, BN=64, BK=bk, num_warps=8, num_stages=2, waves=2, row_max=True)
    elif compute_bound:
        cfg = ForwardConfig(BM=256, BN=64, BK=bk, num_warps=8, num_stages=3, waves=8, row_max=True)
    elif rows >= 128:
        cfg = ForwardConfig(BM=128, BN=64, BK=bk, num_warps=8, num_stages=3)
    elif big_corpus and d <= 64:
        cfg = ForwardConfig(BM=max(16, rows), BN=128, BK=bk, num_warps=4, num_stages=4, tma=True)
    elif argmax and candidates:
        # Training on candidate lists: half the tile and twice the programs.
        cfg = ForwardConfig(BM=max(16, rows), BN=64, BK=bk, num_warps=4, num_stages=3, waves=4)
    else:
        cfg = ForwardConfig(BM=max(16, rows), BN=128, BK=bk, num_warps=4, num_stages=3)
    if argmax and cfg.row_max and compute_bound and d <= 128:
        if seg < 128:  # the inference tile (BM=256, BN=64) at 3 stages, 8 programs per multiprocessor
            cfg = dataclasses.replace(cfg, num_stages=3, waves=8)
        else:
            cfg = ForwardConfig(BM=64, BN=128, BK=bk, num_warps=4, num_stages=3, waves=1, row_max=True, tma=True)
    elif argmax and cfg.row_max and cfg.BN > 64:
        cfg = dataclasses.replace(cfg, BN=64)
    if interpret:
        # The interpreter runs one program at a time: few, small programs, no pipelining.
        return ForwardConfig(BM=min(cfg.BM, 64), BN=min(cfg.BN, 64), BK=cfg.BK, num_warps=4, num_stages=1,
                             waves=1, row_max=cfg.row_max, tma=cfg.tma)
    return cfg


# ---------------------------------------------------------------------------------------------
# Opt-in autotuning (MAXSIM_AUTOTUNE=1) with a persistent cache.
#
# The rule above was measured on an H200. On another GPU a server can let maxsim time a few
# neighbours of the rule's choice once per shape bucket; the winner is stored in a JSON file
# (MAXSIM_TUNING_CACHE, default ~/.cache/maxsim/tuning-<gpu>-triton<version>.json) that every
# later process reads, so tuning happens once per machine, not once per process. The key holds
# only buckets, so Nd, Ld and batch sizes inside a bucket never tune again.
# ---------------------------------------------------------------------------------------------


def autotune_enabled() -> bool:
    return os.environ.get("MAXSIM_AUTOTUNE", "0").strip().lower() in ("1", "true", "yes")


def tuning_key(kind: str, Nq: int, Lq: int, d: int, dtype: torch.dtype, candidates: bool, flags: str,
               big_corpus: bool = False) -> str:
    """A bucketed key: dtype, d, pow2(Lq), pow2 rows (capped at 256), layout, corpus class and
    kernel flags."""
    seg = next_pow2(max(Lq, 1))
    rows = min(256, seg if candidates else seg * next_pow2(max(Nq, 1)))
    layout = "candidates" if candidates else "cross"
    corpus = "big" if big_corpus else "small"
    return f"{kind}|{str(dtype).replace('torch.', '')}|d{d}|lq{seg}|rows{rows}|{layout}|{corpus}|{flags}"


def neighbour_configs(rule: ForwardConfig) -> list[ForwardConfig]:
    """The rule's config and a few neighbours (tile widths, warps, max strategy, waves)."""
    out = [rule]
    if rule.warp_specialized:  # its ring depth; BN is fixed by the registers (argmax or not)
        return out + [dataclasses.replace(rule, num_stages=2)]
    for BM, BN, warps, row_max, waves in (
        (rule.BM, 128 if rule.BN == 64 else 64, rule.num_warps, rule.row_max, rule.waves),
        (rule.BM, rule.BN, 8 if rule.num_warps == 4 else 4, rule.row_max, rule.waves),
        (rule.BM, rule.BN, rule.num_warps, not rule.row_max, rule.waves),
        (rule.BM, rule.BN, rule.num_warps, rule.row_max, 8 if rule.waves == 2 else 2),
        (max(16, rule.BM // 2), rule.BN, 4, rule.row_max, rule.waves),
    ):
        cfg = ForwardConfig(BM, BN, rule.BK, warps, rule.num_stages, waves, row_max, rule.tma)
        if cfg not in out and BM * BN <= 256 * 128:
            out.append(cfg)
    return out


def pick_fastest(configs, run, timer) -> ForwardConfig:
    """The config whose ``run(cfg)`` is fastest by ``timer(fn) -> ms``; configs that fail to
    compile or launch (e.g. out of shared memory) are skipped. Raises if none runs."""
    best, best_ms, errors = None, float("inf"), []
    for cfg in configs:
        try:
            ms = timer(lambda: run(cfg))
        except Exception as e:  # noqa: BLE001 - a config that cannot run is not a candidate
            errors.append(f"{cfg}: {type(e).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError("maxsim: no candidate configuration ran: " + "; ".join(errors))
    return best


def cuda_timer(fn, reps: int = 5) -> float:
    """Median ms of ``fn`` over ``reps`` runs after one warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class TuningCache:
    """Tuned configs on disk: a JSON object {key: ForwardConfig fields}, written atomically."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._entries: dict | None = None

    @staticmethod
    def default_path() -> Path:
        if os.environ.get("MAXSIM_TUNING_CACHE"):
            return Path(os.environ["MAXSIM_TUNING_CACHE"])
        import triton

        gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
        return Path.home() / ".cache" / "maxsim" / f"tuning-{gpu}-triton{triton.__version__}.json"

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    def get(self, key: str) -> ForwardConfig | None:
        fields = self._load().get(key)
        return ForwardConfig(**fields) if fields else None

    def put(self, key: str, cfg: ForwardConfig) -> None:
        entries = self._load()
        try:  # merge what other processes wrote meanwhile
            entries.update(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            pass
        entries[key] = dataclasses.asdict(cfg)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


_CACHES: dict = {}


def tuning_cache() -> TuningCache:
    path = TuningCache.default_path()
    if path not in _CACHES:
        _CACHES[path] = TuningCache(path)
    return _CACHES[path]
