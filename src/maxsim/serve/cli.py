"""``python -m maxsim serve CORPUS``: the search server (maxsim.serve) on uvicorn."""

from __future__ import annotations

import os
import sys


def add_serve_parser(subparsers):
    p = subparsers.add_parser(
        "serve", help="serve a corpus over HTTP: batched search, durable appends and deletes",
        description="Serve the corpus folder CORPUS over HTTP (FastAPI + uvicorn: pip install \"maxsim[serve]\"): "
                    "POST /search, POST and DELETE /documents, GET /health and /stats (docs/serve.md). "
                    "Concurrent searches are batched into one kernel call; writes are committed to the "
                    "folder before they are acknowledged. With --model PATH (a local PyLate or Sentence "
                    "Transformers 6 multi-vector model folder) /search and /documents also take text, "
                    "which that model encodes: python -m maxsim serve corpus/ --model my-colbert/")
    p.add_argument("corpus", help="corpus folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="key that writes must send (Authorization: Bearer KEY or X-API-Key: KEY); default: the "
                        "environment's MAXSIM_API_KEY, else none")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA when available)")
    p.add_argument("--load", choices=["device", "mmap", "host"], default="device",
                   help="the corpus resident on the device (default), memory-mapped or in host memory")
    p.add_argument("--max-batch", type=int, default=32, help="queries searched together at most (default %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=0.5,
                   help="milliseconds a search waits for more requests to join its batch (default %(default)s)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local multi-vector model folder, loaded once at start (PyLate's ColBERT: pip install "
                        "pylate; else Sentence Transformers 6's MultiVectorEncoder): /search then also takes "
                        "{\"text\": [queries]} and /documents {\"ids\": [...], \"text\": [documents]}, encoded by "
                        "its query and document sides. Its output d must be the corpus's")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body in MB (default %(default)s): 413 beyond")
    p.set_defaults(run=run_serve)
    return p


def run_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ImportError('maxsim: the server needs FastAPI and uvicorn: pip install "maxsim[serve]"') from None
    from maxsim.serve import Service, create_app

    if not 0 < args.port < 65536:
        raise ValueError(f"maxsim: --port must be in 1..65535; got {args.port}")
    if args.max_body_mb <= 0:
        raise ValueError(f"maxsim: --max-body-mb must be positive; got {args.max_body_mb}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("MAXSIM_API_KEY") or None
    service = Service(args.corpus, device=args.device, load=args.load, max_batch=args.max_batch,
                      max_wait_s=args.max_wait_ms / 1e3, model=args.model)
    model = "" if service.encoder is None else f", text by {service.encoder.library} model {service.model_path}"
    app = create_app(service, api_key=api_key, max_body_bytes=int(args.max_body_mb * (1 << 20)))
    print(f"maxsim serve: {service.corpus.num_live} documents ({service.corpus.encoding}, d {service.dim}) on "
          f"{service.device}{model}, http://{args.host}:{args.port}{'' if api_key else ' (writes need no key)'}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
