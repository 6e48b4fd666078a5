"""The HTTP API of a :class:`maxsim.serve.Service`, on FastAPI (the ``[serve]`` extra).

    POST   /search     {"queries": [[[...]]] | "queries_npy": base64 .npy | "text": ["..."], "k": 10,
                        "subset": [ids]}
                       -> {"results": [{"ids": [...], "scores": [...]}, ...]}   (one per query)
    POST   /documents  {"ids": [...], "documents": [[[...]]] | "text": ["..."]}  -> {"appended": n, "live": N}
    DELETE /documents  {"ids": [...]}                           -> {"deleted": n, "live": N}
    GET    /health     -> {"status": "ok"}
    GET    /stats      -> documents, encoding, memory, q/s, ...

``text`` (strings, in place of token arrays) needs a server started with a model
(``Service(model=PATH)``, ``--model PATH``): the model encodes them in a worker thread, then they
take the arrays' path. Every refusal is a 4xx with ``{"error": "one line"}``; writes need the API
key when one is set (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``); a body over
``max_body_bytes`` is a 413.
"""

# (no `from __future__ import annotations`: FastAPI reads the endpoints' Request annotations, imported
# inside create_app, at run time)
import asyncio
import base64
import binascii
import hmac
import io
import json

import numpy as np

from .service import RequestError, Service

# A body declared over the limit but at most this many times it is read (and dropped) before the 413,
# so that the client gets the answer; a larger one is refused at once, the connection closed.
DRAIN_FACTOR = 4


def create_app(service: Service, *, api_key: str | None = None, max_body_bytes: int = 64 << 20):
    """A FastAPI app serving ``service``; ``api_key``: required for writes when given."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
    except ImportError:
        raise ImportError('maxsim: the server needs FastAPI and uvicorn: pip install "maxsim[serve]"') from None
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await service.stop()

    app = FastAPI(title="maxsim", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    @app.middleware("http")
    async def refuse(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            if length.isdigit() and int(length) <= DRAIN_FACTOR * max_body_bytes:
                # read and drop the body (never held): a connection closed mid-upload is a broken
                # pipe to the client, which then never reads this 413
                async for _ in request.stream():
                    pass
            return error(413, f"the request body is over {max_body_bytes} bytes")
        try:
            return await call_next(request)
        except RequestError as err:
            return error(err.status, str(err))

    @app.exception_handler(404)
    async def not_found(request, exc):
        return error(404, f"no such endpoint: {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request, exc):
        return error(405, f"{request.method} is not allowed on {request.url.path}")

    async def body(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise RequestError(f"the request body is over {max_body_bytes} bytes", 413)
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RequestError("the request body is not JSON") from None
        if not isinstance(payload, dict):
            raise RequestError("the request body must be a JSON object")
        return payload

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise RequestError("writes need the API key: Authorization: Bearer KEY or X-API-Key: KEY", 401)

    def queries_of(payload: dict):
        if "queries_npy" in payload:
            try:
                raw = base64.b64decode(payload["queries_npy"], validate=True)
                array = np.load(io.BytesIO(raw), allow_pickle=False)
            except (binascii.Error, ValueError, TypeError, OSError, EOFError):
                raise RequestError("queries_npy must be a base64-encoded .npy file") from None
            lengths = payload.get("query_lengths")
            if lengths is not None:
                if array.ndim != 3 or not isinstance(lengths, list) or len(lengths) != array.shape[0] or \
                        not all(isinstance(n, int) and 1 <= n <= array.shape[1] for n in lengths):
                    raise RequestError("query_lengths must give one length in [1, Lq] per query of a [Nq, Lq, d] array")
                return [array[i, :n] for i, n in enumerate(lengths)]
            return array
        if "queries" not in payload:
            raise RequestError('the request needs "queries" (or "queries_npy"), or "text"')
        return payload["queries"]

    def text_of(payload: dict, arrays: tuple):
        """The request's ``text`` (checked), or None when it sends ``arrays`` instead; both or
        neither: a RequestError."""
        given = [name for name in arrays if name in payload]
        if "text" in payload:
            if given:
                raise RequestError(f'send "text" or "{given[0]}", not both')
            return service.check_text(payload["text"])
        return None

    @app.post("/search")
    async def search(request: Request):
        payload = await body(request)
        text = text_of(payload, ("queries", "queries_npy"))
        queries = None if text is not None else service.check_queries(queries_of(payload))
        k = service.check_k(payload.get("k", 10))
        subset = service.check_subset(payload.get("subset"))
        try:
            if text is not None:  # encoded off the event loop, then batched like arrays
                queries = await asyncio.to_thread(service.encode_queries, text)
            answers = await service.search(queries, k, subset)
        except RuntimeError as err:
            return error(500, str(err).replace("maxsim: ", ""))
        return {"results": [{"ids": ids, "scores": scores} for ids, scores in answers]}

    @app.post("/documents")
    async def append(request: Request):
        authorised(request)
        payload = await body(request)
        text = text_of(payload, ("documents",))
        if text is None:
            if "documents" not in payload:
                raise RequestError('the request needs "documents" (token arrays) or "text"')
            ids, documents = service.check_documents(payload.get("ids"), payload.get("documents"))
        else:
            ids = service.check_ids(payload.get("ids"), len(text), "texts")
            try:
                documents = await asyncio.to_thread(service.encode_documents, text)
            except RuntimeError as err:
                return error(500, str(err).replace("maxsim: ", ""))
        live = await asyncio.to_thread(service.append, ids, documents)
        return {"appended": len(ids), "live": live}

    @app.delete("/documents")
    async def delete(request: Request):
        authorised(request)
        payload = await body(request)
        count = await asyncio.to_thread(service.delete, payload.get("ids"))
        return {"deleted": count, "live": int(service.corpus.num_live)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return service.stats()

    return app
