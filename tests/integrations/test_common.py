"""The integrations' shared rules that need no library installed."""

import pytest
import torch

from maxsim.integrations._common import scores_dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scores_dtype_follows_the_library_path_of_the_device(dtype):
    # CUDA: the libraries' kernel backends return fp32 for 16-bit inputs; the CPU: their einsum's dtype
    assert scores_dtype(dtype, torch.device("cuda")) == torch.float32
    assert scores_dtype(dtype, torch.device("cpu")) == dtype
    assert scores_dtype(torch.float64, torch.device("cuda")) == torch.float64  # no kernel takes float64


@pytest.mark.parametrize("module, distribution, extra", [("pylate", "pylate", "pylate"),
                                                         ("colpali", "colpali-engine", "colpali"),
                                                         ("sentence_transformers", "sentence-transformers",
                                                          "sentence-transformers")])
def test_patch_without_the_library_names_the_extra(monkeypatch, module, distribution, extra):
    import importlib
    from importlib import metadata

    integration = importlib.import_module(f"maxsim.integrations.{module}")
    real = metadata.version

    def version(name):
        if name == distribution:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ModuleNotFoundError, match=rf'pip install "maxsim\[{extra}\]"'):
        integration.patch()
    assert not integration.is_patched()


def test_a_version_outside_the_tested_range_warns_once(monkeypatch):
    from importlib import metadata

    from maxsim.integrations import _common

    monkeypatch.setattr(_common, "_WARNED", set())
    monkeypatch.setattr(metadata, "version", lambda name: "9.1.0")
    with pytest.warns(UserWarning, match=r"somelib 9\.1\.0 is outside .*>= 1\.6, < 1\.7"):
        _common.require_library("somelib", "somelib", ("1.6", "1.7"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _common.require_library("somelib", "somelib", ("1.6", "1.7"))  # once per process
        monkeypatch.setattr(metadata, "version", lambda name: "1.6.3")
        _common.require_library("otherlib", "otherlib", ("1.6", "1.7"))  # inside: silent
