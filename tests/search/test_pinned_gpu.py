"""Exact-size pinned host copies (maxsim/search/pinned.py) on the GPU: page-locked, the caching
allocator's power-of-two blocks not used for large tensors, the registration undone when the last
view is freed, and a pinned corpus searches as the resident one does."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from maxsim.search import pinned
from maxsim.search.corpus import Corpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _caching_host_bytes() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float8_e4m3fn])
def test_a_large_copy_is_page_locked_at_its_own_size(dtype):
    # just over EXACT_BYTES (2^26) whatever the element size: the caching allocator would take 2^27
    row_bytes = 128 * torch.empty((), dtype=dtype).element_size()
    rows = (pinned.EXACT_BYTES + (1 << 20)) // row_bytes
    src = torch.randn(rows, 128, device="cuda").to(dtype)  # [rows, 128]
    before, live = _caching_host_bytes(), pinned.live_registrations()
    host = pinned.pinned_copy(src)
    assert host.is_pinned() and host.device.type == "cpu" and host.dtype == dtype and host.shape == src.shape
    assert _caching_host_bytes() == before  # not from PyTorch's pinned blocks
    assert pinned.live_registrations() == live + 1
    assert torch.equal(host.view(torch.uint8), src.cpu().view(torch.uint8))
    back = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    view = host[1:5]
    del host
    gc.collect()
    assert pinned.live_registrations() == live + 1  # a view keeps the buffer
    del view
    gc.collect()
    assert pinned.live_registrations() == live


def test_a_small_copy_keeps_the_caching_allocator():
    live = pinned.live_registrations()
    host = pinned.pinned_copy(torch.arange(1000, device="cuda"))
    assert host.is_pinned() and pinned.live_registrations() == live
    assert torch.equal(host, torch.arange(1000))


def test_a_pinned_corpus_searches_as_the_resident_one():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 40, (4000,), generator=g)
    tokens = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), 128, generator=g), dim=-1)
    offsets = np.concatenate([[0], np.cumsum(lengths.numpy())])
    Q = torch.nn.functional.normalize(torch.randn(3, 32, 128, generator=g), dim=-1).half().cuda()
    resident = Corpus.from_packed(tokens.half().cuda(), offsets)  # [T, 128], ~24 MB
    # 4,096 more documents of 64 tokens (64 MiB) take the tokens past the exact-size threshold
    extra = torch.nn.functional.normalize(torch.randn(4096 * 64, 128, generator=g), dim=-1)
    big = Corpus.from_packed(torch.cat([tokens, extra]).half(),
                             np.concatenate([offsets, offsets[-1] + 64 * np.arange(1, 4097)]))
    live = pinned.live_registrations()
    host = big.pin_memory()
    assert host.where() == "pinned" and pinned.live_registrations() > live
    expected = resident.search(Q, 10)
    found = host.search(Q, 10, subset=list(range(4000)))
    assert torch.equal(found.indices.cpu(), expected.indices.cpu())
    torch.testing.assert_close(found.scores.cpu(), expected.scores.cpu(), rtol=0, atol=1e-5)
