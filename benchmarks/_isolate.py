"""Run one benchmark measurement in a fresh Python process.

A peer that poisons the CUDA context (after an illegal memory access every later CUDA call fails)
or kills its process then costs one table row, not the run:

    from _isolate import run_isolated

    result = run_isolated(measure_provider, "1x10k", "maxsim fused", timeout_s=600)
    # {"status": "ok", **measure_provider's dict}, or {"status": ..., "error": "one line"}

``fn`` is a module-level function of a Python file (a benchmark script works: the child loads
the file under its own name, so its ``if __name__ == "__main__"`` block does not run there). Its
arguments and the dict it returns travel as JSON: pass sizes and a seed and let the child build
its tensors, never the tensors themselves. The child's stdout and stderr are ours (the tail of
stderr is kept to say why a child died). Statuses:

    ok        fn returned
    error     fn raised an ordinary exception (a peer's API differs, an import failed)
    OOM       fn ran out of memory
    crashed   the process died, or fn raised an error after which CUDA is unusable
    timeout   no result within timeout_s; the child and everything it started were killed

The main harness (``python -m maxsim bench``) has its own worker protocol for its (shape,
provider) grid; this module reuses its error classification and crash-reason parsing.
"""

from __future__ import annotations

import collections
import faulthandler
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

DEFAULT_TIMEOUT_S = 600.0
STDERR_TAIL_LINES = 200  # enough to hold a traceback and faulthandler's dump


def run_isolated(fn, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> dict:
    """``fn(*args, **kwargs)`` in a new Python process: its dict with ``status: ok``, or a
    ``status`` (error, OOM, crashed, timeout) and a one-line ``error``."""
    file, module, qualname = _locate(fn)
    with tempfile.TemporaryDirectory(prefix="maxsim-isolate-") as tmp:
        result_path = Path(tmp) / "result.json"
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({
            "file": file, "module": module, "function": qualname, "args": list(args), "kwargs": kwargs,
            "sys_path": sys.path, "result": str(result_path),
        }))
        sys.stdout.flush()  # our lines first, then the child's, on the same terminal
        sys.stderr.flush()
        # A session of its own, so that a timeout can kill whatever the child started too;
        # unbuffered, so that a child that dies loses none of what it printed.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(spec_path)],
                                stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        pump = threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if hasattr(signal, "SIGUSR1"):  # the child's stacks on stderr first: where it was stuck
                proc.send_signal(signal.SIGUSR1)
                pump.join(timeout=3)
            _kill_session(proc)
            return {"status": "timeout", "error": f"no result within {timeout_s:g} s"}
        except BaseException:  # Ctrl-C reaches only us (the child has its own session): take it down
            _kill_session(proc)
            raise
        pump.join(timeout=5)
        if result_path.exists():
            return json.loads(result_path.read_text())
    from maxsim.bench.runner import crash_reason

    return {"status": "crashed", "error": crash_reason("".join(tail), returncode)}


def failed(result: dict) -> str:
    """``""`` for an ok result, else ``"<status>: <error>"`` (a table's note)."""
    if result["status"] == "ok":
        return ""
    error = result.get("error")
    return f"{result['status']}: {error}" if error else result["status"]


def _locate(fn) -> tuple[str, str, str]:
    """(file, module name, qualified name) by which a child finds ``fn`` again."""
    qualname = getattr(fn, "__qualname__", "")
    if not qualname or "<" in qualname:
        raise ValueError(f"run_isolated needs a module-level function, not {fn!r}")
    file = os.path.abspath(sys.modules[fn.__module__].__file__)
    module = Path(file).stem if fn.__module__ == "__main__" else fn.__module__
    return file, module, qualname


def _tee(stream, tail: collections.deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        tail.append(line)
        sys.stderr.write(line)
        sys.stderr.flush()
    stream.close()


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session; the child is not reaped yet, so its id is still ours."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


# --- child side ---------------------------------------------------------------------------------


def _status_of(exc: BaseException) -> str:
    if "torch" not in sys.modules:  # no CUDA context to poison, no CUDA allocator to exhaust
        return "error"
    from maxsim.bench.runner import classify_error

    return classify_error(exc)


def _headline(exc: BaseException) -> str:
    # The first line: CUDA's errors put the cause there and boilerplate after it.
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:200]


def _load(file: str, module: str, qualname: str):
    spec = importlib.util.spec_from_file_location(module, file)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    target = loaded
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _child(spec_path: str) -> None:
    faulthandler.enable()  # a segfault or an abort still leaves its reason on stderr
    if hasattr(signal, "SIGUSR1"):  # a timeout asks for the stacks before the kill
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(Path(spec_path).read_text())
    sys.path[:] = [os.path.dirname(spec["file"]), *spec["sys_path"]]
    try:
        value = _load(spec["file"], spec["module"], spec["function"])(*spec["args"], **spec["kwargs"])
        text = json.dumps({**(value or {}), "status": "ok"})
    except Exception as exc:
        traceback.print_exc()
        text = json.dumps({"status": _status_of(exc), "error": _headline(exc)})
    partial = spec["result"] + ".partial"
    Path(partial).write_text(text)
    os.replace(partial, spec["result"])  # the parent never reads half a result
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: after a CUDA error it can hang, and nothing is left to do.
    os._exit(0)


if __name__ == "__main__":
    _child(sys.argv[1])
