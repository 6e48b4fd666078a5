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

from maxsim.dense import forward  # noqa: E402

# Kernels write every output element: poison the buffers so an unwritten one shows up as NaN.
forward.POISON_OUTPUTS = True

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
    # Fresh random inputs every run (the seed is printed on failure through the test id).
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield
