"""Test set-up shared by both tiers.

Without a GPU the kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
triton is imported, so it is set here, first. With a GPU the same tests compile the kernels, and
the tests marked ``gpu`` (real shapes, > 2**31 elements) run too.
"""

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from maxsim import _outputs  # noqa: E402


def _poisoned_empty(shape, dtype, device):
    # Kernels write every output element: poison the buffers so an unwritten one shows up (NaN, -2).
    return torch.full(shape, float("nan") if dtype.is_floating_point else -2, dtype=dtype, device=device)


_outputs.empty = _poisoned_empty

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs every run; a failing test prints its seed (see the hook below), and
    # MAXSIM_TEST_SEED=<seed> replays it (every test of the run gets that seed).
    replay = os.environ.get("MAXSIM_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.maxsim_seed = seed
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "maxsim_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"MAXSIM_TEST_SEED={seed} (or torch.manual_seed({seed})) replays "
                                               "this test's inputs"))
