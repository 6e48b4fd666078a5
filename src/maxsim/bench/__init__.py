"""Benchmark harness: ``python -m maxsim bench [--mode forward|train]``.

See :mod:`maxsim.bench.runner` for what is measured and how crashes are isolated, and
:mod:`maxsim.bench.train` for the training step.
"""

from __future__ import annotations

from maxsim.bench.shapes import (
    CPU_SHAPES,
    GPU_SHAPES,
    TRAIN_CPU_SHAPES,
    TRAIN_GPU_SHAPES,
    Shape,
    floor_seconds,
    make_inputs,
)


def run_cli(argv: list[str] | None = None, *, shapes: list[Shape] | None = None) -> int:
    """Run the benchmark with command-line options ``argv``; returns the exit status."""
    # Imported here, not at the top: `python -m maxsim.bench.runner` (the worker) must not find
    # the runner module already imported by its package.
    from maxsim.bench.runner import run_cli as _run_cli

    return _run_cli(argv, shapes=shapes)


__all__ = [
    "CPU_SHAPES",
    "GPU_SHAPES",
    "TRAIN_CPU_SHAPES",
    "TRAIN_GPU_SHAPES",
    "Shape",
    "floor_seconds",
    "make_inputs",
    "run_cli",
]
