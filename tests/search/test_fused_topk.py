"""maxsim.topk's fused kernel (maxsim/search/fused_topk.py) and its selection
(maxsim/selection/search.py), against the definition: a stable descending sort of the full score
matrix (ties -> lower index, NaN first).

Without a GPU the kernel runs in Triton's interpreter (MAXSIM_BACKEND=triton, as
tests/dense/test_forward.py does). Launcher tests pass small tiles (cheap in the interpreter, and
they cross every block edge with small shapes) and force several document runs per query; the
routed tests go through maxsim.topk and the selection's own tile. Candidate buffers are poisoned
before each launch (tests/conftest.py), so a slot the kernel fails to write shows up.
"""

import math

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.search import fused_topk as fused
from maxsim.search import specs
from maxsim.search.topk import order_keys, topk
from maxsim.selection.search import explain_topk, topk_choice
from maxsim.tuning import tables as T
from maxsim.tuning.configs import ForwardConfig
from oracle import oracle


@pytest.fixture(autouse=True)
def _fused_kernels_on(monkeypatch):
    # These tests exercise the fused kernel; on a GPU the selection runs it only when opted in
    # (maxsim.selection.common.not_yet_on_gpu) until its GPU run has been recorded.
    monkeypatch.setenv("MAXSIM_UNVERIFIED_KERNELS", "1")

# Small tiles: BM 16 rows (2 queries of <= 8 tokens a block), BN 8 tokens a tile.
ELEMENTWISE = ForwardConfig(BM=16, BN=8, BK=16, num_warps=4, num_stages=1, waves=1)
ROW_MAX = ForwardConfig(BM=16, BN=8, BK=16, num_warps=4, num_stages=1, waves=1, row_max=True)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "triton")


def sorted_topk(full, k):
    """The oracle's rule on a full score matrix: stable descending sort, first k."""
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


def small_ints(*shape, dtype=torch.float16):
    """Integers in [-2, 2]: exact products and sums whatever the order, and many tied scores."""
    return torch.randint(-2, 3, shape, device=KERNEL_DEVICE).to(dtype)


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=KERNEL_DEVICE).to(dtype)


def assert_same(got, want):
    (gs, gi), (ws, wi) = got, want
    assert gs.dtype == torch.float32 and gi.dtype == torch.int64
    assert gs.shape == ws.shape and gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi.cpu()), (gi, wi)
    assert torch.equal(gs.isnan().cpu(), ws.isnan().cpu())
    keep = ~ws.isnan()
    assert torch.equal(gs[keep].cpu(), ws[keep].float().cpu())


# ---------------------------------------------------------------------------------------------
# the launcher, on exact (integer-valued) inputs: many ties, every edge


@pytest.mark.parametrize("config,mask_mode,runs", [(ELEMENTWISE, "exclude", 3), (ROW_MAX, "multiply", 8),
                                                   (ROW_MAX, "exclude", 1)],
                         ids=["elementwise-exclude-3runs", "rowmax-multiply-8runs", "rowmax-exclude-1run"])
def test_ties_masks_and_k_edges_equal_exhaustive(config, mask_mode, runs):
    # 5 queries of 7 tokens (2 a block: the last block ragged), 37 documents of 11 tokens (two
    # tiles, the last ragged; runs of 5-37 documents, the last ragged). Duplicate documents and an
    # empty one make exact ties; the float64 oracle is exact here.
    Q, D = small_ints(5, 7, 16), small_ints(37, 11, 16)
    D[20], D[30] = D[3], D[3]
    q_mask = torch.rand(5, 7, device=KERNEL_DEVICE) > 0.25
    d_mask = torch.rand(37, 11, device=KERNEL_DEVICE) > 0.3
    d_mask[30] = d_mask[20] = d_mask[3]
    d_mask[9] = False  # an empty document
    q_mask[4] = False  # a query with no real token: every score 0, ties everywhere
    full, _ = oracle(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    for k in (1, 5, 50):  # k > Nd returns Nd results
        got = fused.fused_topk(Q, D, k, q_mask, d_mask, config=config, multiply=mask_mode == "multiply",
                               doc_runs=runs)
        assert_same(got, sorted_topk(full, k))
    assert torch.equal(got[1][4].cpu(), torch.arange(37))  # all tied at 0: index order


def test_unmasked_equal_exhaustive_several_programs():
    Q, D = small_ints(3, 8, 16), small_ints(29, 8, 16)  # one full tile per document
    full, _ = oracle(Q, D)
    for config, k in ((ELEMENTWISE, 6), (ROW_MAX, 29)):  # k = Nd: every document, sorted
        assert_same(fused.fused_topk(Q, D, k, None, None, config=config, doc_runs=4), sorted_topk(full, k))


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
def test_tma_document_tiles(mask_mode):
    # Document tiles through a TMA descriptor of D as [1, Nd * Ld, d]: a ragged last tile reads into
    # the next document, which the bounds mask must drop.
    config = ForwardConfig(BM=16, BN=8, BK=16, num_warps=4, num_stages=1, waves=1, tma=True)
    Q, D = small_ints(3, 5, 16), small_ints(13, 9, 16)
    d_mask = torch.rand(13, 9, device=KERNEL_DEVICE) > 0.3
    assert fused._tma_ready(D, config)
    full, _ = oracle(Q, D, None, d_mask, mask_mode=mask_mode)
    got = fused.fused_topk(Q, D, 5, None, d_mask, config=config, multiply=mask_mode == "multiply", doc_runs=2)
    assert_same(got, sorted_topk(full, 5))


def test_wide_embedding_k_loop():
    # d = 40 > BK = 16: three K chunks, the last ragged (EVEN_K False).
    Q, D = small_ints(2, 3, 40), small_ints(19, 5, 40)
    full, _ = oracle(Q, D)
    assert_same(fused.fused_topk(Q, D, 4, None, None, config=ELEMENTWISE, doc_runs=2), sorted_topk(full, 4))


def test_candidates_hold_exact_keys(monkeypatch):
    # Every slot the kernel writes is a real key (order_keys of its score and document) or the
    # empty key; no document appears twice; each program's best k are all there.
    captured = {}
    real_merge = fused.merge_candidates

    def capture(keys, scores, take):
        captured.update(keys=keys.clone(), scores=scores.clone())
        return real_merge(keys, scores, take)

    monkeypatch.setattr(fused, "merge_candidates", capture)
    Q, D = small_ints(3, 5, 16), small_ints(23, 9, 16)
    fused.fused_topk(Q, D, 20, None, None, config=ELEMENTWISE, doc_runs=3)  # runs of 8, 8, 7 < KB = 32
    keys, scores = captured["keys"], captured["scores"]  # [3, 3 * 32]
    real = keys != fused.EMPTY_KEY
    assert int(real.sum()) == 3 * 23  # every document once per query, nothing else
    index = (2**32 - 1) - (keys & (2**32 - 1))
    assert torch.equal(order_keys(scores, torch.where(real, index, -1))[real], keys[real])
    for row in range(3):
        assert sorted(index[row][real[row]].tolist()) == list(range(23))


# ---------------------------------------------------------------------------------------------
# random inputs: the same scores as maxsim.maxsim, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_random_inputs_bitwise_equal_maxsim(dtype):
    Q, D = rand(3, 5, 16, dtype=dtype), rand(21, 6, 16, dtype=dtype)
    d_mask = torch.rand(21, 6, device=KERNEL_DEVICE) > 0.2
    want = sorted_topk(maxsim.maxsim(Q, D, None, d_mask), 21)
    assert_same(fused.fused_topk(Q, D, 21, None, d_mask, config=ELEMENTWISE, doc_runs=3), want)
    assert_same(topk(Q, D, 7, None, d_mask, path="fused"), (want[0][:, :7], want[1][:, :7]))


def test_normalize_bitwise_equal_maxsim():
    Q, D = rand(2, 4, 16), rand(17, 6, 16)
    want = sorted_topk(maxsim.maxsim(Q, D, normalize=True), 5)
    assert_same(fused.fused_topk(Q, D, 5, None, None, config=ROW_MAX, normalize=True, doc_runs=2), want)


def test_nan_ranks_first_ties_to_lower_index():
    Q, D = rand(3, 4, 16, dtype=torch.float32), rand(15, 6, 16, dtype=torch.float32)
    D[4, 2, 0] = math.nan  # document 4 is NaN for every query
    D[11, 5, 3] = math.nan  # ... and document 11 (in the ragged last tile)
    Q[2, 1, 0] = math.nan  # query 2 is NaN for every document
    d_mask = torch.ones(15, 6, dtype=torch.bool, device=KERNEL_DEVICE)
    d_mask[7, 1] = False
    D[7, 1, 0] = math.nan  # masked: takes no part
    s, i = fused.fused_topk(Q, D, 4, None, d_mask, config=ELEMENTWISE, doc_runs=3)
    assert i[0, :2].tolist() == [4, 11] and i[1, :2].tolist() == [4, 11]
    assert s[:2, :2].isnan().all() and not s[:2, 2:].isnan().any()
    assert i[2].tolist() == [0, 1, 2, 3] and s[2].isnan().all()
    ref = maxsim.maxsim(Q, D, None, d_mask)
    assert_same((s, i), sorted_topk(ref, 4))


def test_empty_sets():
    Q, D = rand(3, 4, 16), rand(6, 5, 16)
    s, i = fused.fused_topk(Q, D[:0], 3, None, None, config=ELEMENTWISE)  # no documents
    assert s.shape == (3, 0) and i.shape == (3, 0)
    for q, d in ((Q[:, :0], D), (Q, D[:, :0])):  # Lq = 0 or Ld = 0: every score 0
        s, i = fused.fused_topk(q, d, 4, None, None, config=ELEMENTWISE)
        assert torch.equal(s.cpu(), torch.zeros(3, 4)) and torch.equal(i.cpu(), torch.arange(4).expand(3, 4))
    s, i = fused.fused_topk(Q[:0], D, 2, None, None, config=ELEMENTWISE)
    assert s.shape == (0, 2)
    # Every document empty by its mask: all scores 0, the first k by index.
    s, i = fused.fused_topk(Q, D, 4, None, torch.zeros(6, 5, dtype=torch.bool, device=KERNEL_DEVICE),
                            config=ROW_MAX, doc_runs=2)
    assert torch.equal(s.cpu(), torch.zeros(3, 4)) and torch.equal(i.cpu(), torch.arange(4).expand(3, 4))


# ---------------------------------------------------------------------------------------------
# routing: maxsim.topk through the selection


def test_topk_routes_to_fused_and_matches_chunked(monkeypatch):
    calls = []
    real = fused.fused_topk
    monkeypatch.setattr(fused, "fused_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    Q, D = small_ints(3, 5, 16), small_ints(12, 6, 16)
    q_mask = torch.rand(3, 5, device=KERNEL_DEVICE) > 0.2
    d_mask = torch.rand(12, 6, device=KERNEL_DEVICE) > 0.2
    got = topk(Q, D, 5, q_mask.int(), d_mask)  # a 0/1 integer mask is accepted, as by maxsim.maxsim
    assert calls == [1]
    want = topk(Q, D, 5, q_mask, d_mask, path="chunked")
    assert calls == [1]
    assert_same(got, want)
    full, _ = oracle(Q, D, q_mask, d_mask)
    assert_same(got, sorted_topk(full, 5))
    s, i = topk(Q[0], D, 3, q_mask[0], d_mask)  # one 2-D query
    assert calls == [1, 1] and s.shape == (3,) and torch.equal(i, got[1][0, :3])


def test_chunked_where_fused_cannot_run(monkeypatch):
    monkeypatch.setattr(fused, "fused_topk", lambda *a, **kw: pytest.fail("the fused kernel ran"))
    Q, D = small_ints(2, 3, 16), small_ints(9, 4, 16)
    full = maxsim.maxsim(Q, D)
    assert_same(topk(Q, D, 3, chunk_documents=4), sorted_topk(full, 3))  # a chunk asked for
    s, i = topk(Q, D, 3, subset=[[1, 5, 8], [0, 2]])  # candidate lists
    assert i[0].tolist() == sorted([1, 5, 8], key=lambda j: (-full[0, j].item(), j))


def test_cpu_backend_runs_chunked(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "reference")
    Q, D = torch.randn(2, 3, 8), torch.randn(9, 4, 8)
    choice = topk_choice(Q, D, 3, masked=False, normalize=False)
    assert choice.kernel is specs.CHUNKED_TOPK and "PyTorch backend" in choice.rejected[0][1]
    with pytest.raises(ValueError, match="PyTorch backend"):
        topk(Q, D, 3, path="fused")


def test_bad_input():
    Q, D = rand(2, 3, 16), rand(9, 4, 16)
    with pytest.raises(ValueError, match="k must be at least 1"):
        topk(Q, D, 0, path="fused")
    with pytest.raises(TypeError, match="k must be an int"):
        topk(Q, D, 1.5)
    with pytest.raises(ValueError, match="path must be one of"):
        topk(Q, D, 2, path="fast")
    with pytest.raises(ValueError, match="chunk_documents"):
        topk(Q, D, 2, path="fused", chunk_documents=4)
    with pytest.raises(ValueError, match="k = 300 > 256"):
        topk(Q, D, 300, path="fused")
    with pytest.raises(ValueError, match="subset="):
        topk(Q, D, 2, subset=[[1], [2]], path="fused")
    with pytest.raises(ValueError, match="packed documents"):
        topk(Q, [D[0], D[1]], 2, path="fused")
    with pytest.raises(ValueError, match="mask_mode"):
        topk(Q, D, 2, mask_mode="mul")
    with pytest.raises(TypeError, match="normalize"):
        topk(Q, D, 2, normalize=1)
    with pytest.raises(ValueError, match="q_mask must have shape"):
        topk(Q, D, 2, torch.ones(2, 4, dtype=torch.bool, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="d_mask must have shape"):
        topk(Q, D, 2, None, torch.ones(9, 5, dtype=torch.bool, device=KERNEL_DEVICE))
    with pytest.raises(TypeError, match="must match"):
        topk(Q, D.float(), 2)
    with pytest.raises(ValueError, match="d must be at least 1"):
        topk(Q[..., :0], D[..., :0], 2)


# ---------------------------------------------------------------------------------------------
# selection rules (meta tensors: Hopper's plan for the bar shapes, from any machine)


def meta(*shape):
    return torch.empty(*shape, dtype=torch.float16, device="meta")


def test_selection_at_the_bar_shapes():
    one = topk_choice(meta(1, 32, 128), meta(10**6, 300, 128), 100, masked=False, normalize=False, family="sm90")
    assert one.kernel is specs.FUSED_TOPK and one.config.BM == 32 and "128 slots" in one.rule
    # 32 x 1M (32, 128) unmasked: maxsim.maxsim runs the warp-specialized kernel there, so the
    # chunked path (which scores with it) keeps the answer bit-exact; masked, the Triton tile fuses.
    many = topk_choice(meta(32, 32, 128), meta(10**6, 128, 128), 100, masked=False, normalize=False, family="sm90")
    assert many.kernel is specs.CHUNKED_TOPK and "warp_specialized" in many.rejected[0][1]
    masked = topk_choice(meta(32, 32, 128), meta(10**6, 128, 128), 100, masked=True, normalize=False, family="sm90")
    assert masked.kernel is specs.FUSED_TOPK and masked.config.BM == 256


def test_selection_rejections_in_words():
    limits = T.TOPK_FUSED_SM90[0].tile
    cases = [
        ((meta(4, 1024, 128), meta(1000, 300, 128), 10), "longer than the tile"),
        ((meta(1, 32, 128), meta(1000, 300, 128), limits["MAX_K"] + 1), "would not fit"),
        ((meta(256, 8, 128), meta(10**6, 128, 128), 100), "buffered keys a program"),
    ]
    for (Q, D, k), words in cases:
        choice = topk_choice(Q, D, k, masked=True, normalize=False, family="sm90")
        assert choice.kernel is specs.CHUNKED_TOPK and words in choice.rejected[0][1], choice.rejected
    for layout, words in (("packed", "packed documents"), ("candidates", "subset=")):
        choice = topk_choice(meta(2, 8, 64), meta(10, 8, 64), 5, masked=False, normalize=False, layout=layout,
                             family="sm90")
        assert choice.kernel is specs.CHUNKED_TOPK and words in choice.rejected[0][1]
    text = explain_topk(meta(1, 32, 128), meta(1000, 300, 128), 10, gpu="sm90")
    assert "search.fused_topk" in text and "not search.chunked_topk" in text


def test_scratch_is_independent_of_the_corpus(monkeypatch):
    # With 132 multiprocessors the runs follow the GPU, not Nd: the candidates' bytes stay fixed.
    monkeypatch.setattr(fused, "multiprocessors", lambda index: 132)
    sizes = set()
    for nd in (10**6, 4 * 10**6, 10**8):
        seg, runs, per_program, programs = fused.run_plan(1, nd, 32, 32, 128, waves=2, device_index=0)
        assert runs * per_program >= nd > (runs - 1) * per_program and programs == runs
        sizes.add(fused.scratch_bytes(1, runs, 128))
    assert len(sizes) == 1 and sizes.pop() <= 12 * 264 * 128
    # A small corpus: the candidates never outnumber the documents by more than one run's slots.
    _, runs, _, _ = fused.run_plan(1, 1000, 32, 32, 128, waves=2, device_index=0)
    assert runs * 128 <= 1000 + 128


# ---------------------------------------------------------------------------------------------
# GPU tier: the bar shapes (as large as fits in about 20 GB), against maxsim.maxsim + a stable sort


def _peak_above(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 600_000, 32, 128), (1, 250_000, 32, 300)],
                         ids=["32x600K(32,128)", "1x250K(32,300)"])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_bar_shapes_equal_exhaustive(shape, masked, monkeypatch):
    nq, nd, lq, ld = shape
    calls = []
    real = fused.fused_topk
    monkeypatch.setattr(fused, "fused_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.float16)
    D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.float16)
    q_mask = d_mask = None
    if masked:
        q_mask = torch.rand(nq, lq, device="cuda") > 0.1
        d_mask = torch.arange(ld, device="cuda")[None, :] < torch.randint(1, ld + 1, (nd, 1), device="cuda")
    want = sorted_topk(maxsim.maxsim(Q, D, q_mask, d_mask), 100)
    choice = topk_choice(Q, D, 100, masked=masked, normalize=False)
    got, peak = _peak_above(lambda: topk(Q, D, 100, q_mask, d_mask))
    assert_same(got, want)
    assert bool(calls) == (choice.kernel is specs.FUSED_TOPK)
    if calls:  # the fused path: candidates (about 12 * Nq * 264 * 128 bytes here), never the scores
        assert peak < 16 * 2**20, peak
    print(f"{shape} masked={masked}: {choice.kernel.name}, peak {peak / 2**20:.1f} MiB above the inputs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 100, 256])
def test_gpu_ties_every_regime(dtype, k):
    # Integer inputs: exact scores and many ties, against the stable sort of maxsim.maxsim; short
    # stacked queries, one query, 128-token queries, d = 64 and d = 256, both mask rules.
    for nq, lq, ld, d in [(8, 32, 128, 128), (1, 32, 300, 128), (2, 128, 180, 128), (4, 16, 64, 64), (3, 20, 90, 256)]:
        Q = torch.randint(-2, 3, (nq, lq, d), device="cuda").to(dtype)
        D = torch.randint(-2, 3, (3000, ld, d), device="cuda").to(dtype)
        D[1500:2000] = D[:500]
        d_mask = torch.rand(3000, ld, device="cuda") > 0.2
        d_mask[1500:2000] = d_mask[:500]
        for mode in ("exclude", "multiply"):
            want = sorted_topk(maxsim.maxsim(Q, D, None, d_mask, mask_mode=mode), k)
            assert_same(topk(Q, D, k, None, d_mask, mask_mode=mode), want)
            assert_same(topk(Q, D, k, None, d_mask, mask_mode=mode, path="chunked"), want)


@pytest.mark.gpu
def test_gpu_unaligned_and_strided_inputs():
    # Views: a non-unit stride on d (copied), D two bytes off 16-byte alignment (pointer loads
    # instead of TMA).
    Q = torch.randn(4, 32, 256, device="cuda", dtype=torch.float16)[..., ::2]
    D = torch.randn(20_000 * 64 * 128 + 1, device="cuda", dtype=torch.float16)[1:].view(20_000, 64, 128)
    d_mask = torch.rand(20_000, 64, device="cuda") > 0.1
    want = sorted_topk(maxsim.maxsim(Q, D, None, d_mask), 50)
    assert_same(topk(Q, D, 50, None, d_mask, path="fused"), want)


def test_gpu_calls_stay_on_the_verified_path_until_opted_in(monkeypatch):
    # Until its GPU run is recorded, a GPU call runs the chunked path and says why; the switch
    # (or the interpreter) lets the fused kernel run.
    Q = torch.empty(4, 32, 128, dtype=torch.float16, device="meta")
    D = torch.empty(50_000, 64, 128, dtype=torch.float16, device="meta")
    monkeypatch.delenv("MAXSIM_UNVERIFIED_KERNELS")
    held = topk_choice(Q, D, 10, masked=True, normalize=False, family="sm90")
    assert held.kernel is not specs.FUSED_TOPK
    assert "has not yet run on a GPU" in dict(held.rejected)[specs.FUSED_TOPK.name]
    monkeypatch.setenv("MAXSIM_UNVERIFIED_KERNELS", "1")
    assert topk_choice(Q, D, 10, masked=True, normalize=False, family="sm90").kernel is specs.FUSED_TOPK
