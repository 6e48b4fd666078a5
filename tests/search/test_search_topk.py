"""maxsim.search.topk against the definition: a stable descending sort of the full score matrix."""

import pytest
import torch

import maxsim
from maxsim.search import merge_topk, topk
from maxsim.search.topk import choose_chunk_documents, order_keys


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
def test_subset(packed):
    Q, D = integer_tensor(3, 2, 4), integer_tensor(50, 3, 4)
    full = maxsim.maxsim(Q, D)  # [3, 50]
    lists = [[4, 9, 9, 30, 2, 41, 17], [0], list(range(49, 19, -1))]
    k = 5
    Dx = [D[j] for j in range(50)] if packed else D
    s, i = topk(Q if not packed else [Q[0], Q[1], Q[2]], Dx, k, subset=lists, chunk_documents=3)
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
    with pytest.raises(ValueError, match="subset"):
        topk(Q, D, 3, subset=[[1, 2, 99], [0]])
    with pytest.raises(ValueError, match="packed layout"):
        topk(Q, [D[0]], 3, normalize=True)
    with pytest.raises(ValueError, match="cu_seqlens_d"):
        topk(Q, D[0], 3)


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
