"""Speed and memory of the drop-in integrations on the GPU, against each library's own paths.

    python benchmarks/integrations_bench.py [--batch 32,128] [--pages 1000] [--only pylate,colpali,sentence-transformers]

Rows (every library's torch path, its ``lik`` / ``flash`` kernel backends when importable, and
maxsim through the library's ``patch()``):
- PyLate training steps over precomputed embeddings (its real loss forward: normalise, score,
  cross entropy or KL, backward), ColBERT shapes (Lq 32, Ld 90-180, d 128): ``Contrastive``
  in-batch with one hard negative in fp32 (as PyLate's models produce embeddings) and under bf16
  autocast; ``Distillation`` with 32 candidates a query.
- PyLate ``rank.rerank`` of 32 queries over 100 ragged candidates each (lists of CUDA tensors).
- colpali ``score_multi_vector`` of 16 queries (20 tokens) against 1K pages (1030 tokens), bf16.
- Sentence Transformers 6 ``util.maxsim`` (``MultiVectorEncoder.similarity``): 32 queries against
  1K ragged documents, fp32 lists. PyLate 1.6 pins Sentence Transformers 5: run this row in an
  environment with Sentence Transformers 6 (``--only sentence-transformers``).

Median ms from ``triton.testing.do_bench`` and the peak memory of one call above its inputs.

Each backend runs in a fresh process (benchmarks/_isolate.py) that builds its inputs from a fixed
seed, one process for all PyLate cases of a batch (PyLate is slow to import) and one for each other
library's case: a backend that crashes the CUDA context makes its rows ``crashed``, a case that
merely raises is an ``error`` row. The results meet in files, for the relative error against the
library's torch path.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
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


class _PrintedRows:
    """The table's rows, each printed as it comes (nothing kept): a run cut short by a timeout
    keeps what finished."""

    def append(self, row: tuple[str, str, str, str]) -> None:
        name, ms, peak, error = row
        print(f"{name:72} {ms:>10} {peak:>9} {error:>8}", flush=True)


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
DISTILLATION_CANDIDATES = 32  # documents a query in PyLate's Distillation (its KD examples use 32)
RERANK_CANDIDATES = 100  # documents a query in rank.rerank (a first stage's top 100)
PYLATE_CASES = {
    "contrastive": "Contrastive step B={batch} (Lq {q}, Ld {d}, 1 positive + 1 negative, fp32)",
    "contrastive-bf16": "Contrastive step B={batch} (same, bf16 autocast)",
    "distillation": "Distillation step B={half} (Lq {q}, Ld {d}, " + str(DISTILLATION_CANDIDATES) + " candidates, fp32)",
    "rerank": "rank.rerank {batch} queries x " + str(RERANK_CANDIDATES) + " candidates (Ld {d_lo}-{d}, fp32)",
}


def _pylate_features(embeddings, lengths=None):
    """PyLate's tokenizer output for precomputed ``embeddings`` [B, L, d]: a mask of ``lengths``."""
    rows_, length = embeddings.shape[:2]
    device = embeddings.device
    mask = torch.ones(rows_, length, dtype=torch.long, device=device)
    if lengths is not None:
        mask = (torch.arange(length, device=device)[None, :] < lengths.to(device)[:, None]).long()
    return {"input_ids": torch.ones_like(mask), "attention_mask": mask, "embeddings": embeddings}


def _pylate_training_step(case: str, batch: int):
    """The step function of a PyLate loss over random embeddings (a fixed seed)."""
    from pylate import losses

    q_len, d_len, dim = PYLATE_SHAPE
    device = "cuda"
    if case == "distillation":
        batch = batch // 2
        queries = torch.randn(batch, q_len, dim, device=device, requires_grad=True)
        documents = [torch.randn(batch * DISTILLATION_CANDIDATES, d_len, dim, device=device, requires_grad=True)]
        lengths = torch.randint(d_len // 2, d_len + 1, (1, batch * DISTILLATION_CANDIDATES))
        labels = torch.randn(batch, DISTILLATION_CANDIDATES, device=device)
        loss = losses.Distillation(model=_EmbeddingsModel())
    else:
        queries = torch.randn(batch, q_len, dim, device=device, requires_grad=True)
        documents = [torch.randn(batch, d_len, dim, device=device, requires_grad=True) for _ in range(2)]
        lengths = torch.randint(d_len // 2, d_len + 1, (2, batch))
        labels = None
        loss = losses.Contrastive(model=_EmbeddingsModel())
    features = [_pylate_features(queries)] + [_pylate_features(d, lengths[i]) for i, d in enumerate(documents)]

    def step():
        for tensor in (queries, *documents):
            tensor.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case == "contrastive-bf16"):
            value = loss(features, labels)
        value.backward()
        return value.detach().float().reshape(1)

    return step


def _pylate_rerank(batch: int):
    """``rank.rerank`` of ``batch`` queries over RERANK_CANDIDATES documents of ragged lengths each
    (lists of [L, d] CUDA tensors, as a first stage hands them over)."""
    from pylate import rank

    q_len, d_len, dim = PYLATE_SHAPE
    queries = [torch.randn(q_len, dim, device="cuda") for _ in range(batch)]
    lengths = torch.randint(d_len // 4, d_len + 1, (batch, RERANK_CANDIDATES)).tolist()
    documents = [[torch.randn(n, dim, device="cuda") for n in row] for row in lengths]
    ids = [list(range(RERANK_CANDIDATES))] * batch

    def run():
        ranked = rank.rerank(ids, queries, documents)
        # the scores in candidate order: comparable across backends whatever the ties
        return torch.tensor([[r["score"] for r in sorted(row, key=lambda r: r["id"])] for row in ranked])

    return run


PYLATE_BACKENDS = (("torch", "  pylate torch"), ("lik", "  pylate lik"), ("flash", "  pylate flash"),
                   ("maxsim", "  maxsim (patch)"),
                   ("none", "  no scorer (the step's floor)"))  # (backend, row name), torch first: the reference
PYLATE_BACKEND_MODULES = {"lik": "late_interaction_kernels", "flash": "flash_maxsim"}


def _null_score(queries, documents, queries_mask, documents_mask, doc_layout: str) -> torch.Tensor:
    """A stand-in scorer of the drop-in's shape that reads one value a sequence: the step's time
    without MaxSim (what PyLate's own Python and the loss cost). Q [Nq, Lq, d]; D [Nd, Ld, d]
    (shared) or [Nq, K, Ld, d] (candidates) -> [Nq, Nd] / [Nq, K], in the graph."""
    q_first = queries[:, 0, 0].float()  # [Nq]
    d_first = documents[..., 0, 0].float()  # [Nd] or [Nq, K]
    return q_first[:, None] + (d_first[None, :] if doc_layout == "shared" else d_first)


def _pylate_result_path(tmp: str, case: str, batch: int, backend: str) -> str:
    return str(Path(tmp) / f"pylate-{case}-{batch}-{backend}.pt")


def pylate_cells(cases: list[str], batch: int, backend: str, tmp: str) -> dict:
    """Every PyLate case in ``cases`` (loss steps, rerank) at ``batch`` with ``backend`` (torch, lik,
    flash, or maxsim through patch()), in one process: ``{case: {"ms", "peak"} or {"error"}}``.
    A case that raises is its own error; one that leaves CUDA unusable ends the process."""
    from maxsim.bench.runner import classify_error
    from maxsim.integrations import pylate as maxsim_pylate

    os.environ["PYLATE_SCORES_BACKEND"] = "auto" if backend in ("maxsim", "none") else backend
    if backend == "none":  # the drop-in's plumbing around a scorer that does next to nothing
        maxsim_pylate._score = _null_score
    if backend in ("maxsim", "none"):
        maxsim_pylate.patch()  # this process ends with the measurements: no unpatch
    measured = {}
    for case in cases:
        if backend == "none" and case == "rerank":  # rank.rerank's drop-in packs: no _score to replace
            continue
        torch.manual_seed(SEED)  # each case's inputs the same whatever ran before it, in every backend
        try:
            run = _pylate_rerank(batch) if case == "rerank" else _pylate_training_step(case, batch)
            measured[case] = _measure(run, _pylate_result_path(tmp, case, batch, backend))
        except Exception as exc:
            status = classify_error(exc)
            if status == "crashed":  # the context is poisoned: the parent marks every case crashed
                raise
            traceback.print_exc()
            first_line = (str(exc).strip().splitlines() or [""])[0]
            measured[case] = {"error": f"{status}: {type(exc).__name__}: {first_line}"[:200]}
        run = None  # the case's inputs go before the next case allocates its own
        torch.cuda.empty_cache()
        outcome = "error" if "error" in measured[case] else "done"
        print(f"pylate batch {batch} {backend}: {case} {outcome}", file=sys.stderr, flush=True)
    return measured


def bench_pylate(rows, batch: int, tmp: str, timeout_s: float, cases) -> None:
    """One process a backend for all ``cases`` (``timeout_s`` a case), then each case's rows."""
    q_len, d_len, _ = PYLATE_SHAPE
    labels = {case: "pylate " + PYLATE_CASES[case].format(batch=batch, half=batch // 2, q=q_len, d=d_len,
                                                          d_lo=d_len // 4)
              for case in cases}
    if not _importable("pylate"):
        rows.append((labels[cases[0]], "not installed (pylate)", "", ""))
        return
    by_backend = {}
    for backend, _ in PYLATE_BACKENDS:
        module = PYLATE_BACKEND_MODULES.get(backend)
        if module is not None and not _importable(module):
            continue
        start = time.perf_counter()
        by_backend[backend] = run_isolated(pylate_cells, list(cases), batch, backend, tmp,
                                           timeout_s=timeout_s * len(cases))
        status = by_backend[backend]["status"]
        print(f"pylate batch {batch}: {backend} {'done' if status == 'ok' else status} in "
              f"{time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    for case in cases:
        rows.append((labels[case], "", "", ""))
        reference_path = _pylate_result_path(tmp, case, batch, "torch")
        for backend, name in PYLATE_BACKENDS:
            if backend not in by_backend:
                rows.append((name, f"not installed ({PYLATE_BACKEND_MODULES[backend]})", "", ""))
                continue
            measured = by_backend[backend]
            if measured["status"] != "ok":
                rows.append((name, failed(measured)[:90], "", ""))
                continue
            if case not in measured:  # the floor of a loss step only
                continue
            cell = measured[case]
            if "error" in cell:
                rows.append((name, cell["error"][:90], "", ""))
                continue
            error = ""
            if backend not in ("torch", "none") and Path(reference_path).exists():  # torch measured this case
                result = torch.load(_pylate_result_path(tmp, case, batch, backend))
                reference = torch.load(reference_path)
                error = f"{float((result - reference).norm() / reference.norm()):.1e}"
            rows.append((name, f"{cell['ms']:.3f}", f"{cell['peak']:.0f}", error))


def profile_pylate(case: str, batch: int) -> None:
    """torch.profiler table of a few warm steps of ``case`` with maxsim patched (this process)."""
    from torch.profiler import ProfilerActivity, profile

    from maxsim.integrations import pylate as maxsim_pylate

    torch.manual_seed(SEED)
    run = _pylate_rerank(batch) if case == "rerank" else _pylate_training_step(case, batch)
    maxsim_pylate.patch()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


ST_SHAPE = (32, 1000, 32, 300, 128)  # queries, documents, Lq, max Ld, d


def st_cell(backend: str, result_path: str) -> dict:
    """Sentence Transformers 6's ``MultiVectorEncoder.similarity`` path (``util.maxsim`` over lists
    of ragged fp32 embeddings, as ``encode`` returns them), its torch path or maxsim through patch()."""
    import sentence_transformers
    from sentence_transformers.util import similarity as st_similarity

    from maxsim.integrations import sentence_transformers as maxsim_st

    if int(sentence_transformers.__version__.split(".")[0]) < 6:
        raise RuntimeError(f"needs sentence-transformers >= 6 (found {sentence_transformers.__version__})")
    n_q, n_d, q_len, d_max, dim = ST_SHAPE
    torch.manual_seed(SEED)
    queries = [torch.nn.functional.normalize(torch.randn(q_len, dim, device="cuda"), dim=-1) for _ in range(n_q)]
    documents = [torch.nn.functional.normalize(torch.randn(int(n), dim, device="cuda"), dim=-1)
                 for n in torch.randint(d_max // 5, d_max + 1, (n_d,))]
    if backend == "maxsim":
        maxsim_st.patch()  # this process ends with the measurement: no unpatch

    def score():
        return st_similarity.maxsim(queries, documents)

    return _measure(score, result_path)


def bench_sentence_transformers(rows, tmp: str, timeout_s: float) -> None:
    n_q, n_d, q_len, d_max, _ = ST_SHAPE
    label = f"sentence-transformers 6 similarity {n_q} x {n_d} (Lq {q_len}, Ld {d_max // 5}-{d_max}, fp32 lists)"
    if not _importable("sentence_transformers"):
        rows.append((label, "not installed (sentence_transformers)", "", ""))
        return
    rows.append((label, "", "", ""))
    path = {b: str(Path(tmp) / f"st-{b}.pt") for b in ("torch", "maxsim")}
    _row(rows, "  sentence-transformers torch", st_cell, ("torch",), path["torch"], timeout_s=timeout_s)
    _row(rows, "  maxsim (patch)", st_cell, ("maxsim",), path["maxsim"], reference_path=path["torch"],
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
    parser.add_argument("--batch", default="32,128",
                        help="PyLate batches (queries), comma-separated: each PyLate case runs at each (a small "
                             "step is bound by host work, a large one by the GPU); --profile takes the first")
    parser.add_argument("--pages", type=int, default=1000, help="colpali pages")
    parser.add_argument("--only", default="pylate,colpali,sentence-transformers",
                        help="comma-separated libraries (a PyLate environment pins Sentence Transformers 5)")
    parser.add_argument("--pylate-cases", default=",".join(PYLATE_CASES),
                        help="comma-separated: " + ", ".join(PYLATE_CASES))
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds one backend may take before its process is killed (a 'timeout' row)")
    parser.add_argument("--profile", choices=list(PYLATE_CASES),
                        help="instead of the table: torch.profiler's top ops (CPU and CUDA time) of this "
                             "PyLate case with maxsim patched, where a step's time goes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("integrations_bench.py needs a CUDA GPU")
    if args.profile:
        profile_pylate(args.profile, int(args.batch.split(",")[0]))
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'case':72} {'median ms':>10} {'peak MB':>9} {'rel err':>8}")
    rows = _PrintedRows()
    with tempfile.TemporaryDirectory(prefix="maxsim-integrations-") as tmp:
        only = args.only.split(",")
        if "pylate" in only:
            for batch in (int(b) for b in args.batch.split(",")):
                bench_pylate(rows, batch, tmp, args.timeout, args.pylate_cases.split(","))
        if "colpali" in only:
            bench_colpali(rows, args.pages, tmp, args.timeout)
        if "sentence-transformers" in only:
            bench_sentence_transformers(rows, tmp, args.timeout)


if __name__ == "__main__":
    main()
