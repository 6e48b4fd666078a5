"""The thin launch path's bookkeeping, with a stand-in kernel (its GPU behaviour is tested in
tests/dense/test_forward_gpu.py)."""

import torch

from maxsim import _launch


class FakeCompiled:
    """Triton's CompiledKernel as the thin path uses it: ``run`` (the launcher) and, when a launch
    hook is installed, ``compiled[grid](*args)``."""

    function, packed_metadata = "cu-function", "packed-metadata"

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, "a compiled kernel's launcher needs a 3-D grid"
        return lambda *args: self.log.append(("hooked", grid, args))

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (stream, function, packed_metadata) == ("stream", self.function, self.packed_metadata)
        assert (launch_metadata, enter_hook, exit_hook) == (None, None, None)
        self.log.append(("fast", (gx, gy, gz), args))


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


def _thin_path(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: "stream")
    monkeypatch.setitem(_launch._FAST_PATH, "enabled", True)


def test_second_call_launches_the_cached_kernel(monkeypatch):
    _thin_path(monkeypatch)
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


def test_launch_hooks_see_cached_launches(monkeypatch):
    # With a launch hook installed (a profiler), the cached kernel goes through compiled[grid],
    # which calls the hooks; without one, straight to its launcher.
    import triton

    _thin_path(monkeypatch)
    kernel = FakeKernel()
    x = torch.zeros(64)
    for _ in range(2):
        _launch.launch(kernel, (5,), (x, 7), {"BLOCK": 32}, num_warps=4, num_stages=2)
    chain = triton.knobs.HookChain()
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", chain)
    _launch.launch(kernel, (5,), (x, 7), {"BLOCK": 32}, num_warps=4, num_stages=2)  # an empty chain
    chain.add(lambda metadata: None)
    _launch.launch(kernel, (5,), (x, 7), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in kernel.log] == ["jit", "fast", "fast", "hooked"]
    assert kernel.log[3][1:] == ((5, 1, 1), (x, 7, 32))


def test_launch_options_and_a_num_warps_constexpr(monkeypatch):
    # The Gluon forward: num_warps is both a constexpr of the kernel and a launch option, and
    # maxnreg is an option. The JIT sees each once; the cached launch passes the constexpr's value.
    _thin_path(monkeypatch)

    class GluonLike(FakeKernel):
        arg_names = ["x", "n", "BLOCK", "num_warps"]

        def __init__(self):
            super().__init__()
            self.params.append(FakeParam(False))

    kernel = GluonLike()
    x = torch.zeros(64)
    for _ in range(2):
        _launch.launch(kernel, (3,), (x, 7), {"BLOCK": 32, "num_warps": 4}, num_warps=4, maxnreg=168)
    assert [e[0] for e in kernel.log] == ["jit", "fast"]
    assert kernel.log[0][3] == {"BLOCK": 32, "num_warps": 4, "maxnreg": 168}
    assert kernel.log[1][2] == (x, 7, 32, 4)
    # Another option value is another compiled kernel.
    _launch.launch(kernel, (3,), (x, 7), {"BLOCK": 32, "num_warps": 4}, num_warps=4, maxnreg=128)
    assert kernel.log[2][0] == "jit"


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


def test_one_kernels_surprise_leaves_the_others_on_the_thin_path(monkeypatch):
    # A kernel whose constexprs come out of signature order takes Triton's ordinary path from then
    # on, with the reason kept; every other kernel keeps its direct launch.
    _thin_path(monkeypatch)
    monkeypatch.setattr(_launch, "ORDINARY_PATH_ONLY", {})

    class TwoConstexprs(FakeKernel):
        arg_names = ["x", "n", "BLOCK", "EVEN"]

    odd, plain = TwoConstexprs(), FakeKernel()
    x = torch.zeros(64)
    for _ in range(3):
        _launch.launch(odd, (5,), (x, 7), {"EVEN": True, "BLOCK": 32}, num_warps=4, num_stages=2)
        _launch.launch(plain, (5,), (x, 7), {"BLOCK": 32}, num_warps=4, num_stages=2)
    assert [e[0] for e in odd.log] == ["jit", "jit", "jit"]
    assert "EVEN" in _launch.ORDINARY_PATH_ONLY[odd] and plain not in _launch.ORDINARY_PATH_ONLY
    assert [e[0] for e in plain.log] == ["jit", "fast", "fast"]
