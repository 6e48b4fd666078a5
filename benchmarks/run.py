"""Forward benchmark: ``python benchmarks/run.py [options]``, same as ``python -m maxsim bench``.

Run ``python benchmarks/run.py --help`` for the options.
"""

import sys
from pathlib import Path

# Benchmark this checkout's code, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from maxsim.bench import run_cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))
