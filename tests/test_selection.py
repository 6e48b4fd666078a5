"""The selection layer: which kernel and tile a call gets (read from the tile tables), the
``backward="auto"`` rule, the words of ``maxsim.explain``, and the opt-in autotuner's cache."""

import json

import pytest
import torch

import maxsim
from maxsim.dense import specs
from maxsim.selection import dense as select
from maxsim.selection import varlen as select_varlen
from maxsim.tuning import tables as T
from maxsim.tuning.autotune import TuningCache, autotune_enabled, neighbour_configs, pick_fastest, tuning_key
from maxsim.tuning.configs import ForwardConfig
from maxsim.tuning.rules import Rule, When, first_match

F16 = torch.float16


def choice(nq, lq, d, dtype=F16, candidates=False, argmax=False, tokens=64 * 180, masked=False, normalize=False,
           family="sm90", D=None):
    """The forward choice for a call of these shapes, as ``family`` runs it (meta tensors: no data)."""
    Q = torch.empty(nq, lq, d, dtype=dtype, device="meta")
    if D is None:
        ld = 128
        nd = max(1, tokens // ld // (nq if candidates else 1))
        D = torch.empty(nq if candidates else 1, nd, ld, d, dtype=dtype, device="meta")
    return select.forward_choice(Q, D, masked, normalize, argmax, family=family)


def is_ws(c):
    return c.kernel is specs.WARP_SPECIALIZED_FORWARD


def test_rule_depends_on_buckets_only():
    # Same Lq bucket and stacked-rows bucket: the same tile (so no new compile).
    assert choice(8, 30, 128).config == choice(64, 32, 128).config
    assert choice(1, 32, 128).config != choice(32, 32, 128).config
    assert tuning_key("k", 9, 17, 128, torch.bfloat16, False, "f") == tuning_key("k", 16, 32, 128, torch.bfloat16, False, "f")
    assert tuning_key("k", 500, 32, 128, torch.bfloat16, False, "f") == tuning_key("k", 8, 32, 128, torch.bfloat16, False, "f")


def test_corpus_class_changes_only_the_documented_buckets():
    big = T.BIG_CORPUS_TOKENS
    # Stacked short queries at d=128 (Triton, masked so the Gluon kernel is out): TMA tiles on a big
    # corpus only. One short masked query at d=64: TMA tiles for both, the short walks' many
    # resident programs on a small corpus, the streaming tile on a big one.
    small_c, big_c = (choice(32, 32, 128, tokens=t, masked=True) for t in (10_000, big))
    assert big_c.config.tma and not small_c.config.tma
    small_c, big_c = (choice(1, 32, 64, tokens=t, masked=True) for t in (10_000, big))
    assert small_c.config.tma and big_c.config.tma and small_c.config.waves > big_c.config.waves
    for nq, lq, d in [(128, 128, 128), (1, 1024, 128), (1, 32, 128), (1, 128, 128), (32, 32, 768), (32, 32, 64)]:
        assert choice(nq, lq, d, tokens=big, masked=True).config == choice(nq, lq, d, masked=True).config
    assert choice(32, 32, 128, argmax=True, tokens=big, masked=True).config == \
        choice(32, 32, 128, argmax=True, masked=True).config


def test_fp32_products_choose_their_own_tiles():
    # fp32 tiles read through TMA where few query rows share a document token: the on-chip split
    # (fp16x3) for one query and candidate lists, one TF32 product (tf32) on its leaner tile; the
    # IEEE dots, and many-row TF32 calls, keep the pointer tile.
    def fp32(nq, lq, precision, candidates=False):
        Q = torch.empty(nq, lq, 128, dtype=torch.float32, device="meta")
        D = torch.empty(nq if candidates else 1, 100, 180, 128, dtype=torch.float32, device="meta")
        return select.forward_choice(Q, D, True, False, False, family="sm90", precision=precision)

    split, tf32, ieee = (fp32(1, 32, p) for p in ("fp16x3", "tf32", "ieee"))
    assert split.config.tma and tf32.config.tma and not ieee.config.tma
    assert tf32.config.BN < split.config.BN and tf32.rule != split.rule != ieee.rule
    assert fp32(16, 32, "fp16x3", candidates=True).config == split.config  # a candidate list: rows of one query
    assert fp32(1, 48, "tf32").config.tma and fp32(1, 48, "tf32").config.BM == 64  # a 48-token query
    assert not fp32(16, 32, "tf32").config.tma  # 512 stacked rows: the product, not the read, sets the pace


def test_widths_between_the_tiles_read_through_tma():
    # One query at d 96 reads its 128-wide box through TMA (zero fill, not masked loads); d 320
    # takes whole 64-wide chunks through TMA; d 128 and the widest keep the pointer tiles that
    # measured faster there.
    tokens = 3 * 10**6
    d96, d320 = choice(1, 32, 96, tokens=tokens), choice(1, 32, 320, tokens=tokens)
    assert d96.config.tma and d96.config.BK == 128
    assert d320.config.tma and d320.config.BK == 64 and 320 % d320.config.BK == 0
    for d in (128, 2560, 4096):
        assert not choice(1, 32, d, tokens=tokens).config.tma
    assert choice(1, 32, 96, tokens=tokens, masked=True).rule != d96.rule  # masked reranks: their own rule


def test_the_d64_split_copy_runs_256_row_blocks():
    # fp32 at d 64 through the 16-bit kernels is a d 192 fp16 call: 48-token queries stacked 32
    # deep (mxbai-edge's search) take 256-row blocks; a training step's argmax forward does not.
    tokens = 100_000 * 512
    c = choice(32, 48, 192, tokens=tokens)
    assert c.config.BM == 256 and c.config.BN == 128 and c.config.BK == 64 and c.config.tma
    assert choice(32, 48, 192, tokens=tokens, argmax=True).config.BM == 128
    assert choice(2, 64, 192, tokens=tokens).config.BM == 128  # 128 rows: no half-empty block
    assert choice(32, 48, 256, tokens=tokens).config.BM == 128  # past d 192: the d > 128 rule


def test_the_fp32_split_on_chip_stacks_128_rows_for_in_batch_training():
    # 64 queries x 32 tokens share each document token: 128-row blocks, 8 warps (fewer programs
    # splitting each fp32 tile); one query keeps the bandwidth tile
    def split(nq, d):
        Q = torch.empty(nq, 32, d, dtype=torch.float32, device="meta")
        D = torch.empty(1, 64, 512, d, dtype=torch.float32, device="meta")
        return select.forward_choice(Q, D, True, False, True, family="sm90", precision="fp16x3")
    many, one = split(64, 128), split(1, 128)
    assert many.config.BM == 128 and many.config.num_warps == 8 and many.config.tma
    assert one.config.BM == 32 and one.rule != many.rule
    assert split(64, 96).rule != many.rule  # unmeasured widths keep the bandwidth tile


def test_warp_specialized_kernel_only_where_it_was_measured_faster():
    big = T.BIG_CORPUS_TOKENS
    for nq, lq, d in [(128, 128, 128), (1, 1024, 128), (32, 32, 128)]:
        c = choice(nq, lq, d, tokens=big)
        assert is_ws(c) and c.config.BM == 256 and c.config.BN == 128 and c.config.BK == d
        assert choice(nq, lq, d, argmax=True, tokens=big).config == c.config
        assert not is_ws(choice(nq, lq, d, tokens=big, masked=True))
        assert not is_ws(choice(nq, lq, d, tokens=10_000))
        assert not is_ws(choice(nq, lq, d, tokens=big, family="interpreter"))
        assert not is_ws(choice(nq, lq, d, tokens=big, family="unmeasured"))
        assert not is_ws(choice(nq, lq, d, tokens=big, normalize=True))
        assert not is_ws(choice(nq, lq, d, dtype=torch.float32, tokens=big))
    one = choice(1, 128, 128, tokens=2**22)
    assert is_ws(one) and (one.config.BN, one.config.num_stages) == (64, 6)
    assert one.config == choice(1, 100, 128, tokens=2**22).config
    assert not is_ws(choice(1, 128, 128, argmax=True, tokens=2**22))
    for nq, lq in [(1, 32), (4, 32), (2, 64)]:  # other row blocks of < 256 rows: not compute-bound
        assert not is_ws(choice(nq, lq, 128, tokens=2**22))
    assert not is_ws(choice(8, 32, 64, tokens=2**22))  # d = 64: never timed
    assert not is_ws(choice(4, 32, 128, candidates=True, tokens=2**22))  # candidate lists
    assert neighbour_configs(choice(128, 128, 128, tokens=big).config, warp_specialized=True)[1].num_stages == 2


def test_one_query_takes_the_warp_specialized_kernel_only_on_long_calls():
    n = T.WS_ONE_BLOCK_MIN_TOKENS
    D = lambda tokens: torch.empty(1, tokens, 1, 128, dtype=F16, device="meta")  # noqa: E731
    assert is_ws(choice(1, 128, 128, D=D(n))) and not is_ws(choice(1, 128, 128, D=D(n - 1)))
    assert is_ws(choice(2, 128, 128, D=D(2**17))) and is_ws(choice(1, 1024, 128, D=D(2**17)))
    assert is_ws(choice(3, 33, 128, D=D(2**17)))  # stacked to 256 rows: compute-bound


def test_warp_specialized_kernel_needs_shared_documents_in_one_run_of_rows():
    # The first 50 of each document's 100 tokens: not one strided run of rows (it would copy D).
    strided = torch.empty(1, 4096, 100, 128, dtype=F16, device="meta")[:, :, :50]
    c = choice(128, 128, 128, D=strided)
    assert not is_ws(c)
    assert "one 16-byte-aligned strided run" in dict(c.rejected)[specs.WARP_SPECIALIZED_FORWARD.name]


def test_gluon_kernel_only_under_the_triton_release_it_was_written_for(monkeypatch):
    from maxsim.selection import common

    base = choice(128, 128, 128, tokens=2**20)
    assert is_ws(base)
    for version, expected in [((3, 6), True), ((3, 7), False), ((3, 4), False)]:
        monkeypatch.setattr(common, "TRITON_VERSION", version)
        select._forward_choice.cache_clear()
        c = choice(128, 128, 128, tokens=2**20)
        assert is_ws(c) is expected, version
        if not expected:
            assert "written for Triton 3.6" in dict(c.rejected)[specs.WARP_SPECIALIZED_FORWARD.name]
    select._forward_choice.cache_clear()


def test_unmeasured_gpus_get_the_sm90_choice_clamped_to_what_every_gpu_holds():
    for shape in [(128, 128, 128), (32, 32, 128), (1, 32, 64), (1, 1024, 128), (32, 32, 768)]:
        for tokens in (10_000, 2**20):
            sm90 = choice(*shape, tokens=tokens, masked=True).config
            other = choice(*shape, tokens=tokens, masked=True, family="unmeasured").config
            assert not other.tma and other.BM <= 128 and other.BN <= 64 and other.num_stages <= 2
            assert (other.BK, other.num_warps, other.row_max) == (sm90.BK, sm90.num_warps, sm90.row_max)


def test_every_table_ends_with_a_default_row():
    for table in (T.DENSE_FORWARD_SM90, T.DENSE_GATHER_SM90, T.DENSE_OWNED_SM90, T.VARLEN_FORWARD_SM90):
        assert table[-1].when == When()
        assert all(r.record for r in table)
    assert first_match((Rule("a", When(d=(1, 8))), Rule("b", When())), dict(d=9)).name == "b"
    with pytest.raises(LookupError):
        first_match((Rule("a", When(d=(1, 8))),), dict(d=9))


def test_auto_strategy_one_rule_for_dense_and_packed():
    lists = torch.empty(4, 8, 16, 32, device="meta")
    shared = torch.empty(1, 8, 16, 32, device="meta")
    assert select.strategy("auto", lists, 32) == "lowmem"
    assert select.strategy("auto", lists, T.LISTS_MAX_LQ) == "lowmem"
    assert select.strategy("auto", lists, T.LISTS_MAX_LQ + 1) == "unified"
    assert select.strategy("auto", shared, 32) == "unified"
    assert select.strategy("unified", lists, 32) == "unified"
    assert select.strategy("lowmem", shared, 32) == "lowmem"
    huge = torch.empty(1, 2**20, 600, 1, device="meta")  # an fp32 buffer of 2.3 GiB
    assert select.strategy("auto", huge, 32) == "lowmem"
    q, d = torch.empty(100, 64, device="meta"), torch.empty(1000, 64, device="meta")
    assert select_varlen.strategy("auto", q, d, 32) == "unified"  # no one-hot kernel in the family
    assert select_varlen.strategy("auto", q, torch.empty(2**23, 64, device="meta"), 32) == "lowmem"


def test_explain_names_the_kernel_and_every_rejection():
    # The two calls of the issue: a masked 64 x 64 and an unmasked in-batch 128 x 128 bf16 call,
    # as a Hopper GPU runs them (explained from any machine with gpu="sm90").
    Q = torch.empty(64, 32, 128, dtype=F16, device="meta")
    D = torch.empty(64, 180, 128, dtype=F16, device="meta")
    m = torch.ones(64, 32, dtype=torch.bool, device="meta"), torch.ones(64, 180, dtype=torch.bool, device="meta")
    text = str(maxsim.explain(Q, D, *m, gpu="sm90"))
    assert "forward: dense.triton_forward" in text
    assert "not dense.warp_specialized_forward: the call has padding masks" in text
    assert "backward (when Q or D requires grad): dense.unified_backward" in text
    assert "not dense.lowmem_owned_backward" in text
    Qb = torch.empty(128, 128, 128, dtype=torch.bfloat16, device="meta")
    Db = torch.empty(128, 1024, 128, dtype=torch.bfloat16, device="meta")
    text = str(maxsim.explain(Qb, Db, gpu="sm90"))
    assert "forward: dense.warp_specialized_forward" in text and "not dense.triton_forward" in text
    text = str(maxsim.explain(Qb, Db, gpu="unmeasured"))
    assert "not dense.warp_specialized_forward: runs on a Hopper GPU (sm90) only" in text
    text = str(maxsim.explain(Qb[:, :, :96], Db[:, :, :96], gpu="sm90"))
    assert "runs d in {64, 128} only, not d = 96" in text


def test_explain_on_the_cpu_and_for_packed_calls():
    Q, D = torch.randn(2, 5, 16), torch.randn(3, 7, 16)
    text = str(maxsim.explain(Q, D))
    assert "no Triton kernel" in text and "backend: cpu (" in text and "blocked GEMMs" in text
    text = str(maxsim.explain([torch.randn(5, 16), torch.randn(3, 16)], [torch.randn(7, 16)] * 4, gpu="sm90"))
    assert "forward: varlen.stream_forward" in text and "varlen.unified_backward" in text
    assert "not varlen.cross_forward: the stream runs this call" in text
    with pytest.raises(ValueError, match="gpu must be one of"):
        maxsim.explain(Q, D, gpu="h100")


def test_neighbours_start_with_the_rule_and_are_distinct():
    rule = choice(32, 32, 128).config
    cands = neighbour_configs(rule)
    assert cands[0] == rule and len(cands) == len(set(cands)) >= 4


def test_pick_fastest_skips_configs_that_fail():
    a, b, c = (ForwardConfig(bm, 64, 128, 4, 3) for bm in (32, 64, 128))
    times = {a: 3.0, b: 1.0}

    def run(cfg):
        if cfg not in times:
            raise RuntimeError("out of shared memory")
        return cfg

    assert pick_fastest([a, b, c], run, lambda fn: times[fn()]) == b
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
    # A cache written by an older release (a field since removed) still reads.
    path.write_text(json.dumps({"k3": dict(cfg.__dict__, warp_specialized=True)}))
    assert TuningCache(path).get("k3") == cfg


def test_default_path_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MAXSIM_TUNING_CACHE", str(tmp_path / "x.json"))
    assert TuningCache.default_path() == tmp_path / "x.json"
    monkeypatch.setenv("MAXSIM_AUTOTUNE", "1")
    assert autotune_enabled()


def test_warp_specialized_launch_plan_is_plain_integers():
    # A constexpr leaking into the plan's arithmetic would make Triton specialise the kernel on the
    # value (a compile per batch size): the plan must be Python ints and bools.
    pytest.importorskip("triton.experimental.gluon")
    from maxsim.dense.forward_ws import ws_plan

    for nq, nd, lq, split in [(8, 1100, 32, None), (1, 1000, 128, None), (3, 99, 1024, False), (128, 128, 128, True)]:
        plan = ws_plan(nq, nd, lq, split, 132)
        assert all(type(x) in (int, bool) for x in plan), plan


def test_forced_tile_for_tuning_sweeps(monkeypatch):
    tile, ws = select.parse_tile("BM=128, BN=64, BK=128, num_warps=8, num_stages=3, row_max=1")
    assert tile == ForwardConfig(128, 64, 128, 8, 3, row_max=True) and not ws
    assert select.parse_tile("BM=256,BN=128,BK=128,num_warps=4,num_stages=4,kernel=ws")[1]
    assert select.parse_tile("") is None
    assert select.parse_tile("BM=32,BN=32,BK=128,num_warps=2,num_stages=3,flat_walk=1")[0].flat_walk
    for bad in ("BM=128,BN=64", "BM=128,BN=64,BK=128,num_warps=8,num_stages=3,colour=1",
                "BM=128,BN,BK=128,num_warps=8,num_stages=3", "BM=12x,BN=64,BK=128,num_warps=8,num_stages=3"):
        with pytest.raises(ValueError, match="MAXSIM_FORWARD_TILE needs"):
            select.parse_tile(bad)
    Q = torch.empty(4, 32, 128, dtype=F16, device="meta")
    D = torch.empty(1, 10, 50, 128, dtype=F16, device="meta")
    monkeypatch.setattr(select, "FORCED_TILE", (tile, True))
    monkeypatch.setattr(select, "device_of", lambda t: (0, "sm90"))
    plan = select.forward_plan(Q, D, None, None, False, False, False)
    # The forced tile, on the Triton kernel: the Gluon kernel does not take this small call.
    assert plan.config == tile and not plan.warp_specialized


def test_an_unmeasured_gpu_takes_the_clamped_choices_said_once(monkeypatch):
    """A GPU the tables were not measured on (here an sm80 card, faked) is family "unmeasured", with
    one UntunedGPUWarning naming it; Hopper cards (H100, H200) are "sm90" and say nothing."""
    import warnings

    from maxsim import tuning

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-80GB")
    tuning.gpu_family.cache_clear()
    try:
        with pytest.warns(tuning.UntunedGPUWarning, match="A100-SXM4-80GB .sm80."):
            assert tuning.gpu_family(0) == "unmeasured"
        with warnings.catch_warnings():
            warnings.simplefilter("error", tuning.UntunedGPUWarning)
            assert tuning.gpu_family(0) == "unmeasured"  # said once a device
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
            assert tuning.gpu_family(1) == "sm90"
    finally:
        tuning.gpu_family.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts a CUDA device's memory")
def test_free_device_bytes_counts_what_the_caching_allocator_holds_unused():
    from maxsim.tuning import free_device_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    with_block = free_device_bytes(device)
    del block  # back to PyTorch's cache, still taken for the driver
    driver_free = torch.cuda.mem_get_info(device)[0]
    after = free_device_bytes(device)
    assert after >= driver_free + (256 << 20)
    assert after >= with_block + (256 << 20)
