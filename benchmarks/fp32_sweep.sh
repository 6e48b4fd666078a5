#!/usr/bin/env bash
# The fp32 on-chip split's tile (precision="fp16x3", few query rows a document token): the fp32
# rerank rows of --shapes models under each candidate tile, maxsim alone (the peers' numbers come
# from the same shapes in gpu_session.sh fp32). Logs under $OUT; one table line a (tile, shape).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/maxsim-out}; mkdir -p "$OUT"
SHAPES=${SWEEP_SHAPES:-m_colbertv2_rerank_1x1k_32x180_d128_fp32,m_answerai-small_rerank_1x1k_32x300_d96_fp32,m_jina-v2-d64_rerank_1x1k_32x512_d64_fp32,m_mxbai-edge-32m_rerank_1x1k_48x512_d64_fp32,m_colpali-v1.3_rerank_1x1k_32x1030_d128_fp32}
TILES=${SWEEP_TILES:-"table
BM=32,BN=32,BK=128,num_warps=4,num_stages=4
BM=32,BN=64,BK=64,num_warps=4,num_stages=4
BM=32,BN=128,BK=128,num_warps=8,num_stages=3
BM=32,BN=128,BK=64,num_warps=8,num_stages=3
BM=32,BN=64,BK=128,num_warps=4,num_stages=3,waves=4
BM=32,BN=64,BK=128,num_warps=8,num_stages=4"}
while read -r tile; do
  [ -z "$tile" ] && continue
  args=(); [ "$tile" != table ] && args=(--forward-tile "$tile")
  python3 -m maxsim bench --quick --timeout 60 --shapes "$SHAPES" --providers maxsim "${args[@]}" \
    > "$OUT/fp32-sweep-${tile//[^A-Za-z0-9]/_}.log" 2>&1
  grep -E "^m_" "$OUT/fp32-sweep-${tile//[^A-Za-z0-9]/_}.log" | awk -v t="$tile" '{print t, $1, $(NF-4), $(NF-3) "% floor"}'
done <<< "$TILES"
