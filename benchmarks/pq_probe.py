"""Probe: the PQ scorer at the speed of its bytes (issue 54, point 3). Needs a GPU.

    python benchmarks/pq_probe.py [--docs 1000000] [--out results/pq_probe.json]

One query (and 32) x ``--docs`` documents of 32-96 tokens, d 128, pq32 (32 sub-spaces of 4
dimensions, 256 centroids each), codes drawn at random:

- ``lut``: the PQ look-up scorers, :mod:`maxsim.compressed.pq_gluon` (Gluon, codebooks in shared
  memory) and :mod:`maxsim.compressed.pq_lut` (Triton), over a few tiles and ablations; checked
  first against their float64 emulation on the first documents;
- ``stream``: today's ``maxsim_pq_varlen`` (the stream kernel decoding fp16 sub-vectors on chip);
- ``fp16``: ``maxsim.maxsim_varlen`` on the corpus decoded to fp16 (the bar's baseline);
- ``bytes``: the layout's codes read once by a plain reduction (the stream's floor);
- ``int8`` / ``fp8_e4m3``: the same documents as one-byte tokens (random unit vectors), through
  the Gluon one-byte scorer (:mod:`maxsim.compressed.onebyte_gluon`) and the stream kernel's
  quantised-query path.

Each provider runs in its own process (``_isolate``); times are medians of
``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from _isolate import run_isolated  # noqa: E402

DIM, LQ, M, SEED = 128, 32, 32, 0


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def make_case(docs: int, device="cuda"):
    """(pq, codes [T, M] uint8, cu [Nd + 1] int64): a fixed seed."""
    from maxsim.compressed.pq import ProductQuantizer

    g = torch.Generator(device=device).manual_seed(SEED)
    pq = ProductQuantizer(torch.randn(M, 256, DIM // M, device=device, generator=g) * 0.09)
    lengths = torch.randint(32, 97, (docs,), device=device, generator=g)
    cu = torch.zeros(docs + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    codes = torch.randint(0, 256, (int(cu[-1]), M), device=device, generator=g, dtype=torch.uint8)
    return pq, codes, cu


def queries(n: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(SEED + 1)
    return torch.nn.functional.normalize(torch.randn(n, LQ, DIM, device=device, generator=g), dim=-1).half()


def lut_cell(docs: int, variants: list) -> dict:
    from maxsim.compressed.pq_lut import build_layout, pq_lut_emulation, pq_lut_scores

    pq, codes, cu = make_case(docs)
    t = time.perf_counter()
    layout = build_layout(pq, codes, cu)
    torch.cuda.synchronize()
    out = dict(tokens=codes.shape[0], padded_tokens=layout.codes.shape[0], layout_bytes=layout.nbytes(),
               build_s=time.perf_counter() - t)
    small = 2000
    lay_s = build_layout(pq, codes[: int(cu[small])], cu[: small + 1])
    Qc = queries(3)
    got = pq_lut_scores(Qc, lay_s).double().cpu()
    ref = pq_lut_emulation(Qc, lay_s)
    out["emulation_max_abs"] = float((got - ref).abs().max())
    out["emulation_ok"] = bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-4))
    exact = torch.stack([maxsim_decoded(Qc[i], pq, codes, cu, small) for i in range(3)])
    out["vs_decoded_max_abs"] = float((got - exact).abs().max())
    out["top10_vs_decoded"] = sum(len(set(got[i].topk(10).indices.tolist()) & set(exact[i].topk(10).indices.tolist()))
                                  for i in range(3)) / 30
    print("  correctness", {k: v for k, v in out.items() if "emul" in k or "decoded" in k}, flush=True)
    Q1, Q32 = queries(1), queries(32)
    for v in variants:
        v = dict(v)
        label = v.pop("label")
        Q = Q1 if v.pop("queries", 1) == 1 else Q32
        try:
            if v.pop("gluon", False):
                from maxsim.compressed.pq_gluon import gluon_scores
                if label in ("gluon BT128 waves8", "gluon pairs BT128 waves8 maxnreg128"):  # against the emulation too
                    g_s = gluon_scores(Qc, lay_s, pairs=v.get("pairs", False)).double().cpu()
                    out[label + " emulation_max_abs"] = float((g_s - ref).abs().max())
                ms = median_ms(lambda: gluon_scores(Q, layout, **v))
            else:
                ms = median_ms(lambda: pq_lut_scores(Q, layout, **v))
        except Exception as e:  # a tile that does not compile is a cell, not a dead run
            ms = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        out[label] = ms
        print(f"  lut {label:28s} {ms if isinstance(ms, str) else format(ms, '.3f')}", flush=True)
    out["bytes_ms"] = median_ms(lambda: layout.codes.view(torch.int32).sum(dtype=torch.int32))
    x = pq.decode(codes[: 1 << 22]).half()  # 4M tokens: the build's encode (the fused kernel on the GPU)
    out["encode_4M_tokens_ms"] = median_ms(lambda: pq.encode(x))
    return out


def maxsim_decoded(q, pq, codes, cu, docs):
    """float64 scores of one query [LQ, d] against the first ``docs`` documents, decoded."""
    x = pq.decode(codes[: int(cu[docs])]).double()
    s = q.double() @ x.T  # [LQ, t]
    out = torch.zeros(docs, dtype=torch.float64, device=q.device)
    for j in range(docs):
        lo, hi = int(cu[j]), int(cu[j + 1])
        out[j] = s[:, lo:hi].amax(-1).sum()
    return out.cpu()


def stream_cell(docs: int) -> dict:
    from maxsim.compressed.pq import maxsim_pq_varlen

    pq, codes, cu = make_case(docs)
    out = {}
    for nq in (1, 32):
        Q = queries(nq)
        out[f"stream_q{nq}_ms"] = median_ms(lambda: maxsim_pq_varlen(Q, codes, cu, pq))
    return out


def fp16_cell(docs: int) -> dict:
    import maxsim

    pq, codes, cu = make_case(docs)
    decoded = pq.decode(codes).half()
    del codes
    max_len = int((cu[1:] - cu[:-1]).max())
    out = {}
    for nq in (1, 32):
        q = queries(nq).reshape(-1, DIM)
        cu_q = torch.arange(nq + 1, device=q.device) * LQ
        out[f"fp16_q{nq}_ms"] = median_ms(lambda: maxsim.maxsim_varlen(q, decoded, cu_q, cu, max_seqlen_q=LQ,
                                                                      max_seqlen_d=max_len))
    return out


def onebyte_cell(docs: int, fmt: str = "int8") -> dict:
    """int8 (or fp8_e4m3) tokens (random unit vectors, quantised a token) through the Gluon one-byte
    scorer and the stream kernel (the quantised-query path Corpus.search takes today)."""
    from maxsim.compressed.onebyte_gluon import build_layout, onebyte_emulation, onebyte_scores
    from maxsim.compressed.quantized import maxsim_quantized_varlen, quantize_tokens

    _, codes, cu = make_case(docs)
    total = codes.shape[0]
    del codes
    g = torch.Generator(device="cuda").manual_seed(SEED + 2)
    values = torch.empty(total, DIM, dtype=torch.int8 if fmt == "int8" else torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(total, dtype=torch.float32, device="cuda")
    for start in range(0, total, 1 << 22):  # fp32 tokens a chunk at a time
        stop = min(total, start + (1 << 22))
        x = torch.nn.functional.normalize(torch.randn(stop - start, DIM, device="cuda", generator=g), dim=-1)
        values[start:stop], scales[start:stop] = quantize_tokens(x, fmt)
    layout = build_layout(values, scales, cu)
    small = 2000
    lay_s = build_layout(values[: int(cu[small])], scales[: int(cu[small])], cu[: small + 1])
    Qc = queries(3)
    out = {f"{fmt} emulation_max_abs": float((onebyte_scores(Qc, lay_s).double().cpu()
                                               - onebyte_emulation(Qc, lay_s)).abs().max())}
    print(f"  {fmt} correctness", out, flush=True)
    Q1, Q32 = queries(1), queries(32)
    # one query: the table's choice (168 registers, 3 programs an SM, 9 waves: whole rounds); 32 queries:
    # 4 a program spills at 168 registers (int8), so the cap is swept against 2 programs an SM
    q32 = [(f"q32 {fmt} gluon pairs qpb4 BT64 " + (f"maxnreg{cap}" if cap else "uncapped"), Q32,
            dict(pairs=True, qpb=4, block_tokens=64, **({"maxnreg": cap} if cap else {})))
           for cap in (168, 200, None)]
    # one query in 64-token tiles: 116-124 registers uncapped (sm_90 ptxas), so 4 programs an SM
    bt64 = [(f"{fmt} gluon pairs BT64 waves{w}", Q1, dict(pairs=True, block_tokens=64, waves=w)) for w in (8, 12)]
    bt64 += [(f"{fmt} gluon pairs BT64 waves10 maxnreg96", Q1, dict(pairs=True, block_tokens=64, waves=10, maxnreg=96))]
    for label, Q, kw in [(f"{fmt} gluon pairs BT128 waves9 maxnreg168", Q1, dict(pairs=True, waves=9, maxnreg=168))] + bt64 + q32 + [
                         (f"q32 {fmt} gluon pairs qpb2 BT128 maxnreg168", Q32,
                          dict(pairs=True, qpb=2, block_tokens=128, maxnreg=168)),
                         (f"{fmt} gluon ablation: no document max", Q1, dict(ablate=2))]:
        out[label] = median_ms(lambda: onebyte_scores(Q, layout, **kw))
        print(f"  {label:34s} {out[label]:.3f}", flush=True)
    for nq, Q in ((1, Q1), (32, Q32)):
        out[f"{fmt} stream q{nq}_ms"] = median_ms(lambda: maxsim_quantized_varlen(Q, values, scales, cu,
                                                                                  quantize_query=True))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--skip", nargs="*", default=[], help="providers to leave out: lut fp16 stream int8 fp8_e4m3")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    # the defaults (sm90 table), the breakdown's ablations, and the Triton scorer (earlier sweeps:
    # benchmarks/HISTORY.md)
    variants = [dict(label="gluon BT128 waves8", gluon=True),
                dict(label="gluon pairs BT128 waves8 maxnreg128", gluon=True, pairs=True, maxnreg=128),
                dict(label="gluon pairs BT128 waves4 maxnreg128", gluon=True, pairs=True, maxnreg=128, waves=4),
                dict(label="gluon pairs BT128 waves12 maxnreg128", gluon=True, pairs=True, maxnreg=128, waves=12),
                # 64-token tiles at 96 registers: 5 programs an SM (24 B of spill, sm_90 ptxas)
                dict(label="gluon pairs BT64 waves10 maxnreg96", gluon=True, pairs=True, block_tokens=64, maxnreg=96,
                     waves=10),
                dict(label="q32 gluon pairs qpb4 BT64 maxnreg168", gluon=True, pairs=True, queries=32, qpb=4,
                     block_tokens=64, maxnreg=168),
                dict(label="gluon ablation: no gather", gluon=True, ablate=1),
                dict(label="gluon ablation: no document max", gluon=True, ablate=2),
                dict(label="gluon ablation: neither", gluon=True, ablate=3),
                dict(label="BT128 w4 waves8", waves=8)]
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), docs=args.docs)
    skipped = dict(status="error", error="skipped")
    res["lut"] = skipped if "lut" in args.skip else run_isolated(lut_cell, args.docs, variants, timeout_s=args.timeout)
    res["fp16"] = skipped if "fp16" in args.skip else run_isolated(fp16_cell, args.docs, timeout_s=args.timeout)
    print("fp16", res["fp16"], flush=True)
    res["stream"] = skipped if "stream" in args.skip else run_isolated(stream_cell, args.docs, timeout_s=args.timeout)
    print("stream", res["stream"], flush=True)
    for fmt in ("int8", "fp8_e4m3"):
        res[fmt] = skipped if fmt in args.skip else run_isolated(onebyte_cell, args.docs, fmt, timeout_s=args.timeout)
        print(fmt, res[fmt], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    base, lut = res["fp16"], res["lut"]
    print(f"\n{'pq32, ' + str(args.docs) + ' docs':34s} {'ms':>8s} {'x fp16':>7s}")
    rows = [("pq " + k, v) for k, v in lut.items()] + [("pq " + k, v) for k, v in res["stream"].items()] \
        + list(res["int8"].items()) + list(res["fp8_e4m3"].items()) + [(k, v) for k, v in base.items()]
    for key, val in rows:
        timed = "ms" in key or "rows" in key or "q1" in key or "q32" in key or "BT" in key
        if isinstance(val, float) and "emulation" not in key and timed:
            ref = base.get("fp16_q32_ms" if "q32" in key else "fp16_q1_ms")
            ratio = f"{ref / val:.2f}" if isinstance(ref, float) else ""
            print(f"{key:34s} {val:8.3f} {ratio:>7s}")


if __name__ == "__main__":
    main()
