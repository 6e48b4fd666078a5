"""benchmarks/headline_bench.py keeps what a cell measured when the cell is stopped (the deadline of
a device call, a crash): its finished searches are rows, and one more row says why it stopped.
Runs a tiny CPU headline with the cell's process replaced by an in-process call that then reports
a timeout. Nothing here times anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import headline_bench  # noqa: E402


def _in_process(stop_cells: set):
    """run_isolated's stand-in: the cell runs here; cells named in ``stop_cells`` then report a
    timeout instead of their result, as a cell killed at the deadline does."""
    def run(fn, *args, timeout_s=None, **kwargs):
        result = dict(fn(*args, **kwargs), status="ok")
        if fn.__name__ in stop_cells:
            return {"status": "timeout", "error": f"no result within {timeout_s:g} s"}
        return result
    return run


def _headline(tmp_path, monkeypatch, stop_cells):
    out = tmp_path / "headline.json"
    monkeypatch.setattr(headline_bench, "run_isolated", _in_process(stop_cells))
    monkeypatch.setattr(sys, "argv", ["headline_bench.py", "--docs", "400", "--encodings", "int8,residual2",
                                      "--engines", "", "--device", "cpu", "--queries", "4", "--reps", "1",
                                      "--search-budget-s", "120", "--refine", "float16", "--refine-factors", "2",
                                      "--deadline-s", "0", "--tmp", str(tmp_path), "--out", str(out)])
    headline_bench.main()
    return json.loads(out.read_text())["rows"]


def test_a_stopped_cell_keeps_its_finished_searches(tmp_path, monkeypatch):
    rows = _headline(tmp_path, monkeypatch, {"encoding_cell"})
    by_label = {r["encoding"]: r for r in rows}
    # int8 has no refine; residual2 has its scan and the refined scan; each ends in a "stopped" row
    for label in ("int8", "residual2", "residual2+r2"):
        row = by_label[label]
        assert 0.0 <= row["recall_1"] <= 1.0 and row["ms_1"] > 0 and row["queries_1"] == 4, row
    assert by_label["residual2"]["build_s"] > 0  # the built fields came back with the first row
    for encoding in ("int8", "residual2"):
        stopped = by_label[f"{encoding} (stopped)"]
        assert "timeout" in stopped["note"] and "the rows above finished" in stopped["note"]
    assert not any("partial_path" in r for r in rows)


def test_a_finished_cell_is_reported_as_before(tmp_path, monkeypatch):
    rows = _headline(tmp_path, monkeypatch, set())
    labels = [r["encoding"] for r in rows]
    assert labels == ["int8", "residual2", "residual2+r2"]
    assert all(0.0 <= r["recall_1"] <= 1.0 for r in rows)


def test_plaid_only_times_the_plaid_searches_and_not_the_scan(tmp_path, monkeypatch):
    out = tmp_path / "headline.json"
    monkeypatch.setattr(headline_bench, "run_isolated", _in_process(set()))
    monkeypatch.setattr(sys, "argv", ["headline_bench.py", "--docs", "400", "--encodings", "residual2:plaid",
                                      "--plaid-only", "--plaid-args", "ncells=2,ndocs=64", "--engines", "",
                                      "--device", "cpu", "--queries", "4", "--reps", "1", "--search-budget-s", "120",
                                      "--refine", "float16", "--refine-factors", "2", "--deadline-s", "0",
                                      "--tmp", str(tmp_path), "--out", str(out)])
    headline_bench.main()
    rows = json.loads(out.read_text())["rows"]
    labels = [r["encoding"] for r in rows]
    assert labels == ["residual2:plaid[ncells=2,ndocs=64]", "residual2:plaid[ncells=2,ndocs=64]+r2"]
    first, refined = rows
    assert first["build_s"] > 0 and "index.from_corpus" in first["note"]  # the cell's build, the PLAID note
    assert "refined from float16" in refined["note"]
    assert all(0.0 <= r["recall_1"] <= 1.0 and r["queries_1"] == 4 for r in rows)
