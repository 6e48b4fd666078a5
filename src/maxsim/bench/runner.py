"""Benchmark: time every provider on every shape, check it, and report.

    python -m maxsim bench [--mode forward|train|varlen] [--shapes a,b] [--providers p,q] [--quick]
                           [--repeat N] [--pin-cpu CPU] [--device cpu|cuda] [--out DIR]

For each (shape, provider) cell: build the inputs from a fixed seed, compute the reference
scores, call the provider once (compiles and autotunes), compare with the reference, measure the
peak memory of one call, then time it (median on CUDA, each call after a flush that leaves the L2
cold and clean: :mod:`maxsim.bench.timing`;
``time.perf_counter`` median on CPU).

``--mode varlen`` times ragged batches: maxsim on packed tokens against maxsim on the padded
batch, naive PyTorch and the peers' packed entry points (:data:`maxsim.bench.shapes.RAGGED_KINDS`).

``--mode train`` does the same for one training step instead of one call: zero the gradients,
score, cross-entropy loss, backward (:mod:`maxsim.bench.train`); the check covers the scores and
the gradients of Q and D, against the reference's autograd in fp32.

Crash isolation: one faulty kernel can poison the CUDA context (an illegal memory access makes
every later CUDA call fail), so on CUDA each provider runs in a worker subprocess
(``python -m maxsim.bench.runner --worker SPEC``) that streams one JSON line per finished cell.
When a worker dies, the parent records the shape it was on as ``crashed (<reason>)`` and starts a
fresh worker on the remaining shapes. Inputs come from a seeded generator on the device, so every
worker sees the same numbers and computes its own reference. On CPU everything runs in-process.

Exit status: 0 when maxsim (every ``maxsim*`` row) ran and was correct on every shape (a peer
crashing is a result, not a failure); 1 when maxsim failed or its relative error (of the scores,
and in train mode of the gradients) exceeded the tolerance; 2 for bad options.
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

from maxsim.bench.options import DESCRIPTION, EPILOG, add_arguments
from maxsim.bench.providers import REGISTRIES, Provider, get_providers, is_maxsim
from maxsim.bench.shapes import (
    RAGGED_KINDS,
    Roofline,
    Shape,
    default_shapes,
    floor_seconds,
    make_inputs,
    roofline_for,
    shapes_by_name,
)
from maxsim.bench.timing import back_to_back, cold_ms
from maxsim.bench.train import grad_error, reference_step, train_labels, train_step

# Largest acceptable max|out - ref| / max|ref| for maxsim itself, by input dtype; in train mode
# also the largest ||grad - ref|| / ||ref|| of grad_Q and grad_D.
TOLERANCE = {"fp16": 2e-2, "bf16": 2e-2, "fp32": 1e-4}
# A provider that asks for TF32 products on fp32 inputs (10-bit mantissas) is held to this instead.
TF32_TOLERANCE = 2e-3


def tolerance_for(row: dict) -> float:
    """The largest relative error a maxsim row may show: its dtype's, or TF32's for a TF32 variant."""
    tf32 = row["dtype"] == "fp32" and row["provider"].endswith("-tf32")
    return TF32_TOLERANCE if tf32 else TOLERANCE[row["dtype"]]
# triton.testing.do_bench (warmup, rep) in ms, and CPU timing runs, without / with --quick.
# Short enough that the default GPU run (every shape x every provider) stays a few minutes.
DO_BENCH_MS = {False: (25, 100), True: (5, 25)}
CPU_RUNS = {False: 5, True: 3}

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
    "nq", "nd", "lq", "ld", "d", "dtype", "masked", "candidates", "ragged", "note",
]  # fmt: skip
TRAIN_CSV_FIELDS = [
    "shape", "provider", "status", "ms", "wall_ms", "floor_ms", "pct_floor", "peak_mb", "rel_err", "grad_q_err",
    "grad_d_err", "speedup", "nq", "nd", "lq", "ld", "d", "dtype", "masked", "candidates", "note",
]  # fmt: skip
GRAD_FIELDS = ("grad_q_err", "grad_d_err")


# --- one cell -----------------------------------------------------------------------------------


def _record(shape: Shape, provider: str, status: str, note: str = "", mode: str = "forward", **values) -> dict:
    """One result row. status: ok | OOM | crashed | error. The floor columns are filled in by the
    parent (:func:`add_floors`), which knows the GPU's roofline."""
    row = {
        "shape": shape.name,
        "provider": provider,
        "status": status,
        "note": note,
        "ms": None,
        "floor_ms": None,
        "pct_floor": None,
        "peak_mb": None,
        "rel_err": None,
        "speedup": None,
    }
    if mode == "train":
        row.update(dict.fromkeys(GRAD_FIELDS))
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
    """``max|out - ref| / max|ref|`` in float64; NaN when ``out`` holds a NaN."""
    diff = (out.double() - ref.double()).abs().max()
    scale = ref.double().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
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


def _time_ms(fn, device: str, quick: bool, flush: str = "read") -> float:
    """Median milliseconds per call. On CUDA each call starts with a cold L2: ``flush="read"``
    leaves it clean (:func:`maxsim.bench.timing.cold_ms`), ``"zero"`` is do_bench's own flush,
    which leaves it dirty (the timed call then also writes ~50 MB back)."""
    if device == "cuda":
        warmup, rep = DO_BENCH_MS[quick]
        if flush == "zero":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        return cold_ms(fn, warmup=warmup, rep=rep)
    times = []
    for _ in range(CPU_RUNS[quick]):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _wall_ms(fn, device: str, estimate_ms: float, budget_ms: float = 100.0) -> float | None:
    """Wall-clock milliseconds per call of a loop: calls enqueued back to back, one synchronisation
    at the end (a training loop's throughput; where the host is slower than the GPU, the host's
    time). CUDA only: on the CPU ``ms`` is already wall time."""
    if device != "cuda":
        return None
    n = max(10, min(1000, int(budget_ms / max(estimate_ms, 1e-3))))
    return back_to_back(fn, n)[1] * 1e3


def _measure(shape: Shape, provider: Provider, device: str, seed: int, quick: bool, flush: str = "read") -> dict:
    """ms, % of floor, peak MB and relative error of one cell; exceptions propagate."""
    from maxsim.reference import maxsim_reference

    Q, D, q_mask, d_mask = make_inputs(shape, device, seed)
    # float64 products and sums: an fp32 kernel's own error (1e-7 scale) is not hidden under the
    # reference's (an fp32 reference is 1e-7 to 5e-7 off on these shapes)
    ref = maxsim_reference(Q, D, q_mask, d_mask, mask_mode=provider.mask_mode, dtype=torch.float64)  # [nq, nd]
    _free(device)  # drop the reference's scratch before the provider allocates its own
    fn = functools.partial(provider.fn, *provider.prepare(Q, D, q_mask, d_mask))
    out = fn()  # warm-up: compiles and autotunes
    _sync(device)
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"returned shape {list(out.shape)}, expected {list(ref.shape)}")
    err = rel_error(out, ref)
    del out
    peak = _peak_mb(fn, device)
    ms = _time_ms(fn, device, quick, flush)
    return {"ms": ms, "peak_mb": peak, "rel_err": err}


def _measure_train(shape: Shape, provider: Provider, device: str, seed: int, quick: bool,
                   flush: str = "read") -> dict:
    """The same for one training step (see :mod:`maxsim.bench.train`), plus the errors of the
    gradients; the peak is that of one step above the inputs, gradients included."""
    Q, D, q_mask, d_mask = make_inputs(shape, device, seed)
    labels = train_labels(shape, device)
    ref = reference_step(shape, Q, D, q_mask, d_mask, labels, mask_mode=provider.mask_mode)
    _free(device)  # the reference's scratch
    Q.requires_grad_(True)
    D.requires_grad_(True)
    step = functools.partial(train_step, provider.fn, provider.prepare(Q, D, q_mask, d_mask), (Q, D), labels)
    scores = step()  # warm-up: compiles and autotunes forward and backward
    _sync(device)
    if tuple(scores.shape) != tuple(ref.scores.shape):
        raise ValueError(f"returned shape {list(scores.shape)}, expected {list(ref.scores.shape)}")
    values = {"rel_err": rel_error(scores, ref.scores), "note": ref.note}
    if ref.grad_Q is not None:
        values["grad_q_err"] = grad_error(Q.grad, ref.grad_Q, "Q")
        values["grad_d_err"] = grad_error(D.grad, ref.grad_D, "D")
    del scores, ref
    Q.grad = D.grad = None  # not part of "before": the step allocates its own
    peak = _peak_mb(step, device)
    ms = _time_ms(step, device, quick, flush)
    values.update(ms=ms, wall_ms=_wall_ms(step, device, ms), peak_mb=peak)
    return values


def measure(
    shape: Shape, provider: Provider, device: str, seed: int = 0, quick: bool = False, mode: str = "forward",
    flush: str = "read",
) -> dict:
    """Run one (shape, provider) cell in this process and return its result row.

    Exceptions become rows (status OOM / crashed / error, traceback on stderr), never escape."""
    try:
        if mode == "train":
            with torch.enable_grad():
                values = _measure_train(shape, provider, device, seed, quick, flush)
        else:
            with torch.no_grad():
                values = _measure(shape, provider, device, seed, quick, flush)
    except Exception as exc:
        traceback.print_exc()
        return _record(shape, provider.name, classify_error(exc), note=_one_line(exc), mode=mode)
    return _record(shape, provider.name, "ok", mode=mode, **values)


# --- worker side --------------------------------------------------------------------------------


def worker_main(spec: str) -> int:
    """Run one provider over a list of shapes, printing one result line per shape.

    spec: JSON ``{"mode", "provider", "device", "seed", "quick", "flush", "shapes": [Shape dicts]}``."""
    faulthandler.enable()  # a segfault or abort still leaves its reason on stderr
    cfg = json.loads(spec)
    mode = cfg.get("mode", "forward")
    provider = REGISTRIES[mode][0][cfg["provider"]]
    for fields in cfg["shapes"]:
        shape = Shape(**fields)
        print(SHAPE_MARK + shape.name, file=sys.stderr, flush=True)
        print(START_MARK + shape.name, flush=True)
        row = measure(shape, provider, cfg["device"], cfg["seed"], cfg["quick"], mode, cfg.get("flush", "read"))
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
        "mode": opts.mode,
        "provider": provider.name,
        "device": device,
        "seed": opts.seed,
        "quick": opts.quick,
        "flush": opts.flush,
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
            report(_record(crashed, provider.name, "crashed", note=reason, mode=opts.mode))
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
        if isolate:
            run_isolated(shapes, provider, device, opts, log_path, report)
        else:
            for shape in shapes:
                report(measure(shape, provider, device, opts.seed, opts.quick, opts.mode, opts.flush))
                _free(device)
    shape_pos = {s.name: i for i, s in enumerate(shapes)}
    prov_pos = {p.name: i for i, p in enumerate(providers)}
    return sorted(rows, key=lambda r: (shape_pos[r["shape"]], prov_pos[r["provider"]]))


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per (shape, provider) from several rounds of :func:`run_all`: the round with the
    median ms among the ok ones (the lower middle one of an even count; wall ms the median of its
    own), its note listing every round's ms. A cell with no ok round keeps its first round's row."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for cells in zip(*rounds):  # every round lists the cells in the same order
        ok = sorted((r for r in cells if r["status"] == "ok"), key=lambda r: r["ms"])
        if not ok:
            merged.append(cells[0])
            continue
        row = dict(ok[(len(ok) - 1) // 2])
        walls = [r["wall_ms"] for r in ok if r.get("wall_ms") is not None]
        if walls:
            row["wall_ms"] = statistics.median_low(walls)
        runs = " ".join(f"{r['ms']:.3f}" if r["status"] == "ok" else r["status"] for r in cells)
        row["note"] = "; ".join(n for n in (row["note"], f"median of {len(cells)} runs, ms: {runs}") if n)
        merged.append(row)
    return merged


# --- report -------------------------------------------------------------------------------------


def add_floors(rows: list[dict], shapes: list[Shape], roofline: Roofline | None, mode: str) -> None:
    """floor_ms and pct_floor (floor / measured time, 100 = at the floor) of every ok row, from
    ``roofline``; both stay None without one (a CPU, or a GPU with no measured roofline)."""
    if roofline is None:
        return
    floors = {s.name: floor_seconds(s, mode, roofline) * 1e3 for s in shapes}
    for r in rows:
        r["floor_ms"] = floors[r["shape"]]
        if r["status"] == "ok":
            r["pct_floor"] = 100 * r["floor_ms"] / r["ms"]


def add_speedups(rows: list[dict]) -> None:
    """speedup = the row's ms / maxsim's ms on the same shape: how many times faster maxsim is
    than this row (below 1: the row is faster). None on maxsim's own row, and where either did
    not run. For maxsim's variants (maxsim-lowmem, maxsim-padded) it says what ``maxsim`` gains
    over them."""
    for shape in {r["shape"] for r in rows}:
        same = [r for r in rows if r["shape"] == shape]
        mine = next((r["ms"] for r in same if r["provider"] == "maxsim" and r["status"] == "ok"), None)
        for r in same:
            ok = r["status"] == "ok" and mine is not None and r["provider"] != "maxsim"
            r["speedup"] = r["ms"] / mine if ok else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


DIM_COLUMNS = ["Nq x Nd", "Lq", "Ld", "d", "dtype", "masks"]
# Columns left out when no row has a value (peak MB and wall ms are CUDA-only, % floor needs a
# measured roofline).
OPTIONAL_COLUMNS = {"wall ms", "% floor", "peak MB", "note"}


def _shape_of(row: dict) -> Shape:
    return Shape(name=row["shape"], **{k: row[k] for k in Shape.__dataclass_fields__ if k != "name"})


def format_table(rows: list[dict], mode: str = "forward") -> str:
    """Fixed-width text table, one line per row: the shape's dimensions, then the measurements
    (train mode: with the gradients' errors). Columns no row has a value for are left out."""
    columns = [  # (header, value of a row)
        ("shape", lambda r: r["shape"]),
        *((c, lambda r, c=c: _shape_of(r).dims()[c]) for c in DIM_COLUMNS),
        ("provider", lambda r: r["provider"]),
        ("ms", lambda r: _fmt(r["ms"], ".3f") if r["status"] == "ok" else r["status"]),
    ]
    if mode == "train":
        columns.append(("wall ms", lambda r: _fmt(r.get("wall_ms"), ".3f")))
    columns += [
        ("% floor", lambda r: _fmt(r["pct_floor"], ".1f")),
        ("peak MB", lambda r: _fmt(r["peak_mb"], ".1f")),
        ("rel err", lambda r: _fmt(r["rel_err"], ".1e")),
    ]
    if mode == "train":
        columns += [("gQ err", lambda r: _fmt(r.get("grad_q_err"), ".1e")),
                    ("gD err", lambda r: _fmt(r.get("grad_d_err"), ".1e"))]
    columns += [("maxsim x", lambda r: "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"),
                ("note", lambda r: r["note"])]
    table = [(head, [value(r) for r in rows]) for head, value in columns]
    table = [(h, cells) for h, cells in table if h not in OPTIONAL_COLUMNS or any(c not in ("-", "") for c in cells)]
    text = {"shape", "masks", "provider", "note"}  # left-aligned; numbers are right-aligned
    widths = [max([len(h)] + [len(c) for c in cells]) for h, cells in table]

    def line_of(values):
        parts = [v.ljust(w) if h in text else v.rjust(w) for (h, _), v, w in zip(table, values, widths)]
        return "  ".join(parts).rstrip()

    lines = [line_of([h for h, _ in table]), line_of(["-" * w for w in widths])]
    lines += [line_of([cells[i] for _, cells in table]) for i in range(len(rows))]
    return "\n".join(lines)


def table_notes(mode: str, roofline: Roofline | None, device: str) -> str:
    """What the columns mean, printed under the table."""
    notes = []
    if mode == "train":
        notes.append(
            "One step: grads set to None, scores, loss = cross_entropy(scores, arange(Nq)) in-batch or "
            "(scores, zeros(Nq)) for candidate lists ('per q'), backward into Q and D.")
    if mode == "varlen":
        kinds = "; ".join(f"{k}: {v}" for k, v in RAGGED_KINDS.items())
        notes.append(
            f"Ragged documents, lengths in [1, Ld] ({kinds}); fill = mean length / Ld. maxsim scores the packed "
            "tokens (maxsim_varlen), maxsim-padded and naive the padded batch with a document mask; packing "
            "pays where maxsim-padded's 'maxsim x' is near 1 / fill.")
    if roofline is not None:
        bw, fl = roofline.bytes_per_s / 1e12, roofline.flops_per_s / 1e12
        floor = f"max(bytes / {bw:g} TB/s, flops / {fl:g} TFLOP/s)"
        if mode == "train":
            floor += f" + backward bytes / {bw:g} TB/s (backward bytes = read Q and D, write their gradients)"
        notes.append(
            f"% floor: the {roofline.gpu} roofline floor {floor} ({roofline.source}), over the measured time "
            "(100 = at the floor); "
            "flops = 2 Nq Nd Lq Ld d, bytes = Q + D + masks + fp32 scores.")
    if device == "cuda":
        notes.append("ms: median of calls each after an L2 flush (cold L2).")
        notes.append("peak MB: max allocated during a call minus allocated before it (inputs).")
    else:
        notes.append("ms: median wall time of a few calls. On the CPU maxsim runs its CPU backend (maxsim.cpu: "
                     "blocked GEMMs in PyTorch, docs/cpu.md); the Triton kernels need a CUDA GPU.")
    if mode == "train" and device == "cuda":
        notes.append("wall ms: steps enqueued back to back, one sync at the end (a training loop's time per step).")
    notes.append("maxsim x: this row's ms / maxsim's ms on the same shape (how many times faster maxsim is; "
                 "below 1: this row is faster).")
    ref = "maxsim_reference in float64" if mode != "train" else "the autograd of maxsim_reference in fp32"
    notes.append(f"rel err: max|out - ref| / max|ref| against {ref} (naive: mask_mode='multiply', PyLate's rule)"
                 + ("; gQ err, gD err: ||grad - ref|| / ||ref||." if mode == "train" else "."))
    return "\n".join("  " + n for n in notes)


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


def environment(device: str, providers: list[Provider]) -> dict:
    """What the numbers were measured on: the device, torch, triton and each provider's version."""
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
    for p in providers:
        if p.dist:
            env[p.dist] = _version(p.dist)
    env["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return env


def header_line(env: dict) -> str:
    return " | ".join([env["device"]] + [f"{k} {v}" for k, v in env.items() if k not in ("device", "date")] + [env["date"]])


def skipped_line(not_installed: list[Provider], need_cuda: list[Provider]) -> str | None:
    """One line naming the providers that were left out, and why (None when none was)."""
    parts = []
    if not_installed:
        parts.append("not installed: " + ", ".join(p.name for p in not_installed))
    if need_cuda:
        parts.append("need a CUDA GPU: " + ", ".join(p.name for p in need_cuda))
    return "skipped, " + "; ".join(parts) if parts else None


def floor_line(roofline: Roofline | None, device: str, device_name: str) -> str | None:
    if roofline is not None:
        return None
    if device == "cuda":
        return f"% floor: left out, no measured roofline for {device_name} (known: {roofline_names()})"
    return "% floor: left out on the CPU (the floor is a measured GPU roofline)"


def roofline_names() -> str:
    from maxsim.bench.shapes import ROOFLINES

    return ", ".join(r.gpu for r in ROOFLINES)


def write_csv(rows: list[dict], path: Path, mode: str = "forward") -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        fields = TRAIN_CSV_FIELDS if mode == "train" else CSV_FIELDS
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_jsonl(rows: list[dict], env: dict, argv: list[str], path: Path) -> None:
    """First line: the environment and the command line; then one line per row."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"env": env, "argv": argv}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


# Shapes per panel of the plot: a sweep of 108 shapes becomes a column of readable panels.
PLOT_SHAPES_PER_PANEL = 18


def write_png(rows: list[dict], path: Path, title: str) -> bool:
    """Grouped bars, one group per shape, one bar per provider, at most ``PLOT_SHAPES_PER_PANEL``
    shapes per panel: % of floor where the rows have one, else ms on a log scale. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark box
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    with_floor = any(r["pct_floor"] is not None for r in rows)
    key = "pct_floor" if with_floor else "ms"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cell = {(r["shape"], r["provider"]): r for r in rows}
    width = 0.8 / len(providers)
    panels = [shapes[i:i + PLOT_SHAPES_PER_PANEL] for i in range(0, len(shapes), PLOT_SHAPES_PER_PANEL)]
    per_panel = len(panels[0])
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(7.0, 1.2 * per_panel + 1.5), 4.5 * len(panels)))
    for ax, panel in zip(axes[:, 0], panels):
        for i, p in enumerate(providers):
            xs = [j - 0.4 + width * (i + 0.5) for j in range(len(panel))]
            heights = [(cell[(s, p)][key] or 0.0) if (s, p) in cell else 0.0 for s in panel]
            ax.bar(xs, heights, width, label=p, color=f"C{i}")
            for x, s in zip(xs, panel):  # say why a bar is missing
                status = cell[(s, p)]["status"] if (s, p) in cell else "not run"
                if status != "ok":
                    ax.text(x, 0, status, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(panel)))
        ax.set_xticklabels(panel, rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.6, per_panel - 0.4)
        if not with_floor:
            ax.set_yscale("log")
        ax.set_ylabel("% of floor (higher is better)" if with_floor else "ms (lower is better)", fontsize=8)
    axes[0, 0].set_title(title, fontsize=8)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def maxsim_failures(rows: list[dict]) -> list[str]:
    """Why maxsim itself (or a variant, e.g. maxsim-lowmem) failed, one line per bad row (empty
    when it is fine). Gradient errors count where they were measured."""
    bad = []
    for r in rows:
        if not is_maxsim(r["provider"]):
            continue
        tol = tolerance_for(r)
        if r["status"] != "ok":
            bad.append(f"{r['shape']}: {r['provider']} {r['status']} {r['note']}".rstrip())
            continue
        for key, what in [("rel_err", "rel err"), ("grad_q_err", "grad_Q err"), ("grad_d_err", "grad_D err")]:
            if key == "rel_err" or r.get(key) is not None:
                if not r[key] <= tol:  # also catches NaN
                    bad.append(f"{r['shape']}: {r['provider']} {what} {r[key]:.2e} above {tol:g}")
    return bad


# --- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The runner's own parser: the bench options plus the hidden ``--worker``."""
    p = argparse.ArgumentParser(prog="python -m maxsim bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as a worker on this JSON spec
    return p


def _output_paths(opts) -> dict:
    out = opts.out
    stem = f"{opts.mode}-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
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


def list_shapes_and_providers() -> str:
    """Every mode's shapes (GPU set, then CPU set) with their dimensions, and its providers."""
    from maxsim.bench.shapes import NAMED_SETS, SHAPE_SETS

    lines = []
    for mode, (gpu, cpu) in SHAPE_SETS.items():
        registry, names = REGISTRIES[mode]
        lines.append(f"--mode {mode}")
        def label(p: Provider) -> str:
            needs = [w for w, missing in (("needs CUDA", p.needs_cuda), ("not installed", not p.installed())) if missing]
            return p.name + (f" ({', '.join(needs)})" if needs else "")

        lines.append("  providers: " + ", ".join(label(registry[n]) for n in names))
        for title, shapes in (("GPU shapes", gpu), ("CPU shapes", cpu)):
            lines.append(f"  {title}:")
            for s in shapes:
                dims = s.dims()
                docs = f"{s.nq} queries x {s.nd} " + ("candidates each" if s.candidates else "documents")
                mask = "" if dims["masks"] == "-" else f", masks {dims['masks']}"
                lines.append(f"    {s.name:24s} {docs}, Lq {dims['Lq']}, Ld {dims['Ld']}, d {dims['d']}, "
                             f"{dims['dtype']}{mask}")
    described = {"sweep": "forward: the Nq x Lq x Ld x d grid", "sweep_cpu": "forward: the grid, scaled down",
                 "models": "forward: real models' configurations, rerank and search, 16-bit and fp32",
                 "models_train": "--mode train: real models' in-batch and distillation steps, 16-bit and fp32",
                 "padded": "forward: one-query reranks of documents padded to the longest, real length distributions",
                 "widths": "forward: one query, bandwidth-bound, d 64 to 4096"}
    for name, shapes in NAMED_SETS.items():
        lines.append(f"set '{name}': {len(shapes)} shapes ({described.get(name, 'forward')}), e.g. {shapes[0].name}")
    return "\n".join(lines)


def run_cli(argv: list[str] | None = None, *, shapes: list[Shape] | None = None) -> int:
    """The benchmark on command-line options ``argv``; ``shapes`` overrides ``--shapes`` (tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    if opts.worker:
        return worker_main(opts.worker)
    return run_options(opts, argv, shapes=shapes)


def run_options(opts, argv: list[str] | None = None, *, shapes: list[Shape] | None = None) -> int:
    """Entry point of ``python -m maxsim bench`` once its options are parsed; ``argv`` is recorded
    in the JSONL file. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if opts.list:
        print(list_shapes_and_providers())
        return 0
    if opts.forward_tile:
        from maxsim.selection.dense import parse_tile

        try:
            parse_tile(opts.forward_tile)
        except ValueError as exc:
            print(f"maxsim bench: --forward-tile: {exc}", file=sys.stderr)
            return 2
        os.environ["MAXSIM_FORWARD_TILE"] = opts.forward_tile  # read by the workers at import
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("maxsim bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        if shapes is None:
            shapes = shapes_by_name(_names(opts.shapes)) if opts.shapes else default_shapes(device, opts.mode)
        names = _names(opts.providers) if opts.providers else REGISTRIES[opts.mode][1]
        providers = get_providers(names, opts.mode)
        if opts.mode == "train":
            for shape in shapes:
                if shape.ragged:
                    raise ValueError(f"shape {shape.name} is ragged: use --mode varlen")
    except ValueError as exc:
        print(f"maxsim bench: {exc}", file=sys.stderr)
        return 2
    if opts.pin_cpu is not None:
        allowed = _allowed_cpus()
        if opts.pin_cpu not in allowed:
            print(f"maxsim bench: --pin-cpu {opts.pin_cpu} is not among this process's CPUs "
                  f"{_cpu_list(allowed)}", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, {opts.pin_cpu})  # the workers inherit it
        try:
            return _run(opts, argv, device, shapes, providers)
        finally:
            os.sched_setaffinity(0, allowed)
    return _run(opts, argv, device, shapes, providers)


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on (empty where the OS cannot pin: macOS, Windows)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus))) or "(none: this OS cannot pin)"


def _run(opts, argv, device, shapes, providers) -> int:
    """Measure, print the table, write the files; the exit status of :func:`run_cli`."""
    not_installed = [p for p in providers if not p.installed()]
    need_cuda = [p for p in providers if p.installed() and not p.runs_on(device)]
    runnable = [p for p in providers if p not in not_installed and p not in need_cuda]
    paths = _output_paths(opts)
    isolate = opts.isolate == "on" or (opts.isolate == "auto" and device == "cuda")
    env = environment(device, runnable)
    roofline = roofline_for(env["device"]) if device == "cuda" else None
    if device == "cuda":
        env["L2 flush"] = opts.flush
    if opts.pin_cpu is not None:
        env["CPU pin"] = opts.pin_cpu

    rounds = []
    for i in range(opts.repeat):
        if opts.repeat > 1:
            print(f"round {i + 1} of {opts.repeat}", file=sys.stderr, flush=True)
        rounds.append(run_all(shapes, runnable, device, opts, isolate, paths["workers"]))
    rows = median_rows(rounds)
    add_floors(rows, shapes, roofline, opts.mode)
    add_speedups(rows)
    print(f"maxsim bench --mode {opts.mode} on " + header_line(env))
    for extra in (skipped_line(not_installed, need_cuda), floor_line(roofline, device, env["device"])):
        if extra:
            print(extra)
    print(format_table(rows, opts.mode))
    print(table_notes(opts.mode, roofline, device))
    write_csv(rows, paths["csv"], opts.mode)
    write_jsonl(rows, env, argv, paths["jsonl"])
    written = [paths["csv"], paths["jsonl"]]
    if write_png(rows, paths["png"], header_line(env)):
        written.append(paths["png"])
    if isolate:
        written.append(paths["workers"])
    print(f"wrote {len(written)} files to {opts.out.resolve()}: " + ", ".join(
        p.name if p.parent.resolve() == opts.out.resolve() else str(p) for p in written))

    failures = list(dict.fromkeys(maxsim_failures([r for rnd in rounds for r in rnd])))  # every round counts
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_cli())
