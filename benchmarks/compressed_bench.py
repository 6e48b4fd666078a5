"""The fused residual MaxSim (maxsim.compressed.maxsim_residual_varlen) against fp16 maxsim.maxsim_varlen on the
decoded corpus: one query (or ``--queries``) against 100K-1M documents from a 2-bit and a 4-bit index. Needs a GPU.

    python benchmarks/compressed_bench.py                          # 100K and 1M documents, 2 and 4 bits
    python benchmarks/compressed_bench.py --docs 100000 --nbits 2 --out results/compressed.json

The index: ``--centroids`` unit centroids (d 128), bucket cutoffs and weights at the quantiles of
the residuals (as colbert-ai trains them), and a pool of ``--pool`` random unit tokens encoded by
``ResidualCodec.encode``; each document's tokens are drawn from that pool (so every code and
residual byte is a real encoding) with lengths uniform in ``[--min-len, --max-len]``. The query:
32 unit tokens, fp16. Times are medians of ``triton.testing.do_bench`` (the corpus is far larger
than L2). The floor is the bytes each call must read from HBM over ``--hbm-tbs``: codes + residuals
+ the query (+ cu_seqlens) for the fused kernel, the decoded fp16 tokens for maxsim_varlen.
``chunked ms``: the same call on the chunked path (decode to fp16 a chunk at a time, then score).

The fused kernel and maxsim_varlen each run in a fresh process (benchmarks/_isolate.py) that
builds the case from a fixed seed, so a crash is a ``crashed`` cell; their scores meet in files.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import triton
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated

import maxsim
from maxsim.compressed import ResidualCodec, maxsim_residual_varlen
from maxsim.selection.compressed import explain_residual

DIM = 128
QUERY_LEN = 32
SEED = 0


def make_codec(nbits: int, num_centroids: int, device) -> ResidualCodec:
    centroids = torch.nn.functional.normalize(torch.randn(num_centroids, DIM, device=device), dim=-1).half().float()
    sample = torch.nn.functional.normalize(torch.randn(4096, DIM, device=device), dim=-1)  # [4096, C] scores
    residual = (sample - centroids[(sample @ centroids.T).argmax(1)]).flatten()
    quantiles = torch.arange(1 << nbits, device=device) / (1 << nbits)
    cutoffs = residual.quantile(quantiles[1:])
    weights = residual.quantile(quantiles + 0.5 / (1 << nbits))
    return ResidualCodec(centroids, weights, nbits, bucket_cutoffs=cutoffs)


def make_corpus(codec: ResidualCodec, num_docs: int, min_len: int, max_len: int, pool: int, device):
    """(codes [T] int32, residuals [T, P] uint8, cu_seqlens [Nd + 1] int64, max length)."""
    x = torch.nn.functional.normalize(torch.randn(pool, DIM, device=device), dim=-1)
    pool_codes, pool_residuals = codec.encode(x)
    lengths = torch.randint(min_len, max_len + 1, (num_docs,), device=device)
    cu = torch.zeros(num_docs + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    pick = torch.randint(0, pool, (int(cu[-1]),), device=device)
    return pool_codes[pick], pool_residuals[pick], cu, int(lengths.max())


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def time_fused(Q, codes, residuals, cu, codec, max_len):
    """(ms with normalize=True, ms with normalize=False, scores [1, Nd])."""
    def fused():
        return maxsim_residual_varlen(Q, codes, residuals, cu, codec, max_seqlen_d=max_len)

    def raw():
        return maxsim_residual_varlen(Q, codes, residuals, cu, codec, max_seqlen_d=max_len, normalize=False)

    return median_ms(fused), median_ms(raw), fused()


def time_fp16(Q, decoded, cu, max_len):
    """(ms, scores [Nq, Nd]) of fp16 maxsim.maxsim_varlen on the decoded corpus, Q [Nq, Lq, d]."""
    num_queries, query_len, dim = Q.shape
    q = Q.reshape(-1, dim)  # [Nq * Lq, d] packed
    cu_q = torch.arange(num_queries + 1, device=Q.device) * query_len

    def fp16():
        return maxsim.maxsim_varlen(q, decoded, cu_q, cu, max_seqlen_q=query_len, max_seqlen_d=max_len)

    return median_ms(fp16), fp16()


def case_inputs(nbits: int, num_docs: int, options: dict):
    """(codec, codes, residuals, cu_seqlens, max length, Q [1, Lq, d] fp16, bytes of the compressed
    call) of one case: the same in every process that builds it (fixed seed)."""
    torch.manual_seed(SEED)
    device = torch.device("cuda")
    codec = make_codec(nbits, options["centroids"], device)
    codes, residuals, cu, max_len = make_corpus(codec, num_docs, options["min_len"], options["max_len"],
                                                options["pool"], device)
    Q = torch.nn.functional.normalize(torch.randn(options["queries"], QUERY_LEN, DIM, device=device), dim=-1).half()
    compressed_bytes = (codes.numel() * codes.element_size() + residuals.numel() + Q.numel() * Q.element_size()
                        + cu.numel() * cu.element_size())
    return codec, codes, residuals, cu, max_len, Q, compressed_bytes


def sweep_tiles(Q, codes, residuals, cu, codec, max_len) -> dict:
    """ms of the stream kernel's residual decode per tile (BN tokens, warps, waves), and two
    ablations at the selected tile: every code 0 (the centroid gather always hits one row) and
    normalize=False."""
    from maxsim.compressed.forward import residual_stream_forward
    from maxsim.compressed.scoring import _select

    num_queries, query_len, dim = Q.shape
    q = Q.reshape(-1, dim).contiguous()
    cu_q = torch.arange(num_queries + 1, device=Q.device) * query_len
    base = _select.forward_choice(num_queries, query_len, dim, Q.dtype, "packed", False, True, False, "sm90").config
    out = {}

    def timed(label, config, codes=codes, normalize=True):
        try:
            out[label] = median_ms(lambda: residual_stream_forward(q, cu_q, query_len, codes, residuals, cu, codec,
                                                                   Q.dtype, normalize, config=config, max_d=max_len))
        except Exception as e:  # a tile that does not compile (shared memory) is a cell, not a dead run
            out[label] = f"{type(e).__name__}"
        print(f"  sweep {label:28s} {out[label] if isinstance(out[label], str) else format(out[label], '.3f')}",
              flush=True)

    for bn in (16, 32, 64, 128):
        for warps in (1, 2, 4, 8):
            timed(f"BN {bn} {warps}w", dict(base, BN=bn, num_warps=warps))
    for waves in (2, 4, 16):
        timed(f"selected, waves {waves}", dict(base, waves=waves))
    timed("selected, stages 1", dict(base, num_stages=1))
    timed("selected, codes all 0", base, codes=torch.zeros_like(codes))
    timed("selected, normalize=False", base, normalize=False)
    return out


def fused_cell(nbits: int, num_docs: int, options: dict, scores_path: str) -> dict:
    """The fused kernel on one case, in its own process; its scores go to ``scores_path``."""
    codec, codes, residuals, cu, max_len, Q, compressed_bytes = case_inputs(nbits, num_docs, options)
    fused_ms, raw_ms, scores = time_fused(Q, codes, residuals, cu, codec, max_len)
    torch.save(scores.float().cpu(), scores_path)
    sweep = sweep_tiles(Q, codes, residuals, cu, codec, max_len) if options["sweep"] else None
    return dict(tokens=codes.shape[0], compressed_bytes=compressed_bytes, fused_ms=fused_ms, fused_raw_ms=raw_ms,
                chunked_ms=time_chunked(Q, codes, residuals, cu, codec, max_len), sweep=sweep)


def time_chunked(Q, codes, residuals, cu, codec, max_len) -> float:
    """ms of the same call on the chunked path (decode a bounded chunk to fp16, then maxsim_varlen):
    the alternative the stream kernel must beat."""
    from maxsim.compressed import scoring

    on_chip = scoring._on_chip
    scoring._on_chip = lambda *args: None  # the selection's "not the stream kernel" answer
    try:
        return median_ms(lambda: maxsim_residual_varlen(Q, codes, residuals, cu, codec, max_seqlen_d=max_len))
    finally:
        scoring._on_chip = on_chip


def fp16_cell(nbits: int, num_docs: int, options: dict, scores_path: str) -> dict:
    """maxsim_varlen on the decoded corpus of one case, in its own process; scores to ``scores_path``."""
    codec, codes, residuals, cu, max_len, Q, compressed_bytes = case_inputs(nbits, num_docs, options)
    tokens = codes.shape[0]
    decoded = codec.decode(codes, residuals, normalize=True, dtype=torch.float16)  # [T, d], untimed
    del codes, residuals
    fp16_bytes = decoded.numel() * 2 + Q.numel() * 2 + cu.numel() * 8
    fp16_ms, scores = time_fp16(Q, decoded, cu, max_len)
    torch.save(scores.float().cpu(), scores_path)
    return dict(tokens=tokens, compressed_bytes=compressed_bytes, fp16_bytes=fp16_bytes, fp16_ms=fp16_ms)


def run_case(nbits: int, num_docs: int, args) -> dict:
    """One row: each side in its own process; a side that failed leaves its columns None and says
    why in ``note``."""
    options = vars(args)
    hbm = args.hbm_tbs * 1e12
    with tempfile.TemporaryDirectory(prefix="maxsim-compressed-") as tmp:
        paths = {side: str(Path(tmp) / f"{side}.pt") for side in ("fused", "fp16")}
        fused = run_isolated(fused_cell, nbits, num_docs, options, paths["fused"], timeout_s=args.timeout)
        fp16 = run_isolated(fp16_cell, nbits, num_docs, options, paths["fp16"], timeout_s=args.timeout)
        max_abs_diff = None
        if fused["status"] == fp16["status"] == "ok":
            max_abs_diff = float((torch.load(paths["fused"]) - torch.load(paths["fp16"])).abs().max())
    sizes = fused if fused["status"] == "ok" else fp16
    row = dict(nbits=nbits, docs=num_docs, tokens=sizes.get("tokens"), fused_status=fused["status"],
               fp16_status=fp16["status"], max_abs_diff=max_abs_diff,
               note="; ".join(f"{side} {failed(r)}" for side, r in (("fused", fused), ("fp16", fp16)) if failed(r)))
    compressed_bytes = sizes.get("compressed_bytes")
    row["compressed_MB"] = None if compressed_bytes is None else compressed_bytes / 2**20
    row["fused_ms"], row["fused_raw_ms"] = fused.get("fused_ms"), fused.get("fused_raw_ms")
    row["chunked_ms"] = fused.get("chunked_ms")
    row["fp16_ms"] = fp16.get("fp16_ms")
    row["sweep"] = fused.get("sweep")
    row.update(dict.fromkeys(("fused_docs_per_s", "fused_pct_floor", "fused_raw_pct_floor", "fp16_docs_per_s",
                              "fp16_pct_own_floor", "speedup_vs_fp16")))
    if row["fused_ms"] is not None:
        row["fused_docs_per_s"] = num_docs / (row["fused_ms"] * 1e-3)
        row["fused_pct_floor"] = 100 * (compressed_bytes / hbm) / (row["fused_ms"] * 1e-3)
        row["fused_raw_pct_floor"] = 100 * (compressed_bytes / hbm) / (row["fused_raw_ms"] * 1e-3)
    if row["fp16_ms"] is not None:
        row["fp16_docs_per_s"] = num_docs / (row["fp16_ms"] * 1e-3)
        row["fp16_pct_own_floor"] = 100 * (fp16["fp16_bytes"] / hbm) / (row["fp16_ms"] * 1e-3)
    if row["fused_ms"] is not None and row["fp16_ms"] is not None:
        row["speedup_vs_fp16"] = row["fp16_ms"] / row["fused_ms"]
    return row


def _cell(row: dict, key: str, spec: str, status_key: str | None = None, suffix: str = "") -> str:
    """``row[key]`` formatted by ``spec`` (then ``suffix``); where it is missing, the side's
    status (in its time cell, given ``status_key``) or "-"."""
    value = row.get(key)
    if value is not None:
        return format(value, spec) + suffix
    return row[status_key] if status_key else "-"


def format_row(r: dict) -> str:
    """One line of the table; a side that failed shows its status in its ms column."""
    line = (f"{r['nbits']:>5} {r['docs']:>9} {_cell(r, 'tokens', 'd'):>11} "
            f"{_cell(r, 'compressed_MB', '.0f'):>8} | "
            f"{_cell(r, 'fused_ms', '.3f', 'fused_status'):>9} {_cell(r, 'fused_docs_per_s', '.3g'):>9} "
            f"{_cell(r, 'fused_pct_floor', '.1f', suffix='%'):>7} "
            f"{_cell(r, 'fused_raw_pct_floor', '.1f', suffix='%'):>7} | "
            f"{_cell(r, 'fp16_ms', '.3f', 'fp16_status'):>8} {_cell(r, 'fp16_docs_per_s', '.3g'):>9} "
            f"{_cell(r, 'fp16_pct_own_floor', '.1f', suffix='%'):>8} | {_cell(r, 'speedup_vs_fp16', '.2f'):>6} "
            f"{_cell(r, 'max_abs_diff', '.2e'):>9} | {_cell(r, 'chunked_ms', '.3f'):>10}")
    return line + (f" | {r['note']}" if r["note"] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="100000,1000000", help="comma-separated document counts")
    ap.add_argument("--nbits", default="2,4", help="comma-separated residual widths")
    ap.add_argument("--centroids", type=int, default=65536)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=112)
    ap.add_argument("--queries", type=int, default=1, help="queries of 32 tokens scored in one call")
    ap.add_argument("--pool", type=int, default=1 << 20, help="encoded tokens the documents draw from")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8 TB/s)")
    ap.add_argument("--sweep", action="store_true", help="also time the residual decode's tiles and ablations")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds one side of one case may take before its process is killed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compressed_bench needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    codec = make_codec(2, 1024, device)
    print(explain_residual(torch.randn(1, QUERY_LEN, DIM, device=device).half(), codec, num_docs=1))
    rows = []
    header = (f"{'nbits':>5} {'docs':>9} {'tokens':>11} {'MB':>8} | {'fused ms':>9} {'docs/s':>9} {'% floor':>7} "
              f"{'raw %fl':>7} | {'fp16 ms':>8} {'docs/s':>9} {'% own fl':>8} | {'x fp16':>6} {'max|diff|':>9}"
              f" | {'chunked ms':>10} | note")
    print(header)
    print("-" * len(header))
    for nbits in (int(x) for x in args.nbits.split(",")):
        for num_docs in (int(x) for x in args.docs.split(",")):
            r = run_case(nbits, num_docs, args)
            rows.append(r)
            print(format_row(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
