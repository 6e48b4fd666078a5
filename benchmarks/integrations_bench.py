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

Each backend runs in a fresh process (benchmarks/_isolate.py) that builds its inputs from a fixed
seed: a backend that crashes the CUDA context is a ``crashed`` row. The results meet in files, for
the relative error against the library's torch path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import triton.testing
from _isolate import DEFAULT_TIMEOUT_S, failed, run_isolated

SEED = 0


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(fn, result_path: str) -> dict:
    """ms and peak MB of ``fn``; its output goes to ``result_path`` (for the parent's rel err)."""
    result = fn()  # also the warm-up (compilation)
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    peak = _peak_mb(fn)
    torch.save(result.detach().float().cpu(), result_path)
    return {"ms": ms, "peak": peak}


def _row(rows, name, cell, args, result_path: str, *, reference_path: str | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S):
    """Run ``cell(*args, result_path)`` in its own process and add its row; a backend that cannot
    run these shapes, or crashes, says so in the ms column and the run goes on."""
    measured = run_isolated(cell, *args, result_path, timeout_s=timeout_s)
    if measured["status"] != "ok":
        rows.append((name, failed(measured)[:90], "", ""))
        return
    error = ""
    if reference_path is not None and Path(reference_path).exists():
        result, reference = torch.load(result_path), torch.load(reference_path)
        error = f"{float((result - reference).norm() / reference.norm()):.1e}"
    rows.append((name, f"{measured['ms']:.3f}", f"{measured['peak']:.0f}", error))


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


PYLATE_SHAPE = (32, 180, 128)  # Lq, Ld, d


def pylate_cell(batch: int, backend: str, result_path: str) -> dict:
    """One PyLate Contrastive step with ``backend`` (torch, lik, flash, or maxsim through patch()),
    in its own process."""
    from pylate import losses

    from maxsim.integrations import pylate as maxsim_pylate

    q_len, d_len, dim = PYLATE_SHAPE
    device = "cuda"
    torch.manual_seed(SEED)
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

    os.environ["PYLATE_SCORES_BACKEND"] = "auto" if backend == "maxsim" else backend
    if backend == "maxsim":
        maxsim_pylate.patch()  # this process ends with the measurement: no unpatch
    return _measure(step, result_path)


def bench_pylate(rows, batch: int, tmp: str, timeout_s: float) -> None:
    q_len, d_len, _ = PYLATE_SHAPE
    label = f"pylate Contrastive step B={batch} (Lq {q_len}, Ld {d_len}, N 2, fp32)"
    if not _importable("pylate"):
        rows.append((label, "not installed (pylate)", "", ""))
        return
    rows.append((label, "", "", ""))
    path = {b: str(Path(tmp) / f"pylate-{b}.pt") for b in ("torch", "lik", "flash", "maxsim")}
    _row(rows, "  pylate torch", pylate_cell, (batch, "torch"), path["torch"], timeout_s=timeout_s)
    for backend, module in (("lik", "late_interaction_kernels"), ("flash", "flash_maxsim")):
        if _importable(module):
            _row(rows, f"  pylate {backend}", pylate_cell, (batch, backend), path[backend],
                 reference_path=path["torch"], timeout_s=timeout_s)
        else:
            rows.append((f"  pylate {backend}", f"not installed ({module})", "", ""))
    _row(rows, "  maxsim (patch)", pylate_cell, (batch, "maxsim"), path["maxsim"], reference_path=path["torch"],
         timeout_s=timeout_s)


def colpali_cell(pages: int, backend: str, result_path: str) -> dict:
    """colpali's score_multi_vector with ``backend`` (torch, lik, or maxsim through patch()), in
    its own process."""
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    from maxsim.integrations import colpali as maxsim_colpali

    device = "cuda"
    torch.manual_seed(SEED)
    queries = [torch.nn.functional.normalize(torch.randn(20, 128, device=device), dim=-1).bfloat16() for _ in range(16)]
    passages = [torch.nn.functional.normalize(torch.randn(1030, 128, device=device), dim=-1).bfloat16()
                for _ in range(pages)]

    def score():
        with torch.no_grad():
            return BaseVisualRetrieverProcessor.score_multi_vector(queries, passages, device=device)

    os.environ["COLPALI_SCORES_BACKEND"] = "auto" if backend == "maxsim" else backend
    if backend == "maxsim":
        maxsim_colpali.patch()  # this process ends with the measurement: no unpatch
    return _measure(score, result_path)


def bench_colpali(rows, pages: int, tmp: str, timeout_s: float) -> None:
    label = f"colpali score_multi_vector 16 x {pages} pages (20 x 1030 tokens, bf16)"
    if not _importable("colpali_engine"):
        rows.append((label, "not installed (colpali_engine)", "", ""))
        return
    rows.append((label, "", "", ""))
    path = {b: str(Path(tmp) / f"colpali-{b}.pt") for b in ("torch", "lik", "maxsim")}
    _row(rows, "  colpali torch", colpali_cell, (pages, "torch"), path["torch"], timeout_s=timeout_s)
    if _importable("late_interaction_kernels"):
        _row(rows, "  colpali lik", colpali_cell, (pages, "lik"), path["lik"], reference_path=path["torch"],
             timeout_s=timeout_s)
    else:
        rows.append(("  colpali lik", "not installed (late_interaction_kernels)", "", ""))
    _row(rows, "  maxsim (patch)", colpali_cell, (pages, "maxsim"), path["maxsim"], reference_path=path["torch"],
         timeout_s=timeout_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="PyLate training batch (queries)")
    parser.add_argument("--pages", type=int, default=1000, help="colpali pages")
    parser.add_argument("--skip-pylate", action="store_true")
    parser.add_argument("--skip-colpali", action="store_true")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds one backend may take before its process is killed (a 'timeout' row)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("integrations_bench.py needs a CUDA GPU")
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="maxsim-integrations-") as tmp:
        if not args.skip_pylate:
            bench_pylate(rows, args.batch, tmp, args.timeout)
        if not args.skip_colpali:
            bench_colpali(rows, args.pages, tmp, args.timeout)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'case':72} {'median ms':>10} {'peak MB':>9} {'rel err':>8}")
    for name, ms, peak, error in rows:
        print(f"{name:72} {ms:>10} {peak:>9} {error:>8}")


if __name__ == "__main__":
    main()
