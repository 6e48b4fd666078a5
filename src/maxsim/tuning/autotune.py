"""Opt-in autotuning (``MAXSIM_AUTOTUNE=1``) with a persistent cache.

The tile tables were measured on an H200. On another GPU a server can let maxsim time a few
neighbours of the table's choice once per shape bucket; the winner is stored in a JSON file
(``MAXSIM_TUNING_CACHE``, default ``~/.cache/maxsim/tuning-<gpu>-triton<version>.json``) that every
later process reads, so tuning happens once per machine, not once per process. The key holds only
buckets, so Nd, Ld and batch sizes inside a bucket never tune again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from maxsim.tuning.configs import ForwardConfig
from maxsim.tuning.rules import next_pow2


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


def neighbour_configs(rule: ForwardConfig, warp_specialized: bool = False) -> list[ForwardConfig]:
    """The rule's config and a few neighbours (tile widths, warps, max strategy, waves); for the
    warp-specialized kernel only its ring depth (its BN is fixed by the registers)."""
    out = [rule]
    if warp_specialized:
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
        if not fields:
            return None
        known = {f.name for f in dataclasses.fields(ForwardConfig)}  # (older caches held more fields)
        return ForwardConfig(**{k: v for k, v in fields.items() if k in known})

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
