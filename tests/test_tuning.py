"""The configuration rule's buckets, and the opt-in autotuner's choice and persistent cache."""

import json

import pytest
import torch

from maxsim import _tuning
from maxsim._tuning import ForwardConfig, TuningCache, forward_config, neighbour_configs, pick_fastest, tuning_key


def test_rule_depends_on_buckets_only():
    # Same Lq bucket, same stacked-rows bucket -> same configuration (so no new compile).
    assert forward_config(8, 30, 128, torch.float16, False) == forward_config(64, 32, 128, torch.float16, False)
    assert forward_config(1, 32, 128, torch.float16, False) != forward_config(32, 32, 128, torch.float16, False)
    assert tuning_key("k", 9, 17, 128, torch.bfloat16, False, "f") == tuning_key("k", 16, 32, 128, torch.bfloat16, False, "f")
    assert tuning_key("k", 500, 32, 128, torch.bfloat16, False, "f") == tuning_key("k", 8, 32, 128, torch.bfloat16, False, "f")


def test_corpus_class_changes_only_the_documented_buckets():
    f16 = torch.float16
    assert not _tuning.is_big_corpus(64 * 180) and _tuning.is_big_corpus(_tuning.BIG_CORPUS_TOKENS)
    # Stacked short queries at d=128, and one short query at d=64: TMA tiles on a big corpus only.
    for nq, lq, d in [(32, 32, 128), (1, 32, 64)]:
        small, big = (forward_config(nq, lq, d, f16, False, big_corpus=b) for b in (False, True))
        assert big.tma and not small.tma
    # Everything else, and the training forward (argmax), keeps one tile for both classes.
    for nq, lq, d in [(128, 128, 128), (1, 1024, 128), (1, 32, 128), (1, 128, 128), (32, 32, 768), (32, 32, 64)]:
        assert forward_config(nq, lq, d, f16, False, big_corpus=True) == forward_config(nq, lq, d, f16, False)
    assert forward_config(32, 32, 128, f16, False, argmax=True, big_corpus=True) == \
        forward_config(32, 32, 128, f16, False, argmax=True)
    assert tuning_key("k", 32, 32, 128, f16, False, "f", big_corpus=True) != tuning_key("k", 32, 32, 128, f16, False, "f")


def test_warp_specialized_kernel_only_where_it_was_measured_faster():
    # Many query rows on a big corpus, when the Gluon kernel can run: it, BN=128 with or without the
    # argmax; one 128-token query there: it with split documents, BN=64, a ring of 6 (not with the
    # argmax: not timed). Small corpora, fewer rows, the interpreter, or a call it cannot run: the
    # Triton rule.
    f16, ws = torch.float16, dict(warp_specialize=True)
    for nq, lq, d in [(128, 128, 128), (1, 1024, 128), (32, 32, 128)]:
        cfg = forward_config(nq, lq, d, f16, False, big_corpus=True, **ws)
        assert cfg.warp_specialized and cfg.BM == 256 and cfg.BN == 128 and cfg.BK == d
        assert forward_config(nq, lq, d, f16, False, argmax=True, big_corpus=True, **ws) == cfg
        assert not forward_config(nq, lq, d, f16, False, big_corpus=True).warp_specialized
        assert not forward_config(nq, lq, d, f16, False, big_corpus=False, **ws).warp_specialized
        assert not forward_config(nq, lq, d, f16, False, True, big_corpus=True, **ws).warp_specialized
    one_query = forward_config(1, 128, 128, f16, False, big_corpus=True, **ws)
    assert one_query.warp_specialized and (one_query.BN, one_query.num_stages) == (64, 6)
    assert one_query == forward_config(1, 100, 128, f16, False, big_corpus=True, **ws)
    for big, argmax in [(False, False), (True, True)]:
        assert not forward_config(1, 128, 128, f16, False, argmax=argmax, big_corpus=big, **ws).warp_specialized
    for nq, lq in [(1, 32), (4, 32), (2, 64)]:  # other row blocks of < 256 rows: not compute-bound
        assert not forward_config(nq, lq, 128, f16, False, big_corpus=True, **ws).warp_specialized
    assert not forward_config(8, 32, 64, f16, False, big_corpus=True, **ws).warp_specialized  # d = 64: not timed
    assert neighbour_configs(forward_config(128, 128, 128, f16, False, big_corpus=True, **ws))[1].num_stages == 2


def test_one_query_takes_the_warp_specialized_kernel_only_on_long_calls():
    # One 128-token query needs WS_ONE_BLOCK_MIN_TOKENS document tokens (at 256K the two kernels
    # tied; from 512K the warp-specialized one was faster); many query rows always qualify.
    n = _tuning.WS_ONE_BLOCK_MIN_TOKENS
    assert _tuning.warp_specialize_pays(1, 128, n) and not _tuning.warp_specialize_pays(1, 128, n - 1)
    assert _tuning.warp_specialize_pays(1, 128, 1000 * 1024)  # the 1 x 1K (128, 1024) bar shape
    assert not _tuning.warp_specialize_pays(1, 128, 100 * 1024)
    assert _tuning.warp_specialize_pays(2, 128, 2**17) and _tuning.warp_specialize_pays(1, 1024, 2**17)
    assert _tuning.warp_specialize_pays(3, 33, 2**17)  # stacked to 256 rows: compute-bound


def test_masked_calls_stay_on_the_triton_kernel():
    # The Gluon kernel's per-tile mask work spills: with masks the Triton kernel was faster.
    assert _tuning.warp_specialize_pays(128, 128, 2**24)
    assert not _tuning.warp_specialize_pays(128, 128, 2**24, masked=True)
    assert not _tuning.warp_specialize_pays(1, 128, 2**24, masked=True)


def test_warp_specialized_kernel_needs_hopper_shared_documents_and_16_bit():
    from maxsim.dense.forward import warp_specialize_ok

    Q = torch.zeros(4, 32, 128, dtype=torch.float16)
    D = torch.zeros(1, 10, 50, 128, dtype=torch.float16)
    assert not warp_specialize_ok(Q, D, False, False, -1)  # no GPU (device index -1)
    assert not warp_specialize_ok(Q, D, False, True, 0)  # the interpreter
    assert not warp_specialize_ok(Q, D, True, False, 0)  # normalize
    assert not warp_specialize_ok(Q.float(), D.float(), False, False, 0)
    assert not warp_specialize_ok(Q, D.expand(4, -1, -1, -1), False, False, 0)  # candidate lists
    assert not warp_specialize_ok(Q[..., :96], D[..., :96], False, False, 0)  # d not in {64, 128}
    # D's tokens not one strided run of rows (the first 50 of each document's 100): the kernel
    # would copy D.
    assert not warp_specialize_ok(Q, torch.zeros(1, 10, 100, 128, dtype=torch.float16)[:, :, :50], False, False, 0)


def test_neighbours_start_with_the_rule_and_are_distinct():
    rule = forward_config(32, 32, 128, torch.float16, False)
    cands = neighbour_configs(rule)
    assert cands[0] == rule and len(cands) == len(set(cands)) >= 4


def test_pick_fastest_skips_configs_that_fail():
    a, b, c = (ForwardConfig(bm, 64, 128, 4, 3) for bm in (32, 64, 128))
    times = {a: 3.0, b: 1.0}

    def run(cfg):
        if cfg not in times:
            raise RuntimeError("out of shared memory")
        return cfg

    chosen = pick_fastest([a, b, c], run, lambda fn: times[fn()])
    assert chosen == b
    with pytest.raises(RuntimeError, match="no candidate configuration ran"):
        pick_fastest([c], run, lambda fn: times[fn()])


def test_cache_persists_across_instances_and_merges(tmp_path):
    path = tmp_path / "tuning.json"
    one, two = TuningCache(path), TuningCache(path)
    cfg = ForwardConfig(256, 64, 128, 8, 3, 8, True)
    assert one.get("k1") is None
    one.put("k1", cfg)
    two.put("k2", ForwardConfig(32, 128, 128, 4, 3))  # another process writes its own key
    assert TuningCache(path).get("k1") == cfg and TuningCache(path).get("k2").BM == 32
    assert set(json.loads(path.read_text())) == {"k1", "k2"}


def test_default_path_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MAXSIM_TUNING_CACHE", str(tmp_path / "x.json"))
    assert TuningCache.default_path() == tmp_path / "x.json"
    monkeypatch.setenv("MAXSIM_AUTOTUNE", "1")
    assert _tuning.autotune_enabled()


def test_warp_specialized_launch_plan_is_plain_integers():
    # A constexpr leaking into the plan's arithmetic would make Triton specialise the kernel on the
    # value (a compile per batch size): the plan must be Python ints and bools.
    from maxsim.dense.forward_ws import ws_plan

    for nq, nd, lq, split in [(8, 1100, 32, None), (1, 1000, 128, None), (3, 99, 1024, False), (128, 128, 128, True)]:
        plan = ws_plan(nq, nd, lq, split, 132)
        assert all(type(x) in (int, bool) for x in plan), plan


def test_gluon_kernel_only_under_the_triton_release_it_was_written_for(monkeypatch):
    # Gluon's API moves between releases: another Triton runs the Triton kernel instead.
    import triton

    from maxsim.dense import forward

    Q = torch.zeros(4, 32, 128, dtype=torch.float16)
    D = torch.zeros(1, 10, 50, 128, dtype=torch.float16)
    monkeypatch.setattr(forward, "_is_hopper", lambda device_index: True)  # (no GPU here)
    try:
        for version, expected in [("3.6.0", True), ("3.6.1", True), ("3.7.0", False), ("3.4.0", False)]:
            monkeypatch.setattr(triton, "__version__", version)
            forward._gluon_forward.cache_clear()
            assert forward.warp_specialize_ok(Q, D, False, False, 0) is expected, version
    finally:
        monkeypatch.undo()
        forward._gluon_forward.cache_clear()
