"""Every kernel variant compiles for Hopper (sm_90) with Triton's real compiler, on the CPU.

The interpreter runs kernels as Python and misses what only the compiler rejects (a loop-carried
value changing type, an unsupported construct, shared memory past the limit). Triton's front end
and its bundled ptxas need no GPU, so CI compiles each variant (tests/compile_check.py) in a
subprocess without TRITON_INTERPRET. The tensor-core variants must also still lower to wgmma:
losing it would be a silent several-fold slowdown.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_check.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    print(res.stdout)
    failed = [line for line in res.stdout.splitlines() if " FAIL " in line]
    assert res.returncode == 0 and not failed, "\n".join(failed) or res.stderr[-2000:]
    assert " 0 failed" in res.stdout
