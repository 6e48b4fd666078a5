"""The benchmark harness, end to end on CPU with tiny shapes. Nothing here asserts on timings."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from maxsim.bench import Shape, floor_seconds, make_inputs, run_cli
from maxsim.bench import providers as bench_providers
from maxsim.bench.runner import SHAPE_MARK, crash_reason
from maxsim.bench.shapes import CPU_SHAPES, GPU_SHAPES, shapes_by_name
from maxsim.reference import maxsim_reference

TINY = [
    Shape("tiny_fp16", 2, 5, 8, 16, d=32),
    Shape("tiny_masked_bf16", 3, 4, 6, 10, d=16, dtype="bf16", masked=True),
    Shape("tiny_fp32", 1, 3, 4, 7, d=8, dtype="fp32"),
]


def _only(tmp_path, pattern):
    found = list(tmp_path.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def _csv_rows(tmp_path):
    with open(_only(tmp_path, "forward-*.csv"), newline="") as f:
        return list(csv.DictReader(f))


def _table_rows(stdout):
    """(shape, provider) -> the table line's fields."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("tiny_"):
            rows[(parts[0], parts[1])] = parts
    return rows


def test_end_to_end_cpu(tmp_path, capsys):
    argv = ["--providers", "maxsim,naive", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY) == 0
    out = capsys.readouterr().out

    assert out.splitlines()[0].startswith("CPU")  # the header line
    table = _table_rows(out)
    assert set(table) == {(s.name, p) for s in TINY for p in ("maxsim", "naive")}

    rows = _csv_rows(tmp_path)
    assert len(rows) == 2 * len(TINY)
    for row in rows:
        assert row["status"] == "ok"
        assert 0 <= float(row["rel_err"]) < 1e-2
        assert float(row["ms"]) > 0 and float(row["pct_floor"]) > 0
        assert row["peak_mb"] == ""  # not measured on CPU
        assert float(row["speedup"]) > 0
    by_key = {(r["shape"], r["provider"]): r for r in rows}
    assert float(by_key[("tiny_fp32", "maxsim")]["rel_err"]) <= 1e-4

    lines = _only(tmp_path, "forward-*.jsonl").read_text().splitlines()
    assert "env" in json.loads(lines[0])
    assert [json.loads(x)["shape"] for x in lines[1:]] == [r["shape"] for r in rows]


def test_csv_option_and_unavailable_peers(tmp_path, capsys):
    target = tmp_path / "sub" / "result.csv"
    argv = ["--providers", "maxsim,flash-maxsim", "--device", "cpu", "--quick"]
    argv += ["--out", str(tmp_path), "--csv", str(target)]
    assert run_cli(argv, shapes=TINY[:1]) == 0
    with open(target, newline="") as f:
        rows = {r["provider"]: r for r in csv.DictReader(f)}
    assert rows["maxsim"]["status"] == "ok"
    assert rows["flash-maxsim"]["status"] == "n/a"  # peers need CUDA
    assert _table_rows(capsys.readouterr().out)[("tiny_fp16", "flash-maxsim")][2] == "n/a"


def test_maxsim_wrong_result_fails(tmp_path, monkeypatch):
    def off_by_ten_percent(Q, D, q_mask, d_mask):
        return maxsim_reference(Q, D, q_mask, d_mask) * 1.1

    broken = dataclasses.replace(bench_providers.PROVIDERS["maxsim"], fn=off_by_ten_percent)
    monkeypatch.setitem(bench_providers.PROVIDERS, "maxsim", broken)
    argv = ["--providers", "maxsim", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY[:1]) == 1


def test_crash_isolation(tmp_path):
    # selftest-crash aborts on odd nd and raises a CUDA-style error on nd = 2 mod 4.
    shapes = [
        Shape("tiny_abort", 1, 5, 4, 8, d=16),
        Shape("tiny_cuda_error", 1, 6, 4, 8, d=16),
        Shape("tiny_after", 1, 4, 4, 8, d=16),
    ]
    argv = ["--providers", "selftest-crash", "--device", "cpu", "--quick", "--isolate", "on"]
    assert run_cli(argv + ["--out", str(tmp_path)], shapes=shapes) == 0  # a peer crash is a result
    rows = {r["shape"]: r for r in _csv_rows(tmp_path)}
    assert rows["tiny_abort"]["status"] == "crashed"
    assert "Aborted" in rows["tiny_abort"]["note"]
    assert rows["tiny_cuda_error"]["status"] == "crashed"
    assert "illegal memory access" in rows["tiny_cuda_error"]["note"]
    assert rows["tiny_after"]["status"] == "ok"  # a fresh worker carried on
    assert float(rows["tiny_after"]["rel_err"]) < 1e-6


def test_crash_reason_reads_the_last_shape():
    text = (
        f"{SHAPE_MARK}first\nValueError: old news\n"
        f"{SHAPE_MARK}second\nTraceback (most recent call last):\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    )
    assert crash_reason(text, 1) == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert crash_reason(f"{SHAPE_MARK}x\n", -9) == "killed by SIGKILL"


def test_floor_seconds_by_hand():
    # 1q_x_100k is memory-bound: fp16 Q + D, no masks, fp32 scores.
    bytes_ = (1 * 32 + 100_000 * 300) * 128 * 2 + 1 * 100_000 * 4
    assert bytes_ == 7_680_408_192
    assert floor_seconds(shapes_by_name(["1q_x_100k"])[0]) == pytest.approx(bytes_ / 4.3e12)
    # masked_64x64 is compute-bound: 2 * 64 * 64 * 32 * 180 * 128 FLOPs.
    assert floor_seconds(shapes_by_name(["masked_64x64"])[0]) == pytest.approx(6_039_797_760 / 790e12)


def test_inputs_are_deterministic_prefix_masked_and_nonzero():
    shape = Shape("tiny", 3, 4, 6, 10, d=16, dtype="bf16", masked=True)
    Q, D, qm, dm = make_inputs(shape, "cpu", seed=3)
    Q2, D2, qm2, dm2 = make_inputs(shape, "cpu", seed=3)
    assert torch.equal(Q, Q2) and torch.equal(D, D2) and torch.equal(qm, qm2) and torch.equal(dm, dm2)
    assert Q.dtype == torch.bfloat16 and Q.shape == (3, 6, 16) and D.shape == (4, 10, 16)
    assert (Q != 0).any() and (D != 0).any()
    for mask in (qm, dm):
        lengths = mask.sum(-1)
        assert (lengths >= 1).all()
        assert torch.equal(mask, torch.arange(mask.shape[1]) < lengths[:, None])


def test_flash_prepare_turns_masks_into_lengths():
    shape = Shape("tiny", 3, 4, 6, 10, d=16, masked=True)
    Q, D, qm, dm = make_inputs(shape, "cpu")
    flash = bench_providers.PROVIDERS["flash-maxsim"]
    _, _, q_len, d_len = flash.prepare(Q, D, qm, dm)
    assert q_len.dtype == torch.int32 and q_len.tolist() == qm.sum(-1).tolist()
    assert d_len.dtype == torch.int32 and d_len.tolist() == dm.sum(-1).tolist()
    # One query: its padding is cut off, since flash_maxsim() takes no query length.
    Q1, _, q_len1, _ = flash.prepare(Q[:1], D, qm[:1], dm)
    assert q_len1 is None and Q1.shape[1] == int(qm[0].sum())
    with pytest.raises(ValueError, match="prefix"):
        flash.prepare(Q, D, qm.flip(-1), dm)


def test_naive_matches_reference_in_pylate_mask_mode():
    shape = Shape("tiny", 2, 3, 5, 9, d=16, dtype="fp32", masked=True)
    Q, D, qm, dm = make_inputs(shape, "cpu")
    out = bench_providers.PROVIDERS["naive"].fn(Q, D, qm, dm)
    ref = maxsim_reference(Q, D, qm, dm, mask_mode="multiply")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_bad_options_exit_2(tmp_path):
    assert run_cli(["--shapes", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert run_cli(["--providers", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2


def test_gpu_shape_set_is_the_specified_one():
    names = [s.name for s in GPU_SHAPES]
    assert names == [
        "1q_x_100k", "32q_x_100k", "colpali_1x1k", "1x1k_128x1024",
        "inbatch_128x128", "masked_64x64", "d768_32x10k",
    ]  # fmt: skip
    assert [s.name for s in CPU_SHAPES] == [n + "_cpu" for n in names]
