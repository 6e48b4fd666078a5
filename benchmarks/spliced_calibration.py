"""Does splicing (``spliced_passages.py``) look like real tokens to PLAID and the codecs? A real
corpus of word-model passages beside corpora spliced to the same size from a pool a tenth of it
(the ratio of the 10M headline to its 1M pool), one row each:

    python benchmarks/real_passages.py --docs 8000 --out /tmp/calib/real --generated-only --seed 0
    python benchmarks/real_passages.py --docs 800 --out /tmp/calib/pool --generated-only --seed 1
    python benchmarks/spliced_calibration.py --real /tmp/calib/real --pool /tmp/calib/pool --jumps 0.1,0.25,0.5,1

Columns: passages a centroid's list holds (mean over non-empty lists of the residual2 codec trained
on the corpus itself: PLAID's candidate generation feeds on these), the source passage's rank
(exact top-1 share), recall@10 against the exact fp32 top-10 of the residual2 scan and of PLAID's
first stage at a few (ncells, ndocs) settings (no threshold), and the exact scores' shape
((s_r - s_100) / (s_2 - s_100) at ranks 10 and 50, mean over queries). Every corpus's queries are
made the same way: spans of random passages' wordpieces, decoded and encoded by MiniLM
(``spliced_passages.encode_spans``). The jump whose row is nearest the real one on the PLAID and scan
recalls is ``spliced_passages.JUMP``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from headline_bench import _recall  # noqa: E402

K = 10
PLAID_SETTINGS = ((1, 64), (2, 64), (2, 256), (4, 256))  # (ncells, ndocs)
SHAPE_RANKS = (10, 50)


def measure(tokens: torch.Tensor, offsets: np.ndarray, Q: torch.Tensor, source: torch.Tensor) -> dict:
    """The row's numbers for one corpus: tokens [T, d] fp16, offsets [N + 1], Q [Nq, 32, d]."""
    import maxsim

    exact = maxsim.Corpus.from_packed(tokens.float(), offsets, encoding="float32").search(Q.float(), 100)
    s = exact.scores  # [Nq, 100]
    shape = {f"shape_r{r}": float(((s[:, r - 1] - s[:, 99]) / (s[:, 1] - s[:, 99]).clamp_min(1e-9)).mean())
             for r in SHAPE_RANKS}
    truth = exact.indices[:, :K]
    torch.manual_seed(0)
    corpus = maxsim.Corpus.from_packed(tokens, offsets, encoding="residual2")
    index = maxsim.index.from_corpus(corpus)
    lists = index.ivf_lengths[index.ivf_lengths > 0].float()
    row = dict(passages=len(offsets) - 1, tokens=int(tokens.shape[0]), centroids=int(index.ivf_lengths.numel()),
               list_mean=float(lists.mean()), list_median=float(lists.median()),
               source_top1=float((exact.indices[:, 0] == source).float().mean()),
               scan=_recall(corpus.search(Q, K).indices, truth), **shape)
    for ncells, ndocs in PLAID_SETTINGS:
        found = index.search(Q, K, ncells=ncells, ndocs=ndocs, centroid_score_threshold=None).indices
        row[f"plaid_{ncells}_{ndocs}"] = _recall(found, truth)
    return row


def real_corpus(folder: str, num_queries: int, seed: int):
    """The real folder's tokens and queries made as the spliced corpora's are."""
    from spliced_passages import encode_spans

    tokens = torch.from_numpy(np.load(os.path.join(folder, "tokens.npy")))
    lengths = np.load(os.path.join(folder, "lengths.npy"))
    ids = np.load(os.path.join(folder, "ids.npy"))
    with open(os.path.join(folder, "meta.json")) as handle:
        meta = json.load(handle)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(seed)
    source = rng.choice(lengths.size, num_queries, replace=False)
    rows = [ids[offsets[j]:offsets[j + 1]] for j in source]
    Q = encode_spans(rows, tokens.shape[1], int(meta.get("seed", 0)), "cpu", rng)
    return tokens, offsets, Q, torch.from_numpy(source.astype(np.int64))


def spliced_corpus(pool: str, num_docs: int, jump: float, num_queries: int):
    from spliced_passages import SplicedPassages

    gen = SplicedPassages(pool, num_docs, device="cpu", num_queries=num_queries, jump=jump)
    (_, tokens, offsets), = list(gen.slices())
    Q, source = gen.queries()
    return tokens, offsets, Q, source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", required=True)
    ap.add_argument("--pool", required=True)
    ap.add_argument("--jumps", default="0.1,0.25,0.5,1")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--out", help="JSON lines, one a corpus")
    args = ap.parse_args()
    rows = []
    tokens, offsets, Q, source = real_corpus(args.real, args.queries, seed=7)
    rows.append(dict(corpus="real", **measure(tokens, offsets, Q, source)))
    num_docs = len(offsets) - 1
    for jump in (float(j) for j in args.jumps.split(",")):
        rows.append(dict(corpus=f"spliced jump {jump:g}", **measure(*spliced_corpus(args.pool, num_docs, jump,
                                                                                  args.queries))))
        print(json.dumps(rows[-1]), flush=True)
    keys = ["list_mean", "list_median", "source_top1", "scan"] + [f"plaid_{c}_{d}" for c, d in PLAID_SETTINGS] \
        + [f"shape_r{r}" for r in SHAPE_RANKS]
    print("| corpus | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for row in rows:
        print(f"| {row['corpus']} | " + " | ".join(f"{row[k]:.3f}" if k != "list_mean" else f"{row[k]:.1f}"
                                                  for k in keys) + " |")
    if args.out:
        with open(args.out, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
