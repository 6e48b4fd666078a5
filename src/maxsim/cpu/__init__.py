"""The CPU backend: MaxSim on blocked GEMMs in plain PyTorch (see docs/cpu.md).

:func:`maxsim_cpu` has the arguments and the results of :func:`maxsim.reference.maxsim_reference`,
which stays the plain statement of the contract (and the tests' oracle); this is the fast path
that CPU tensors run.
"""

from maxsim.cpu.dense import maxsim_cpu

__all__ = ["maxsim_cpu"]
