#!/usr/bin/env bash
# The server's packages the GPU image lacks (FastAPI and what it pins beyond the image: it has anyio,
# click, h11, idna, annotated-doc), as Python 3.12 manylinux x86_64 wheels in DIR (default
# .whl-serve, gitignored; about 3 MB), for benchmarks/serve_bench.py on the GPU (issue 55 point 3):
#   bash benchmarks/serve_wheels.sh [DIR]
#   bash benchmarks/gpu_session.sh serve          (carry: [".whl-serve"])
set -euo pipefail
dir="${1:-.whl-serve}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  typing-inspection==0.4.2 annotated-types==0.7.0 typing-extensions==4.16.0 opentelemetry-api==1.45.3
ls -l "$dir"/*.whl | awk '{ t += $5 } END { printf "%d wheels, %.1f MiB\n", NR, t / 1048576 }'
