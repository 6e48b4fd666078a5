"""Command line: ``python -m maxsim bench | info``."""

from __future__ import annotations

import argparse
import sys


def _info() -> int:
    import torch

    import maxsim
    from maxsim._dispatch import backend_for

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
    print(f"backend for CPU tensors: {backend_for(torch.device('cpu'))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m maxsim", description=__doc__)
    parser.add_argument("command", choices=["bench", "info"], help="bench: time forward (--mode forward) or training steps (--mode train); info: versions and backends")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from maxsim.bench import run_cli

        return run_cli(rest)
    if command == "info":
        return _info()
    parser.parse_args(argv)  # prints the usage error
    return 2


if __name__ == "__main__":
    sys.exit(main())
