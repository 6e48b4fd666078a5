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


class FakeKernel:
    arg_names = ["x", "n", "BLOCK"]

    def __init__(self):
        self.log = []

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
        _launch.launch(kernel, (5,), (x, 7), (False, True), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log] == ["jit", "fast"]
    assert kernel.log[0][3] == {"BLOCK": 32, "num_warps": 4, "num_stages": 2}
    assert kernel.log[1][1] == (5, 1, 1) and kernel.log[1][2] == (x, 7, 32)
    # Another alignment, another specialised value class, another constexpr: Triton's JIT again.
    _launch.launch(kernel, (5,), (x[1:], 7), (False, True), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(kernel, (5,), (x, 16), (False, True), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(kernel, (5,), (x, 7), (False, True), {"BLOCK": 64}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log] == ["jit", "fast", "jit", "jit", "jit"]
    # A value Triton does not specialise on shares the cached kernel.
    _launch.launch(kernel, (9,), (x, 8), (False, False), {"BLOCK": 32}, num_warps=4, num_stages=2)
    _launch.launch(kernel, (9,), (x, 9), (False, False), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log][-2:] == ["jit", "fast"]


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
