#!/usr/bin/env bash
# The wheels of the engines that benchmarks/headline_bench.py runs beside maxsim.Corpus (fast-plaid,
# xtr-warp-rs, colsearch), and of what they import that the GPU image lacks, for Python 3.12 on
# manylinux x86_64, downloaded into DIR (default .whl-engines) on a machine with a package index:
#   bash benchmarks/engine_wheels.sh [DIR]
# On the GPU machine (no network; its image has torch 2.11, triton 3.6, numpy, scipy, pandas, pyarrow,
# h5py, joblib, tqdm, safetensors, filelock):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site-engines DIR/*.whl
#   PYTHONPATH=/tmp/site-engines python3 benchmarks/headline_bench.py --docs 1000000 ...
# Each wheel is named, pinned, and downloaded without resolving dependencies: the list below is what
# the code paths that headline_bench uses import (read from the packages' sources; duckdb is the large
# one, imported by xtr_warp at import time). About 42 MB in all.
set -euo pipefail
dir="${1:-.whl-engines}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
wheels=(
  fast-plaid==1.7.0.2110  # fast_plaid, the build for torch 2.11
  fastkmeans==0.5.0       # fast_plaid's index build imports it
  usearch==2.26.6         # fast_plaid.search imports usearch.index
  numkong==7.8.6          # usearch imports it
  xtr-warp-rs==2.1.0.2110 # xtr_warp, the build for torch 2.11 (its Rust extension links libtorch 2.11)
  duckdb==2.0.1           # xtr_warp imports it at import (xtr_warp/filtering.py: metadata filters); 25 MB
  colsearch==0.1.7        # colsearch, pure Python; its exact lane imports numpy, torch, triton, safetensors
)
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${wheels[@]}"
ls -l "$dir"/*.whl | awk '{ printf "%10d  %s\n", $5, $NF; total += $5 } END { printf "%10d  total (%.1f MiB)\n", total, total / 1048576 }'
