"""Load generator for ``python -m maxsim serve`` (issue 55 point 3): concurrent single-query
clients on localhost against a served corpus, beside the same corpus searched directly.

    python benchmarks/serve_bench.py --docs 1000000 --clients 64            # GPU: 1M passages
    python benchmarks/serve_bench.py --docs 20000 --device cpu --clients 16  # CPU

The corpus: ``--docs`` passages of benchmarks/_passages.py's headline generator (float16 on the
GPU, float32 on the CPU), saved to a temporary folder and served by a child process
(``--max-wait-ms``). Reported:

- direct: ``Corpus.search`` in this process on the same folder, 1 query a call (p50 ms) and 32
  queries a call (q/s): the batched kernel's rate;
- served, one client: p50 / p95 latency of one query a request;
- served, ``--clients`` concurrent clients (threads, each sending one query a request, as fast
  as answers come) for ``--seconds``: q/s, p50 / p95 latency, searches the server ran.

The bar (issue 55): served q/s >= 70 % of the direct 32-query rate; served p50 at one client
<= 1.5x the direct single query. Bounded: at most ``--seconds`` of load, localhost only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "serve"))


def build(folder: str, docs: int, device, dtype) -> np.ndarray:
    """The corpus folder; returns queries [64, 32, d] float32 (from the generator)."""
    import maxsim
    from _passages import HEADLINE, Passages

    gen = Passages(docs, device=device, num_queries=64, seed=0, **HEADLINE)
    corpus = None
    for first, tokens, offsets in gen.slices(min(docs, 500_000)):  # ids follow on from slice to slice
        part = maxsim.Corpus.from_packed(tokens.to(dtype).cpu(), offsets,
                                         ids=np.arange(first, first + len(offsets) - 1))
        corpus = part if corpus is None else corpus.append(part)
    corpus.save(folder)
    queries, _ = gen.queries()
    return queries.float().cpu().numpy()


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0, help="load duration (bounded)")
    ap.add_argument("--max-wait-ms", type=float, default=0.5)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON file for the numbers")
    args = ap.parse_args()
    import maxsim
    from maxsim.client import Client
    from served import Server

    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="maxsim-serve-bench-") as tmp:
        folder = os.path.join(tmp, "c")
        t = time.perf_counter()
        queries = build(folder, args.docs, device, dtype)
        print(f"# corpus: {args.docs} passages built in {time.perf_counter() - t:.1f} s", flush=True)
        direct = maxsim.Corpus.load(folder, device=device)
        Q = torch.from_numpy(queries).to(device=device, dtype=dtype)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for i in range(len(Q)):  # compile every variant
            direct.search(Q[i:i + 1], 10, progress=False)
        direct.search(Q[:32], 10, progress=False)
        single = []
        for i in range(len(Q)):
            sync()
            t = time.perf_counter()
            direct.search(Q[i:i + 1], 10, progress=False)
            sync()
            single.append(1e3 * (time.perf_counter() - t))
        batched = []
        for _ in range(5):
            sync()
            t = time.perf_counter()
            direct.search(Q[:32], 10, progress=False)
            sync()
            batched.append(time.perf_counter() - t)
        res = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                   torch=torch.__version__, docs=args.docs, clients=args.clients,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   direct_single_p50_ms=statistics.median(single), direct_q32_qps=32 / statistics.median(batched))
        del direct
        if device.type == "cuda":
            torch.cuda.empty_cache()
        server = Server(folder, "--device", str(device), "--max-wait-ms", str(args.max_wait_ms), "--max-batch",
                        str(args.max_batch))
        try:
            client = Client(server.url)
            for i in range(len(queries)):
                client.search(queries[i][None], k=10)
            one = []
            for i in range(len(queries)):
                t = time.perf_counter()
                client.search(queries[i][None], k=10)
                one.append(1e3 * (time.perf_counter() - t))
            before = client.stats()["searches"]
            latencies, stop = [], time.perf_counter() + args.seconds
            lock = threading.Lock()

            def run(c):
                me = Client(server.url)
                mine = []
                i = c
                while time.perf_counter() < stop:
                    t = time.perf_counter()
                    me.search(queries[i % len(queries)][None], k=10)
                    mine.append(1e3 * (time.perf_counter() - t))
                    i += args.clients
                with lock:
                    latencies.extend(mine)

            start = time.perf_counter()
            threads = [threading.Thread(target=run, args=(c,)) for c in range(args.clients)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            elapsed = time.perf_counter() - start
            searches = client.stats()["searches"] - before
        finally:
            server.stop()
        res.update(served_one_client_p50_ms=statistics.median(one), served_one_client_p95_ms=percentile(one, 95),
                   served_qps=len(latencies) / elapsed, served_p50_ms=percentile(latencies, 50),
                   served_p95_ms=percentile(latencies, 95), served_queries=len(latencies), served_searches=searches)
    res["qps_fraction_of_direct_q32"] = res["served_qps"] / res["direct_q32_qps"]
    res["one_client_p50_over_direct"] = res["served_one_client_p50_ms"] / res["direct_single_p50_ms"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['device']}  torch {res['torch']}  {args.docs} passages  {args.clients} clients")
    print(f"direct: 1 query p50 {res['direct_single_p50_ms']:.2f} ms; 32 queries {res['direct_q32_qps']:.0f} q/s")
    print(f"served, 1 client: p50 {res['served_one_client_p50_ms']:.2f} ms "
          f"({res['one_client_p50_over_direct']:.2f}x direct; bar 1.5x), p95 {res['served_one_client_p95_ms']:.2f}")
    print(f"served, {args.clients} clients: {res['served_qps']:.0f} q/s ({res['qps_fraction_of_direct_q32']:.0%} of "
          f"direct batched; bar 70 %), p50 {res['served_p50_ms']:.1f} ms, p95 {res['served_p95_ms']:.1f}, "
          f"{res['served_queries']} queries in {res['served_searches']} searches")


if __name__ == "__main__":
    main()
