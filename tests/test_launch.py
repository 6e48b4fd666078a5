"""The thin launch path's bookkeeping, with a stand-in kernel (its GPU behaviour is tested in
tests/dense/test_forward_gpu.py)."""

import torch

from maxsim import _launch


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, "a compiled kernel's launcher needs a 3-D grid"
        return lambda *args: self.log.append(("fast", grid, args))


class FakeParam:
    def __init__(self, do_not_specialize):
        self.do_not_specialize = do_not_specialize


class FakeKernel:
    arg_names = ["x", "n", "BLOCK"]

    def __init__(self, specialize_n=True):
        self.log = []
        self.params = [FakeParam(False), FakeParam(not specialize_n), FakeParam(False)]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)

        return run


def test_second_call_launches_the_cached_kernel(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(_launch._FAST_PATH, "enabled", True)
    kernel = FakeKernel()
    x = torch.zeros(64)
    for _ in range(2):
        _launch.launch(kernel, (5,), (x, 7), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log] == ["jit", "fast"]
    assert kernel.log[0][3] == {"BLOCK": 32, "num_warps": 4, "num_stages": 2}
    assert kernel.log[1][1] == (5, 1, 1) and kernel.log[1][2] == (x, 7, 32)
    # Another alignment, another specialised value class, another constexpr: Triton's JIT again.
    _launch.launch(kernel, (5,), (x[1:], 7), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(kernel, (5,), (x, 16), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(kernel, (5,), (x, 7), {"BLOCK": 64}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log] == ["jit", "fast", "jit", "jit", "jit"]
    # A value Triton does not specialise on (do_not_specialize) shares the cached kernel.
    unspecialized = FakeKernel(specialize_n=False)
    _launch.launch(unspecialized, (9,), (x, 8), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(unspecialized, (9,), (x, 9), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in unspecialized.log] == ["jit", "fast"]


def test_value_specialization_read_from_the_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["b"])
    def k(x_ptr, a, b, BLOCK: tl.constexpr):
        pass

    if not hasattr(k, "params"):  # the interpreter's kernel: the fast path is off there anyway
        k = triton.runtime.jit.JITFunction(k.fn, do_not_specialize=["b"])
    assert _launch._value_specialized(k) == (True, True, False, True)


def test_group_by_row_is_a_stable_csr_inverse():
    from maxsim._csr import group_by_row

    n_rows = 37
    dest = torch.randint(0, n_rows + 1, (5000,), dtype=torch.int32)  # n_rows = "goes nowhere"
    order, rowptr = group_by_row(dest, n_rows)
    counts = torch.bincount(dest.long(), minlength=n_rows + 1)[:n_rows]
    assert rowptr[0] == 0 and torch.equal(rowptr.diff(), counts)
    for r in (0, 5, n_rows - 1):
        ids = order[rowptr[r]:rowptr[r + 1]]
        assert torch.equal(ids, (dest == r).nonzero().flatten())  # every entry, ascending ids
