"""The benchmark harness, end to end on CPU with tiny shapes. Nothing here asserts on timings."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re

import pytest
import torch

from maxsim.bench import Shape, floor_seconds, make_inputs, run_cli
from maxsim.bench import providers as bench_providers
from maxsim.bench import runner as bench_runner
from maxsim.bench import train as bench_train
from maxsim.bench.runner import SHAPE_MARK, TRAIN_CSV_FIELDS, crash_reason, median_rows
from maxsim.bench.shapes import (
    GPU_SHAPES,
    H200,
    NAMED_SETS,
    SHAPE_SETS,
    TRAIN_CPU_SHAPES,
    TRAIN_GPU_SHAPES,
    VARLEN_GPU_SHAPES,
    ragged_lengths,
    roofline_for,
    shapes_by_name,
)
from maxsim.cli import main as cli_main
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


def _csv_rows(tmp_path, mode="forward"):
    with open(_only(tmp_path, f"{mode}-*.csv"), newline="") as f:
        return list(csv.DictReader(f))


PROVIDER_NAMES = {name for registry, _ in bench_providers.REGISTRIES.values() for name in registry}


def _table_rows(stdout):
    """(shape, provider) -> the table line's fields (split on blanks)."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("tiny_"):
            provider = next(p for p in parts if p in PROVIDER_NAMES)
            rows[(parts[0], provider)] = parts
    return rows


def test_end_to_end_cpu(tmp_path, capsys):
    argv = ["--providers", "maxsim,naive", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY) == 0
    out = capsys.readouterr().out

    assert out.splitlines()[0].startswith("maxsim bench --mode forward on CPU")  # the header line
    assert "% floor" not in out.splitlines()[3]  # no H200 roofline on a CPU: no column
    table = _table_rows(out)
    assert set(table) == {(s.name, p) for s in TINY for p in ("maxsim", "naive")}
    for (name, _), parts in table.items():  # every row shows its dimensions
        shape = next(s for s in TINY if s.name == name)
        dims = [str(shape.nq), "x", str(shape.nd), str(shape.lq), str(shape.ld), str(shape.d), shape.dtype]
        assert parts[1:9] == dims + ["prefix" if shape.masked else "-"]

    rows = _csv_rows(tmp_path)
    assert len(rows) == 2 * len(TINY)
    for row in rows:
        assert row["status"] == "ok"
        assert 0 <= float(row["rel_err"]) < 1e-2
        assert float(row["ms"]) > 0
        assert row["pct_floor"] == row["floor_ms"] == row["peak_mb"] == ""  # not on a CPU
    by_key = {(r["shape"], r["provider"]): r for r in rows}
    for shape in TINY:  # one definition on every row: the row's ms over maxsim's
        naive, mine = by_key[(shape.name, "naive")], by_key[(shape.name, "maxsim")]
        assert mine["speedup"] == ""
        assert float(naive["speedup"]) == pytest.approx(float(naive["ms"]) / float(mine["ms"]), rel=1e-3)
    assert float(by_key[("tiny_fp32", "maxsim")]["rel_err"]) <= 1e-4

    lines = _only(tmp_path, "forward-*.jsonl").read_text().splitlines()
    assert "env" in json.loads(lines[0])
    assert [json.loads(x)["shape"] for x in lines[1:]] == [r["shape"] for r in rows]


def test_csv_option_and_skipped_peers(tmp_path, capsys, monkeypatch):
    # One peer installed but CUDA-only (its module stands in for an installed one), one missing.
    flash = bench_providers.PROVIDERS["flash-maxsim"]
    monkeypatch.setitem(bench_providers.PROVIDERS, "flash-maxsim", dataclasses.replace(flash, module="json"))
    lik = bench_providers.PROVIDERS["late-interaction-kernels"]
    missing = dataclasses.replace(lik, module="maxsim_bench_no_such_module")
    monkeypatch.setitem(bench_providers.PROVIDERS, "late-interaction-kernels", missing)
    target = tmp_path / "sub" / "result.csv"
    argv = ["--providers", "maxsim,flash-maxsim,late-interaction-kernels", "--device", "cpu", "--quick"]
    argv += ["--out", str(tmp_path), "--csv", str(target)]
    assert run_cli(argv, shapes=TINY) == 0
    with open(target, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["provider"] for r in rows} == {"maxsim"} and len(rows) == len(TINY)  # no n/a rows
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipped")]
    assert skipped == ["skipped, not installed: late-interaction-kernels; need a CUDA GPU: flash-maxsim"]
    assert {p for _, p in _table_rows(out)} == {"maxsim"}


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
    with pytest.raises(SystemExit) as exc:  # argparse refuses an unknown L2 flush
        run_cli(["--flush", "nope", "--device", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # and a repeat count below 1
        run_cli(["--repeat", "0", "--device", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="this OS cannot pin a process to a CPU")
def test_pin_cpu_pins_the_run_and_restores_the_affinity(tmp_path, capsys, monkeypatch):
    before = os.sched_getaffinity(0)
    cpu = max(before)
    seen = []
    original = bench_runner._run

    def spy(*args):
        seen.append(os.sched_getaffinity(0))
        return original(*args)

    monkeypatch.setattr(bench_runner, "_run", spy)
    argv = ["--providers", "maxsim", "--device", "cpu", "--quick", "--pin-cpu", str(cpu), "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY[:1]) == 0
    assert seen == [{cpu}]  # what the workers inherit
    assert f"CPU pin {cpu}" in capsys.readouterr().out.splitlines()[0]
    assert os.sched_getaffinity(0) == before
    assert run_cli(argv[:-4] + ["--pin-cpu", "100000", "--out", str(tmp_path)], shapes=TINY[:1]) == 2


def _cell(provider, ms, status="ok", wall=None, note=""):
    return {"shape": "s", "provider": provider, "status": status, "ms": ms, "wall_ms": wall, "note": note}


def test_median_rows_takes_each_cells_median_round():
    rounds = [
        [_cell("maxsim", 3.0, wall=3.5), _cell("naive", 9.0), _cell("flash-maxsim", None, "crashed", note="boom")],
        [_cell("maxsim", 1.0, wall=1.5), _cell("naive", None, "OOM"), _cell("flash-maxsim", None, "crashed", note="x")],
        [_cell("maxsim", 2.0, wall=0.5), _cell("naive", 7.0), _cell("flash-maxsim", None, "crashed")],
    ]
    mine, naive, flash = median_rows(rounds)
    assert mine["ms"] == 2.0 and mine["wall_ms"] == 1.5  # each the median of its own column
    assert mine["note"] == "median of 3 runs, ms: 3.000 1.000 2.000"
    assert naive["status"] == "ok" and naive["ms"] == 7.0  # the lower middle of the two ok rounds
    assert "OOM" in naive["note"]
    assert flash["status"] == "crashed" and flash["note"] == "boom"  # no ok round: the first round's row
    assert median_rows(rounds[:1]) is rounds[0]  # one round: unchanged


def test_repeat_runs_every_cell_that_many_times(tmp_path, capsys):
    argv = ["--providers", "maxsim,naive", "--device", "cpu", "--quick", "--repeat", "2", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY[:2]) == 0
    rows = _csv_rows(tmp_path)
    assert [(r["shape"], r["provider"]) for r in rows] == [(s.name, p) for s in TINY[:2] for p in ("maxsim", "naive")]
    for row in rows:
        assert row["status"] == "ok"
        runs = row["note"].split("ms: ")[1].split()
        assert len(runs) == 2 and float(row["ms"]) == pytest.approx(min(map(float, runs)), abs=1e-3)
    assert "round 2 of 2" in capsys.readouterr().err


def test_gpu_shape_set_is_the_specified_one():
    names = [s.name for s in GPU_SHAPES]
    assert names == [
        "1q_x_100k", "32q_x_100k", "colpali_1x1k", "1x1k_128x1024",
        "inbatch_128x128", "masked_64x64", "1x1k_32x300", "d768_32x10k",
    ]  # fmt: skip


def _layout(s):
    return (s.dtype, s.masked, s.candidates, s.ragged, s.d)


@pytest.mark.parametrize("mode", list(SHAPE_SETS))
def test_cpu_sets_scale_the_gpu_sets_down(mode):
    gpu, cpu = SHAPE_SETS[mode]
    assert len(cpu) == len(gpu)
    for small, big in zip(cpu, gpu):
        assert _layout(small) == _layout(big), (small.name, big.name)
        assert small.nq * small.nd * small.lq * small.ld < big.nq * big.nd * big.lq * big.ld


def _count(text):
    return int(text[:-1]) * 1000 if text.endswith("k") else int(text)


def _dims_in_name(name):
    """What a shape's name says of its dimensions: ``4q_x_500`` and the first ``AxB`` are Nq x Nd
    (``b4``: Nq = Nd = 4), a further ``AxB`` Lq x Ld, ``d768`` d, ``colpali`` Lq = Ld = 1024."""
    said, pairs = {}, []
    for token in name.split("_"):
        if m := re.fullmatch(r"(\d+k?)x(\d+k?)", token):
            pairs.append((_count(m[1]), _count(m[2])))
        elif m := re.fullmatch(r"b(\d+)", token):
            said["nq"] = said["nd"] = int(m[1])
        elif m := re.fullmatch(r"d(\d+)", token):
            said["d"] = int(m[1])
    if m := re.match(r"(\d+k?)q_x_(\d+k?)", name):
        pairs.insert(0, (_count(m[1]), _count(m[2])))
    if "nq" not in said and pairs:
        said["nq"], said["nd"] = pairs.pop(0)
    if pairs:
        said["lq"], said["ld"] = pairs.pop(0)
    if "colpali" in name and "lq" not in said:
        said["lq"] = said["ld"] = 1024
    return said


@pytest.mark.parametrize("shape", [s for sets in SHAPE_SETS.values() for shape_set in sets for s in shape_set]
                         + NAMED_SETS["models"] + NAMED_SETS["models_train"], ids=lambda s: s.name)
def test_shape_names_say_their_dimensions(shape):
    said = _dims_in_name(shape.name)
    assert "nq" in said and "nd" in said, f"{shape.name} does not say Nq x Nd"
    assert said == {k: getattr(shape, k) for k in said}


def test_the_dimension_parser_catches_a_misleading_name():
    assert _dims_in_name("1q_x_100k_cpu") == {"nq": 1, "nd": 100_000}  # the old name of a 1 x 500 shape
    assert _dims_in_name("train_b4_256x512") == {"nq": 4, "nd": 4, "lq": 256, "ld": 512}


# --- train mode ---------------------------------------------------------------------------------

TINY_TRAIN = [
    Shape("tiny_train_inbatch_bf16", 4, 4, 6, 12, d=16, dtype="bf16"),
    Shape("tiny_train_inbatch_fp32_masked", 3, 5, 5, 9, d=8, dtype="fp32", masked=True),
    Shape("tiny_train_cand_bf16_masked", 3, 4, 5, 10, d=16, dtype="bf16", masked=True, candidates=True),
    Shape("tiny_train_cand_fp32", 2, 3, 4, 7, d=8, dtype="fp32", candidates=True),
]
TRAIN_ARGV = ["--mode", "train", "--device", "cpu", "--quick"]


def test_train_end_to_end_cpu(tmp_path, capsys):
    argv = TRAIN_ARGV + ["--providers", "maxsim,naive", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY_TRAIN) == 0
    out = capsys.readouterr().out

    assert out.splitlines()[0].startswith("maxsim bench --mode train on CPU")
    assert "gQ err" in out and "gD err" in out and "cross_entropy" in out
    assert "wall ms" not in out and "peak MB" not in out  # CUDA-only columns
    table = _table_rows(out)
    assert set(table) == {(s.name, p) for s in TINY_TRAIN for p in ("maxsim", "naive")}

    with open(_only(tmp_path, "train-*.csv"), newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == TRAIN_CSV_FIELDS
        rows = list(reader)
    assert len(rows) == 2 * len(TINY_TRAIN)
    dtype = {s.name: s.dtype for s in TINY_TRAIN}
    for row in rows:
        assert row["status"] == "ok", row
        assert float(row["ms"]) > 0 and row["pct_floor"] == ""
        assert (row["speedup"] == "") == (row["provider"] == "maxsim")
        assert row["peak_mb"] == "" and row["wall_ms"] == ""  # not measured on CPU (ms is wall time there)
        tol = 1e-4 if dtype[row["shape"]] == "fp32" else 1e-2
        assert 0 <= float(row["rel_err"]) <= tol, (row["shape"], row["provider"], row["rel_err"])
        # naive rounds every similarity to bf16 before the max: near-ties pick other winners than
        # the fp32 reference, each moving a whole embedding's gradient (up to ~40 % measured on
        # the GPU), so its gradient errors are reported, not bounded.
        grad_tol = float("inf") if (row["provider"], dtype[row["shape"]]) == ("naive", "bf16") else tol
        for key in ("grad_q_err", "grad_d_err"):
            assert 0 <= float(row[key]) <= grad_tol, (row["shape"], row["provider"], key, row[key])
    assert {r["candidates"] for r in rows} == {"True", "False"}

    lines = _only(tmp_path, "train-*.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["argv"] == argv
    assert [json.loads(x)["provider"] for x in lines[1:]] == [r["provider"] for r in rows]
    assert not list(tmp_path.glob("forward-*"))


def test_train_variants_rows_and_speedups(tmp_path):
    argv = TRAIN_ARGV + ["--providers", "maxsim,maxsim-unified,maxsim-lowmem,naive,flash-maxsim"]
    assert run_cli(argv + ["--out", str(tmp_path)], shapes=TINY_TRAIN[:1]) == 0
    rows = {r["provider"]: r for r in _csv_rows(tmp_path, "train")}
    assert "flash-maxsim" not in rows  # not installed here, or needs CUDA: said in the header
    mine = float(rows["maxsim"]["ms"])
    assert rows["maxsim"]["speedup"] == ""
    for name in ("maxsim-unified", "maxsim-lowmem", "naive"):
        assert rows[name]["status"] == "ok"
        assert float(rows[name]["speedup"]) == pytest.approx(float(rows[name]["ms"]) / mine, rel=1e-3)


def test_train_in_a_worker(tmp_path):
    argv = TRAIN_ARGV + ["--providers", "maxsim", "--isolate", "on", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY_TRAIN[3:]) == 0
    (row,) = _csv_rows(tmp_path, "train")
    assert row["status"] == "ok" and float(row["grad_d_err"]) <= 1e-4  # the worker ran the train mode


def test_train_wrong_gradient_fails(tmp_path, monkeypatch):
    def right_scores_wrong_gradient(Q, D, q_mask, d_mask):
        good = maxsim_reference(Q, D, q_mask, d_mask)
        scaled = maxsim_reference(Q * 1.1, D, q_mask, d_mask)
        return scaled - (scaled - good).detach()  # the scores of `good`, gradients 1.1x

    broken = dataclasses.replace(bench_providers.TRAIN_PROVIDERS["maxsim-lowmem"], fn=right_scores_wrong_gradient)
    monkeypatch.setitem(bench_providers.TRAIN_PROVIDERS, "maxsim-lowmem", broken)
    argv = TRAIN_ARGV + ["--providers", "maxsim,maxsim-lowmem", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY_TRAIN[3:]) == 1
    rows = {r["provider"]: r for r in _csv_rows(tmp_path, "train")}
    assert float(rows["maxsim-lowmem"]["rel_err"]) < 1e-6
    assert float(rows["maxsim-lowmem"]["grad_q_err"]) == pytest.approx(0.1, rel=1e-3)


def test_train_gradient_check_skipped_when_the_reference_is_too_big(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_train, "REF_GRAD_LIMIT_BYTES", 0)
    argv = TRAIN_ARGV + ["--providers", "maxsim", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY_TRAIN[:1]) == 0
    (row,) = _csv_rows(tmp_path, "train")
    assert row["status"] == "ok" and float(row["rel_err"]) < 1e-2
    assert row["grad_q_err"] == row["grad_d_err"] == ""
    assert row["note"].startswith("grad check skipped")


def test_train_in_batch_needs_a_document_per_query(tmp_path):
    argv = TRAIN_ARGV + ["--providers", "naive", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=[Shape("tiny_train_short", 3, 2, 4, 5, d=8)]) == 0  # no maxsim row
    (row,) = _csv_rows(tmp_path, "train")
    assert row["status"] == "error" and "nd >= nq" in row["note"]


def test_train_labels_and_reference_gradient_by_hand():
    # One query, two documents of one token each: the score is the best dot product, and with
    # labels [0] the loss gradient is softmax - onehot.
    shape = Shape("tiny", 1, 2, 1, 1, d=2, dtype="fp32")
    Q = torch.tensor([[[1.0, 2.0]]])
    D = torch.tensor([[[3.0, 0.0]], [[0.0, 1.0]]])
    labels = bench_train.train_labels(shape, "cpu")
    assert labels.tolist() == [0]
    ref = bench_train.reference_step(shape, Q, D, None, None, labels)
    torch.testing.assert_close(ref.scores, torch.tensor([[3.0, 2.0]]))
    p = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    g = p - torch.tensor([1.0, 0.0])
    torch.testing.assert_close(ref.grad_Q, (g[0] * D[0] + g[1] * D[1]).reshape(1, 1, 2))
    torch.testing.assert_close(ref.grad_D, (g[:, None, None] * Q[0]).reshape(2, 1, 2))
    cand = Shape("tiny", 3, 4, 2, 2, d=2, candidates=True)
    assert bench_train.train_labels(cand, "cpu").tolist() == [0, 0, 0]
    assert bench_train.train_labels(Shape("tiny", 3, 3, 2, 2), "cpu").tolist() == [0, 1, 2]


def test_train_floor_seconds_by_hand():
    # train_inbatch_128x128: compute-bound forward, then the backward reads Q, D and writes grads.
    shape = shapes_by_name(["train_inbatch_128x128"])[0]
    fwd_flops = 2 * 128 * 128 * 128 * 1024 * 128
    qd_bytes = (128 * 128 + 128 * 1024) * 128 * 2
    assert floor_seconds(shape, "train") == pytest.approx(fwd_flops / 790e12 + 2 * qd_bytes / 4.3e12)
    # train_candidates_32x32: every query has its own 32 x 300 tokens; memory-bound.
    shape = shapes_by_name(["train_candidates_32x32"])[0]
    qd_bytes = (32 * 32 + 32 * 32 * 300) * 128 * 2
    fwd = (qd_bytes + 32 * 32 * 4) / 4.3e12
    assert fwd > 2 * 32 * 32 * 32 * 300 * 128 / 790e12
    assert floor_seconds(shape) == pytest.approx(fwd)
    assert floor_seconds(shape, "train") == pytest.approx(fwd + 2 * qd_bytes / 4.3e12)


def test_candidate_inputs_and_naive_scores():
    shape = Shape("tiny", 2, 3, 5, 9, d=16, dtype="fp32", masked=True, candidates=True)
    Q, D, qm, dm = make_inputs(shape, "cpu")
    assert D.shape == (2, 3, 9, 16) and dm.shape == (2, 3, 9)
    lengths = dm.sum(-1)
    assert (lengths >= 1).all() and torch.equal(dm, torch.arange(9) < lengths[..., None])
    out = bench_providers.PROVIDERS["naive"].fn(Q, D, qm, dm)
    torch.testing.assert_close(out, maxsim_reference(Q, D, qm, dm, mask_mode="multiply"), rtol=1e-5, atol=1e-4)
    # flash-maxsim's candidate layout takes one length per (query, candidate), flattened.
    *_, q_len, d_len = bench_providers.TRAIN_PROVIDERS["flash-maxsim"].prepare(Q, D, qm, dm)
    assert q_len.tolist() == qm.sum(-1).tolist() and d_len.tolist() == lengths.reshape(-1).tolist()


def test_train_shape_set_is_the_specified_one():
    got = [(s.name, s.nq, s.nd, s.lq, s.ld, s.d, s.dtype, s.candidates) for s in TRAIN_GPU_SHAPES]
    assert got == [
        ("train_inbatch_128x128", 128, 128, 128, 1024, 128, "bf16", False),
        ("train_inbatch_256x256", 256, 256, 32, 180, 128, "bf16", False),
        ("train_candidates_32x32", 32, 32, 32, 300, 128, "bf16", True),
        ("train_colpali_b128", 128, 128, 1024, 1024, 128, "bf16", False),
    ]
    for cpu in TRAIN_CPU_SHAPES:
        assert cpu.candidates or cpu.nd >= cpu.nq
    # The fp32 reference's gradients fit the budget on every GPU shape (no check is skipped).
    assert all(bench_train.reference_grad_bytes(s) <= bench_train.REF_GRAD_LIMIT_BYTES for s in TRAIN_GPU_SHAPES)


def test_sweep_set_covers_the_grid_at_about_a_millisecond():
    from maxsim.bench.shapes import floor_seconds, shapes_by_name

    sweep = shapes_by_name(["sweep"])
    assert len(sweep) == 4 * 3 * 3 * 3 and len({s.name for s in sweep}) == len(sweep)
    assert {(s.nq, s.lq, s.ld, s.d) for s in sweep} >= {(128, 1024, 1024, 768), (1, 32, 128, 64)}
    for s in sweep:
        if 16 < s.nd < 200_000:  # not clamped
            assert 0.9e-3 <= floor_seconds(s) <= 1.1e-3


# --- varlen mode --------------------------------------------------------------------------------

TINY_VARLEN = [
    Shape("tiny_varlen_uniform", 3, 7, 5, 24, d=16, ragged="uniform"),
    Shape("tiny_varlen_ragged_fp32", 2, 9, 4, 40, d=8, dtype="fp32", ragged="ragged"),
]


@pytest.mark.parametrize("kind", ["uniform", "hotpotqa", "ragged"])
def test_ragged_lengths_are_deterministic_and_in_range(kind):
    shape = Shape("tiny", 2, 500, 4, 64, d=8, ragged=kind)
    lengths = ragged_lengths(shape, seed=5)
    assert torch.equal(lengths, ragged_lengths(shape, seed=5))
    assert lengths.shape == (500,) and int(lengths.min()) >= 1 and int(lengths.max()) <= 64
    assert len(set(lengths.tolist())) > 10  # ragged, not one length
    if kind == "uniform":
        assert int(lengths.min()) >= 32
    Q, D, q_mask, d_mask = make_inputs(shape, "cpu", seed=5)
    assert q_mask is None and torch.equal(d_mask.sum(-1), lengths)


def test_ragged_shapes_need_no_other_masks():
    with pytest.raises(ValueError, match="ragged"):
        Shape("bad", 1, 2, 3, 4, ragged="uniform", masked=True)
    with pytest.raises(ValueError, match="ragged"):
        Shape("bad", 1, 2, 3, 4, ragged="zipf")


def test_varlen_prepare_packs_the_real_tokens():
    shape = TINY_VARLEN[0]
    Q, D, q_mask, d_mask = make_inputs(shape, "cpu")
    q, d, cu_q, cu_d, max_q, max_d = bench_providers.VARLEN_PROVIDERS["maxsim"].prepare(Q, D, q_mask, d_mask)
    lengths = d_mask.sum(-1)
    assert torch.equal(q, Q.reshape(-1, shape.d)) and cu_q.tolist() == list(range(0, 16, 5)) and max_q == 5
    assert cu_d.tolist() == [0] + torch.cumsum(lengths, 0).tolist() and max_d == int(lengths.max())
    for i in range(shape.nd):
        assert torch.equal(d[cu_d[i]:cu_d[i + 1]], D[i, : lengths[i]])
    queries, d2, cu_d32, max_d2 = bench_providers.VARLEN_PROVIDERS["flash-maxsim"].prepare(Q, D, q_mask, d_mask)
    assert len(queries) == shape.nq and torch.equal(d2, d) and cu_d32.dtype == torch.int32 and max_d2 == max_d


def test_varlen_end_to_end_cpu(tmp_path, capsys):
    argv = ["--mode", "varlen", "--providers", "maxsim,maxsim-padded,naive", "--device", "cpu", "--quick"]
    assert run_cli(argv + ["--out", str(tmp_path)], shapes=TINY_VARLEN) == 0
    rows = _csv_rows(tmp_path, "varlen")
    assert [(r["shape"], r["provider"]) for r in rows] == [
        (s.name, p) for s in TINY_VARLEN for p in ("maxsim", "maxsim-padded", "naive")]
    for row in rows:
        assert row["status"] == "ok" and row["ragged"] in ("uniform", "ragged")
        tol = 1e-4 if row["dtype"] == "fp32" else 1e-2
        assert 0 <= float(row["rel_err"]) <= tol
    out = capsys.readouterr().out
    assert "fill" in out and "maxsim_varlen" in out
    assert run_cli(["--mode", "train", "--shapes", "varlen_ragged_4x64", "--device", "cpu"]) == 2


def test_varlen_wrong_packing_fails(tmp_path, monkeypatch):
    def drops_the_last_document(q, d, cu_q, cu_d, max_q, max_d):
        import maxsim

        scores = maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=max_q, max_seqlen_d=max_d)
        scores[:, -1] = 0
        return scores

    broken = dataclasses.replace(bench_providers.VARLEN_PROVIDERS["maxsim"], fn=drops_the_last_document)
    monkeypatch.setitem(bench_providers.VARLEN_PROVIDERS, "maxsim", broken)
    argv = ["--mode", "varlen", "--providers", "maxsim", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=TINY_VARLEN[:1]) == 1


def test_varlen_floor_counts_the_real_tokens():
    shape = VARLEN_GPU_SHAPES[2]
    tokens = int(ragged_lengths(shape).sum())
    assert tokens < shape.nd * shape.ld / 4  # fill ~0.16
    bytes_ = (shape.nq * shape.lq + tokens) * shape.d * 2 + shape.nq * shape.nd * 4
    flops_ = 2 * shape.nq * shape.lq * tokens * shape.d
    assert floor_seconds(shape, "varlen") == pytest.approx(max(bytes_ / 4.3e12, flops_ / 790e12))


# --- floors, output directory, command line -----------------------------------------------------


def test_rooflines_only_for_known_gpus():
    from maxsim.bench.shapes import H100_NVL, H100_PCIE, H100_SXM

    assert roofline_for("NVIDIA H200") is H200
    # each H100 form by the name torch gives it: the PCIe and NVL cards before the generic "H100"
    assert roofline_for("NVIDIA H100 80GB HBM3") is H100_SXM and H100_SXM.source == "measured"
    assert roofline_for("NVIDIA H100 PCIe") is H100_PCIE and H100_PCIE.bytes_per_s < H100_SXM.bytes_per_s
    assert roofline_for("NVIDIA H100 NVL") is H100_NVL and "derived" in H100_NVL.source
    assert roofline_for("NVIDIA A100-SXM4-80GB") is None
    assert roofline_for("CPU (x86_64, 2 cores)") is None
    notes = bench_runner.table_notes("forward", H100_PCIE, "cuda")
    assert "H100 PCIe roofline" in notes and "derived from the datasheet" in notes


def _row(provider, ms, shape=TINY[0]):
    return bench_runner._record(shape, provider, "ok", ms=ms, rel_err=0.0, peak_mb=1.0)


def test_floor_column_only_with_a_roofline():
    rows = [_row("maxsim", 2.0), _row("naive", 6.0)]
    bench_runner.add_floors(rows, TINY, None, "forward")
    assert all(r["pct_floor"] is None for r in rows)
    assert "% floor" not in bench_runner.format_table(rows)
    bench_runner.add_floors(rows, TINY, H200, "forward")
    floor_ms = floor_seconds(TINY[0]) * 1e3
    assert [r["pct_floor"] for r in rows] == pytest.approx([100 * floor_ms / 2.0, 100 * floor_ms / 6.0])
    table = bench_runner.format_table(rows)
    assert "% floor" in table.splitlines()[0] and "peak MB" in table.splitlines()[0]


def test_speedups_differ_per_row_with_one_peer():
    # The old rule gave maxsim's row the fastest peer's ratio: with one peer, the same number twice.
    rows = [_row("maxsim", 2.0), _row("naive", 6.0), _row("maxsim-lowmem", 3.0)]
    bench_runner.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [None, pytest.approx(3.0), pytest.approx(1.5)]
    rows = [_row("naive", 6.0)]  # no maxsim row: no ratio
    bench_runner.add_speedups(rows)
    assert rows[0]["speedup"] is None


def test_default_out_dir_is_under_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["--providers", "maxsim", "--device", "cpu", "--quick"], shapes=TINY[:1]) == 0
    out_dir = tmp_path / "maxsim-bench-results"
    assert len(list(out_dir.glob("forward-*.csv"))) == 1
    assert f"to {out_dir.resolve()}" in capsys.readouterr().out


def test_main_command_runs_bench_and_info(tmp_path, capsys):
    argv = ["bench", "--shapes", "masked_16x16", "--providers", "maxsim", "--device", "cpu", "--quick"]
    assert cli_main(argv + ["--out", str(tmp_path)]) == 0
    jsonl = _only(tmp_path, "forward-*.jsonl").read_text().splitlines()
    assert json.loads(jsonl[0])["argv"] == argv + ["--out", str(tmp_path)]
    assert json.loads(jsonl[1])["shape"] == "masked_16x16"
    assert cli_main(["info"]) == 0
    assert "backend for CPU tensors" in capsys.readouterr().out
    assert cli_main([]) == 2


def test_list_shows_every_mode(capsys):
    assert cli_main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for mode, (gpu, cpu) in SHAPE_SETS.items():
        assert f"--mode {mode}" in out
        for s in gpu + cpu:
            assert s.name in out
    assert "1q_x_500                 1 queries x 500 documents, Lq 32, Ld 300" in out
    assert "selftest" not in out


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["info", "--help"]])
def test_help_has_no_markup_and_no_test_provider(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m maxsim" in out
    assert "``" not in out and ":mod:" not in out and ":func:" not in out
    assert "selftest" not in out


def test_the_test_provider_is_accepted_but_not_listed(tmp_path, capsys):
    assert run_cli(["--providers", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "known: maxsim, naive" in err and "selftest" not in err
    assert bench_providers.get_providers(["selftest-crash"])[0].internal


@pytest.mark.gpu
def test_gpu_varlen_run_and_the_floor_column(tmp_path, capsys):
    argv = ["--mode", "varlen", "--shapes", "varlen_ragged_32x20k", "--providers", "maxsim,maxsim-padded"]
    assert run_cli(argv + ["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("shape") and "provider" in line)
    known = roofline_for(torch.cuda.get_device_name(0)) is not None
    assert ("% floor" in header) == known  # the column; a GPU without a roofline has the line saying so
    assert ("% floor: left out, no measured roofline" in out) == (not known)
    rows = {r["provider"]: r for r in _csv_rows(tmp_path, "varlen")}
    assert rows["maxsim"]["status"] == rows["maxsim-padded"]["status"] == "ok"
    assert float(rows["maxsim-padded"]["speedup"]) > 0 and float(rows["maxsim"]["peak_mb"]) >= 0


def test_tensor_core_fp32_providers_run_by_name_only(tmp_path, capsys):
    # maxsim-tf32x3 / maxsim-tf32 (precision=...) are not in the default set, and run when named: on
    # the CPU backend (IEEE whatever the word) their rows pass the harness's accuracy check.
    assert "maxsim-tf32x3" not in bench_providers.DEFAULT_PROVIDERS
    fp32 = [dataclasses.replace(s, dtype="fp32") for s in TINY[:2]]
    argv = ["--providers", "maxsim,maxsim-tf32x3,maxsim-tf32", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    assert run_cli(argv, shapes=fp32) == 0
    rows = _csv_rows(tmp_path)
    assert {r["provider"] for r in rows} == {"maxsim", "maxsim-tf32x3", "maxsim-tf32"}
    assert all(r["status"] == "ok" for r in rows)


def test_the_tf32_variant_is_held_to_tf32s_tolerance():
    # maxsim-tf32 rounds fp32 inputs to 10-bit mantissas by request: an error of 7e-4 is its
    # precision, not a failure; the IEEE rows and anything past TF32's rounding still fail.
    from maxsim.bench.runner import TF32_TOLERANCE, TOLERANCE, maxsim_failures

    def row(provider, err, dtype="fp32"):
        return {"shape": "s", "provider": provider, "dtype": dtype, "status": "ok", "note": "", "rel_err": err}

    tf32_err = 7.5e-4
    assert TOLERANCE["fp32"] < tf32_err < TF32_TOLERANCE
    assert maxsim_failures([row("maxsim-tf32", tf32_err)]) == []
    assert len(maxsim_failures([row("maxsim", tf32_err)])) == 1
    assert len(maxsim_failures([row("maxsim-tf32x3", tf32_err)])) == 1
    assert len(maxsim_failures([row("maxsim-tf32", 10 * TF32_TOLERANCE)])) == 1
    assert len(maxsim_failures([row("maxsim-tf32", float("nan"))])) == 1
