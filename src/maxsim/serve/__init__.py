"""A search server over a stored corpus: ``python -m maxsim serve CORPUS``.

:class:`Service` (no web framework: the corpus, its lock, the batcher of concurrent queries, durable
writes, statistics; with ``model=PATH`` also texts, encoded by :mod:`maxsim.serve.encoder`) and
:func:`create_app` (its HTTP API on FastAPI; the optional ``[serve]`` extra).
``maxsim.client.Client`` speaks the API. docs/serve.md describes both.
"""

from .service import RequestError, Service

__all__ = ["RequestError", "Service", "create_app"]


def create_app(service: Service, **options):
    """The FastAPI application of ``service`` (see :func:`maxsim.serve.app.create_app`)."""
    from .app import create_app as _create

    return _create(service, **options)
