"""The server's state and work, independent of the web framework.

One corpus, loaded from its folder, and one lock: a search and a write never run at the same time,
so every search sees a whole write or none of it. Searches are batched: concurrent requests wait in
a queue, and the loop takes every request that arrived while the previous search ran (up to
``max_batch`` queries, after at most ``max_wait_s`` more), and answers them with one
``Corpus.search`` call (the largest k among them, then each request's own k). Requests with a
``subset`` are searched in a batch of those with the same subset.

With a text model (``model=PATH``: a local PyLate / Sentence Transformers 6 multi-vector folder,
see :mod:`maxsim.serve.encoder`), requests may send texts instead of token arrays: they are encoded
per request in a worker thread (outside the corpus lock), then take the same batched search or
durable append as arrays do.

Writes are durable before they are acknowledged: an append or a delete is applied in memory, then
saved to the corpus folder (``Corpus.save(path, overwrite=True)`` writes only the change, fsyncs it
and commits it by renaming the manifest); a failed save restores the folder's state. A process
killed at any moment restarts from the last committed manifest.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_K = 10_000


class RequestError(ValueError):
    """A request the server refuses: ``status`` (4xx) and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _Pending:
    queries: list  # [L_i, d] tensors
    k: int
    subset: tuple | None
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


class Service:
    """A corpus folder served: :meth:`search` (batched, async), :meth:`append` and :meth:`delete`
    (durable, blocking: run them in a thread), :meth:`stats`.

    Args:
        path: the corpus folder (``python -m maxsim index`` or ``Corpus.save`` wrote it).
        device: where to search (default: CUDA when available, else the CPU).
        load: ``"device"`` (the corpus resident on ``device``), ``"mmap"`` or ``"host"``.
        max_batch: queries searched together at most.
        max_wait_s: how long the loop waits for more requests after the first (0: it takes what
            arrived while the previous search ran, and no more).
        model: a local multi-vector model folder (PyLate ``ColBERT``, or Sentence Transformers 6
            ``MultiVectorEncoder``) whose output d is the corpus's: :meth:`encode_queries` and
            :meth:`encode_documents` then turn texts into token arrays. None: token arrays only.
    """

    def __init__(self, path, *, device=None, load: str = "device", max_batch: int = 32, max_wait_s: float = 0.0005,
                 model=None):
        if load not in ("device", "mmap", "host"):
            raise ValueError(f"maxsim: load must be device, mmap or host; got {load!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"maxsim: max_batch must be a positive int; got {max_batch!r}")
        if not (isinstance(max_wait_s, (int, float)) and 0 <= max_wait_s <= 1):
            raise ValueError(f"maxsim: max_wait_s must be in [0, 1] seconds; got {max_wait_s!r}")
        self.path = str(path)
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.load_mode, self.max_batch, self.max_wait_s = load, max_batch, float(max_wait_s)
        self.corpus = self._load()
        self.encoder = None
        if model is not None:
            from .encoder import TextEncoder

            self.encoder = TextEncoder(model, device=self.device)
            if self.encoder.dim != self.dim:
                raise ValueError(f"maxsim: the model {self.encoder.path} encodes d={self.encoder.dim} but the corpus "
                                 f"{self.path} has d={self.dim}: serve a corpus that this model encoded")
        self.lock = threading.Lock()
        self._queue: asyncio.Queue | None = None
        self._loop_task = None
        self.started = time.time()
        self.searches = self.queries_served = self.appended = self.deleted = 0
        self._recent = collections.deque(maxlen=4096)  # (time, queries) of recent searches

    # -- the corpus -----------------------------------------------------------------------------

    def _load(self):
        from maxsim.search import Corpus

        return Corpus.load(self.path, mmap=self.load_mode != "host",
                           device=self.device if self.load_mode == "device" else None)

    @property
    def dim(self) -> int:
        return self.corpus.dim

    @property
    def model_path(self) -> str | None:
        return None if self.encoder is None else self.encoder.path

    # -- texts ----------------------------------------------------------------------------------

    def check_text(self, text) -> list[str]:
        """A request's ``text``: a non-empty list of strings, and a server with a model."""
        if self.encoder is None:
            raise RequestError("text needs a model, and this server was started without --model: send token "
                               "arrays, or restart it with --model PATH")
        if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
            raise RequestError("text must be a non-empty list of strings")
        return text

    def encode_queries(self, texts: list[str]) -> list:
        """Query texts (checked by :meth:`check_text`) -> ``[L_i, d]`` float32 tensors, as
        :meth:`check_queries` gives them (blocking: run it in a thread)."""
        return [self._tokens(a, f"text {i}") for i, a in enumerate(self._encode(self.encoder.queries, texts))]

    def encode_documents(self, texts: list[str]) -> list:
        """Document texts -> ``[L_i, d]`` float32 tensors, as :meth:`check_documents` gives them."""
        return [self._tokens(a, f"text {i}", empty_ok=True)
                for i, a in enumerate(self._encode(self.encoder.documents, texts))]

    @staticmethod
    def _encode(side, texts: list[str]) -> list:
        try:
            return side(texts)
        except Exception as err:
            raise RuntimeError(f"maxsim: the model failed to encode the text: {_one_line(err)}") from None

    # -- searching ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loop (in the running event loop)."""
        self._queue = asyncio.Queue()
        self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass

    def check_queries(self, queries) -> list:
        """``queries``: an array ``[Nq, Lq, d]`` / ``[Lq, d]`` or a list of ``[L_i, d]`` -> a list of
        float32 tensors; a RequestError says what is wrong."""
        if isinstance(queries, np.ndarray) and queries.dtype != object:
            if queries.ndim == 2:
                queries = queries[None]
            if queries.ndim != 3:
                raise RequestError(f"queries must be [Nq, Lq, d] or [Lq, d]; got shape {list(queries.shape)}")
            items = list(queries)
        elif isinstance(queries, list):
            items = queries
        else:
            raise RequestError("queries must be a list of [Lq][d] arrays (or a base64 .npy in queries_npy)")
        if not items:
            raise RequestError("queries is empty: send at least one query")
        out = [self._tokens(q, f"query {i}") for i, q in enumerate(items)]
        return out

    @staticmethod
    def check_k(k) -> int:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise RequestError(f"k must be an int in [1, {MAX_K}]; got {k!r}")
        return k

    def check_subset(self, subset):
        if subset is None:
            return None
        if not isinstance(subset, list) or not subset:
            raise RequestError("subset must be a non-empty list of document ids")
        if isinstance(self.corpus.ids, np.ndarray):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in subset):
                raise RequestError("subset must list int ids: this corpus's ids are ints")
        elif not all(isinstance(x, str) for x in subset):
            raise RequestError("subset must list string ids: this corpus's ids are strings")
        return tuple(subset)

    async def search(self, queries: list, k: int, subset=None) -> list[tuple[list, list]]:
        """Each query's ``(ids, scores)``, best first, batched with concurrent requests."""
        if self._queue is None:
            raise RuntimeError("maxsim: Service.start() was not called")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, k, subset, future))
        return await future

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            batch, count = [first], len(first.queries)
            deadline = loop.time() + self.max_wait_s
            while count < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), left)
                    except asyncio.TimeoutError:
                        break
                batch.append(item)
                count += len(item.queries)
            groups = collections.defaultdict(list)
            for item in batch:
                groups[item.subset].append(item)
            for subset, items in groups.items():
                try:
                    answers = await asyncio.to_thread(self._search_batch, items, subset)
                except Exception as err:  # every waiting request learns why
                    for item in items:
                        if not item.future.done():
                            item.future.set_exception(err)
                    continue
                for item, answer in zip(items, answers):
                    if not item.future.done():
                        item.future.set_result(answer)

    def _search_batch(self, items: list, subset) -> list:
        queries = [q for item in items for q in item.queries]
        k = max(item.k for item in items)
        with self.lock:
            corpus = self.corpus
            result = corpus.search(queries, k, progress=False, device=self.device,
                                   subset=None if subset is None else list(subset))
        scores = result.scores.float().cpu()
        if torch.isnan(scores).any():
            raise RuntimeError("maxsim: a document of the corpus scores NaN (a NaN or infinite token): rebuild it "
                               "from finite embeddings")
        ids = result.ids.tolist() if isinstance(result.ids, torch.Tensor) else result.ids
        scores = scores.tolist()
        answers, row = [], 0
        for item in items:
            n = len(item.queries)
            answers.append([(ids[r][:item.k], scores[r][:item.k]) for r in range(row, row + n)])
            row += n
        now = time.perf_counter()
        self.searches += 1
        self.queries_served += len(queries)
        self._recent.append((now, len(queries)))
        return answers

    # -- writing --------------------------------------------------------------------------------

    def check_documents(self, ids, documents) -> tuple[list, list]:
        if not isinstance(documents, list):
            raise RequestError("ids and documents must be lists of the same length")
        ids = self.check_ids(ids, len(documents), "documents")
        return ids, [self._tokens(d, f"document {i}", empty_ok=True) for i, d in enumerate(documents)]

    def check_ids(self, ids, count: int, what: str = "documents") -> list:
        """The ids of ``count`` new documents (``what``: "documents" or "texts", for the message)."""
        if not isinstance(ids, list):
            raise RequestError(f"ids and {what} must be lists of the same length")
        if len(ids) != count or not ids:
            raise RequestError(f"give one id per document: {len(ids)} ids, {count} {what}")
        int_ids = isinstance(self.corpus.ids, np.ndarray)
        if int_ids and not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise RequestError("ids must be ints: this corpus's ids are ints")
        if not int_ids and not all(isinstance(x, str) for x in ids):
            raise RequestError("ids must be strings: this corpus's ids are strings")
        if len(set(ids)) != len(ids):
            raise RequestError("ids must be unique within a request")
        return ids

    def _tokens(self, x, what: str, empty_ok: bool = False) -> torch.Tensor:
        """One request's ``[L][d]`` array (a query, or a document, which may be empty) as a float32
        tensor; a RequestError names ``what`` is wrong with it."""
        try:
            a = np.asarray(x, dtype=np.float32)
        except (TypeError, ValueError):
            raise RequestError(f"{what} is not a [L][d] array of numbers") from None
        if a.ndim != 2 or (a.shape[0] == 0 and not empty_ok):
            raise RequestError(f"{what} must be [L][d] with L >= 1; got shape {list(a.shape)}")
        if a.shape[1] != self.dim:
            raise RequestError(f"{what} has d={a.shape[1]} but the corpus has d={self.dim}")
        if not np.isfinite(a).all():
            raise RequestError(f"{what} holds a NaN or infinite value")
        return torch.from_numpy(np.ascontiguousarray(a))

    def append(self, ids: list, documents: list) -> int:
        """Append documents (checked by :meth:`check_documents`) and commit them to the folder;
        returns the live document count."""
        with self.lock:
            corpus = self.corpus
            if corpus.encoding.exact:  # a float corpus stores its own dtype; the others encode floats
                documents = [d.to(corpus.dtype) for d in documents]
            try:  # (append checks everything before it changes the corpus)
                corpus.append(documents, ids=ids if isinstance(corpus.ids, list) else np.asarray(ids, dtype=np.int64))
            except (ValueError, TypeError) as err:
                if "already" in str(err):  # an update is a delete, then an append
                    raise RequestError(_one_line(err).split(" (")[0] + ": to replace it, DELETE /documents its id "
                                       "first", status=409) from None
                raise RequestError(_one_line(err)) from None
            self._commit()
            self.appended += len(ids)
            return self.corpus.num_live

    def delete(self, ids: list) -> int:
        """Delete documents by id (unknown ones are skipped) and commit; returns how many."""
        if not isinstance(ids, list) or not ids:
            raise RequestError("ids must be a non-empty list")
        with self.lock:
            try:  # (delete checks the ids before it marks any)
                count = self.corpus.delete(ids, missing="ignore")
            except (ValueError, TypeError) as err:
                raise RequestError(_one_line(err)) from None
            if count:
                self._commit()
            self.deleted += count
            return count

    def _commit(self) -> None:
        """Save the in-memory change to the folder (atomic, fsynced); on failure reload the folder's
        state, so memory never runs ahead of what a restart would serve."""
        try:
            self.corpus.save(self.path, overwrite=True)
        except BaseException:
            self.corpus = self._load()
            raise

    # -- statistics -------------------------------------------------------------------------------

    def stats(self) -> dict:
        corpus = self.corpus
        now = time.perf_counter()
        window = [(t, n) for t, n in self._recent if now - t <= 60.0]
        span = (now - window[0][0]) if len(window) > 1 else 0.0
        qps = sum(n for _, n in window) / span if span > 0 else 0.0
        memory = dict(corpus_bytes=int(sum(t.numel() * t.element_size() for s in corpus.segments for t in s.parts())))
        if self.device.type == "cuda":
            memory["gpu_allocated_bytes"] = int(torch.cuda.memory_allocated(self.device))
        return dict(documents=len(corpus), live=int(corpus.num_live), deleted=int(corpus.num_deleted),
                    tokens=int(corpus.num_tokens), encoding=corpus.encoding, dim=corpus.dim, device=str(self.device),
                    load=self.load_mode, memory=memory, searches=self.searches, queries=self.queries_served,
                    queries_per_second_last_minute=round(qps, 2), appended=self.appended, deleted_by_requests=self.deleted,
                    uptime_s=round(time.time() - self.started, 1), max_batch=self.max_batch,
                    max_wait_ms=self.max_wait_s * 1e3, model=self.model_path,
                    model_library=None if self.encoder is None else self.encoder.library)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[len("maxsim: "):] if text.startswith("maxsim: ") else text

