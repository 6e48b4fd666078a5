"""Sharded search over gloo with 2-4 CPU processes equals the one-process search."""

import os
import socket
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import maxsim

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 7, (61,), generator=g).tolist()
    # Integer values: exact sums, many ties across shards.
    docs = [torch.randint(-2, 3, (L, 8), generator=g).float() for L in lengths]
    queries = [torch.randint(-2, 3, (L, 8), generator=g).float() for L in (3, 5, 1, 0)]
    return docs, queries


def _worker(rank, world, port, seed, path, results):
    try:
        import datetime

        import torch.distributed as dist

        from maxsim.search import Corpus
        from maxsim.search.distributed import distributed_search

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        docs, queries = _inputs(seed)
        out = {}
        # The whole corpus, sharded by the function; and a memory-mapped file each rank maps.
        corpus = Corpus.from_list(docs, ids=[f"d{j}" for j in range(len(docs))])
        r = distributed_search(corpus, queries, 20, gpu_memory=4000, progress=False, device="cpu")
        out["memory"] = (r.scores, r.indices, r.ids)
        shard = Corpus.load(path, mmap=True).shard(rank, world)
        r = distributed_search(shard, queries, 100, progress=False, device="cpu")
        out["mmap"] = (r.scores, r.indices, r.ids)
        # an int8 first stage refined from the float tokens: each shard's 5 x 16 candidates hold all
        # of its documents, so the refined answer is the exact top-5
        coarse = Corpus.from_list(docs, ids=[f"d{j}" for j in range(len(docs))], encoding="int8")
        r = distributed_search(coarse, queries, 5, progress=False, device="cpu", refine=corpus, refine_factor=16)
        out["refined"] = (r.scores, r.indices, r.ids)
        stored = Corpus.load(path + "-int8", mmap=True)  # its refine/ folder: refine=True
        r = distributed_search(stored, queries, 5, progress=False, device="cpu", refine=True, refine_factor=16)
        out["stored refine"] = (r.scores, r.indices, r.ids)
        # a subset (ids, one set for every shard; an id no shard holds matches nothing)
        r = distributed_search(corpus, queries, 8, subset=[f"d{j}" for j in range(0, 61, 5)] + ["nope"],
                               progress=False, device="cpu")
        out["subset"] = (r.scores, r.indices, r.ids)
        results[rank] = out
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - reported by the parent
        results[rank] = traceback.format_exc()


@pytest.mark.skipif(sys.platform == "win32", reason="gloo spawn test")
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_sharded_equals_single_process(tmp_path, world):
    from maxsim.search import Corpus

    seed = int(torch.randint(0, 2**31, ()).item())
    docs, queries = _inputs(seed)
    path = tmp_path / "c"
    Corpus.from_list(docs, ids=[f"d{j}" for j in range(len(docs))]).save(path)
    Corpus.from_list(docs, ids=[f"d{j}" for j in range(len(docs))], encoding="int8").save(tmp_path / "c-int8")
    Corpus.from_list(docs, ids=[f"d{j}" for j in range(len(docs))]).save(tmp_path / "c-int8" / "refine")
    full = maxsim.maxsim_varlen(queries, docs)
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)

    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, seed, str(path), results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{len(hung)} of {world} ranks hung"
    for rank in range(world):
        out = results.get(rank)
        assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
        for mode, k in (("memory", 20), ("mmap", 100), ("refined", 5), ("stored refine", 5)):
            scores, indices, ids = out[mode]
            n = min(k, len(docs))
            assert torch.equal(indices, order[:, :n]), (rank, mode)
            assert torch.equal(scores, values[:, :n]), (rank, mode)
            assert ids == [[f"d{j}" for j in row] for row in order[:, :n].tolist()]
        scores, indices, ids = out["subset"]
        allowed = torch.arange(len(docs)) % 5 == 0
        sub_values, sub_order = torch.sort(full[:, allowed], stable=True, dim=-1, descending=True)
        want = torch.nonzero(allowed).flatten()[sub_order[:, :8]]
        assert torch.equal(indices, want) and torch.equal(scores, sub_values[:, :8]), rank
        assert ids == [[f"d{j}" for j in row] for row in want.tolist()]
