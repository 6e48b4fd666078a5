"""The CPU backend (maxsim.cpu, what CPU tensors run) against the float64 oracle and the plain
reference, rule by rule: layouts, masks in both modes, NaN, ties, empty sets, argmax, normalize,
gradients, chunking and the worker pool."""

import math

import pytest
import torch

import maxsim
from maxsim.cpu import engine, maxsim_cpu
from maxsim.reference import maxsim_reference
from oracle import oracle, rel_err, winner_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["exclude", "multiply"]


@pytest.fixture(params=["small", "team", "workers"])
def pool(request, monkeypatch):
    """Every way the engine runs its chunks (forced for small inputs, with chunks of a few KB so
    that there are many): a small call on the caller's thread alone, a large one on the caller's
    intra-op team, or on the caller and the worker pool."""
    if request.param != "small":
        monkeypatch.setattr(engine, "_POOL_MIN_FLOPS", 0)
        monkeypatch.setenv("MAXSIM_CPU_THREADS", request.param)
    return request.param


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def check(Q, D, q_mask=None, d_mask=None, tol=1e-5, chunk=2048, **kw):
    scores, arg = maxsim_cpu(Q, D, q_mask, d_mask, return_argmax=True, max_chunk_bytes=chunk, **kw)
    ref, ref_arg = oracle(Q, D, q_mask, d_mask, **kw)
    assert scores.dtype == torch.float32 and arg.dtype == torch.int32
    assert rel_err(scores, ref) <= tol
    assert torch.equal(arg.long(), ref_arg)
    # Without the argmax: the same scores to fp32 rounding, NaN where they are NaN. Not bit for bit:
    # long documents then take one GEMM each (maxsim.cpu.per_document), whose summation order can
    # differ from the chunked product's (1 ulp apart on an AMD EPYC, equal on a Xeon).
    torch.testing.assert_close(maxsim_cpu(Q, D, q_mask, d_mask, max_chunk_bytes=chunk, **kw), scores,
                               rtol=2e-6, atol=1e-6, equal_nan=True)
    return scores


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nd,lq,ld,d", [(3, 4, 5, 7, 16), (2, 3, 1, 1, 8), (1, 9, 13, 31, 24), (4, 40, 6, 3, 8)])
def test_cross_product_matches_oracle(pool, dtype, nq, nd, lq, ld, d):
    check(rand(nq, lq, d, dtype=dtype), rand(nd, ld, d, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_candidate_lists_match_oracle(pool, dtype):
    check(rand(3, 6, 16, dtype=dtype), rand(3, 5, 9, 16, dtype=dtype))


@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
def test_masks_with_holes_and_empty_rows(pool, mask_mode, normalize, candidates):
    Q = rand(4, 8, 16)
    D = rand(4, 6, 11, 16) if candidates else rand(9, 11, 16)
    q_mask = torch.rand(4, 8) > 0.4
    d_mask = torch.rand(D.shape[:-1]) > 0.5
    q_mask[1] = False  # a query with no real token
    d_mask[..., 2, :] = False  # a document with no real token
    d_mask[..., 3, :] = True  # and one with no masked token
    for qm, dm in [(q_mask, None), (None, d_mask), (q_mask, d_mask)]:
        scores = check(Q, D, qm, dm, mask_mode=mask_mode, normalize=normalize)
        if qm is not None:
            assert torch.all(scores[1] == 0)
        if dm is not None and mask_mode == "exclude":
            assert torch.all(scores[:, 2] == 0)


def test_ragged_prefix_masks_sorted_into_chunks(pool):
    # Many documents of very different lengths: chunks group similar lengths, padded by repetition.
    Q, D = rand(3, 7, 16), rand(50, 40, 16)
    d_mask = torch.arange(40)[None, :] < torch.randint(0, 41, (50, 1))
    check(Q, D, None, d_mask, chunk=3000)


def test_multiply_mode_is_pylate():
    Q, D = rand(3, 5, 16), rand(4, 7, 16)
    q_mask = torch.rand(3, 5) > 0.3
    d_mask = torch.rand(4, 7) > 0.3
    S = torch.einsum("ash,bth->abst", Q, D) * q_mask[:, None, :, None] * d_mask[None, :, None, :]
    torch.testing.assert_close(maxsim_cpu(Q, D, q_mask, d_mask, mask_mode="multiply"), S.max(-1).values.sum(-1),
                               rtol=1e-5, atol=1e-5)


def test_empty_sets_give_zero_scores():
    for nq, nd, lq, ld in [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)]:
        out, arg = maxsim_cpu(rand(nq, lq, 8), rand(nd, ld, 8), return_argmax=True)
        assert out.shape == (nq, nd) and torch.all(out == 0)
        assert arg.shape == (nq, nd, lq) and torch.all(arg == -1)
    all_masked = torch.zeros(3, 5, dtype=torch.bool)
    out, arg = maxsim_cpu(rand(2, 4, 8), rand(3, 5, 8), None, all_masked, return_argmax=True)
    assert torch.all(out == 0) and torch.all(arg == -1)


def test_nan_propagates_and_masked_nan_does_not(pool):
    Q, D = rand(2, 3, 8), rand(3, 4, 8)
    D[1, 2, 5] = math.nan
    out, arg = maxsim_cpu(Q, D, return_argmax=True, max_chunk_bytes=256)
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, [0, 2]]).any()
    assert torch.all(arg[:, 1] == 2)  # the NaN token wins
    d_mask = torch.ones(3, 4, dtype=torch.bool)
    d_mask[1, 2] = False
    assert not torch.isnan(maxsim_cpu(Q, D, None, d_mask)).any()
    # PyLate's rule multiplies the NaN by 0: NaN, as in the reference.
    assert torch.equal(maxsim_cpu(Q, D, None, d_mask, mask_mode="multiply").isnan(),
                       maxsim_reference(Q, D, None, d_mask, mask_mode="multiply").isnan())
    Q[0, 1, 0] = math.nan
    q_mask = torch.ones(2, 3, dtype=torch.bool)
    q_mask[0, 1] = False
    assert not torch.isnan(maxsim_cpu(Q, D, q_mask, d_mask)).any()


def test_ties_go_to_lowest_index(pool):
    Q, D = rand(2, 3, 8), rand(2, 6, 8)
    D[:, 4] = D[:, 1]  # exact duplicates: the same similarity at t = 1, 4 and 5
    D[:, 5] = D[:, 1]
    d_mask = torch.ones(2, 6, dtype=torch.bool)
    d_mask[:, 0] = False  # the gathered path (the first real token is repeated as padding)
    for dm in (None, d_mask):
        _, arg = maxsim_cpu(Q, D, None, dm, return_argmax=True)
        assert torch.equal(arg.long(), oracle(Q, D, None, dm)[1])
        assert not torch.any((arg == 4) | (arg == 5))


def test_two_d_inputs():
    q, doc = rand(5, 16), rand(7, 16)
    Q, D = rand(3, 5, 16), rand(4, 7, 16)
    assert maxsim_cpu(q, doc).shape == ()
    assert maxsim_cpu(q, D).shape == (4,)
    assert maxsim_cpu(Q, doc).shape == (3,)
    torch.testing.assert_close(maxsim_cpu(Q, doc), maxsim_reference(Q, doc))


@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
def test_gradients_match_the_reference(mask_mode, normalize, candidates):
    Q = rand(3, 5, 16)
    D = rand(3, 4, 7, 16) if candidates else rand(6, 7, 16)
    q_mask = torch.rand(3, 5) > 0.3
    d_mask = torch.rand(D.shape[:-1]) > 0.3
    g = torch.randn(3, 4 if candidates else 6)

    def grads(fn):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        (fn(Qg, Dg, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode) * g).sum().backward()
        return Qg.grad, Dg.grad

    ours, ref = grads(maxsim_cpu), grads(maxsim_reference)
    assert rel_err(ours[0], ref[0]) < 1e-5 and rel_err(ours[1], ref[1]) < 1e-5


def test_gradients_match_the_oracle_at_the_winners_and_keep_their_dtype():
    for dtype in DTYPES:
        Q, D = rand(4, 6, 16, dtype=dtype), rand(5, 9, 16, dtype=dtype)
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        scores, arg = maxsim_cpu(Qg, Dg, return_argmax=True, max_chunk_bytes=512)
        g = torch.randn(scores.shape, generator=torch.Generator().manual_seed(0)).double()
        (scores * g.float()).sum().backward()
        assert Qg.grad.dtype == dtype and Dg.grad.dtype == dtype
        ref_q, ref_d = winner_grads(Q, D, arg)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_err(Qg.grad, ref_q) < tol and rel_err(Dg.grad, ref_d) < tol


def test_masked_nan_does_not_leak_into_gradients():
    Q, D = rand(2, 3, 8), rand(3, 4, 8)
    D[1, 2] = math.nan
    d_mask = torch.ones(3, 4, dtype=torch.bool)
    d_mask[1, 2] = False
    Qg = Q.clone().requires_grad_()
    maxsim_cpu(Qg, D, None, d_mask).sum().backward()
    assert torch.isfinite(Qg.grad).all()


def test_workers_run_on_the_pool_and_restore_the_callers_threads(monkeypatch):
    monkeypatch.setattr(engine, "_POOL_MIN_FLOPS", 0)
    monkeypatch.setenv("MAXSIM_CPU_THREADS", "workers")
    threads = set()
    real = engine._chunk_rowmax

    def spy(*args, **kw):
        threads.add((__import__("threading").get_ident(), torch.get_num_threads()))
        return real(*args, **kw)

    monkeypatch.setattr(engine, "_chunk_rowmax", spy)
    own = torch.get_num_threads()
    Q, D = rand(2, 4, 8), rand(64, 9, 8)
    out = maxsim_cpu(Q, D, max_chunk_bytes=512)
    assert torch.get_num_threads() == own
    assert all(n == 1 for _, n in threads)  # every chunk's ops on one thread
    if own > 1:
        assert len(threads) >= 1
    assert rel_err(out, oracle(Q, D)[0]) < 1e-5
    monkeypatch.setenv("MAXSIM_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="MAXSIM_CPU_THREADS must be 'team' or 'workers'"):
        maxsim_cpu(Q, D, max_chunk_bytes=512)


def test_chunk_columns_bound_the_scratch():
    budget = engine.DEFAULT_CHUNK_BYTES
    for R, d, rows in [(32, 128, 150_000), (1024, 128, 4096), (1, 768, 10), (5000, 16, 10**6), (64, 768, 12800)]:
        for copies in (False, True):
            for workers in (1, 2):
                cols = engine._chunk_columns(R, d, rows, budget, copies=copies, workers=workers)
                assert cols >= 1
                assert cols == 1 or cols * R * 4 <= budget  # S
                assert not copies or cols == 1 or cols * d * 4 <= 2 * budget  # the chunk's fp32 rows
                assert workers == 1 or cols <= max(256, -(-rows // 6))  # three chunks per worker


def test_inference_mode_and_no_grad_on_the_pool(pool):
    Q, D = rand(3, 8, 16), rand(20, 9, 16)
    d_mask = torch.rand(20, 9) > 0.3
    ref = maxsim_reference(Q, D, None, d_mask)
    with torch.inference_mode():
        a = maxsim_cpu(Q, D, None, d_mask, max_chunk_bytes=1024)
    with torch.no_grad():
        b = maxsim_cpu(Q, D, None, d_mask, max_chunk_bytes=1024)
    assert rel_err(a, ref.double()) < 1e-5 and torch.equal(a, b)


def test_public_entry_points_dispatch_to_it(monkeypatch):
    calls = []
    import maxsim.dense.ops as dense_ops

    monkeypatch.setattr(dense_ops, "maxsim_cpu", lambda *a, **k: calls.append("cpu") or maxsim_cpu(*a, **k))
    monkeypatch.setattr(maxsim.reference, "maxsim_reference",
                        lambda *a, **k: calls.append("reference") or maxsim_reference(*a, **k))
    Q, D = rand(2, 4, 8), rand(3, 5, 8)
    monkeypatch.setenv("MAXSIM_BACKEND", "auto")
    a = maxsim.maxsim(Q, D)
    monkeypatch.setenv("MAXSIM_BACKEND", "reference")
    b = maxsim.maxsim(Q, D)
    monkeypatch.setenv("MAXSIM_BACKEND", "cpu")
    c = maxsim.maxsim(Q, D)
    assert calls == ["cpu", "reference", "cpu"]
    assert torch.allclose(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_cross_and_pairs_on_the_cpu_backend(monkeypatch, pool, dtype):
    monkeypatch.setenv("MAXSIM_BACKEND", "cpu")
    qs = [rand(n, 16, dtype=dtype) for n in (5, 0, 9, 40, 1)]
    ds = [rand(n, 16, dtype=dtype) for n in (7, 1, 0, 70, 33, 64, 65)]
    out = maxsim.maxsim_varlen(qs, ds)
    ref = torch.tensor([[float(maxsim_reference(q, doc)) if len(q) and len(doc) else 0.0 for doc in ds] for q in qs])
    assert rel_err(out, ref) < 1e-5
    q, cu_q, mq = maxsim.pack(qs)
    d, cu_d, md = maxsim.pack(ds)
    pq = torch.tensor([3, 0, 3, 2, 1, 4, 3])
    pd = torch.tensor([6, 0, 3, 2, 2, 0, 6])
    pairs = maxsim.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md)
    assert rel_err(pairs, ref[pq, pd]) < 1e-5


def test_varlen_gradients_on_the_cpu_backend(monkeypatch):
    q, cu_q, mq = maxsim.pack([rand(n, 16) for n in (4, 11, 1)])
    d, cu_d, md = maxsim.pack([rand(n, 16) for n in (9, 0, 20, 3)])

    def grads(backend):
        monkeypatch.setenv("MAXSIM_BACKEND", backend)
        qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
        s = maxsim.maxsim_varlen(qg, dg, cu_q, cu_d, mq, md)
        p = maxsim.score_pairs_packed(qg, dg, cu_q, cu_d, torch.tensor([2, 0, 1]), torch.tensor([3, 2, 2]), mq, md)
        (s * torch.arange(12.0).view(3, 4)).sum().add(p.sum()).backward()
        return qg.grad, dg.grad

    ours, ref = grads("cpu"), grads("reference")
    assert rel_err(ours[0], ref[0]) < 1e-5 and rel_err(ours[1], ref[1]) < 1e-5


@pytest.mark.parametrize("mask_mode", MODES)
def test_documents_longer_than_a_chunk_run_in_pieces(pool, mask_mode):
    # A chunk of 256 bytes holds ~10 document rows against 6 query rows: every document is split
    # into pieces whose maxima (ties, NaN, argmax) are combined in order.
    Q, D = rand(2, 3, 8), rand(3, 57, 8)
    D[1, 40] = D[1, 3]  # a tie across pieces: the earlier piece wins
    D[2, 33, 1] = math.nan  # a NaN in a later piece wins
    d_mask = torch.rand(3, 57) > 0.3
    d_mask[1, 3] = d_mask[1, 40] = True
    d_mask[2, 33] = True
    for qm, dm in [(None, None), (torch.rand(2, 3) > 0.3, d_mask)]:
        check(Q, D, qm, dm, chunk=256, mask_mode=mask_mode)
    check(Q, rand(2, 4, 57, 8), None, torch.rand(2, 4, 57) > 0.5, chunk=256, mask_mode=mask_mode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["list", "packed"])
def test_long_documents_one_gemm_each_match_the_oracle(monkeypatch, dtype, layout):
    """Documents of 32+ tokens on average (lists and packed) take the per-document path: one GEMM
    each from where they lie, never packed or gathered. Against the float64 oracle: both product
    orientations (a page longer than 8x the query rows), an empty document (0), a NaN token (NaN),
    queries of different lengths; a list is never packed (only the queries are)."""
    from maxsim.cpu import varlen as cpu_varlen
    from maxsim.varlen import ops

    lengths = [40, 0, 33, 700, 64, 51, 90]
    docs = [rand(n, 24, dtype=dtype) for n in lengths]
    docs[5] = docs[5].clone()
    docs[5][7, 3] = float("nan")
    queries = [rand(n, 24, dtype=dtype) for n in (5, 3, 8)]
    calls, packs = [], []
    real_scores, real_pack = cpu_varlen.per_document_scores, ops.pack
    monkeypatch.setattr(cpu_varlen, "per_document_scores", lambda *a: calls.append(1) or real_scores(*a))
    monkeypatch.setattr(ops, "pack", lambda seqs: packs.append(len(list(seqs))) or real_pack(seqs))
    if layout == "list":
        got = maxsim.maxsim_varlen(queries, docs)
        assert packs == [len(queries)]  # the queries only
    else:
        d, cu_d, _ = maxsim.pack(docs)
        q, cu_q, _ = maxsim.pack(queries)
        got = maxsim.maxsim_varlen(q, d, cu_q, cu_d)
    assert calls and got.shape == (3, len(docs)) and got.dtype == torch.float32
    Qp, qm = maxsim.pad(queries)
    Dp, dm = maxsim.pad(docs)
    want = oracle(Qp, Dp, qm, dm)[0]  # [3, Nd] float64
    assert torch.isnan(got[:, 5]).all()
    assert rel_err(got, want) < 1e-6  # (the NaN column matched too)
    assert torch.equal(got[:, 1], torch.zeros(3))


def test_short_packed_documents_stay_on_the_blocked_engine(monkeypatch):
    from maxsim.cpu import varlen as cpu_varlen

    monkeypatch.setattr(cpu_varlen, "per_document_scores", lambda *a: pytest.fail("per-document path taken"))
    docs = [rand(n, 16) for n in (3, 9, 1, 30)]  # 10.75 tokens on average
    queries = [rand(4, 16)]
    d, cu_d, _ = maxsim.pack(docs)
    q, cu_q, _ = maxsim.pack(queries)
    Qp, qm = maxsim.pad(queries)
    Dp, dm = maxsim.pad(docs)
    assert rel_err(maxsim.maxsim_varlen(q, d, cu_q, cu_d), oracle(Qp, Dp, qm, dm)[0]) < 1e-6


def test_short_listed_documents_are_never_packed_whole(monkeypatch):
    # A list of short documents is scored a task at a time (one GEMM over the task's items, a max
    # per item), without the per-item loop: the list itself is never packed.
    from maxsim.cpu import per_document as cpu_per_document
    from maxsim.varlen import ops

    def no_loop(*args):
        pytest.fail("the per-item loop ran on short items")

    monkeypatch.setattr(cpu_per_document, "_document_loops", lambda: (no_loop, cpu_per_document._rowmax_packed))
    docs = [rand(n, 16) for n in (3, 9, 1, 30, 0)]
    docs[2] = docs[2].clone()
    docs[2][0, 5] = float("nan")
    queries = [rand(4, 16), rand(2, 16)]
    Qp, qm = maxsim.pad(queries)
    Dp, dm = maxsim.pad(docs)
    want = oracle(Qp, Dp, qm, dm)[0]
    packs = []
    real_pack = ops.pack
    monkeypatch.setattr(ops, "pack", lambda seqs: packs.append(len(list(seqs))) or real_pack(seqs))
    got = maxsim.maxsim_varlen(queries, docs)
    assert packs == [len(queries)]  # the queries only
    assert torch.isnan(got[:, 2]).all() and torch.equal(got[:, 4], torch.zeros(2))
    keep = [0, 1, 3, 4]
    assert rel_err(got[:, keep], want[:, keep]) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_and_long_tasks_of_one_list(two_workers, monkeypatch, dtype):
    # Each task of a list takes its own way: short items one GEMM over their copy, long ones a
    # GEMM each (the per-item loop, counted here).
    from maxsim.cpu import per_document as cpu_per_document

    listed, packed = cpu_per_document._document_loops()
    long_tasks = []
    monkeypatch.setattr(cpu_per_document, "_document_loops",
                        lambda: (lambda docs, *a: long_tasks.append(len(docs)) or listed(docs, *a), packed))
    lengths = [2, 3, 1, 0, 50, 60, 40, 70, 1, 0, 2, 3, 33, 40, 90, 2]  # tasks of 4: short, long, short, long
    docs = [rand(n, 16, dtype=dtype) for n in lengths]
    queries = [rand(4, 16, dtype=dtype), rand(7, 16, dtype=dtype)]
    got = maxsim.maxsim_varlen(queries, docs)
    assert long_tasks == [4, 4]
    Qp, qm = maxsim.pad(queries)
    Dp, dm = maxsim.pad(docs)
    assert rel_err(got, oracle(Qp, Dp, qm, dm)[0]) < 1e-6


def test_per_document_scores_of_a_list_without_item_lengths_reads_the_shapes():
    # Called directly (no caller's check), a list's token counts come from the items' shapes.
    from maxsim.cpu.per_document import per_document_scores

    docs = [rand(n, 8) for n in (5, 0, 70, 3)]
    q = rand(6, 8)
    got = per_document_scores(q, torch.zeros(6, dtype=torch.long), 1, docs, len(docs))  # [1, 4]
    Dp, dm = maxsim.pad(docs)
    assert got.shape == (1, 4)
    assert rel_err(got, oracle(q[None], Dp, None, dm)[0]) < 1e-6


@pytest.mark.parametrize("layout", ["list", "packed", "padded"])
def test_compiled_and_python_document_loops_give_the_same_bits(monkeypatch, layout):
    from maxsim.cpu import per_document as cpu_per_document

    lengths = (40, 0, 300, 64, 51)
    docs = [rand(n, 24) for n in lengths]  # 300 > 8 x 5 query rows: the other orientation
    queries = [rand(5, 24)]

    def scores():
        if layout == "padded":
            (Qp, qm), (Dp, dm) = maxsim.pad(queries), maxsim.pad(docs)
            return maxsim.maxsim(Qp, Dp, qm, dm)
        if layout != "packed":
            return maxsim.maxsim_varlen(queries, docs)
        d, cu_d, _ = maxsim.pack(docs)
        q, cu_q, _ = maxsim.pack(queries)
        return maxsim.maxsim_varlen(q, d, cu_q, cu_d)

    first = scores()
    monkeypatch.setattr(cpu_per_document, "_document_loops",
                        lambda: (cpu_per_document._rowmax_listed, cpu_per_document._rowmax_packed))
    assert torch.equal(scores(), first)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_long_documents_under_prefix_masks_take_the_per_document_path(monkeypatch, dtype):
    # maxsim.maxsim on the CPU: long documents whose masks are prefixes (or no mask) are scored one
    # GEMM each from the padded rows; masks with holes, the argmax and normalize keep the engine.
    from maxsim.cpu import dense as cpu_dense

    docs = [rand(n, 24, dtype=dtype) for n in (40, 0, 33, 700, 64)]
    queries = [rand(n, 24, dtype=dtype) for n in (5, 3)]
    Qp, qm = maxsim.pad(queries)
    Dp, dm = maxsim.pad(docs)
    want = oracle(Qp, Dp, qm, dm)[0]
    calls = []
    real = cpu_dense.per_document_scores
    monkeypatch.setattr(cpu_dense, "per_document_scores", lambda *a: calls.append(1) or real(*a))
    got = maxsim.maxsim(Qp, Dp, qm, dm)
    assert calls == [1] and rel_err(got, want) < 1e-6 and torch.equal(got[:, 1], torch.zeros(2))
    assert rel_err(maxsim.maxsim(Qp, Dp[:, :64]), oracle(Qp, Dp[:, :64])[0]) < 1e-6 and calls == [1, 1]  # no masks
    holes = dm.clone()
    holes[0, 3] = False
    for call in (lambda: maxsim.maxsim(Qp, Dp, qm, holes), lambda: maxsim.maxsim(Qp, Dp, qm, dm, return_argmax=True),
                 lambda: maxsim.maxsim(Qp, Dp, qm, dm, normalize=True)):
        call()
    assert calls == [1, 1]


def test_a_list_with_a_gradient_takes_the_packed_path():
    docs = [rand(40, 16).requires_grad_(True) for _ in range(3)]
    q = rand(5, 16)
    scores = maxsim.maxsim_varlen([q], docs)
    scores.sum().backward()
    assert all(d.grad is not None and d.grad.abs().sum() > 0 for d in docs)


@pytest.fixture
def two_workers(monkeypatch):
    """The per-document path on the caller and a pool worker, in tasks of 4 documents."""
    from maxsim.cpu import per_document as cpu_per_document

    monkeypatch.setattr(cpu_per_document, "_TASK_DOCUMENTS", (4, 4))
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(own)


@pytest.mark.parametrize("bad,message", [
    (lambda x: x[:, :8], r"item 157 has d=8"),
    (lambda x: x.half(), r"item 157 has d=16, torch.float16"),
    (lambda x: x[0], r"item 157 is shape \[16\]"),
    (lambda x: "text", r"item 157 is str"),
])
@pytest.mark.parametrize("length", [6, 40])
def test_a_bad_list_item_raises_while_the_workers_score_the_others(two_workers, bad, message, length):
    # Each task's items are checked by the thread that scores them, before it does: the check's
    # clear error is the one raised, never a GEMM's on the bad item.
    docs = [rand(length, 16) for _ in range(200)]
    docs[157] = bad(docs[157])
    with pytest.raises(ValueError, match=message):
        maxsim.maxsim_varlen([rand(5, 16)], docs)


@pytest.mark.parametrize("length", [6, 40])
def test_a_late_list_item_with_a_gradient_takes_the_packed_path(two_workers, monkeypatch, length):
    from maxsim.varlen import ops

    docs = [rand(length, 16) for _ in range(200)]
    docs[190].requires_grad_(True)
    q = rand(5, 16)
    packs = []
    real_pack = ops.pack
    monkeypatch.setattr(ops, "pack", lambda seqs, **kw: packs.append(len(list(seqs))) or real_pack(seqs, **kw))
    scores = maxsim.maxsim_varlen([q], docs)
    assert 200 in packs and scores.requires_grad
    scores.sum().backward()
    assert docs[190].grad is not None and docs[190].grad.abs().sum() > 0
    packs.clear()
    with torch.no_grad():
        plain = maxsim.maxsim_varlen([q], docs)  # no gradient wanted: scored from the list
    assert 200 not in packs
    Qp, qm = maxsim.pad([q])
    Dp, dm = maxsim.pad([x.detach() for x in docs])
    want = oracle(Qp, Dp, qm, dm)[0]
    assert rel_err(plain, want) < 1e-6 and rel_err(scores.detach(), want) < 1e-6


@pytest.mark.parametrize("threads_mode", ["workers", "team"])
def test_a_chunk_that_returns_stop_drops_the_chunks_not_started(monkeypatch, threads_mode):
    monkeypatch.setenv("MAXSIM_CPU_THREADS", threads_mode)
    ran = []

    def work(c):
        ran.append(c)
        return engine.STOP if c == 2 else c * 2

    assert engine._run_chunks(lambda c: c * 2, list(range(8)), 2) == [c * 2 for c in range(8)]
    assert engine._run_chunks(work, list(range(64)), 2) is None
    assert 2 in ran and len(ran) < 64  # (a worker may have started one more chunk meanwhile)
    ran.clear()
    assert engine._run_chunks(work, list(range(64)), 1) is None and ran == [0, 1, 2]
