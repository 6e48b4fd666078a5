"""Host time of a call: what a small call or a training step's scorer costs the CPU.

A PyLate loss step at batch 32 or a one-query rerank is bound by the host (Python, validation,
launches), not by the GPU. For each case and provider, in its own process: the GPU time
(``triton.testing.do_bench`` median), and host / wall time per call of calls enqueued back to back
(the host's rate where it is the bottleneck). ``--profile`` adds cProfile's top functions of
maxsim's call: where its host time goes.

    python benchmarks/host_bench.py [--cases pylate-contrastive-32,small-rerank] [--profile]

Cases:
    pylate-contrastive-B  PyLate's ``colbert_scores`` as its Contrastive loss calls it at batch B
                        (32 or 128): queries [B, 32, 128] fp32, documents [2B, 180, 128] fp32 with
                        an int64 attention mask, forward + backward (needs PyLate; providers:
                        PyLate torch / flash / lik, maxsim's drop-in, and the drop-in with fp32's
                        split forced on chip or to the copy)
    small-rerank        ``maxsim.maxsim`` inference, one query [1, 32, 128] x 1000 documents of 300
                        tokens, fp16 (the plan replay: no validation after the first call)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import triton  # noqa: E402
from _isolate import run_isolated  # noqa: E402

from maxsim.bench.timing import back_to_back  # noqa: E402

CASES = ("pylate-contrastive-32", "pylate-contrastive-128", "small-rerank")
_PYLATE = ("torch", "flash", "lik", "maxsim", "maxsim-onchip", "maxsim-copy")
PROVIDERS = {"pylate-contrastive-32": _PYLATE, "pylate-contrastive-128": _PYLATE,
             "small-rerank": ("maxsim", "flash", "lik")}


def _pylate_contrastive(provider: str, batch: int):
    """fn() of PyLate's scorer call + backward with ``provider``."""
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(batch, 32, 128, device="cuda"), dim=-1).requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(2 * batch, 180, 128, device="cuda"), dim=-1).requires_grad_()
    lengths = torch.randint(90, 181, (2 * batch,), device="cuda")
    d_mask = (torch.arange(180, device="cuda")[None, :] < lengths[:, None]).long()  # [2B, 180] int64
    if provider.startswith("maxsim"):
        from maxsim.integrations.pylate import colbert_scores
        from maxsim.tuning import tables as T

        if provider == "maxsim-onchip":
            T.SPLIT16_MIN_ROWS = 10**9
        elif provider == "maxsim-copy":
            T.SPLIT16_MIN_PRODUCTS = 0

        def score():
            return colbert_scores(q, d, None, d_mask, backend="auto")
    else:
        from pylate.scores import colbert_scores as pylate_scores

        def score():
            return pylate_scores(q, d, None, d_mask, backend=provider)

    def step():
        q.grad = d.grad = None
        scores = score()
        scores.sum().backward()
        return scores

    return step


def _small_rerank(provider: str):
    torch.manual_seed(0)
    Q = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
    D = torch.randn(1000, 300, 128, device="cuda", dtype=torch.float16)
    if provider == "maxsim":
        import maxsim

        return lambda: maxsim.maxsim(Q, D)
    from maxsim.bench.providers import get_providers

    name = {"flash": "flash-maxsim", "lik": "late-interaction-kernels"}[provider]
    p = get_providers([name])[0]
    args = p.prepare(Q, D, None, None)
    return lambda: p.fn(*args)


def measure(case: str, provider: str, profile: bool) -> dict:
    if case.startswith("pylate-contrastive-"):
        fn = _pylate_contrastive(provider, int(case.rsplit("-", 1)[1]))
    else:
        fn = _small_rerank(provider)
    fn()
    torch.cuda.synchronize()
    gpu_ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    host, wall = back_to_back(fn, 200)
    out = {"gpu_us": gpu_ms * 1e3, "host_us": host * 1e6, "wall_us": wall * 1e6}
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--providers", help="comma-separated: only these (default: every one of each case)")
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions of maxsim's call")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_bench.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'case':22} {'provider':13} {'GPU us':>9} {'host us':>9} {'wall us':>9}")
    profiles = []
    for case in args.cases.split(","):
        for provider in PROVIDERS[case]:
            if args.providers and provider not in args.providers.split(","):
                continue
            r = run_isolated(measure, case, provider, args.profile and provider == "maxsim" and case != "pylate-contrastive-128", timeout_s=180)
            if r["status"] != "ok":
                print(f"{case:22} {provider:13} {r['status']}: {r.get('error', '')[:80]}")
                continue
            print(f"{case:22} {provider:13} {r['gpu_us']:9.1f} {r['host_us']:9.1f} {r['wall_us']:9.1f}", flush=True)
            if "profile" in r:
                profiles.append((case, r["profile"]))
    for case, text in profiles:
        print(f"\n== cProfile, maxsim, {case}: 100 calls ==\n{text}")


if __name__ == "__main__":
    main()
