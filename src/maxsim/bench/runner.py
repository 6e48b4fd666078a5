"""Forward benchmark: time every provider on every shape, check it, and report.

    python -m maxsim bench [--shapes a,b] [--providers p,q] [--quick] [--device cpu|cuda] [--out DIR]

For each (shape, provider) cell: build the inputs from a fixed seed, compute the reference
scores, call the provider once (compiles and autotunes), compare with the reference, measure the
peak memory of one call, then time it (``triton.testing.do_bench`` median on CUDA,
``time.perf_counter`` median on CPU).

Crash isolation: one faulty kernel can poison the CUDA context (an illegal memory access makes
every later CUDA call fail), so on CUDA each provider runs in a worker subprocess
(``python -m maxsim.bench.runner --worker SPEC``) that streams one JSON line per finished cell.
When a worker dies, the parent records the shape it was on as ``crashed (<reason>)`` and starts a
fresh worker on the remaining shapes. Inputs come from a seeded generator on the device, so every
worker sees the same numbers and computes its own reference. On CPU everything runs in-process.

Exit status: 0 when maxsim ran and was correct on every shape (a peer crashing is a result, not a
failure); 1 when maxsim failed or its relative error exceeded the tolerance; 2 for bad options.
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import functools
import gc
import importlib
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from maxsim.bench.providers import DEFAULT_PROVIDERS, PROVIDERS, Provider, get_providers
from maxsim.bench.shapes import (
    DENSE_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    Shape,
    default_shapes,
    floor_seconds,
    make_inputs,
    shapes_by_name,
)

# Largest acceptable max|out - ref| / max|ref| for maxsim itself, by input dtype.
TOLERANCE = {"fp16": 2e-2, "bf16": 2e-2, "fp32": 1e-4}
# triton.testing.do_bench (warmup, rep) in ms, and CPU timing runs, without / with --quick.
# 25/100 ms keeps the default GPU run (7 shapes x 4 providers) to a few minutes.
DO_BENCH_MS = {False: (25, 100), True: (5, 25)}
CPU_RUNS = {False: 5, True: 3}
DEFAULT_TIMEOUT_S = 300.0

# The worker's stdout protocol; any other line there is a library's noise.
START_MARK = "@@maxsim-bench start "  # + shape name, before the shape is attempted
RESULT_MARK = "@@maxsim-bench row "  # + JSON result row
SHAPE_MARK = "[maxsim-bench] shape "  # written to stderr before each shape, to attribute a crash
# Exception messages after which the CUDA context is unusable: the worker must be replaced.
FATAL_MARKERS = (
    "CUDA error",
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "Triton Error [CUDA]",
)
_ERROR_LINE = re.compile(r"(error|exception)\s*:", re.IGNORECASE)

CSV_FIELDS = [
    "shape", "provider", "status", "ms", "floor_ms", "pct_floor", "peak_mb", "rel_err", "speedup",
    "nq", "nd", "lq", "ld", "d", "dtype", "masked", "note",
]  # fmt: skip


# --- one cell -----------------------------------------------------------------------------------


def _record(shape: Shape, provider: str, status: str, note: str = "", **values) -> dict:
    """One result row. status: ok | OOM | crashed | error | n/a."""
    row = {
        "shape": shape.name,
        "provider": provider,
        "status": status,
        "note": note,
        "ms": None,
        "floor_ms": floor_seconds(shape) * 1e3,
        "pct_floor": None,
        "peak_mb": None,
        "rel_err": None,
        "speedup": None,
    }
    row.update({k: v for k, v in shape.to_dict().items() if k != "name"})
    row.update(values)
    return row


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Return cached blocks so the next cell (maybe a memory-hungry naive) starts clean."""
    gc.collect()
    if device == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # a poisoned context; the caller is about to give up on it anyway
            pass


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` in fp32; NaN when ``out`` holds a NaN."""
    diff = (out.float() - ref.float()).abs().max()
    scale = ref.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float(diff / scale)


def classify_error(exc: BaseException) -> str:
    """OOM (recoverable), crashed (CUDA context poisoned) or error (anything else)."""
    msg = str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg:
        return "OOM"
    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(m in msg for m in FATAL_MARKERS):
        return "crashed"
    return "error"


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:200]


def _peak_mb(fn, device: str) -> float | None:
    """Peak memory of one call above what was allocated before it (inputs included there), MB."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def _time_ms(fn, device: str, quick: bool) -> float:
    """Median milliseconds per call."""
    if device == "cuda":
        import triton.testing

        warmup, rep = DO_BENCH_MS[quick]
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    times = []
    for _ in range(CPU_RUNS[quick]):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _measure(shape: Shape, provider: Provider, device: str, seed: int, quick: bool) -> dict:
    """ms, % of floor, peak MB and relative error of one cell; exceptions propagate."""
    from maxsim.reference import maxsim_reference

    Q, D, q_mask, d_mask = make_inputs(shape, device, seed)
    ref = maxsim_reference(Q, D, q_mask, d_mask, mask_mode=provider.mask_mode)  # [nq, nd] fp32
    _free(device)  # drop the reference's scratch before the provider allocates its own
    fn = functools.partial(provider.fn, *provider.prepare(Q, D, q_mask, d_mask))
    out = fn()  # warm-up: compiles and autotunes
    _sync(device)
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"returned shape {list(out.shape)}, expected {list(ref.shape)}")
    err = rel_error(out, ref)
    del out
    peak = _peak_mb(fn, device)
    ms = _time_ms(fn, device, quick)
    return {"ms": ms, "pct_floor": 100 * floor_seconds(shape) * 1e3 / ms, "peak_mb": peak, "rel_err": err}


def measure(shape: Shape, provider: Provider, device: str, seed: int = 0, quick: bool = False) -> dict:
    """Run one (shape, provider) cell in this process and return its result row.

    Exceptions become rows (status OOM / crashed / error, traceback on stderr), never escape."""
    try:
        with torch.no_grad():
            values = _measure(shape, provider, device, seed, quick)
    except Exception as exc:
        traceback.print_exc()
        return _record(shape, provider.name, classify_error(exc), note=_one_line(exc))
    return _record(shape, provider.name, "ok", **values)


# --- worker side --------------------------------------------------------------------------------


def worker_main(spec: str) -> int:
    """Run one provider over a list of shapes, printing one result line per shape.

    spec: JSON ``{"provider", "device", "seed", "quick", "shapes": [Shape dicts]}``."""
    faulthandler.enable()  # a segfault or abort still leaves its reason on stderr
    cfg = json.loads(spec)
    provider = PROVIDERS[cfg["provider"]]
    for fields in cfg["shapes"]:
        shape = Shape(**fields)
        print(SHAPE_MARK + shape.name, file=sys.stderr, flush=True)
        print(START_MARK + shape.name, flush=True)
        row = measure(shape, provider, cfg["device"], cfg["seed"], cfg["quick"])
        print(RESULT_MARK + json.dumps(row), flush=True)
        if row["status"] == "crashed":
            # The CUDA context is unusable: exit without touching it; the parent starts a new worker.
            sys.stderr.flush()
            os._exit(3)
        _free(cfg["device"])
    return 0


# --- parent side --------------------------------------------------------------------------------


def crash_reason(stderr_text: str, returncode: int) -> str:
    """Why a worker died: the last error-looking stderr line written for the shape it was on
    (else the last line, else the exit status)."""
    if SHAPE_MARK in stderr_text:
        stderr_text = stderr_text.rpartition(SHAPE_MARK)[2].partition("\n")[2]
    lines = [line.strip() for line in stderr_text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    if errors:
        return errors[-1][:200]
    if lines:
        return lines[-1][:200]
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"worker exited with status {returncode}"


def _worker_env() -> dict:
    """The parent's environment, with this package's source root first on PYTHONPATH so that a
    worker imports the same maxsim even when the parent ran from an uninstalled checkout."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # end of stream


def _run_worker(shapes, provider, device, opts, log_path: Path, report) -> tuple[set, str | None, str]:
    """Start one worker on ``shapes``; pass each result row to ``report`` as it arrives.

    Returns the names of the shapes it finished, the shape it started but did not finish (None
    if there is none) and, in case it stopped early, why."""
    spec = {
        "provider": provider.name,
        "device": device,
        "seed": opts.seed,
        "quick": opts.quick,
        "shapes": [s.to_dict() for s in shapes],
    }
    cmd = [sys.executable, "-m", "maxsim.bench.runner", "--worker", json.dumps(spec)]
    done, current, timed_out = set(), None, False
    with open(log_path, "a+", encoding="utf-8", errors="replace") as log:
        log.write(f"=== worker {provider.name}: {', '.join(s.name for s in shapes)}\n")
        log.flush()
        start = log.tell()
        # stderr goes to a file, not a pipe: a chatty worker can never block on a full pipe.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=_worker_env())
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=opts.timeout)
            except queue.Empty:  # a hung kernel: give up on this worker
                proc.kill()
                timed_out = True
                break
            if line is None:
                break
            if line.startswith(START_MARK):
                current = line[len(START_MARK) :].strip()
            elif line.startswith(RESULT_MARK):
                row = json.loads(line[len(RESULT_MARK) :])
                done.add(row["shape"])
                current = None
                report(row)
            else:
                sys.stderr.write(line)  # a library printing to stdout
        returncode = proc.wait()
        log.seek(start)
        stderr_text = log.read()
    if timed_out:
        return done, current, f"timeout: no result within {opts.timeout:g} s"
    return done, current, crash_reason(stderr_text, returncode)


def run_isolated(shapes, provider, device, opts, log_path: Path, report) -> None:
    """Run ``provider`` over ``shapes`` in worker subprocesses, a fresh worker after each crash.

    A worker that dies mid-shape gets that shape recorded as crashed; one that reported its own
    crash (a poisoned CUDA context) and exited is simply replaced; one that died before starting
    any shape (broken import) is charged with the first, so every round makes progress."""
    todo = list(shapes)
    while todo:
        done, current, reason = _run_worker(todo, provider, device, opts, log_path, report)
        todo = [s for s in todo if s.name not in done]
        if current is None and not done and todo:
            current = todo[0].name
        if current is not None:
            crashed = next(s for s in todo if s.name == current)
            report(_record(crashed, provider.name, "crashed", note=reason))
            todo.remove(crashed)


def run_all(shapes, providers, device, opts, isolate: bool, log_path: Path) -> list[dict]:
    """Every (shape, provider) row, ordered by shape then provider."""
    rows: list[dict] = []
    total = len(shapes) * len(providers)

    def report(row):
        rows.append(row)
        shown = f"{row['ms']:.3f} ms" if row["status"] == "ok" else f"{row['status']} {row['note']}"
        print(f"[{len(rows)}/{total}] {row['shape']} {row['provider']}: {shown}", file=sys.stderr, flush=True)

    for provider in providers:
        if not provider.available(device):
            for shape in shapes:
                report(_record(shape, provider.name, "n/a", note=f"not available on {device}"))
        elif isolate:
            run_isolated(shapes, provider, device, opts, log_path, report)
        else:
            for shape in shapes:
                report(measure(shape, provider, device, opts.seed, opts.quick))
                _free(device)
    shape_pos = {s.name: i for i, s in enumerate(shapes)}
    prov_pos = {p.name: i for i, p in enumerate(providers)}
    return sorted(rows, key=lambda r: (shape_pos[r["shape"]], prov_pos[r["provider"]]))


# --- report -------------------------------------------------------------------------------------


def add_speedups(rows: list[dict]) -> None:
    """speedup = the provider's ms / maxsim's ms on the same shape (how many times faster maxsim
    is); on the maxsim row, the same against the fastest other provider that ran."""
    for shape in {r["shape"] for r in rows}:
        same = [r for r in rows if r["shape"] == shape]
        ms = {r["provider"]: r["ms"] for r in same if r["status"] == "ok"}
        mine = ms.pop("maxsim", None)
        for r in same:
            if mine is None:
                r["speedup"] = None
            elif r["provider"] == "maxsim":
                r["speedup"] = min(ms.values()) / mine if ms else None
            else:
                r["speedup"] = ms[r["provider"]] / mine if r["provider"] in ms else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_pct(value) -> str:
    # One decimal on the GPU; two significant digits for the tiny CPU percentages.
    return "-" if value is None else f"{value:.1f}" if value >= 0.1 else f"{value:.2g}"


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table, one line per row."""
    head = ["shape", "provider", "ms", "% floor", "peak MB", "rel err", "maxsim x", "note"]
    cells = []
    for r in rows:
        ok = r["status"] == "ok"
        cells.append([
            r["shape"],
            r["provider"],
            _fmt(r["ms"], ".3f") if ok else r["status"],
            _fmt_pct(r["pct_floor"]),
            _fmt(r["peak_mb"], ".1f"),
            _fmt(r["rel_err"], ".1e"),
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            r["note"],
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in cells + [head]) for i in range(len(head))]
    left = {0, 1, 7}  # text columns; numbers are right-aligned

    def line(row):
        parts = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    out = [line(head), line(["-" * w for w in widths])] + [line(c) for c in cells]
    return "\n".join(out)


TABLE_NOTES = (
    f"% floor: H200 roofline floor max(bytes / {HBM_BYTES_PER_S / 1e12:g} TB/s, "
    f"flops / {DENSE_FLOPS_PER_S / 1e12:g} TFLOP/s) over measured time (100 = at the floor). "
    "maxsim x: provider ms / maxsim ms (maxsim row: fastest other provider). "
    "rel err: max|out - ref| / max|ref| vs maxsim_reference (naive: mask_mode='multiply', PyLate's rule)."
)


def _version(dist: str) -> str:
    """Installed version of ``dist``, else its module's ``__version__`` (a checkout on the path)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module(dist.replace("-", "_"))
    except Exception:
        return "not installed"
    return str(getattr(module, "__version__", "unknown"))


def environment(device: str) -> dict:
    """What the numbers were measured on."""
    if device == "cuda":
        where = torch.cuda.get_device_name(0)
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    env = {"device": where, "torch": torch.__version__, "triton": triton_version}
    for p in PROVIDERS.values():
        if p.dist:
            env[p.dist] = _version(p.dist)
    env["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return env


def header_line(env: dict) -> str:
    return " | ".join([env["device"]] + [f"{k} {v}" for k, v in env.items() if k not in ("device", "date")] + [env["date"]])


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_jsonl(rows: list[dict], env: dict, argv: list[str], path: Path) -> None:
    """First line: the environment and the command line; then one line per row."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"env": env, "argv": argv}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_png(rows: list[dict], path: Path, title: str) -> bool:
    """Grouped bars of % of floor, one group per shape, one bar per provider. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark box
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cell = {(r["shape"], r["provider"]): r for r in rows}
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(shapes)), 4.5))
    for i, p in enumerate(providers):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(shapes))]
        heights = [cell[(s, p)]["pct_floor"] or 0.0 for s in shapes]
        ax.bar(xs, heights, width, label=p)
        for x, s in zip(xs, shapes):  # say why a bar is missing
            if cell[(s, p)]["status"] != "ok":
                ax.text(x, 0, cell[(s, p)]["status"], rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=20, ha="right")
    ax.set_ylabel("% of H200 roofline floor (higher is better)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def maxsim_failures(rows: list[dict]) -> list[str]:
    """Why maxsim itself failed, one line per bad shape (empty when it is fine)."""
    bad = []
    for r in rows:
        if r["provider"] != "maxsim":
            continue
        tol = TOLERANCE[r["dtype"]]
        if r["status"] != "ok":
            bad.append(f"{r['shape']}: maxsim {r['status']} {r['note']}".rstrip())
        elif not r["rel_err"] <= tol:  # also catches NaN
            bad.append(f"{r['shape']}: maxsim rel err {r['rel_err']:.2e} above {tol:g}")
    return bad


# --- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maxsim bench", description="Forward MaxSim benchmark against peers.")
    p.add_argument("--shapes", help="comma-separated shape names (default: the set for the device)")
    p.add_argument(
        "--providers",
        default=",".join(DEFAULT_PROVIDERS),
        help=f"comma-separated providers (default: %(default)s; known: {', '.join(PROVIDERS)})",
    )
    p.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--out", type=Path, help="directory for the CSV, PNG and logs")
    p.add_argument("--csv", type=Path, help="CSV path (default: OUT/forward-<date>.csv)")
    p.add_argument("--png", type=Path, help="bar chart path (default: OUT/forward-<date>.png)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default: %(default)s)")
    p.add_argument(
        "--isolate",
        choices=["auto", "on", "off"],
        default="auto",
        help="one worker subprocess per provider, surviving crashes (auto: on for cuda)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a worker may take on one shape before it is killed (default: %(default)s)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as a worker on this JSON spec
    return p


def _default_out_dir() -> Path:
    """benchmarks/results of the checkout this file lives in, else the working directory."""
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file() and (repo / "benchmarks").is_dir():
        return repo / "benchmarks" / "results"
    return Path.cwd()


def _output_paths(opts) -> dict:
    out = opts.out or _default_out_dir()
    stem = "forward-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    paths = {
        "csv": opts.csv or out / f"{stem}.csv",
        "jsonl": out / f"{stem}.jsonl",
        "png": opts.png or out / f"{stem}.png",
        "workers": out / f"{stem}.workers.log",
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    return paths


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def run_cli(argv: list[str] | None = None, *, shapes: list[Shape] | None = None) -> int:
    """Entry point of ``python -m maxsim bench``. ``shapes`` overrides ``--shapes`` (for tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    if opts.worker:
        return worker_main(opts.worker)
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("maxsim bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        if shapes is None:
            shapes = shapes_by_name(_names(opts.shapes)) if opts.shapes else default_shapes(device)
        providers = get_providers(_names(opts.providers))
    except ValueError as exc:
        print(f"maxsim bench: {exc}", file=sys.stderr)
        return 2
    paths = _output_paths(opts)
    isolate = opts.isolate == "on" or (opts.isolate == "auto" and device == "cuda")
    env = environment(device)

    rows = run_all(shapes, providers, device, opts, isolate, paths["workers"])
    add_speedups(rows)
    print(header_line(env))
    print(format_table(rows))
    print(TABLE_NOTES)
    write_csv(rows, paths["csv"])
    write_jsonl(rows, env, argv, paths["jsonl"])
    written = [paths["csv"], paths["jsonl"]]
    if write_png(rows, paths["png"], header_line(env)):
        written.append(paths["png"])
    if isolate:
        written.append(paths["workers"])
    print("wrote " + ", ".join(str(p) for p in written))

    failures = maxsim_failures(rows)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_cli())
