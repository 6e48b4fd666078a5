"""Searching a corpus chunk by chunk: GPU-resident, host-resident (pinned) or memory-mapped.

A host corpus streams to the GPU in chunks sized to a memory budget, double-buffered::

    copy stream:    H2D chunk 0 | H2D chunk 1 | H2D chunk 2 (waits until chunk 0's buffer is free) ...
    compute stream:             | score 0     | score 1     | score 2 ...
                                  (each waits for its chunk's copy: events)

Every query batch is scored against a chunk while it is resident (query batching is where the
compute-bound kernel pays) and merged into a running top-k (topk.RunningTopK: exact ties). A
memory-mapped (or unpinned) corpus is first read by a worker thread into one of two pinned staging
buffers, so that reading the file, the copy and the scoring overlap. The host keeps at most two
chunks in flight, which bounds the GPU memory and makes the progress bar and Ctrl-C prompt. On the
CPU (or for a corpus already on the device) the same loop runs on views, without streams.

An int8 / fp8 corpus streams its one-byte values and fp32 scales together (d + 4 bytes a token)
and each chunk is scored by ``maxsim.compressed.quantized.maxsim_quantized_varlen``. A residual
corpus streams its codes and packed residuals together (d * nbits / 8 + 4 bytes a token), each
chunk scored by ``maxsim.compressed.maxsim_residual_varlen`` (decoded on chip by the stream kernel
on CUDA, a bounded chunk at a time elsewhere); a PQ corpus streams its codes (m bytes a token),
each chunk scored by ``maxsim.compressed.maxsim_pq_varlen``. Their codec is moved to the scoring
device once per search.

Deleted documents and a ``subset`` filter: the candidates (a host bool per document) go to the
scoring device once per search; a chunk without one is not scored, and in the others a
non-candidate's column gets index -1 before the running top-k, which keys it below every real
document (topk.order_keys), so it is never selected ahead of one; the result is cut to
min(k, candidates) columns. Exact, and per chunk only two small device ops (no host read).
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from maxsim._progress import progress_bar
from maxsim.search.topk import MAX_DOCUMENTS, SCRATCH_BYTES_PER_SCORE, RunningTopK, check_k, choose_chunk_documents
from maxsim.varlen.queries import packed_queries

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QueryDtypeWarning(UserWarning):
    """Queries of another float dtype than a float corpus's were converted to its dtype."""


# Share of the budget for the two chunk buffers (the rest: scores, top-k state, kernel scratch).
_BUFFER_SHARE = 0.5
_CPU_DEFAULT_BUDGET = 1 << 30


def default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        from maxsim.tuning import free_device_bytes

        return free_device_bytes(device) // 4
    return _CPU_DEFAULT_BUDGET


def choose_device(corpus, Q, device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if corpus.device.type != "cpu":
        return corpus.device
    q_device = Q[0].device if isinstance(Q, (list, tuple)) and Q and isinstance(Q[0], torch.Tensor) else getattr(Q, "device", None)
    if q_device is not None and q_device.type != "cpu":
        return q_device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def plan_chunks(offsets: np.ndarray, max_tokens: int, max_documents: int,
                longest: int | None = None) -> list[tuple[int, int]]:
    """Split documents ``0 .. len(offsets) - 2`` into contiguous chunks of at most ``max_tokens``
    tokens and ``max_documents`` documents, balanced (about equal token counts) so that no chunk is
    a small remainder. ``longest``: the longest document's tokens, when known.
    -> ``[(start, stop), ...]``."""
    n = offsets.size - 1
    if n == 0:
        return []
    longest = int(np.diff(offsets).max()) if longest is None else int(longest)
    total = int(offsets[-1])
    if total <= max_tokens and n <= max_documents:  # one chunk (a resident corpus): no pass over the offsets
        return [(0, n)]
    if longest > max_tokens:
        raise ValueError(f"maxsim: a document of {longest} tokens does not fit the chunk buffer of {max_tokens} "
                         "tokens: raise gpu_memory")
    # Equal token targets leave each chunk at most one document over its share.
    room = max(max_tokens - longest, 1)
    count = max(math.ceil(total / room) if total else 1, math.ceil(n / max_documents), 1)
    while True:
        targets = total * np.arange(1, count) / count
        bounds = np.concatenate([[0], np.searchsorted(offsets, targets, side="left"), [n]]).astype(np.int64)
        bounds = np.maximum.accumulate(np.clip(bounds, 0, n))
        bounds = np.unique(bounds)
        chunks = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            # Too many (e.g. empty) documents in one token share: split it evenly.
            parts = math.ceil((b - a) / max_documents)
            edges = np.linspace(a, b, parts + 1).round().astype(np.int64)
            chunks.extend((int(x), int(y)) for x, y in zip(edges[:-1], edges[1:]) if y > x)
        if all(offsets[b] - offsets[a] <= max_tokens for a, b in chunks):
            return chunks
        count += 1  # pragma: no cover - the room above makes the first plan fit


class _Plan:
    """Budget -> chunk buffer size (tokens), documents per chunk, queries per batch."""

    def __init__(self, budget: int, num_queries: int, k: int, query_bytes: int, token_bytes: int,
                 mean_length: float, streamed: bool, batch_size: int | None):
        state = 3 * num_queries * k * 12  # running keys + scores, and the merge's temporaries
        rest = budget - query_bytes - state
        if rest <= 0:
            raise ValueError(f"maxsim: gpu_memory={budget} bytes does not hold the queries and the top-k state "
                             f"({query_bytes + state} bytes): raise it or search fewer queries at a time")
        buffer_bytes = int(rest * _BUFFER_SHARE) if streamed else 0
        self.max_tokens = max(1, buffer_bytes // (2 * token_bytes)) if streamed else None
        score_elements = max(1, (rest - buffer_bytes) // SCRATCH_BYTES_PER_SCORE)
        docs_in_buffer = (self.max_tokens / max(mean_length, 1.0)) if streamed else None
        if batch_size is None:
            wanted = docs_in_buffer if streamed else min(score_elements // max(num_queries, 1), 2**20)
            batch_size = max(1, min(num_queries, int(score_elements // max(wanted, max(k, 1)))))
        self.batch_size = max(1, int(batch_size))
        self.score_bytes = score_elements * SCRATCH_BYTES_PER_SCORE


def search_corpus(corpus, Q, k, *, q_mask=None, batch_size=None, gpu_memory=None, progress=None, device=None,
                  running: list | None = None, subset=None):
    """Top-k of ``corpus`` for the queries ``Q`` -> ``(scores [Nq, k'], global indices [Nq, k'])``.
    The corpus's deleted documents are never ranked; ``subset``: ids, the only documents ranked.

    ``running``: for sharded search, a list to receive the per-batch RunningTopK instead of results
    (a non-candidate may sit there with index -1).
    """
    k = check_k(k)
    candidates = corpus._candidate_mask(subset)  # host bool [N] or None (every document)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"maxsim: batch_size must be a positive int; got {batch_size!r}")
    if gpu_memory is not None and (isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or gpu_memory <= 0):
        raise ValueError(f"maxsim: gpu_memory must be a positive number of bytes; got {gpu_memory!r}")
    device = choose_device(corpus, Q, device)
    squeeze = not isinstance(Q, (list, tuple)) and isinstance(Q, torch.Tensor) and Q.dim() == 2
    if isinstance(Q, np.ndarray):
        Q = torch.from_numpy(Q)
    q, cu_q, cu_q_host, max_q = packed_queries(Q, q_mask)
    encoding = corpus.encoding
    wanted = encoding.scoring_dtype()  # a float corpus's own dtype; None: queries as they are
    if q.dtype not in _QUERY_DTYPES:
        held = f"holds {corpus.dtype}" if wanted is not None else f"of {encoding} tokens takes"
        raise TypeError(f"maxsim: the queries are {q.dtype} but {corpus.name()} {held}"
                        f"{': pass' if wanted is not None else ''} float16, bfloat16 or float32 queries")
    if wanted is not None and q.dtype != wanted:
        # an encoder's fp32 output against an fp16 corpus: scored in the corpus's dtype, said once a place
        warnings.warn(f"maxsim: {str(q.dtype).replace('torch.', '')} queries converted to the "
                      f"{str(wanted).replace('torch.', '')} of {corpus.name()}", QueryDtypeWarning, stacklevel=3)
        q = q.to(wanted)
    if q.shape[1] != corpus.dim:
        raise ValueError(f"maxsim: the queries have d={q.shape[1]} but {corpus.name()} has d={corpus.dim}")
    if corpus.base_index + len(corpus) >= MAX_DOCUMENTS:
        raise ValueError(f"maxsim: search supports fewer than {MAX_DOCUMENTS} documents")
    q, cu_q = q.to(device), cu_q.to(device)
    Nq = cu_q_host.size - 1

    streamed = device.type == "cuda" and corpus.device.type == "cpu"
    # codes on the host, every segment's look-up layout on this GPU (Corpus.to(..., lookup_only=True)):
    # batches the look-up scorer serves read the layouts alone, nothing streamed
    has_layouts = streamed and all(s.lookup_on(device) is not None for s in corpus.segments)
    layouts_only = has_layouts  # False below when a batch the layouts cannot serve streams the codes
    budget = int(gpu_memory) if gpu_memory is not None else default_budget(device)
    # bytes a token takes in a chunk buffer: its embedding, its one-byte values and fp32 scale, or its codes
    # (and residual bytes)
    token_bytes = corpus.bytes_per_token
    codec = corpus.codec
    if codec is not None and codec.device != device:  # once per search, not once per chunk
        codec = codec.to(device)

    def plan_batches(stream_plan: bool, resident: bool):
        """The chunk plan (for streaming when ``stream_plan``) and the query batches, each in the
        encoding's form (``resident``: the look-up scorer's choice where it serves the batch)."""
        plan = _Plan(budget, Nq, k, q.numel() * q.element_size(), token_bytes,
                     corpus.num_tokens / max(len(corpus), 1), stream_plan, batch_size)
        batches = []  # (q_batch, cu_batch, max_q of batch, queries of the batch as [L_i, d] views, RunningTopK)
        for b0 in range(0, Nq, plan.batch_size):
            b1 = min(Nq, b0 + plan.batch_size)
            t0, t1 = int(cu_q_host[b0]), int(cu_q_host[b1])
            cu_b = torch.from_numpy(cu_q_host[b0:b1 + 1] - t0).to(device)
            max_b = int(np.diff(cu_q_host[b0:b1 + 1]).max()) if b1 > b0 else 0
            # the encoding's form of the batch, built once a search
            views = encoding.query_batch(q[t0:t1], cu_b, max_b, cu_q_host[b0:b1 + 1] - t0, codec=codec,
                                         resident=resident, layouts=has_layouts)
            batches.append((q[t0:t1], cu_b, max_b, views, RunningTopK(b1 - b0, k, device)))
        return plan, batches

    plan, batches = plan_batches(streamed and not layouts_only, not streamed or layouts_only)
    if layouts_only and any(views[2] is None for *_, views, _ in batches):
        # a batch the layouts cannot serve: the codes stream as from any host corpus (the batches
        # the look-up scorer serves still read the layouts)
        layouts_only = False
        plan, batches = plan_batches(True, True)
    elif layouts_only:
        streamed = False  # no chunk's codes are read: score_chunk scores the layouts

    # The work: (segment, start, stop) chunks of every segment.
    max_tokens = plan.max_tokens or max(corpus.num_tokens, 1)
    max_documents = choose_chunk_documents(plan.batch_size, max(len(corpus), 1), k, corpus.num_tokens / max(len(corpus), 1),
                                           device, plan.score_bytes)
    work = [(s, a, b) for s in corpus.segments for a, b in plan_chunks(s.offsets, max_tokens, max_documents, s.longest)]
    width, allowed = min(k, len(corpus)), None
    if candidates is not None:
        width = min(k, int(candidates.sum()))
        before = np.concatenate([[0], np.cumsum(candidates, dtype=np.int64)])  # candidates before each document
        work = [(s, a, b) for s, a, b in work if before[s.first_document + b] > before[s.first_document + a]]
        allowed = torch.from_numpy(candidates).to(device)  # once a search
    bar = progress_bar(progress, sum(b - a for _, a, b in work), "maxsim search", "doc")

    def score(chunk, segment, start: int, stop: int, token_base: int) -> None:
        """``chunk``: the segment's rows from ``token_base``, ``(embeddings,)``, ``(values, scales)``,
        ``(codes, residuals)`` or ``(codes,)``."""
        columns = corpus.base_index + segment.first_document + start
        if allowed is not None:  # a non-candidate's index -1: below every document in the top-k
            first = segment.first_document + start
            columns = torch.arange(columns, columns + stop - start, device=device)
            columns = columns.masked_fill_(~allowed[first:first + stop - start], -1)[None]  # [1, c]
        for q_b, cu_b, max_b, views, top in batches:
            scores = encoding.score_chunk(views, (q_b, cu_b, max_b), chunk, segment, start, stop, token_base,
                                          device=device, codec=codec)
            top.update(scores, columns if allowed is None else columns.expand(scores.shape[0], -1))

    try:
        if streamed:
            _stream(work, score, device, plan.max_tokens, corpus.segments[0].parts(), bar)
        else:
            for segment, start, stop in work:
                parts = segment.parts()
                if layouts_only:
                    score(None, segment, start, stop, 0)
                elif parts[0].device != device:  # a GPU corpus searched on the CPU (or another GPU)
                    t0, t1 = int(segment.offsets[start]), int(segment.offsets[stop])
                    score(tuple(p[t0:t1].to(device) for p in parts), segment, start, stop, t0)
                else:
                    score(parts, segment, start, stop, 0)
                if bar is not None:
                    bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()

    if running is not None:
        running.extend(top for *_, top in batches)
        return None
    if batches:
        scores = torch.cat([top.result()[0] for *_, top in batches], 0)[:, :width]
        indices = torch.cat([top.result()[1] for *_, top in batches], 0)[:, :width]
    else:
        scores = torch.empty(0, width, dtype=torch.float32, device=device)
        indices = torch.empty(0, width, dtype=torch.int64, device=device)
    if squeeze:
        return scores[0], indices[0]
    return scores, indices


def _is_pinned(segment) -> bool:
    return all(t.is_pinned() for t in segment.parts())


def _stream(work, score, device, max_tokens: int, templates, bar) -> None:
    """Double-buffered host-to-device streaming of ``work`` chunks; ``score`` runs on the current
    stream with the chunk's device buffers. ``templates``: a segment's per-token tensors
    (``(embeddings [t, d],)`` or ``(values [t, d], scales [t])``), whose row shapes and dtypes the
    buffers take; every part of a chunk is copied with the same events."""
    if not work:
        return
    compute = torch.cuda.current_stream(device)
    copy_stream = torch.cuda.Stream(device)

    def empty(**where):  # one buffer per part: [cap, d] (and [cap])
        return [torch.empty((max_tokens,) + tuple(t.shape[1:]), dtype=t.dtype, **where) for t in templates]

    buffers = [empty(device=device) for _ in range(2)]
    # The buffers' memory may have been freed by work still queued on the compute stream (the
    # caller's previous kernels): the copy stream starts behind it, or its first copies race them.
    copy_stream.wait_stream(compute)
    copied = [torch.cuda.Event() for _ in range(2)]  # chunk j's copy into buffers[j % 2] done
    consumed = [torch.cuda.Event() for _ in range(2)]  # scoring of the chunk in buffers[j % 2] done
    staged_free = [torch.cuda.Event() for _ in range(2)]  # copy out of staging[j % 2] done
    needs_staging = any(not _is_pinned(seg) for seg, _, _ in work)
    staging = [empty(pin_memory=True) for _ in range(2)] if needs_staging else None
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maxsim-read") if needs_staging else None
    pending = {}  # j -> future of the staging read

    def rows(j):
        segment, start, stop = work[j]
        return segment, int(segment.offsets[start]), int(segment.offsets[stop])

    def read(j):  # worker thread: file / pageable memory -> pinned staging[j % 2]
        segment, t0, t1 = rows(j)
        staged_free[j % 2].synchronize()  # the copy of chunk j - 2 has left this staging buffer
        for buffer, part in zip(staging[j % 2], segment.parts()):
            buffer[: t1 - t0].copy_(part[t0:t1])

    def stage(j):
        if j < len(work) and needs_staging and not _is_pinned(work[j][0]):
            pending[j] = reader.submit(read, j)

    def upload(j):
        segment, t0, t1 = rows(j)
        b = j % 2
        if j in pending:
            pending.pop(j).result()
            sources = [buffer[: t1 - t0] for buffer in staging[b]]
        else:
            sources = [part[t0:t1] for part in segment.parts()]
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_event(consumed[b])  # scoring of chunk j - 2 has left buffers[b]
            for buffer, source in zip(buffers[b], sources):
                buffer[: t1 - t0].copy_(source, non_blocking=True)
            copied[b].record(copy_stream)
            staged_free[b].record(copy_stream)

    try:
        stage(0)
        stage(1)
        upload(0)
        for j in range(len(work)):
            segment, start, stop = work[j]
            b = j % 2
            compute.wait_event(copied[b])
            score(buffers[b], segment, start, stop, int(segment.offsets[start]))
            consumed[b].record(compute)
            if j + 1 < len(work):
                upload(j + 1)
            stage(j + 2)
            if j >= 1:
                consumed[(j - 1) % 2].synchronize()  # at most two chunks in flight
                if bar is not None:
                    prev = work[j - 1]
                    bar.update(prev[2] - prev[1])
        consumed[(len(work) - 1) % 2].synchronize()
        if bar is not None:
            bar.update(work[-1][2] - work[-1][1])
    finally:
        # Ctrl-C or an error: let the device finish with the buffers before they are freed.
        if reader is not None:
            for future in pending.values():
                future.cancel()
            reader.shutdown(wait=True)
        copy_stream.synchronize()
        compute.synchronize()
        for parts in buffers:
            for buffer in parts:
                buffer.record_stream(copy_stream)
