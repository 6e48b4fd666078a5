"""maxsim.search.topk against the definition: a stable descending sort of the full score matrix."""

import math

import pytest
import torch

import maxsim
from conftest import KERNEL_DEVICE
from maxsim.search import merge_topk, topk
from maxsim.search.topk import choose_chunk_documents, order_keys
from oracle import oracle


def sorted_topk(full, k):
    """The oracle: all scores, stable descending sort (ties -> lower index), first k."""
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


def integer_tensor(*shape, low=-2, high=3):
    # Small integers: every sum is exact whatever the chunking, and ties are frequent.
    return torch.randint(low, high, shape).float()


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("k", [1, 5, 40, 500])
def test_padded_equals_exhaustive_with_ties(chunk, k):
    Q, D = integer_tensor(4, 3, 4), integer_tensor(120, 5, 4)
    d_mask = torch.rand(120, 5) > 0.3
    q_mask = torch.rand(4, 3) > 0.2
    want_s, want_i = sorted_topk(maxsim.maxsim(Q, D, q_mask, d_mask), k)
    got_s, got_i = topk(Q, D, k, q_mask, d_mask, chunk_documents=chunk)
    assert got_s.dtype == torch.float32 and got_i.dtype == torch.int64
    assert got_s.shape == (4, min(k, 120))
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)


@pytest.mark.parametrize("mode", ["exclude", "multiply"])
def test_padded_float_masks_normalize(mode):
    Q, D = torch.randn(3, 6, 16), torch.randn(90, 9, 16)
    d_mask = torch.rand(90, 9) > 0.4
    d_mask[5] = False  # an empty document
    want = sorted_topk(maxsim.maxsim(Q, D, None, d_mask, normalize=True, mask_mode=mode), 10)
    got = topk(Q, D, 10, None, d_mask, normalize=True, mask_mode=mode, chunk_documents=13)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_list_and_cu_seqlens(dtype):
    # Integers: the CPU's BLAS rounds a float dot product differently as a chunk's shape changes.
    docs = [integer_tensor(n, 8).to(dtype) for n in torch.randint(0, 7, (75,)).tolist()]
    queries = [integer_tensor(n, 8).to(dtype) for n in (4, 1, 0, 6)]
    want = sorted_topk(maxsim.maxsim_varlen(queries, docs), 12)
    got = topk(queries, docs, 12, chunk_documents=9)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    d, cu_d, _ = maxsim.pack(docs)
    q, cu_q, _ = maxsim.pack(queries)
    got = topk(q, d, 12, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, chunk_documents=20)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    # Padded queries with a mask against packed documents: same scores as the packed queries.
    Qp, qm = maxsim.pad([x if x.shape[0] else torch.zeros(1, 8, dtype=dtype) for x in queries])
    qm[2] = False
    got = topk(Qp, docs, 12, qm, chunk_documents=30)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_one_query_and_k_larger_than_corpus():
    Q, D = torch.randn(5, 8), torch.randn(30, 4, 8)
    s, i = topk(Q, D, 100)
    want = sorted_topk(maxsim.maxsim(Q, D), 100)
    assert s.shape == (30,) and torch.equal(i, want[1]) and torch.equal(s, want[0])


def test_nan_ranks_first_and_negative_zero():
    Q = torch.ones(1, 1, 1)
    D = torch.tensor([1.0, float("nan"), -0.0, 0.0, 2.0, float("nan"), float("-inf")]).reshape(7, 1, 1)
    s, i = topk(Q, D, 7, chunk_documents=2)
    # torch.sort(stable) puts NaN first and keeps -0.0 == 0.0 in index order.
    want_s, want_i = sorted_topk(maxsim.maxsim(Q, D), 7)
    assert torch.equal(i, want_i)
    assert torch.equal(torch.isnan(s), torch.isnan(want_s)) and torch.equal(s[~torch.isnan(s)], want_s[~torch.isnan(want_s)])


@pytest.mark.parametrize("packed", [False, True])
def test_candidates(packed):
    Q, D = integer_tensor(3, 2, 4), integer_tensor(50, 3, 4)
    full = maxsim.maxsim(Q, D)  # [3, 50]
    lists = [[4, 9, 9, 30, 2, 41, 17], [0], list(range(49, 19, -1))]
    k = 5
    Dx = [D[j] for j in range(50)] if packed else D
    s, i = topk(Q if not packed else [Q[0], Q[1], Q[2]], Dx, k, candidates=lists, chunk_documents=3)
    for row, cand in enumerate(lists):
        cand = sorted(set(cand))
        ws, wi = sorted_topk(full[row, cand], k)
        n = min(k, len(cand))
        assert torch.equal(i[row, :n], torch.tensor(cand)[wi]) and torch.equal(s[row, :n], ws)
        assert (i[row, n:] == -1).all() and (s[row, n:] == float("-inf")).all()


def test_merge_and_keys_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, -1.0, float("nan")]])
    idx = torch.tensor([[7, 9, 2, 5, -1]])  # -1: no document, never chosen before a real one
    s, i = merge_topk(scores, idx, 4)
    assert i.tolist() == [[2, 9, 7, 5]] and s.tolist() == [[3.0, 3.0, 1.0, -1.0]]
    keys = order_keys(torch.tensor([-2.0, -1.0, 0.0, 1.0, float("inf")]), torch.tensor([0, 0, 0, 0, 0]))
    assert torch.equal(keys, torch.sort(keys).values)


def test_chunk_size_rule():
    assert choose_chunk_documents(32, 10_000, 100, 100, torch.device("cpu"), scratch_bytes=32 * 40 * 1000) == 1000
    c = choose_chunk_documents(32, 10_001, 100, 100, torch.device("cpu"), scratch_bytes=32 * 40 * 1000)
    n = -(-10_001 // c)
    assert c <= 1000 and 10_001 - (n - 1) * c >= c - n  # balanced: no small remainder chunk
    assert choose_chunk_documents(1000, 50, 5, 10, torch.device("cpu"), scratch_bytes=1) == 5
    # On CUDA a chunk keeps at least MIN_CHUNK_TOKENS tokens (the corpus class of a big corpus).
    assert choose_chunk_documents(32, 10**7, 10, 100, torch.device("cuda"), scratch_bytes=1) >= 2**18 // 100


def test_bad_inputs():
    Q, D = torch.randn(2, 3, 8), torch.randn(10, 4, 8)
    with pytest.raises(ValueError, match="k must be at least 1"):
        topk(Q, D, 0)
    with pytest.raises(TypeError, match="k must be an int"):
        topk(Q, D, 2.5)
    with pytest.raises(ValueError, match="d=8 but D has d=4"):
        topk(Q, torch.randn(10, 4, 4), 3)
    with pytest.raises(TypeError, match="must match"):
        topk(Q, D.half(), 3)
    with pytest.raises(ValueError, match="candidates"):
        topk(Q, D, 3, candidates=[[1, 2, 99], [0]])
    with pytest.raises(ValueError, match="packed layout"):
        topk(Q, [D[0]], 3, normalize=True)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        topk(Q, D[0], 3)


# ---------------------------------------------------------------------------------------------
# The contract through the kernels as well: "kernels" runs each chunk's maxsim.maxsim on the Triton
# kernels (Triton's interpreter without a GPU), "default" on the backend the device picks.


@pytest.fixture(params=["default", "kernels"])
def backend(request, monkeypatch):
    if request.param == "kernels":
        monkeypatch.setenv("MAXSIM_BACKEND", "triton")
    return request.param


def small_ints(*shape, dtype=torch.float16):
    """Integers in [-2, 2]: exact products and sums whatever the order, and many tied scores."""
    return torch.randint(-2, 3, shape, device=KERNEL_DEVICE).to(dtype)


def assert_same(got, want):
    (gs, gi), (ws, wi) = got, want
    assert gs.dtype == torch.float32 and gi.dtype == torch.int64
    assert gs.shape == ws.shape and gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi.cpu()), (gi, wi)
    assert torch.equal(gs.isnan().cpu(), ws.isnan().cpu())
    keep = ~ws.isnan()
    assert torch.equal(gs[keep].cpu(), ws[keep].float().cpu())


@pytest.mark.parametrize("mask_mode", ["exclude", "multiply"])
def test_ties_masks_and_k_edges_equal_oracle(backend, mask_mode):
    # 5 queries of 7 tokens, Nd documents of 11 tokens, chunks of 7 (the last ragged) or one chunk.
    # Duplicate documents and an empty one make exact ties; the float64 oracle is exact here. The
    # interpreter runs a program a document (about 0.3 s each): fewer documents and calls there.
    nd = 37 if backend == "default" else 13
    calls = [(c, k) for c in (7, None) for k in (1, 5, 50)] if backend == "default" else [(7, 4), (None, 50)]
    Q, D = small_ints(5, 7, 16), small_ints(nd, 11, 16)
    D[nd - 7], D[nd - 1] = D[3], D[3]
    q_mask = torch.rand(5, 7, device=KERNEL_DEVICE) > 0.25
    d_mask = torch.rand(nd, 11, device=KERNEL_DEVICE) > 0.3
    d_mask[nd - 1] = d_mask[nd - 7] = d_mask[3]
    d_mask[9] = False  # an empty document
    q_mask[4] = False  # a query with no real token: every score 0, ties everywhere
    full, _ = oracle(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    for chunk, k in calls:  # k > Nd returns Nd results
        got = topk(Q, D, k, q_mask, d_mask, mask_mode=mask_mode, chunk_documents=chunk)
        assert_same(got, sorted_topk(full, k))
    assert torch.equal(got[1][4].cpu(), torch.arange(nd))  # all tied at 0: index order


def test_nan_ranks_first_ties_to_lower_index(backend):
    Q, D = torch.randn(3, 4, 16, device=KERNEL_DEVICE), torch.randn(15, 6, 16, device=KERNEL_DEVICE)
    D[4, 2, 0] = math.nan  # document 4 is NaN for every query
    D[11, 5, 3] = math.nan  # ... and document 11 (another chunk)
    Q[2, 1, 0] = math.nan  # query 2 is NaN for every document
    d_mask = torch.ones(15, 6, dtype=torch.bool, device=KERNEL_DEVICE)
    d_mask[7, 1] = False
    D[7, 1, 0] = math.nan  # masked: takes no part
    s, i = topk(Q, D, 4, None, d_mask, chunk_documents=4)
    assert i[0, :2].tolist() == [4, 11] and i[1, :2].tolist() == [4, 11]
    assert s[:2, :2].isnan().all() and not s[:2, 2:].isnan().any()
    assert i[2].tolist() == [0, 1, 2, 3] and s[2].isnan().all()
    want = sorted_topk(maxsim.maxsim(Q, D, None, d_mask), 4)
    assert torch.equal(i[:2].cpu(), want[1][:2].cpu())


def test_empty_sets(backend):
    Q, D = small_ints(3, 4, 16), small_ints(6, 5, 16)
    s, i = topk(Q, D[:0], 3)  # no documents
    assert s.shape == (3, 0) and i.shape == (3, 0) and s.dtype == torch.float32 and i.dtype == torch.int64
    for q, d in ((Q[:, :0], D), (Q, D[:, :0])):  # Lq = 0 or Ld = 0: every score 0
        s, i = topk(q, d, 4)
        assert torch.equal(s.cpu(), torch.zeros(3, 4)) and torch.equal(i.cpu(), torch.arange(4).expand(3, 4))
    s, i = topk(Q[:0], D, 2)  # no queries
    assert s.shape == (0, 2) and i.shape == (0, 2)
    # Every document empty by its mask: all scores 0, the first k by index.
    s, i = topk(Q, D, 4, None, torch.zeros(6, 5, dtype=torch.bool, device=KERNEL_DEVICE), chunk_documents=4)
    assert torch.equal(s.cpu(), torch.zeros(3, 4)) and torch.equal(i.cpu(), torch.arange(4).expand(3, 4))


def test_integer_masks_and_one_query(backend):
    Q, D = small_ints(3, 5, 16), small_ints(12, 6, 16)
    q_mask = torch.rand(3, 5, device=KERNEL_DEVICE) > 0.2
    d_mask = torch.rand(12, 6, device=KERNEL_DEVICE) > 0.2
    got = topk(Q, D, 5, q_mask.int(), d_mask.int())  # 0/1 integer masks, as maxsim.maxsim accepts
    full, _ = oracle(Q, D, q_mask, d_mask)
    assert_same(got, sorted_topk(full, 5))
    s, i = topk(Q[0], D, 3, q_mask[0], d_mask)  # one 2-D query
    assert s.shape == (3,) and torch.equal(i, got[1][0, :3])


def test_bad_padded_options():
    # Checked before any chunk is scored: also with no documents or no candidates to score.
    Q, D = small_ints(2, 3, 16), small_ints(9, 4, 16)
    for docs in (D, D[:0]):
        with pytest.raises(ValueError, match="mask_mode"):
            topk(Q, docs, 2, mask_mode="mul")
        with pytest.raises(TypeError, match="normalize"):
            topk(Q, docs, 2, normalize=1)
    with pytest.raises(ValueError, match="q_mask must have shape"):
        topk(Q, D, 2, torch.ones(2, 4, dtype=torch.bool, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="d_mask must have shape"):
        topk(Q, D, 2, None, torch.ones(9, 5, dtype=torch.bool, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="d must be at least 1"):
        topk(Q[..., :0], D[..., :0], 2)
    with pytest.raises(TypeError):
        topk(Q, D, 2, path="fused")  # one path: there is no path= to choose


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_topk_equals_exhaustive_real_shapes(dtype):
    # 2**19 document tokens: several chunks at the big-corpus class.
    Q = torch.randn(32, 32, 128, device="cuda", dtype=dtype)
    D = torch.randn(16_384, 128, 128, device="cuda", dtype=dtype)
    want = sorted_topk(maxsim.maxsim(Q, D), 100)
    got = topk(Q, D, 100, chunk_documents=4096)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    docs = [D[j, : 1 + (j * 37) % 128] for j in range(D.shape[0])]
    want = sorted_topk(maxsim.maxsim_varlen(list(Q), docs), 100)
    got = topk(list(Q), docs, 100, chunk_documents=4096)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
