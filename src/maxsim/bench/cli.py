"""The ``bench`` subcommand of ``python -m maxsim``: ``add_bench_parser(subparsers)``, its options
from :mod:`maxsim.bench.options`; the runner is imported when the command runs, not to build
``python -m maxsim --help``, and the worker (``python -m maxsim.bench.runner``) is never imported twice.
"""

from __future__ import annotations

import argparse

from maxsim.bench.options import DESCRIPTION, EPILOG, add_arguments

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to ``python -m maxsim``'s subcommands; its ``run(opts)`` is set as a default."""
    p = subparsers.add_parser(
        "bench",
        help="time maxsim against its peers (forward, training step, ragged batches)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=_run)
    return p


def _run(opts) -> int:
    from maxsim.bench.runner import run_options

    return run_options(opts, getattr(opts, "command_line", None))
