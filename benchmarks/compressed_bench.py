"""The fused residual MaxSim (maxsim.maxsim_residual_varlen) against fp16 maxsim.maxsim_varlen on the
decoded corpus: one query against 100K-1M documents from a 2-bit and a 4-bit index. Needs a GPU.

    python benchmarks/compressed_bench.py                          # 100K and 1M documents, 2 and 4 bits
    python benchmarks/compressed_bench.py --docs 100000 --nbits 2 --out results/compressed.json

The index: ``--centroids`` unit centroids (d 128), bucket cutoffs and weights at the quantiles of
the residuals (as colbert-ai trains them), and a pool of ``--pool`` random unit tokens encoded by
``ResidualCodec.encode``; each document's tokens are drawn from that pool (so every code and
residual byte is a real encoding) with lengths uniform in ``[--min-len, --max-len]``. The query:
32 unit tokens, fp16. Times are medians of ``triton.testing.do_bench`` (the corpus is far larger
than L2). The floor is the bytes each call must read from HBM over ``--hbm-tbs``: codes + residuals
+ the query (+ cu_seqlens) for the fused kernel, the decoded fp16 tokens for maxsim_varlen.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import maxsim
from maxsim.compressed import ResidualCodec, maxsim_residual_varlen
from maxsim.selection.compressed import explain_residual

DIM = 128
QUERY_LEN = 32


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


def time_fp16(q, decoded, cu, max_len):
    """(ms, scores [1, Nd]) of fp16 maxsim.maxsim_varlen on the decoded corpus, q [Lq, d]."""
    cu_q = torch.tensor([0, q.shape[0]], device=q.device)

    def fp16():
        return maxsim.maxsim_varlen(q, decoded, cu_q, cu, max_seqlen_q=q.shape[0], max_seqlen_d=max_len)

    return median_ms(fp16), fp16()


def run_case(nbits: int, num_docs: int, args, device) -> dict:
    codec = make_codec(nbits, args.centroids, device)
    codes, residuals, cu, max_len = make_corpus(codec, num_docs, args.min_len, args.max_len, args.pool, device)
    Q = torch.nn.functional.normalize(torch.randn(1, QUERY_LEN, DIM, device=device), dim=-1).half()
    tokens = codes.shape[0]
    hbm = args.hbm_tbs * 1e12
    compressed_bytes = (codes.numel() * codes.element_size() + residuals.numel() + Q.numel() * Q.element_size()
                        + cu.numel() * cu.element_size())

    row = dict(nbits=nbits, docs=num_docs, tokens=tokens, compressed_MB=compressed_bytes / 2**20)
    row["fused_ms"], row["fused_raw_ms"], got = time_fused(Q, codes, residuals, cu, codec, max_len)
    decoded = codec.decode(codes, residuals, normalize=True, dtype=torch.float16)  # [T, d], untimed
    del codes, residuals
    fp16_bytes = decoded.numel() * 2 + Q.numel() * 2 + cu.numel() * 8
    row["fp16_ms"], expected = time_fp16(Q[0], decoded, cu, max_len)
    row["max_abs_diff"] = float((got - expected).abs().max())
    del decoded
    torch.cuda.empty_cache()

    row["fused_docs_per_s"] = num_docs / (row["fused_ms"] * 1e-3)
    row["fused_pct_floor"] = 100 * (compressed_bytes / hbm) / (row["fused_ms"] * 1e-3)
    row["fused_raw_pct_floor"] = 100 * (compressed_bytes / hbm) / (row["fused_raw_ms"] * 1e-3)
    row["fp16_docs_per_s"] = num_docs / (row["fp16_ms"] * 1e-3)
    row["fp16_pct_own_floor"] = 100 * (fp16_bytes / hbm) / (row["fp16_ms"] * 1e-3)
    row["speedup_vs_fp16"] = row["fp16_ms"] / row["fused_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="100000,1000000", help="comma-separated document counts")
    ap.add_argument("--nbits", default="2,4", help="comma-separated residual widths")
    ap.add_argument("--centroids", type=int, default=65536)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=112)
    ap.add_argument("--pool", type=int, default=1 << 20, help="encoded tokens the documents draw from")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8 TB/s)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compressed_bench needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    codec = make_codec(2, 1024, device)
    print(explain_residual(torch.randn(1, QUERY_LEN, DIM, device=device).half(), codec, num_docs=1))
    rows = []
    header = (f"{'nbits':>5} {'docs':>9} {'tokens':>11} {'MB':>8} | {'fused ms':>9} {'docs/s':>9} {'% floor':>7} "
              f"{'raw %fl':>7} | {'fp16 ms':>8} {'docs/s':>9} {'% own fl':>8} | {'x fp16':>6} {'max|diff|':>9}")
    print(header)
    print("-" * len(header))
    for nbits in (int(x) for x in args.nbits.split(",")):
        for num_docs in (int(x) for x in args.docs.split(",")):
            r = run_case(nbits, num_docs, args, device)
            rows.append(r)
            print(f"{r['nbits']:>5} {r['docs']:>9} {r['tokens']:>11} {r['compressed_MB']:>8.0f} | "
                  f"{r['fused_ms']:>9.3f} {r['fused_docs_per_s']:>9.3g} {r['fused_pct_floor']:>6.1f}% "
                  f"{r['fused_raw_pct_floor']:>6.1f}% | {r['fp16_ms']:>8.3f} {r['fp16_docs_per_s']:>9.3g} "
                  f"{r['fp16_pct_own_floor']:>7.1f}% | {r['speedup_vs_fp16']:>6.2f} {r['max_abs_diff']:>9.2e}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
