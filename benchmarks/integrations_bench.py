"""Speed and memory of the drop-in integrations on the GPU, against each library's own paths.

    python benchmarks/integrations_bench.py [--batch 32] [--pages 1000] [--skip-colpali] [--skip-pylate]

Rows:
- PyLate ``Contrastive`` training step (its real forward: normalise, stack, score, cross entropy,
  backward), in-batch with one hard negative, ColBERT shapes (Lq 32, Ld 180, d 128), fp32
  embeddings as PyLate's models produce them: PyLate's torch path, its ``lik`` / ``flash``
  backends when importable, and maxsim through ``maxsim.integrations.pylate.patch()``.
- colpali ``score_multi_vector`` of 16 queries (20 tokens) against 1K pages (1030 tokens), bf16:
  colpali's torch path, its ``lik`` backend when importable, maxsim through ``patch()``.

Median ms from ``triton.testing.do_bench`` and the peak memory of one call above its inputs.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton.testing


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _row(rows, name, fn, reference=None):
    try:
        result = fn()  # also the warm-up (compilation)
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        peak = _peak_mb(fn)
    except Exception as error:  # a backend that cannot run these shapes: say so, keep going
        rows.append((name, f"failed: {type(error).__name__}: {error}"[:90], "", ""))
        return None
    error = ""
    if reference is not None:
        error = f"{float((result.float() - reference.float()).norm() / reference.float().norm()):.1e}"
    rows.append((name, f"{ms:.3f}", f"{peak:.0f}", error))
    return result


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _EmbeddingsModel(torch.nn.Module):
    """Stands in for a ColBERT model inside the real loss: returns the batch's precomputed token
    embeddings, so the step times scoring and its backward, not the encoder."""

    skiplist: list[int] = []
    do_query_expansion = True  # ColBERT queries: no query mask

    def forward(self, features):
        return {"token_embeddings": features["embeddings"]}


def bench_pylate(rows, batch: int) -> None:
    from pylate import losses

    from maxsim.integrations import pylate as maxsim_pylate

    q_len, d_len, dim = 32, 180, 128
    device = "cuda"
    queries = torch.randn(batch, q_len, dim, device=device, requires_grad=True)
    documents = [torch.randn(batch, d_len, dim, device=device, requires_grad=True) for _ in range(2)]
    lengths = torch.randint(d_len // 2, d_len + 1, (2, batch))

    def features(embeddings, doc_lengths=None):
        rows_, length = embeddings.shape[:2]
        mask = torch.ones(rows_, length, dtype=torch.long, device=device)
        if doc_lengths is not None:
            mask = (torch.arange(length, device=device)[None, :] < doc_lengths.to(device)[:, None]).long()
        return {"input_ids": torch.ones_like(mask), "attention_mask": mask, "embeddings": embeddings}

    batch_features = [features(queries)] + [features(d, lengths[i]) for i, d in enumerate(documents)]
    loss = losses.Contrastive(model=_EmbeddingsModel())

    def step():
        for tensor in (queries, *documents):
            tensor.grad = None
        value = loss(batch_features)
        value.backward()
        return value.detach().reshape(1)

    label = f"pylate Contrastive step B={batch} (Lq {q_len}, Ld {d_len}, N 2, fp32)"
    rows.append((label, "", "", ""))
    os.environ["PYLATE_SCORES_BACKEND"] = "torch"
    reference = _row(rows, "  pylate torch", step)
    for backend, module in (("lik", "late_interaction_kernels"), ("flash", "flash_maxsim")):
        if _importable(module):
            os.environ["PYLATE_SCORES_BACKEND"] = backend
            _row(rows, f"  pylate {backend}", step, reference)
        else:
            rows.append((f"  pylate {backend}", f"not installed ({module})", "", ""))
    os.environ["PYLATE_SCORES_BACKEND"] = "auto"
    maxsim_pylate.patch()
    try:
        _row(rows, "  maxsim (patch)", step, reference)
    finally:
        maxsim_pylate.unpatch()


def bench_colpali(rows, pages: int) -> None:
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    from maxsim.integrations import colpali as maxsim_colpali

    device = "cuda"
    queries = [torch.nn.functional.normalize(torch.randn(20, 128, device=device), dim=-1).bfloat16() for _ in range(16)]
    passages = [torch.nn.functional.normalize(torch.randn(1030, 128, device=device), dim=-1).bfloat16()
                for _ in range(pages)]

    def score():
        with torch.no_grad():
            return BaseVisualRetrieverProcessor.score_multi_vector(queries, passages, device=device)

    rows.append((f"colpali score_multi_vector 16 x {pages} pages (20 x 1030 tokens, bf16)", "", "", ""))
    os.environ["COLPALI_SCORES_BACKEND"] = "torch"
    reference = _row(rows, "  colpali torch", score)
    if _importable("late_interaction_kernels"):
        os.environ["COLPALI_SCORES_BACKEND"] = "lik"
        _row(rows, "  colpali lik", score, reference)
    else:
        rows.append(("  colpali lik", "not installed (late_interaction_kernels)", "", ""))
    os.environ["COLPALI_SCORES_BACKEND"] = "auto"
    maxsim_colpali.patch()
    try:
        _row(rows, "  maxsim (patch)", score, reference)
    finally:
        maxsim_colpali.unpatch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="PyLate training batch (queries)")
    parser.add_argument("--pages", type=int, default=1000, help="colpali pages")
    parser.add_argument("--skip-pylate", action="store_true")
    parser.add_argument("--skip-colpali", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("integrations_bench.py needs a CUDA GPU")
    rows: list[tuple[str, str, str, str]] = []
    if not args.skip_pylate:
        bench_pylate(rows, args.batch)
    if not args.skip_colpali:
        bench_colpali(rows, args.pages)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'case':72} {'median ms':>10} {'peak MB':>9} {'rel err':>8}")
    for name, ms, peak, error in rows:
        print(f"{name:72} {ms:>10} {peak:>9} {error:>8}")


if __name__ == "__main__":
    main()
