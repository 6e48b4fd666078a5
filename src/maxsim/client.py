"""A client of ``python -m maxsim serve`` (standard library only).

    from maxsim.client import Client
    client = Client("http://127.0.0.1:8000", api_key=None)
    hits = client.search(Q, k=10)                 # Q: [Nq, Lq, d] / [Lq, d] array or a list of [L_i, d]
    hits[0].ids, hits[0].scores                   # query 0's ids and scores, best first
    client.add(["doc-9"], [doc])                  # durable when it returns
    client.delete(["doc-3"])
    client.stats()
    # a server started with --model PATH also encodes text (the model's query / document side):
    hits = client.search(text=["what is late interaction?"], k=10)
    client.add(["doc-10"], text=["Late interaction scores every query token against every document token."])

Queries travel as a base64 .npy (float32); an error from the server raises :class:`ServerError`
with its status and one-line message.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from typing import NamedTuple

import numpy as np


class Hit(NamedTuple):
    ids: list
    scores: list


class ServerError(RuntimeError):
    """A refusal (4xx) or failure (5xx) of the server: ``status`` and its message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"maxsim server {status}: {message}")
        self.status, self.message = status, message


def _array(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _texts(text) -> list:
    """One string or several -> a list of strings (what the server takes)."""
    items = [text] if isinstance(text, str) else list(text)
    if not all(isinstance(t, str) for t in items):
        raise TypeError("maxsim: text must be a string or a list of strings")
    return items


class Client:
    """``url``: the server's address; ``api_key``: sent with writes; ``timeout``: seconds a call."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 60.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def _call(self, method: str, path: str, payload: dict | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", err.reason)
            except ValueError:
                message = err.reason
            raise ServerError(err.code, message) from None

    def search(self, queries=None, k: int = 10, subset=None, *, text=None) -> list[Hit]:
        """One :class:`Hit` per query. ``queries``: ``[Nq, Lq, d]`` (or ``[Lq, d]``), or a list of
        ``[L_i, d]`` arrays / tensors of any lengths; or ``text``: query strings (a list, or one
        string), which a server started with ``--model`` encodes; ``subset``: ids, the only
        documents ranked."""
        if (queries is None) == (text is None):
            raise ValueError("maxsim: search takes queries (token arrays) or text (strings): one of the two")
        if text is not None:
            payload = dict(text=_texts(text))
        else:
            if isinstance(queries, (list, tuple)):
                items = [_array(q) for q in queries]
                longest = max(q.shape[0] for q in items) if items else 0
                padded = np.zeros((len(items), longest, items[0].shape[1] if items else 0), dtype=np.float32)
                for i, q in enumerate(items):
                    padded[i, :q.shape[0]] = q
                payload = dict(query_lengths=[int(q.shape[0]) for q in items])
            else:
                padded = _array(queries)
                payload = {}
            buffer = io.BytesIO()
            np.save(buffer, padded, allow_pickle=False)
            payload["queries_npy"] = base64.b64encode(buffer.getvalue()).decode()
        payload["k"] = int(k)
        if subset is not None:
            payload["subset"] = [x.item() if hasattr(x, "item") else x for x in subset]
        return [Hit(r["ids"], r["scores"]) for r in self._call("POST", "/search", payload)["results"]]

    def add(self, ids: list, documents: list | None = None, *, text=None) -> dict:
        """Append documents (``[L_i, d]`` each), or ``text`` (document strings, which a server
        started with ``--model`` encodes), under ``ids``; returns ``{"appended", "live"}``."""
        if (documents is None) == (text is None):
            raise ValueError("maxsim: add takes documents (token arrays) or text (strings): one of the two")
        if text is not None:
            return self._call("POST", "/documents", dict(ids=list(ids), text=_texts(text)))
        return self._call("POST", "/documents", dict(ids=list(ids), documents=[_array(d).tolist() for d in documents]))

    def delete(self, ids: list) -> dict:
        """Delete documents by id (unknown ones are skipped); returns ``{"deleted", "live"}``."""
        return self._call("DELETE", "/documents", dict(ids=list(ids)))

    def health(self) -> dict:
        return self._call("GET", "/health")

    def stats(self) -> dict:
        return self._call("GET", "/stats")
