"""The command line, ``python -m maxsim COMMAND``: one argparse subcommand per module."""

from __future__ import annotations

import argparse
import os
import sys


def _info() -> int:
    import torch

    import maxsim
    from maxsim._dispatch import backend_for, pytorch_backend

    print(f"maxsim {maxsim.__version__}")
    print(f"torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed (CPU reference only)")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        print(f"backend for CUDA tensors: {backend_for(torch.device('cuda'))}")
    else:
        print("GPU: none")
    try:
        cpu = backend_for(torch.device("cpu"))
    except RuntimeError as err:  # a backend the environment cannot run: say so, as info's answer
        print(f"backend for CPU tensors: none ({one_line(err)})")
        return 0
    if cpu == "reference":  # the PyTorch side: maxsim.cpu's blocked GEMMs unless MAXSIM_BACKEND=reference
        cpu = pytorch_backend()
    print(f"backend for CPU tensors: {cpu}")
    return 0


def add_info_parser(subparsers) -> None:
    p = subparsers.add_parser("info", help="versions, GPU and the backend each device's tensors run on",
                              description="Print the versions of maxsim, torch and triton, the GPU, and the backend "
                              "that CUDA and CPU tensors run on.")
    p.set_defaults(run=lambda opts: _info())


def build_parser() -> argparse.ArgumentParser:
    from maxsim.bench.cli import add_bench_parser
    from maxsim.search.cli import add_compact_parser, add_delete_parser, add_index_parser, add_search_parser
    from maxsim.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser(
        prog="python -m maxsim",
        description="maxsim: fused MaxSim (late-interaction) scoring. Run a command with --help for its options.",
    )
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    # Each command module adds its own subparser and sets its run(opts) as a default.
    add_bench_parser(subparsers)
    add_index_parser(subparsers)
    add_search_parser(subparsers)
    add_delete_parser(subparsers)
    add_compact_parser(subparsers)
    add_serve_parser(subparsers)
    add_info_parser(subparsers)
    return parser


# What a user's input can raise: shown as one line naming the problem (the library's messages name
# the fix), never a traceback. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    """Run one command -> its exit code: 0, 2 for a mistake in the input (one line on stderr; set
    MAXSIM_DEBUG=1 for the traceback), 130 when interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.command is None:
        parser.print_help()
        return 2
    opts.command_line = argv  # recorded by commands that write result files
    try:
        return opts.run(opts)
    except KeyboardInterrupt:
        print(f"maxsim {opts.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if os.environ.get("MAXSIM_DEBUG"):
            raise
        print(f"maxsim {opts.command}: {one_line(err)}", file=sys.stderr)
        return 2


def one_line(err: BaseException) -> str:
    """An exception as one line: its message without the library's "maxsim: " prefix (a missing
    file: its name)."""
    if isinstance(err, OSError) and err.filename is not None and not str(err).startswith("maxsim"):
        text = f"{err.strerror or type(err).__name__}: {err.filename}"
    else:
        text = str(err) or type(err).__name__
    text = " ".join(text.split())
    return text[len("maxsim: "):] if text.startswith("maxsim: ") else text


if __name__ == "__main__":
    sys.exit(main())
