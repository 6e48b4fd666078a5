"""The bookkeeping of exact-size pinned copies (maxsim/search/pinned.py) on the CPU: a recording
stand-in for the CUDA runtime's two calls checks that the buffer registered is the one returned,
at its own size, and that it is unregistered once, when its last view is freed. The page-locking
itself runs in test_pinned_gpu.py."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from maxsim.search import pinned


class RecordingRuntime:
    """cudaHostRegister / cudaHostUnregister as the CUDA runtime's bindings take them."""

    cudaError = types.SimpleNamespace(success=0)

    def __init__(self, register_status=0):
        self.registered, self.unregistered, self.status = [], [], register_status

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.status

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, status):
        return f"error {status}"


@pytest.fixture
def runtime(monkeypatch):
    rt = RecordingRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float32])
def test_the_returned_buffer_is_registered_at_its_size_and_released_with_its_last_view(runtime, dtype):
    rows = pinned.EXACT_BYTES // (128 * torch.tensor([], dtype=dtype).element_size()) + 3
    src = torch.randn(rows, 128).to(dtype)  # [rows, 128]
    live = pinned.live_registrations()
    host = pinned.pinned_copy(src)
    nbytes = src.numel() * src.element_size()
    assert runtime.registered == [(host.data_ptr(), nbytes, 0)]
    assert torch.equal(host, src) and host.shape == src.shape and host.dtype == dtype
    assert pinned.live_registrations() == live + 1
    view = host[2:]
    del host
    gc.collect()
    assert runtime.unregistered == []  # the view still reads the buffer
    del view
    gc.collect()
    assert runtime.unregistered == [runtime.registered[0][0]]
    assert pinned.live_registrations() == live


def test_a_refused_registration_is_one_clear_error(runtime):
    runtime.status = 2
    with pytest.raises(RuntimeError, match="cannot page-lock .* GB of host memory .*Corpus.to"):
        pinned.pinned_copy(torch.zeros(pinned.EXACT_BYTES, dtype=torch.uint8))


def test_small_tensors_never_reach_the_runtime(runtime, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    out = pinned.pinned_copy(torch.arange(10))
    assert torch.equal(out, torch.arange(10)) and runtime.registered == []
