"""The blocked MaxSim forward in PyTorch: one large GEMM per chunk of documents, the max reduced on
that chunk, so the similarity tensor never exists beyond one chunk (``DEFAULT_CHUNK_BYTES``).

A call is a set of query rows ``q_rows [R, d]`` (every real query token of the call, fp32,
already normalised when asked) scored against document *slots*: slot ``n`` is a sequence of rows
of a token pool ``tokens [T, d]`` (``D`` viewed as ``[Nd * Ld, d]``, or a packed ``d``). For each
chunk of slots::

    C = tokens[rows of the chunk's slots]          # [b * L, d]   fp32 copy (or a view)
    S = C @ q_rows.T                               # [b * L, R]   one BLAS GEMM
    best = S.view(b, L, R).amax(1)                 # [b, R]       max over each slot's tokens
    scores[slots] = sum of best over each query's rows

Two plans lay the slots out:

- :class:`UniformPlan`: every slot has the same length and its rows are contiguous (dense
  documents without a document mask): a chunk is a view of ``tokens`` (no copy in fp32).
- :class:`GatheredPlan`: slots of any length, their rows listed (masked documents: only their
  real tokens are multiplied; packed documents; pairs). Slots are sorted by length, a chunk holds
  slots of similar lengths, and it is padded to its longest slot by *repeating* each slot's first
  real token: a repeated token never changes a max (and maps back to the token it repeats), so no
  mask is applied to ``S``. Empty slots are skipped (they score 0). A slot longer than a chunk
  is cut into pieces whose maxima are combined in order (ties to the earlier piece, NaN winning).
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

# Size of one chunk's S. Measured on a 2-core AVX-512 machine (docs/cpu.md): larger chunks were
# faster up to about this size (fewer, larger GEMMs; S is written and read back from L3).
DEFAULT_CHUNK_BYTES = 16 * 2**20
# Work per thread below which a call runs in the caller's thread alone.
_POOL_MIN_FLOPS = 32e6


@dataclass
class UniformPlan:
    """``n_slots`` slots of ``length`` contiguous rows each: slot n is rows ``n*length:(n+1)*length``
    of the pool. ``mul_mask``: float ``[n_slots, length]`` multiplied into S (mask_mode
    "multiply"), or None."""

    n_slots: int
    length: int
    mul_mask: torch.Tensor | None = None

    def total_rows(self) -> int:
        return self.n_slots * self.length

    def chunks(self, budget_cols: int):
        """Yield (slot ids slice, (first, last) row range, positions None, L, mul_mask chunk, None),
        or, for slots longer than ``budget_cols``, their pieces (..., (slot, offset of the piece))."""
        L = self.length
        if L > budget_cols:
            for n in range(self.n_slots):
                for t0 in range(0, L, budget_cols):
                    t1 = min(L, t0 + budget_cols)
                    mm = self.mul_mask[n:n + 1, t0:t1] if self.mul_mask is not None else None
                    yield slice(n, n + 1), (n * L + t0, n * L + t1), None, t1 - t0, mm, (n, t0)
            return
        b = max(1, budget_cols // max(L, 1))
        for s0 in range(0, self.n_slots, b):
            s1 = min(self.n_slots, s0 + b)
            mm = self.mul_mask[s0:s1] if self.mul_mask is not None else None
            yield slice(s0, s1), (s0 * L, s1 * L), None, L, mm, None


@dataclass
class GatheredPlan:
    """Slots of any length. Slot n is rows ``start[n] + pos[n, k]`` for ``k < length[n]``, where
    ``pos[n, k]`` is the k-th True position of ``mask[n]`` (``mask`` None: ``k`` itself). start,
    length: int64 ``[n_slots]``; mask: bool ``[n_slots, Lmax]`` with ``length`` = its row sums.
    Positions are found per chunk, so no index table the size of the documents is ever held."""

    start: torch.Tensor
    length: torch.Tensor
    mask: torch.Tensor | None = None

    def _positions(self, slots: torch.Tensor, L: int) -> torch.Tensor:
        """int64 ``[b, L]``: the first L real positions of each slot (past its length: anything)."""
        if self.mask is None:
            return torch.arange(L, device=slots.device).expand(slots.numel(), L)
        real_first = torch.sort((~self.mask[slots]).to(torch.uint8), dim=-1, stable=True).indices
        return real_first[:, :L]

    @property
    def n_slots(self) -> int:
        return self.start.numel()

    def total_rows(self) -> int:
        return int(self.length.clamp_min(0).sum())

    def chunks(self, budget_cols: int):
        """Yield (slot ids [b], row indices [b * L] into the pool, positions [b, L] (each row's
        token index inside its slot), L, None, None), or, for slots longer than ``budget_cols``,
        their pieces (..., (slot, offset of the piece))."""
        lengths, order = torch.sort(self.length, stable=True)
        lengths_host = lengths.tolist()
        n = len(lengths_host)
        s = 0
        while s < n and lengths_host[s] <= 0:  # empty slots (and invalid negative ones) score 0
            s += 1
        while s < n and lengths_host[s] <= budget_cols:
            # Slots of similar lengths: padding to the chunk's longest costs at most ~25 % more
            # rows (or 16 for short slots), and the chunk stays within the budget.
            cap = min(budget_cols, max(lengths_host[s] + 16, lengths_host[s] * 5 // 4))
            e = bisect.bisect_right(lengths_host, cap, lo=s)
            e = min(e, s + max(1, budget_cols // lengths_host[e - 1]))
            L = lengths_host[e - 1]
            slots = order[s:e]
            k = torch.arange(L, device=lengths.device)
            # Positions past a slot's length repeat its first real token (k -> 0).
            pos = self._positions(slots, L)  # [b, L]
            pos = torch.where(k[None, :] < lengths[s:e, None], pos, pos[:, :1])
            rows = self.start[slots, None] + pos  # [b, L]
            yield slots, rows.reshape(-1), pos, L, None, None
            s = e
        for slot, L in zip(order[s:].tolist(), lengths_host[s:]):  # the long ones, in pieces
            for t0 in range(0, L, budget_cols):
                t1 = min(L, t0 + budget_cols)
                pos = self._positions(order[s:s + 1].new_tensor([slot]), t1)[0, t0:t1]
                yield [slot], self.start[slot] + pos, pos[None, :], t1 - t0, None, (slot, t0)


def _chunk_columns(R: int, d: int, total_rows: int, chunk_bytes: int, *, copies: bool, workers: int) -> int:
    """Document rows per chunk: S ``[cols, R]`` fp32 within ``chunk_bytes``; where the chunk's rows
    are copied (to fp32, gathered or normalised) the copy ``[cols, d]`` within twice that; with
    ``workers`` > 1, at least three chunks per worker where the call is big enough (they take
    chunks as they free up, so a slowed core takes fewer). Scratch per thread: at most about
    3 x chunk_bytes, whatever the call."""
    cols = chunk_bytes // (4 * R)
    if copies:
        cols = min(cols, 2 * chunk_bytes // (4 * d))
    if workers > 1:
        cols = min(cols, max(256, -(-total_rows // (3 * workers))))
    return max(1, cols)


def _worker_init() -> None:
    # Thread-local: each worker runs its ops on one core, so no op waits at an OpenMP barrier
    # for a thread that a neighbour's process has descheduled.
    torch.set_num_threads(1)


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(n_threads: int) -> ThreadPoolExecutor:
    """A pool of ``n_threads`` single-threaded workers (one per process: a forked child makes its own)."""
    key = (os.getpid(), n_threads)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(n_threads, thread_name_prefix="maxsim-cpu", initializer=_worker_init)
    return _POOLS[key]


def _chunk_rowmax(q_t, row_query, n_queries, tokens, chunk, normalize, want_argmax, q_mul_mask):
    """One chunk: (scores [b, n_queries], winners [b, R] int32 or None); for a piece of a long
    slot: (its best [1, R], its winners [1, R] int64 or None)."""
    slots, rows, pos, L, mul_mask, piece = chunk
    with torch.no_grad():
        if not isinstance(rows, torch.Tensor):  # a (start, stop) range of contiguous rows
            rows = tokens[rows[0]:rows[1]]
        else:
            rows = tokens.index_select(0, rows)
        R = q_t.shape[1]
        b = rows.shape[0] // L
        rows = rows.float()
        if normalize:
            rows = rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        S = torch.mm(rows, q_t).view(b, L, R)  # [b, L, R]
        if mul_mask is not None:
            S.mul_(mul_mask.to(S.dtype)[:, :, None])  # PyLate's rule: masked similarities become 0
        if q_mul_mask is not None:
            S.mul_(q_mul_mask)
        win = None
        if want_argmax:
            best, win = S.max(dim=1)  # [b, R]; NaN wins, ties go to the lowest position
            win = pos.gather(1, win) if pos is not None else win + (piece[1] if piece is not None else 0)
        else:
            best = S.amax(dim=1)  # [b, R]; NaN propagates
        if piece is not None:
            return best, win
        if want_argmax:
            win = win.to(torch.int32)
        return _query_sums(best, row_query, n_queries), win


def _query_sums(best: torch.Tensor, row_query: torch.Tensor | None, n_queries: int) -> torch.Tensor:
    """best ``[b, R]`` -> ``[b, n_queries]``: the sum over each query's rows."""
    if row_query is None:
        return best.view(best.shape[0], n_queries, -1).sum(-1)
    out = torch.zeros(best.shape[0], n_queries, dtype=torch.float32, device=best.device)
    return out.index_add_(1, row_query, best)


@functools.cache
def _thread_local_threads() -> bool:
    """Whether torch.set_num_threads is per thread here (ATen's OpenMP backend: the OpenMP and MKL
    settings are thread-local). Elsewhere (the native backend) it is global, so it is left alone."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _threads_mode() -> str:
    mode = os.environ.get("MAXSIM_CPU_THREADS", "team").strip().lower() or "team"
    if mode not in ("team", "workers"):
        raise ValueError(f"maxsim: MAXSIM_CPU_THREADS must be 'team' or 'workers'; got {mode!r}")
    return mode


# What a chunk's work returns to drop the chunks not yet started (:func:`_run_chunks`).
STOP = object()


def _run_chunks(work, chunks: list, n_threads: int, on_cpu: bool = True, mode: str | None = None) -> list | None:
    """``[work(c) for c in chunks]`` with ``n_threads`` threads, as ``MAXSIM_CPU_THREADS`` says:

    - ``team`` (default): the chunks one after the other on the caller's thread, each op on its
      intra-op threads (one large GEMM per chunk: BLAS's own threading, as a plain einsum gets);
    - ``workers``: the caller's thread and ``n_threads - 1`` pool workers each take the next chunk
      as they free up, every op single-threaded: no op waits at a barrier for a thread that
      another process has descheduled (the faster choice on a shared, oversubscribed machine).

    ``n_threads == 1`` (a small call, or the caller's setting) runs on the caller's thread with one
    intra-op thread (its setting is restored). ``mode``: one of the two, whatever the setting
    (work made of many small GEMMs, which no intra-op team shares, takes ``workers``). Where a
    chunk's work returns ``STOP``, the chunks not yet started are dropped and the call returns None."""
    mode = mode or _threads_mode()
    if not on_cpu or (mode == "team" and n_threads > 1) or not _thread_local_threads():
        results = []
        for chunk in chunks:
            results.append(work(chunk))
            if results[-1] is STOP:
                return None
        return results
    results = [None] * len(chunks)
    todo = iter(enumerate(chunks))
    lock = threading.Lock()
    stop = threading.Event()

    def drain(worker: bool = False):
        if worker:
            # Per task, not once per thread: ATen's first parallel op on a thread re-reads the
            # process-wide count, which the caller may have restored since the thread started.
            torch.set_num_threads(1)
        try:
            while not stop.is_set():
                with lock:
                    nxt = next(todo, None)
                if nxt is None:
                    return
                results[nxt[0]] = work(nxt[1])
                if results[nxt[0]] is STOP:
                    stop.set()
        except BaseException:
            stop.set()
            raise

    helpers = []
    if n_threads > 1 and len(chunks) > 1:
        helpers = [_pool(n_threads - 1).submit(drain, True) for _ in range(n_threads - 1)]
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drain()
    finally:
        # Restore only once the workers are done: the count a thread's first parallel op reads is
        # the last one set anywhere in the process, and it must end as the caller's.
        errors = [f.exception() for f in helpers]
        torch.set_num_threads(own)
    for error in errors:
        if error is not None:
            raise error
    return None if any(r is STOP for r in results) else results


def rowmax_scores(
    q_rows: torch.Tensor,  # [R, d] fp32
    row_query: torch.Tensor | None,  # [R] int64 query of each row, or None: R = n_queries * rows_per_query
    n_queries: int,
    tokens: torch.Tensor,  # [T, d] any float dtype
    plan,
    *,
    normalize: bool = False,
    want_argmax: bool = False,
    q_mul_mask: torch.Tensor | None = None,  # [R] float, mask_mode "multiply"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
):
    """Scores ``[n_slots, n_queries]`` fp32 (sum over each query's rows of the max over the slot's
    tokens) and, with ``want_argmax``, the winners ``[n_slots, R]`` int32 (the token's index inside
    its slot; -1 for an empty slot). An empty slot scores 0. Threads: see :func:`_run_chunks`."""
    R = q_rows.shape[0]
    device = q_rows.device
    n_slots = plan.n_slots
    scores = torch.zeros(n_slots, n_queries, dtype=torch.float32, device=device)
    argmax = torch.full((n_slots, R), -1, dtype=torch.int32, device=device) if want_argmax else None
    if R == 0 or n_slots == 0:
        return scores, argmax
    q_t = q_rows.t()  # [d, R]
    n_threads = torch.get_num_threads() if device.type == "cpu" else 1
    workers = n_threads if _threads_mode() == "workers" else 1
    copies = not (isinstance(plan, UniformPlan) and tokens.dtype == torch.float32 and not normalize)
    budget_cols = _chunk_columns(R, q_rows.shape[1], plan.total_rows(), chunk_bytes, copies=copies, workers=workers)
    chunks = list(plan.chunks(budget_cols))
    work = functools.partial(_chunk_rowmax, q_t, row_query, n_queries, tokens, normalize=normalize,
                             want_argmax=want_argmax, q_mul_mask=q_mul_mask)
    flops = 2.0 * R * q_rows.shape[1] * plan.total_rows()
    if n_threads > 1 and flops < _POOL_MIN_FLOPS * n_threads:
        n_threads = 1  # a small call: the hand-offs would cost more than they share
    results = _run_chunks(work, chunks, n_threads, device.type == "cpu")
    long_best = long_win = None  # the running max of a long slot over its pieces, in order
    for chunk, (out, win) in zip(chunks, results):
        slots, piece = chunk[0], chunk[5]
        if piece is None:
            scores[slots] = out
            if want_argmax:
                argmax[slots] = win
            continue
        if piece[1] == 0:
            long_best, long_win = out, win
        elif want_argmax:
            # Strict '>' keeps the earlier piece on ties; a NaN wins over any number.
            upd = (out > long_best) | (out.isnan() & ~long_best.isnan())
            long_best, long_win = torch.where(upd, out, long_best), torch.where(upd, win, long_win)
        else:
            long_best = torch.maximum(long_best, out)  # NaN propagates
        if piece[1] + chunk[3] == _slot_length(plan, piece[0]):
            scores[slots] = _query_sums(long_best, row_query, n_queries)
            if want_argmax:
                argmax[slots] = long_win.to(torch.int32)
    return scores, argmax


def _slot_length(plan, slot: int) -> int:
    return plan.length if isinstance(plan, UniformPlan) else int(plan.length[slot])
