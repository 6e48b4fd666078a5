"""Ragged batches: packed maxsim against padded maxsim, padded naive PyTorch and the peers'
varlen paths, on three document-length distributions with max length 512 (GPU).

    python benchmarks/varlen_bench.py [--nd 20000] [--out DIR]

32 queries of 32 tokens against Nd documents whose lengths follow:
  uniform   U[256, 512]                        (fill ~0.75)
  hotpotqa  exponential, mean ~150, <= 512     (fill ~0.3)
  ragged    exponential, mean ~80, <= 512      (fill ~0.16)
Each provider runs in its own subprocess (a peer's illegal memory access cannot take the others
down). Prints a table; the bar is speed-up over padded maxsim >= 0.8 / fill.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MAX_LEN = 512
DISTRIBUTIONS = ("uniform", "hotpotqa", "ragged")
PROVIDERS = ("maxsim-varlen", "maxsim-padded", "naive-padded", "late-interaction-kernels", "flash-maxsim")


def doc_lengths(kind: str, n: int, gen):
    import torch

    if kind == "uniform":
        return torch.randint(256, MAX_LEN + 1, (n,), generator=gen)
    mean = {"hotpotqa": 150.0, "ragged": 80.0}[kind]
    x = torch.empty(n).exponential_(1.0 / mean, generator=gen)
    return x.round().clamp(1, MAX_LEN).long()


def make(kind: str, nd: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = doc_lengths(kind, nd, gen)
    cu_d = torch.zeros(nd + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_d[1:])
    g = torch.Generator(device="cuda").manual_seed(1)
    d = torch.randn(int(cu_d[-1]), 128, generator=g, device="cuda", dtype=torch.float16)
    q = torch.randn(32 * 32, 128, generator=g, device="cuda", dtype=torch.float16)
    cu_q = torch.arange(0, 33 * 32, 32, dtype=torch.int64)
    return q, d, cu_q.cuda(), cu_d.cuda(), lengths


def worker(provider: str, kind: str, nd: int) -> dict:
    import torch
    import triton

    import maxsim

    q, d, cu_q, cu_d, lengths = make(kind, nd)
    max_d = int(lengths.max())
    Qp, qm = maxsim.packed_to_padded(q, cu_q, 32)
    Dp, dm = maxsim.packed_to_padded(d, cu_d, MAX_LEN)
    ref = maxsim.maxsim(Qp, Dp, qm, dm)
    if provider == "maxsim-varlen":
        fn = lambda: maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=32, max_seqlen_d=max_d)  # noqa: E731
    elif provider == "maxsim-padded":
        fn = lambda: maxsim.maxsim(Qp, Dp, qm, dm)  # noqa: E731
    elif provider == "naive-padded":
        def fn():
            S = torch.einsum("ash,bth->abst", Qp, Dp) * dm[None, :, None, :]
            return S.max(-1).values.float().sum(-1)
    elif provider == "late-interaction-kernels":
        import late_interaction_kernels as lik

        cq, cd = cu_q.to(torch.int32), cu_d.to(torch.int32)
        fn = lambda: lik.maxsim_varlen(q, d, cq, cd, 32, max_d)  # noqa: E731
    elif provider == "flash-maxsim":
        import flash_maxsim as fm

        cd = cu_d.to(torch.int32)
        Qs = q.view(32, 32, 128)
        fn = lambda: torch.stack([fm.flash_maxsim_packed(Qs[i], d, cd, max_d) for i in range(32)])  # noqa: E731
    else:
        raise ValueError(provider)
    out = fn()
    torch.cuda.synchronize()
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fill = float(lengths.float().mean()) / MAX_LEN
    return {"dist": kind, "provider": provider, "ms": ms, "rel_err": err, "fill": fill}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nd", type=int, default=20000)
    ap.add_argument("--out", default=".")
    ap.add_argument("--worker", nargs=2, metavar=("PROVIDER", "DIST"))
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], args.nd)), flush=True)
        return 0
    rows = []
    for kind in DISTRIBUTIONS:
        for provider in PROVIDERS:
            proc = subprocess.run([sys.executable, __file__, "--nd", str(args.nd), "--worker", provider, kind],
                                  capture_output=True, text=True, timeout=600)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line:
                rows.append(json.loads(line[7:]))
            else:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:90]
                rows.append({"dist": kind, "provider": provider, "ms": None, "note": err})
            print(rows[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "varlen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\n{'dist':9s} {'fill':>5s} {'provider':26s} {'ms':>8s} {'rel err':>8s} {'vs padded maxsim':>17s} {'bar 0.8/fill':>12s}")
    for kind in DISTRIBUTIONS:
        padded = next((r["ms"] for r in rows if r["dist"] == kind and r["provider"] == "maxsim-padded"), None)
        for r in (r for r in rows if r["dist"] == kind):
            if r.get("ms") is None:
                print(f"{kind:9s} {'':>5s} {r['provider']:26s} {'failed':>8s}  {r.get('note', '')}")
                continue
            speed = padded / r["ms"] if padded else float("nan")
            print(f"{kind:9s} {r['fill']:5.2f} {r['provider']:26s} {r['ms']:8.3f} {r['rel_err']:8.1e} "
                  f"{speed:16.2f}x {0.8 / r['fill']:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
