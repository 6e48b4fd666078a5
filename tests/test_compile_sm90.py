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


_PADDING_WALK_IR = """
import sys
sys.path.insert(0, {tests!r})
from compile_check import compile_variant, dense_forward_variants
from maxsim.dense.forward import MASK_ROW_LANES, _maxsim_fwd_kernel
print(MASK_ROW_LANES)
name, consts, ptrs, warps, stages = next(v for v in dense_forward_variants() if v[0].startswith("fwd padded rerank"))
ir = compile_variant(_maxsim_fwd_kernel, ptrs, consts, warps, stages).asm["ttgir"]
print("\\n".join(line.strip() for line in ir.splitlines() if "scf.for" in line))
"""


def test_padding_walk_carries_the_next_documents_extent_on_the_compiler():
    # The document loop of the padding-skipping walk carries the next document's mask row. Triton
    # 3.6 drops a loop-carried value whose only use is an inner loop's bound (every document then
    # walks the first one's tile count: wrong scores on the GPU, right ones in the interpreter),
    # so the kernel uses it in the epilogue too; this checks the compiled loop still carries it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _PADDING_WALK_IR.format(tests=str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lanes, *loops = res.stdout.splitlines()
    assert len(loops) >= 3, res.stdout  # the document loop, a long mask row's pieces, the tile loop
    assert "iter_args" in loops[0] and f"tensor<{lanes}xi1" in loops[0], loops[0]
