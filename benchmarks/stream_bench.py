"""Exhaustive scoring of many short packed documents: the token-stream kernel against the
per-document kernel, fp16 and one-byte (int8, fp8 e4m3) tokens, against the byte floor. On a GPU:

    python benchmarks/stream_bench.py                      # 1M documents of 16-112 tokens, d 128
    python benchmarks/stream_bench.py --docs 200000 --sweep

Rows: ms (median, cold L2, CUDA events), documents per second, GB/s of the bytes a kernel must
read (tokens, scales, offsets, scores written once) and % of the byte floor at 4.3 TB/s (the H200's
measured copy rate; see BENCHMARKS.md, Method). Checks: every variant's scores against the fp16
per-document kernel on the same (dequantised) tokens. Only this project's kernels run here (no
peer), so one process serves every row.
"""

from __future__ import annotations

import argparse
import json

import torch

import maxsim
from maxsim.bench.timing import cold_ms
from maxsim.compressed.quantized import quantize_tokens
from maxsim.varlen.forward import varlen_forward
from maxsim.varlen.stream import stream_forward

COPY_GBPS = 4300.0


def corpus(num_docs: int, lo: int, hi: int, dim: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (num_docs,), device="cuda", generator=g)
    cu = torch.zeros(num_docs + 1, dtype=torch.int64, device="cuda")
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    d = torch.empty(total, dim, dtype=torch.float16, device="cuda")
    step = 1 << 22
    for start in range(0, total, step):  # bounded fp32 scratch
        x = torch.randn(min(step, total - start), dim, device="cuda", generator=g)
        d[start:start + step] = torch.nn.functional.normalize(x, dim=-1).half()
    return d, cu, lengths


def queries(nq: int, lq: int, dim: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.nn.functional.normalize(torch.randn(nq * lq, dim, device="cuda", generator=g), dim=-1).half()
    return q, torch.arange(0, nq * lq + 1, lq, device="cuda")


def stream_config(rows: int, dim: int, **over):
    config = dict(BM=min(128, max(16, rows)), BN=64, BK=max(16, 1 << (dim - 1).bit_length()),
                  num_warps=1 if rows <= 32 else 4, num_stages=2, waves=8)
    config.update(over)
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=112)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--queries", default="1,32", help="numbers of queries, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also time stream tiles (BN, warps, waves) at 1 query")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    d16, cu, lengths = corpus(args.docs, args.min_len, args.max_len, args.dim, 0)
    total = d16.shape[0]
    encodings = {"fp16": (d16, None)}
    for fmt, name in (("int8", "int8"), ("fp8_e4m3", "fp8")):
        values, scales = quantize_tokens(d16, fmt)
        encodings[name] = (values, scales)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.docs} documents of "
          f"{args.min_len}-{args.max_len} tokens ({total / 1e6:.1f}M tokens), d {args.dim}")
    rows = []

    def row(label, nq, enc, fn, ref):
        data, scales = encodings[enc]
        nbytes = data.numel() * data.element_size() + (0 if scales is None else scales.numel() * 4) \
            + cu.numel() * 8 + nq * args.docs * 4
        out = fn()
        err = float(((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
        ms = cold_ms(fn)
        floor_ms = nbytes / (COPY_GBPS * 1e6)
        r = dict(variant=label, queries=nq, encoding=enc, ms=round(ms, 3), docs_per_s=args.docs / ms * 1e3,
                 gbps=nbytes / ms / 1e6, floor_pct=100 * floor_ms / ms, rel_err=err)
        rows.append(r)
        print(f"{label:34s} {nq:3d}q {enc:5s} {ms:9.3f} ms {r['docs_per_s'] / 1e6:8.1f} M docs/s "
              f"{r['gbps']:7.0f} GB/s {r['floor_pct']:5.1f} % floor  rel err {err:.1e}", flush=True)
        return ms

    for nq in (int(x) for x in args.queries.split(",")):
        q, cu_q = queries(nq, args.query_len, args.dim, 0)
        rows_q = nq * args.query_len
        per_doc = dict(BM=min(128, max(16, rows_q)), BN=128 if rows_q <= 64 else 64,
                       BK=stream_config(rows_q, args.dim)["BK"], num_warps=4 if rows_q <= 64 else 8, num_stages=3)
        ref = varlen_forward(q, d16, cu_q, cu, args.query_len, config=per_doc)[0]
        row("per-document kernel (before)", nq, "fp16",
            lambda: varlen_forward(q, d16, cu_q, cu, args.query_len, config=per_doc)[0], ref)
        row("maxsim.maxsim_varlen (as selected)", nq, "fp16",
            lambda: maxsim.maxsim_varlen(q, d16, cu_q, cu, max_seqlen_q=args.query_len, max_seqlen_d=args.max_len), ref)
        for enc, (data, scales) in encodings.items():
            config = stream_config(rows_q, args.dim)
            row(f"stream BN {config['BN']} {config['num_warps']}w", nq, enc,
                lambda: stream_forward(q, data, cu_q, cu, args.query_len, config=config, scales=scales), ref)
            if scales is not None:  # the query quantised too: the bytes multiplied on the tensor cores
                q_values, q_scales = quantize_tokens(q, "int8" if enc == "int8" else "fp8_e4m3")
                row(f"stream BN {config['BN']} {config['num_warps']}w, {enc} query", nq, enc,
                    lambda: stream_forward(q_values, data, cu_q, cu, args.query_len, config=config, scales=scales,
                                           query_scales=q_scales), ref)
        if args.sweep:  # tiles: BN tokens, warps (1 query: every encoding, the one-byte dot too)
            grid = ([(bn, warps) for bn in (64, 128, 256) for warps in (1, 2, 4)] if nq == 1 else
                    [(bn, warps) for bn in (64, 128) for warps in (4, 8)])
            for enc, quantized_query in (("fp16", False), ("int8", False), ("fp8", False), ("int8", True),
                                         ("fp8", True)):
                if nq > 1 and enc == "fp8" and not quantized_query:
                    continue
                data, scales = encodings[enc]
                q_in, q_scales = (quantize_tokens(q, "int8" if enc == "int8" else "fp8_e4m3") if quantized_query
                                  else (q, None))
                for bn, warps in grid:
                    config = stream_config(rows_q, args.dim, BN=bn, num_warps=warps)
                    row(f"  sweep BN {bn} {warps}w{' q8' if quantized_query else ''}", nq, enc,
                        lambda: stream_forward(q_in, data, cu_q, cu, args.query_len, config=config, scales=scales,
                                               query_scales=q_scales), ref)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
