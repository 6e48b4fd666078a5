"""Sharded search with torch.distributed: every rank searches its shard, the ranks merge.

    import torch.distributed as dist
    dist.init_process_group("nccl")                       # or "gloo" (CPU)
    corpus = Corpus.load("corpus/", mmap=True)            # every rank maps the whole file ...
    result = distributed_search(corpus, Q, k=100)         # ... and reads only its shard

Each rank computes the exact top-k of its contiguous shard (global document indices), then the
``[Nq, k]`` (score, index) pairs of all ranks are all-gathered and merged with the same exact rule
as the chunks of one process (score desc, index asc: topk.merge_topk), so every rank returns the
result of a one-process search. Every rank passes the same queries.
"""

from __future__ import annotations

import numpy as np
import torch

from maxsim.search.corpus import Corpus, SearchResult
from maxsim.search.topk import check_k, merge_topk


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_search(corpus: Corpus, Q, k: int, *, q_mask=None, subset=None, refine=None, refine_factor: int = 4,
                       group=None, batch_size=None, gpu_memory=None, progress=None, device=None) -> SearchResult:
    """Exact top-k over a corpus sharded across the ranks of ``group`` (default: the world).

    ``corpus``: the whole corpus (each rank takes ``corpus.shard(rank, world_size)``: views, so a
    memory-mapped corpus reads only that range), or this rank's shard from ``Corpus.shard``.
    ``refine`` (a Corpus of the same documents, whole or this rank's shard, or True: the one stored
    with the corpus): each rank keeps its shard's ``k * refine_factor`` candidates and rescores
    them from its range of ``refine`` before the ranks merge, so the answer is the exact top-k of
    the union of every shard's candidates (at least one process's candidates, often more).
    ``subset`` (ids, one set for every query) and the other arguments as :meth:`Corpus.search`. Returns the same ``SearchResult`` on every rank.
    """
    from maxsim.search.refine import refined_search

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("maxsim: distributed_search needs torch.distributed initialised (init_process_group)")
    k = check_k(k)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if corpus.shard_info is None:
        shard = corpus.shard(rank, world)
    else:
        shard_rank, shard_world, _ = corpus.shard_info
        if (shard_rank, shard_world) != (rank, world):
            raise ValueError(f"maxsim: this rank is {rank} of {world} but the corpus is shard {shard_rank} of {shard_world}")
        shard = corpus
    total = shard.shard_info[2]

    squeeze = isinstance(Q, torch.Tensor) and Q.dim() == 2
    if squeeze:
        Q = Q[None]
        q_mask = None if q_mask is None else q_mask[None]
    if isinstance(refine, Corpus) and refine.shard_info is None:
        refine = refine.shard(rank, world)  # the same documents: the same token-balanced ranges
    if len(shard):
        scores, indices = refined_search(shard, Q, k, q_mask=q_mask, refine=refine, refine_factor=refine_factor,
                                         batch_size=batch_size, gpu_memory=gpu_memory, progress=progress,
                                         device=device, subset=subset)
    else:
        n = len(Q) if isinstance(Q, (list, tuple)) else Q.shape[0]
        scores, indices = torch.empty(n, 0), torch.empty(n, 0, dtype=torch.int64)
    Nq = scores.shape[0]
    # Equal shapes for all_gather: pad to [Nq, k] with "no document" (-1, -inf).
    comm = _collective_device(group)
    padded_scores = torch.full((Nq, k), float("-inf"), dtype=torch.float32, device=comm)
    padded_indices = torch.full((Nq, k), -1, dtype=torch.int64, device=comm)
    padded_scores[:, : scores.shape[1]] = scores.to(comm)
    padded_indices[:, : indices.shape[1]] = indices.to(comm)
    all_scores = [torch.empty_like(padded_scores) for _ in range(world)]
    all_indices = [torch.empty_like(padded_indices) for _ in range(world)]
    dist.all_gather(all_scores, padded_scores, group=group)
    dist.all_gather(all_indices, padded_indices, group=group)
    merged_scores, merged_indices = merge_topk(torch.cat(all_scores, 1), torch.cat(all_indices, 1), k)
    width = min(k, total, int((merged_indices >= 0).sum(1).max()) if Nq else 0)  # a subset may hold fewer
    merged_scores, merged_indices = merged_scores[:, :width].cpu(), merged_indices[:, :width].cpu()

    ids = _gather_ids(shard, indices, merged_indices, group, world)
    out_device = torch.device(device) if device is not None else scores.device
    result = SearchResult(merged_scores.to(out_device), merged_indices.to(out_device), ids)
    if squeeze:
        return SearchResult(result.scores[0], result.indices[0], result.ids[0])
    return result


def _gather_ids(shard: Corpus, local_indices: torch.Tensor, merged: torch.Tensor, group, world: int):
    """Document ids of the merged global indices: each rank knows the ids of its own winners."""
    import torch.distributed as dist

    local = local_indices.cpu()
    mine = {}
    if local.numel():
        ids = shard.ids_of(local)
        flat_ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else [x for row in ids for x in row]
        mine = dict(zip(local.reshape(-1).tolist(), flat_ids))
    gathered = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    table = {}
    for part in gathered:
        table.update(part)
    table[-1] = -1 if isinstance(shard.ids, np.ndarray) else None  # no answer
    rows = [[table[j] for j in row] for row in merged.tolist()]
    if isinstance(shard.ids, np.ndarray):
        return torch.tensor(rows, dtype=torch.int64).reshape(merged.shape)
    return rows
