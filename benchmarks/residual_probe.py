"""Probe: the residual scorer's inner loop at the speed of its bytes (issue 54, point 1). Needs a GPU.

    python benchmarks/residual_probe.py [--docs 1000000] [--out results/residual_probe.json]

One query (and 32) x ``--docs`` documents of 32-96 tokens, d 128, 65536 centroids, codes drawn at
random (every centroid row of the table equally likely: the look-up's worst case for L1):

- ``lut``: :mod:`maxsim.compressed.residual_lut` (codes expanded to int8 weights in registers by a
  byte permute, int8 tensor-core dot against the quantised query, the centroid term gathered from
  a per-query ``Q @ C^T`` table, stored norms, max and sum fused) and its Gluon form
  :mod:`maxsim.compressed.residual_gluon` ("gluon ..." rows), over a few tiles; with
  ``--ablations`` the Triton scorer's ablations that split its time (no table gather, no
  per-document max, no decode, neither gather nor max); and the same bytes read by a plain
  reduction (``bytes``: the stream's floor);
- ``fp16``: ``maxsim.maxsim_varlen`` on the corpus decoded to fp16 (the bar's baseline);
- ``plane``: today's plane-by-plane residual kernel (``maxsim_residual_varlen``);
- ``gemlite``: GemLite 0.6.0's A16W2 / A16W4 GEMM at M 32, K 128 over 8M output columns (pure
  Triton weight-only-quantised GEMM; it writes its [32, N] output, which the table counts), if the
  package imports.

Each provider runs in its own process (``_isolate``). Times are medians of
``triton.testing.do_bench``; the corpus is far larger than L2. Correctness first: the kernel
against its float64 emulation on the first documents, and its top-10 against the plane kernel's.
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
from _isolate import failed, run_isolated  # noqa: E402

DIM, LQ, CENTROIDS, SEED = 128, 32, 65536, 0


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def make_case(nbits: int, docs: int, device="cuda"):
    """(codec, codes [T] int32, residuals [T, P] uint8, cu [Nd + 1] int64): a fixed seed."""
    from maxsim.compressed import ResidualCodec

    g = torch.Generator(device=device).manual_seed(SEED)
    centroids = torch.nn.functional.normalize(torch.randn(CENTROIDS, DIM, device=device, generator=g), dim=-1)
    levels = 1 << nbits
    weights = torch.linspace(-0.12, 0.12, levels, device=device) * (1 + 0.3 * torch.rand(levels, device=device,
                                                                                           generator=g))
    codec = ResidualCodec(centroids.half().float(), weights.sort().values.half().float(), nbits)
    lengths = torch.randint(32, 97, (docs,), device=device, generator=g)
    cu = torch.zeros(docs + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    T = int(cu[-1])
    codes = torch.randint(0, CENTROIDS, (T,), device=device, generator=g, dtype=torch.int32)
    residuals = torch.randint(0, 256, (T, DIM * nbits // 8), device=device, generator=g, dtype=torch.uint8)
    return codec, codes, residuals, cu


def queries(n: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(SEED + 1)
    return torch.nn.functional.normalize(torch.randn(n, LQ, DIM, device=device, generator=g), dim=-1).half()


def lut_cell(nbits: int, docs: int, variants: list, scores_path: str) -> dict:
    from maxsim.compressed.residual_lut import build_layout, lut_emulation, lut_scores

    codec, codes, residuals, cu = make_case(nbits, docs)
    t = time.perf_counter()
    layout = build_layout(codec, codes, residuals, cu)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    out = dict(tokens=codes.numel(), padded_tokens=layout.codes.shape[0], layout_bytes=layout.nbytes(),
               build_s=build_s)
    # correctness on the first documents (the decoder's pack order, the gather, the segmented max)
    small = 3000
    cu_s = cu[: small + 1]
    t_s = int(cu_s[-1])
    lay_s = build_layout(codec, codes[:t_s], residuals[:t_s], cu_s)
    Qc = queries(3)
    got = lut_scores(Qc, lay_s, codec.centroids).double().cpu()
    ref = lut_emulation(Qc, codec, codes[:t_s], residuals[:t_s], cu_s, lay_s)
    out["emulation_max_abs"] = float((got - ref).abs().max())
    out["emulation_ok"] = bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-4))
    try:
        from maxsim.compressed.residual_gluon import gluon_scores

        got_g = gluon_scores(Qc, lay_s, codec.centroids).double().cpu()
        out["gluon_emulation_max_abs"] = float((got_g - ref).abs().max())
        out["gluon_emulation_ok"] = bool(torch.allclose(got_g, ref, rtol=1e-5, atol=1e-4))
        ref32 = lut_emulation(Qc, codec, codes[:t_s], residuals[:t_s], cu_s, lay_s, table_dtype=torch.float32)
        got_32 = gluon_scores(Qc, lay_s, codec.centroids, table_dtype=torch.float32).double().cpu()
        out["gluon_fp32_table_emulation_max_abs"] = float((got_32 - ref32).abs().max())
        out["gluon_fp32_table_emulation_ok"] = bool(torch.allclose(got_32, ref32, rtol=1e-5, atol=1e-4))
    except Exception as e:  # the Gluon kernel is a cell of the probe, not a dead run
        out["gluon_emulation_ok"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    print("  correctness", {k: v for k, v in out.items() if "emulation" in k}, flush=True)
    del lay_s, codes, residuals
    Q1, Q32 = queries(1), queries(32)
    torch.save(lut_scores(Q1, layout, codec.centroids).cpu(), scores_path)
    for v in variants:
        v = dict(v)
        label = v.pop("label")
        nq = v.pop("queries", 1)
        Q = Q1 if nq == 1 else Q32
        use_gluon = v.pop("gluon", False)
        if "table" in v:
            v["table_dtype"] = torch.float32 if v.pop("table") == "fp32" else torch.float16
        try:
            if use_gluon:
                from maxsim.compressed.residual_gluon import gluon_scores

                ms = median_ms(lambda: gluon_scores(Q, layout, codec.centroids, **v))
            else:
                ms = median_ms(lambda: lut_scores(Q, layout, codec.centroids, **v))
        except Exception as e:  # a tile that does not compile is a cell, not a dead run
            ms = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        out[label] = ms
        print(f"  lut{nbits} {label:34s} {ms if isinstance(ms, str) else format(ms, '.3f')}", flush=True)
    # the bytes alone: the codes, ids and norms read once by plain reductions
    out["bytes_ms"] = median_ms(lambda: (layout.codes.view(torch.int32).sum(dtype=torch.int32),
                                         layout.cid.sum(dtype=torch.int32), layout.inv_norm.sum()))
    return out


def _search_ms(corpus, nq: int) -> float:
    """Median ms of ``corpus.search`` (top-10) for ``nq`` queries, after one warm call."""
    Q = queries(nq)
    corpus.search(Q, 10, progress=False)
    torch.cuda.synchronize()
    return median_ms(lambda: corpus.search(Q, 10, progress=False))


def search_cell(nbits: int, docs: int) -> dict:
    """``Corpus.search`` end to end on a resident residual corpus (the look-up scorer, its layout
    built by the first search): the first search's seconds, then ms at 1 and 32 queries."""
    import numpy as np

    from maxsim.search.corpus import Corpus, CorpusSegment

    codec, codes, residuals, cu = make_case(nbits, docs)
    segment = CorpusSegment(codes, cu.cpu().numpy(), 0, residuals=residuals)
    corpus = Corpus._from_segments([segment], np.arange(docs), codec=codec)
    Q = queries(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    corpus.search(Q, 10, progress=False)
    torch.cuda.synchronize()
    out = dict(first_search_s=time.perf_counter() - t, layout_bytes=segment._lookup and
               next(iter(segment._lookup.values())).nbytes(), codes_bytes=codes.numel() * 4 + residuals.numel())
    for nq in (1, 32):
        out[f"search_q{nq}_ms"] = _search_ms(corpus, nq)
    return out


def fp16_cell(docs: int) -> dict:
    import maxsim
    from maxsim.search.corpus import Corpus

    codec, codes, residuals, cu = make_case(2, docs)
    decoded = codec.decode(codes, residuals, normalize=True, dtype=torch.float16)
    del codes, residuals
    out = dict(fp16_bytes=decoded.numel() * 2)
    corpus = Corpus.from_packed(decoded, cu.cpu().numpy())
    for nq in (1, 32):
        out[f"search_fp16_q{nq}_ms"] = _search_ms(corpus, nq)
    del corpus
    max_len = int((cu[1:] - cu[:-1]).max())
    for nq in (1, 32):
        Q = queries(nq)
        q = Q.reshape(-1, DIM)
        cu_q = torch.arange(nq + 1, device=q.device) * LQ
        out[f"fp16_q{nq}_ms"] = median_ms(lambda: maxsim.maxsim_varlen(q, decoded, cu_q, cu, max_seqlen_q=LQ,
                                                                      max_seqlen_d=max_len))
    out["copy_TBs"] = 2 * decoded.numel() * 2 / (median_ms(lambda: decoded.clone()) * 1e-3) / 1e12
    return out


def plane_cell(nbits: int, docs: int, scores_path: str) -> dict:
    from maxsim.compressed import maxsim_residual_varlen

    codec, codes, residuals, cu = make_case(nbits, docs)
    Q = queries(1)
    max_len = int((cu[1:] - cu[:-1]).max())
    fn = lambda: maxsim_residual_varlen(Q, codes, residuals, cu, codec, max_seqlen_d=max_len,  # noqa: E731
                                        decode_dtype=torch.float32)
    torch.save(fn().cpu(), scores_path)
    return dict(plane_fp32_ms=median_ms(fn),
                plane_fp16_ms=median_ms(lambda: maxsim_residual_varlen(Q, codes, residuals, cu, codec,
                                                                       max_seqlen_d=max_len)))


def gemlite_cell(nbits: int, n: int) -> dict:
    import gemlite
    from gemlite import DType, GemLiteLinear

    lin = GemLiteLinear(nbits, group_size=DIM, in_features=DIM, out_features=n, input_dtype=DType.FP16,
                        output_dtype=DType.FP16)
    W_q = torch.randint(0, 1 << nbits, (n, DIM), device="cuda", dtype=torch.uint8)
    scales = torch.rand(n, 1, device="cuda", dtype=torch.float16) * 0.01
    zeros = torch.full((n, 1), (1 << nbits) / 2, device="cuda", dtype=torch.float16)
    lin.pack(W_q, scales, zeros, None)
    x = queries(1)[0]  # [32, 128]
    lin(x)
    torch.cuda.synchronize()
    return dict(gemlite_ms=median_ms(lambda: lin(x)), gemlite_version=getattr(gemlite, "__version__", "?"),
                out_bytes=32 * n * 2, weight_bytes=n * DIM * nbits // 8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--nbits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--gemlite-n", type=int, default=8 << 20)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ablations", action="store_true", help="also time the Triton scorer's ablations")
    p.add_argument("--profile", action="store_true", help="build one 2-bit case, score it three times with the "
                   "scorer Corpus.search picks (for ncu)")
    p.add_argument("--profile-queries", type=int, default=1, help="queries a --profile call")
    p.add_argument("--skip", nargs="*", default=[], help="providers to leave out: fp16 plane gemlite search")
    p.add_argument("--sweep", action="store_true", help="also time the Gluon scorer's tile variants")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    variants = [
        dict(label="gluon BT64 maxnreg128", gluon=True, maxnreg=128), dict(label="gluon BT64", gluon=True),
        dict(label="gluon BT64 pairs", gluon=True, pairs=True),
        dict(label="BT128 w4 waves8", waves=8),
    ]
    if args.sweep:  # the Gluon scorer's knobs
        variants += [dict(label="gluon BT64 fp32 table", gluon=True, table="fp32"),
                     dict(label="gluon BT128", gluon=True, block_tokens=128),
                     dict(label="gluon BT64 waves4 maxnreg128", gluon=True, waves=4, maxnreg=128),
                     dict(label="gluon BT64 waves12 maxnreg128", gluon=True, waves=12, maxnreg=128),
                     dict(label="gluon BT64 waves16 maxnreg128", gluon=True, waves=16, maxnreg=128),
                     dict(label="q32 gluon qpb4 fp32 table", queries=32, gluon=True, qpb=4, table="fp32")]
    if args.ablations:
        variants += [
            dict(label="ablation: no table", no_table=True), dict(label="ablation: no document max", ablate=1),
            dict(label="ablation: no decode", ablate=2),
            dict(label="ablation: no table, no doc max", no_table=True, ablate=1),
            # the Gluon scorer's (a sum of): 1 table row 0 (no gather), 2 no document maxima, 4 no expansion
            dict(label="gluon ablation: no gather", gluon=True, ablate=1),
            dict(label="gluon ablation: no document max", gluon=True, ablate=2),
            dict(label="gluon ablation: no expansion", gluon=True, ablate=4),
            dict(label="gluon ablation: none of them", gluon=True, ablate=7),
        ]
    variants += [dict(label="q32 qpb2", queries=32, qpb=2), dict(label="q32 gluon qpb1", queries=32, gluon=True),
                 dict(label="q32 gluon qpb2", queries=32, gluon=True, qpb=2),
                 dict(label="q32 gluon qpb4", queries=32, gluon=True, qpb=4),
                 dict(label="q32 gluon qpb4 pairs", queries=32, gluon=True, qpb=4, pairs=True)]
    # One query at 96 registers: 5 programs an SM (20 warps, against 16 at 128; the scorer waits on
    # loads with 23 % occupancy), for a spill of 56 B (sm_90 ptxas); waves in whole rounds of 5.
    variants += [dict(label=f"gluon BT64 maxnreg96 waves{w}", gluon=True, maxnreg=96, waves=w) for w in (10, 15)]
    if args.profile:  # a few launches under ncu: what Corpus.search runs (the sm90 table's choice), 2 bits
        from maxsim.compressed.residual_lut import build_layout
        from maxsim.compressed.scoring import lookup_scorer, lookup_scores

        codec, codes, residuals, cu = make_case(2, args.docs)
        layout = build_layout(codec, codes, residuals, cu)
        del codes, residuals
        Q = queries(args.profile_queries)
        choice = lookup_scorer(Q, None, codec)
        if isinstance(choice, str):
            raise SystemExit(f"no look-up scorer here: {choice}")
        print("scorer:", choice.kernel, choice.config, flush=True)
        for _ in range(3):
            lookup_scores(Q, None, layout, codec, choice)
        torch.cuda.synchronize()
        return
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), docs=args.docs)
    tmp = os.environ.get("TMPDIR", "/tmp")
    skipped = dict(status="error", error="skipped")
    res["fp16"] = skipped if "fp16" in args.skip else run_isolated(fp16_cell, args.docs, timeout_s=args.timeout)
    print("fp16", res["fp16"], flush=True)
    for nbits in args.nbits:
        lp, pp = f"{tmp}/lut{nbits}.pt", f"{tmp}/plane{nbits}.pt"
        res[f"lut{nbits}"] = run_isolated(lut_cell, nbits, args.docs, variants, lp, timeout_s=args.timeout)
        res[f"plane{nbits}"] = skipped if "plane" in args.skip else run_isolated(plane_cell, nbits, args.docs, pp,
                                                                                 timeout_s=args.timeout)
        print(f"plane{nbits}", res[f"plane{nbits}"], flush=True)
        if res[f"lut{nbits}"]["status"] == res[f"plane{nbits}"]["status"] == "ok":
            a, b = torch.load(lp)[0], torch.load(pp)[0]
            res[f"lut{nbits}"]["top10_overlap_vs_plane_fp32"] = len(
                set(a.topk(10).indices.tolist()) & set(b.topk(10).indices.tolist())) / 10
            res[f"lut{nbits}"]["max_abs_vs_plane_fp32"] = float((a - b).abs().max())
        res[f"search{nbits}"] = skipped if "search" in args.skip else run_isolated(search_cell, nbits, args.docs,
                                                                                   timeout_s=args.timeout)
        print(f"search{nbits}", res[f"search{nbits}"], flush=True)
        res[f"gemlite{nbits}"] = skipped if "gemlite" in args.skip else run_isolated(
            gemlite_cell, nbits, args.gemlite_n, timeout_s=args.timeout)
        print(f"gemlite{nbits}", res[f"gemlite{nbits}"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    # the short table, last
    f16 = res["fp16"].get("fp16_q1_ms") if res["fp16"]["status"] == "ok" else None
    f32 = res["fp16"].get("fp16_q32_ms") if res["fp16"]["status"] == "ok" else None
    print(f"\n{res['device']}  docs {args.docs}  fp16 q1 {f16} ms  q32 {f32} ms  copy {res['fp16'].get('copy_TBs')} TB/s")
    for nbits in args.nbits:
        r = res[f"lut{nbits}"]
        if failed(r):
            print(f"lut{nbits}: {failed(r)}")
            continue
        print(f"lut{nbits}: emulation ok {r['emulation_ok']} ({r['emulation_max_abs']:.2e}), gluon "
              f"{r.get('gluon_emulation_ok')} ({r.get('gluon_emulation_max_abs')}); top10 vs plane "
              f"{r.get('top10_overlap_vs_plane_fp32')}; bytes {r['layout_bytes'] / 1e9:.2f} GB read in "
              f"{r['bytes_ms']:.3f} ms; build {r['build_s']:.1f} s")
        for v in variants:
            ms = r.get(v["label"])
            ref = f32 if v.get("queries", 1) == 32 else f16
            x = f"{ref / ms:.2f}x fp16" if isinstance(ms, float) and ref else ""
            print(f"   {v['label']:28s} {ms if not isinstance(ms, float) else format(ms, '.3f')} ms  {x}")
        pl = res[f"plane{nbits}"]
        print(f"   plane kernel: {pl.get('plane_fp16_ms')} ms (fp16 decode), {pl.get('plane_fp32_ms')} (fp32)"
              f" {failed(pl) or ''}")
        sr = res[f"search{nbits}"]
        if failed(sr):
            print(f"   Corpus.search: {failed(sr)}")
        else:
            fq1, fq32 = res["fp16"].get("search_fp16_q1_ms"), res["fp16"].get("search_fp16_q32_ms")
            print(f"   Corpus.search top-10: q1 {sr['search_q1_ms']:.3f} ms ({1e3 / sr['search_q1_ms']:.0f} q/s; fp16 "
                  f"corpus {fq1} ms), q32 {sr['search_q32_ms']:.3f} ms ({32e3 / sr['search_q32_ms']:.0f} q/s; fp16 "
                  f"{fq32} ms); first search (layout built) {sr['first_search_s']:.2f} s")
        g = res[f"gemlite{nbits}"]
        if failed(g):
            print(f"   gemlite A16W{nbits}: {failed(g)}")
        else:
            per_tok_ns = g["gemlite_ms"] * 1e6 / args.gemlite_n
            print(f"   gemlite A16W{nbits} M32 K128 N{args.gemlite_n}: {g['gemlite_ms']:.3f} ms = "
                  f"{per_tok_ns * r['tokens'] / 1e6:.3f} ms at this corpus's {r['tokens']} tokens (writes "
                  f"{g['out_bytes'] / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
