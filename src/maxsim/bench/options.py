"""The ``bench`` command's options (``add_arguments``), shared by ``python -m maxsim bench``
(:mod:`maxsim.bench.cli`) and the runner's own parser (tests and workers). It imports neither the
runner nor the kernels: building ``python -m maxsim --help`` stays cheap."""

from __future__ import annotations

import argparse
from pathlib import Path

MODES = ("forward", "train", "varlen")
DEFAULT_OUT_DIR = "maxsim-bench-results"  # under the working directory
DEFAULT_TIMEOUT_S = 300.0

DESCRIPTION = """\
Time maxsim against its peers and check every result against the reference.

Modes:
  forward  one scoring call, Q [Nq, Lq, d] against D [Nd, Ld, d] (or candidate lists)
  train    one training step: scores, cross-entropy loss, backward into Q and D,
           the gradients checked too
  varlen   ragged batches: packed maxsim_varlen against padded maxsim and the peers

On a GPU the default shapes are the benchmark proper; on a CPU, the same layouts scaled
down (maxsim runs its PyTorch reference there, and the GPU peers are skipped). Peers that
are not installed are named once in the header and skipped."""

EPILOG = """\
examples:
  python -m maxsim bench                     forward, the default shapes of this device
  python -m maxsim bench --list              the shapes and providers of every mode
  python -m maxsim bench --mode train --quick
  python -m maxsim bench --shapes sweep --providers maxsim,flash-maxsim --out results/"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``python -m maxsim bench``."""
    from maxsim.bench.providers import REGISTRIES

    p.add_argument("--mode", choices=MODES, default="forward", help="what one timed call is (default: %(default)s)")
    p.add_argument(
        "--shapes",
        help="comma-separated shape names, or the set 'sweep' (forward, 108 shapes) "
        "(default: the mode's set for the device; --list shows them)",
    )
    providers = "; ".join(f"{mode}: {', '.join(names)}" for mode, (_, names) in REGISTRIES.items())
    by_name = ", ".join(n for _, (reg, names) in REGISTRIES.items() for n, pr in reg.items()
                        if not pr.internal and n not in names)
    p.add_argument("--providers", help=f"comma-separated providers (default: all of the mode's: {providers}; "
                                       f"by name only: {by_name})")
    p.add_argument("--list", action="store_true", help="print every mode's shapes and providers, and exit")
    p.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    p.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        help="rounds over every (shape, provider); each cell reports its median round and the note "
        "lists them all (default: %(default)s)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT_DIR),
        help="directory for the CSV, JSONL, PNG and worker log (default: ./%(default)s)",
    )
    p.add_argument("--csv", type=Path, help="CSV path (default: OUT/<mode>-<date>.csv)")
    p.add_argument("--png", type=Path, help="bar chart path, needs matplotlib (default: OUT/<mode>-<date>.png)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default: %(default)s)")
    p.add_argument(
        "--forward-tile",
        metavar="SPEC",
        help="force one dense forward tile for every maxsim call, for tuning sweeps, e.g. "
        "'BM=128,BN=64,BK=128,num_warps=8,num_stages=3,row_max=1' (sets MAXSIM_FORWARD_TILE; "
        "maxsim.explain shows the table's own choice)",
    )
    gpu = p.add_argument_group("GPU timing")
    gpu.add_argument(
        "--flush",
        choices=["read", "zero"],
        default="read",
        help="how the L2 is emptied before each timed call: read 256 MB (clean lines), or zero "
        "256 MB as triton's do_bench does (dirty lines the call must write back) (default: %(default)s)",
    )
    gpu.add_argument(
        "--pin-cpu",
        type=int,
        metavar="CPU",
        help="run the benchmark and its workers on this one CPU core, as taskset -c CPU does, so that "
        "host-bound calls (small training steps) time the same run to run (default: not pinned)",
    )
    gpu.add_argument(
        "--isolate",
        choices=["auto", "on", "off"],
        default="auto",
        help="one worker subprocess per provider, so that a crashing kernel takes only its own "
        "rows down (auto: on for cuda)",
    )
    gpu.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a worker may take on one shape before it is killed (default: %(default)s)",
    )
