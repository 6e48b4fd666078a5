"""Crash isolation of the standalone GPU benchmarks (benchmarks/_isolate.py), on the CPU: a
provider that kills its process, raises or hangs costs its own row, and the next provider still
runs. The providers below are loaded again in each child process. Nothing here times anything."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _isolate import failed, run_isolated  # noqa: E402

# The hang's limit: long enough for its child to start Python, load this file and record its
# process ids on a busy 2-core machine; the other providers get a limit they never approach.
HANG_TIMEOUT_S = 3.0
TIMEOUT_S = 60.0


def doubles(x):
    return {"value": 2 * x, "pid": os.getpid()}


def exits_at_once():
    os._exit(1)


def aborts():
    os.abort()


def raises():
    raise ValueError("the peer's API differs\nsecond line")


def hangs(pid_file):
    """Starts a grandchild, records both process ids, then never returns."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(f"{os.getpid()} {grandchild.pid}")
    time.sleep(600)


def run_providers(providers):
    """The benchmarks' loop: every provider in a process of its own, its result a row."""
    return [run_isolated(fn, *args, timeout_s=timeout_s) for fn, args, timeout_s in providers]


def test_result_comes_back_from_another_process():
    (row,) = run_providers([(doubles, (21,), TIMEOUT_S)])
    assert row["status"] == "ok" and row["value"] == 42
    assert row["pid"] != os.getpid()
    assert failed(row) == ""


def test_a_provider_that_kills_its_process_is_a_crashed_row_and_the_next_one_runs():
    rows = run_providers([(exits_at_once, (), TIMEOUT_S), (doubles, (1,), TIMEOUT_S), (aborts, (), TIMEOUT_S),
                          (doubles, (2,), TIMEOUT_S)])
    assert [r["status"] for r in rows] == ["crashed", "ok", "crashed", "ok"]
    assert [r.get("value") for r in rows] == [None, 2, None, 4]
    assert rows[0]["error"] == "worker exited with status 1"
    assert "Abort" in rows[2]["error"] or "SIGABRT" in rows[2]["error"]  # faulthandler's line, or the signal
    assert failed(rows[0]) == "crashed: worker exited with status 1"


def test_an_exception_is_an_error_row_with_its_first_line():
    row, after = run_providers([(raises, (), TIMEOUT_S), (doubles, (3,), TIMEOUT_S)])
    assert row == {"status": "error", "error": "ValueError: the peer's API differs"}
    assert after["status"] == "ok" and after["value"] == 6


def test_a_hanging_provider_times_out_and_is_killed_with_what_it_started(tmp_path, capfd):
    pid_file = tmp_path / "pids"
    row, after = run_providers([(hangs, (str(pid_file),), HANG_TIMEOUT_S), (doubles, (4,), TIMEOUT_S)])
    assert row == {"status": "timeout", "error": f"no result within {HANG_TIMEOUT_S:g} s"}
    assert after["status"] == "ok" and after["value"] == 8
    for pid in map(int, pid_file.read_text().split()):  # (the file says the child reached hangs())
        assert _gone(pid), f"process {pid} outlived the timeout"
    # before the kill, the child printed where it was stuck: its stack, down to hangs()'s sleep
    assert 'in hangs' in capfd.readouterr().err


def test_only_module_level_functions_can_cross():
    try:
        run_isolated(lambda: {})
    except ValueError as exc:
        assert "module-level function" in str(exc)
    else:
        raise AssertionError("a lambda was accepted")


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether ``pid`` is dead (a zombie waiting for its reaper counts as dead); SIGKILL is
    delivered asynchronously, so give it a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return True
        except OSError:  # no /proc (macOS): fall back to a signal probe
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "R"
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
