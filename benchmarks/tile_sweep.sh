#!/usr/bin/env bash
# A dense forward tile sweep: SWEEP_SHAPES (bench shape names) under each SWEEP_TILES line
# (``--forward-tile`` specs; "table" = the selection's own choice), maxsim alone, each tile in its
# own bench run (peers' numbers come from the same shapes in gpu_session.sh bench / fp32).
#   SWEEP=bar  (default) the one-query bar shapes that trail a peer on the H100 (issue 56)
#   SWEEP=bar128 the one 128-token query against 1K documents of 1024 (the warp-specialized kernel's)
#   SWEEP=masked / masked64 / masked48 the models set's one-query masked 16-bit reranks (d 128, d 64,
#              mxbai's 48-token queries), the flat walk (flat_walk=1: every tile, padded rows
#              predicated off) beside the table's tile
#   SWEEP=fp32 the fp32 on-chip split's tile (precision="fp16x3") on the models set's fp32 reranks
# Logs under $OUT; one table line a (tile, shape): tile, shape, ms, % floor.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/maxsim-out}; mkdir -p "$OUT"
case "${SWEEP:-bar}" in
  bar)
    SHAPES=${SWEEP_SHAPES:-1q_x_100k,1x1k_32x300}
    TILES=${SWEEP_TILES:-"table
BM=32,BN=128,BK=128,num_warps=4,num_stages=4
BM=32,BN=128,BK=128,num_warps=4,num_stages=3,waves=1
BM=32,BN=128,BK=128,num_warps=4,num_stages=3,waves=4
BM=32,BN=128,BK=128,num_warps=4,num_stages=3,tma=1
BM=32,BN=128,BK=128,num_warps=4,num_stages=4,tma=1,waves=1
BM=32,BN=64,BK=128,num_warps=4,num_stages=5
BM=32,BN=64,BK=128,num_warps=4,num_stages=4,tma=1,waves=4
BM=32,BN=256,BK=128,num_warps=8,num_stages=3
BM=32,BN=128,BK=128,num_warps=8,num_stages=4
BM=32,BN=64,BK=128,num_warps=4,num_stages=4
BM=32,BN=128,BK=128,num_warps=4,num_stages=4,waves=16"} ;;
  bar128)
    SHAPES=${SWEEP_SHAPES:-1x1k_128x1024}
    TILES=${SWEEP_TILES:-"table
BM=128,BN=64,BK=128,num_warps=4,num_stages=4,waves=1,row_max=1,tma=1,kernel=ws
BM=128,BN=128,BK=128,num_warps=4,num_stages=3,waves=1,row_max=1,tma=1,kernel=ws
BM=128,BN=64,BK=128,num_warps=8,num_stages=3,row_max=1,tma=1
BM=128,BN=128,BK=128,num_warps=8,num_stages=3,row_max=1,tma=1
BM=128,BN=64,BK=128,num_warps=8,num_stages=4,waves=2,row_max=1,tma=1
BM=64,BN=128,BK=128,num_warps=4,num_stages=3,waves=2,row_max=1,tma=1"} ;;
  masked|masked64|masked48)  # one-query masked reranks of 1K documents (the models set's 16-bit ones that trail flash-maxsim)
    BM=32 BK=128
    case "$SWEEP" in
      masked) SHAPES=${SWEEP_SHAPES:-m_colbertv2_rerank_1x1k_32x180_d128_fp16,m_gte-moderncolbert_rerank_1x1k_32x300_d128_bf16,m_jina-v2_rerank_1x1k_32x512_d128_bf16} ;;
      masked64) SHAPES=${SWEEP_SHAPES:-m_jina-v2-d64_rerank_1x1k_32x512_d64_bf16}; BK=64 ;;
      masked48) SHAPES=${SWEEP_SHAPES:-m_mxbai-edge-32m_rerank_1x1k_48x512_d64_bf16}; BM=64 BK=64 ;;
    esac
    TILES=${SWEEP_TILES:-"table
BM=$BM,BN=32,BK=$BK,num_warps=2,num_stages=3,waves=4,row_max=1,tma=1
BM=$BM,BN=32,BK=$BK,num_warps=2,num_stages=3,waves=8,row_max=1,flat_walk=1
BM=$BM,BN=32,BK=$BK,num_warps=2,num_stages=4,waves=8,row_max=1,flat_walk=1
BM=$BM,BN=64,BK=$BK,num_warps=4,num_stages=3,waves=8,row_max=1,flat_walk=1
BM=$BM,BN=64,BK=$BK,num_warps=4,num_stages=3,waves=4,row_max=1,flat_walk=1"} ;;
  fp32)
    SHAPES=${SWEEP_SHAPES:-m_colbertv2_rerank_1x1k_32x180_d128_fp32,m_answerai-small_rerank_1x1k_32x300_d96_fp32,m_jina-v2-d64_rerank_1x1k_32x512_d64_fp32,m_mxbai-edge-32m_rerank_1x1k_48x512_d64_fp32,m_colpali-v1.3_rerank_1x1k_32x1030_d128_fp32}
    TILES=${SWEEP_TILES:-"table
BM=32,BN=32,BK=128,num_warps=4,num_stages=4
BM=32,BN=64,BK=64,num_warps=4,num_stages=4
BM=32,BN=128,BK=128,num_warps=8,num_stages=3
BM=32,BN=128,BK=64,num_warps=8,num_stages=3
BM=32,BN=64,BK=128,num_warps=4,num_stages=3,waves=4
BM=32,BN=64,BK=128,num_warps=8,num_stages=4"} ;;
  *) echo "tile_sweep.sh: SWEEP must be bar, bar128, masked, masked64, masked48 or fp32, got '${SWEEP}'" >&2; exit 2 ;;
esac
while read -r tile; do
  [ -z "$tile" ] && continue
  args=(); [ "$tile" != table ] && args=(--forward-tile "$tile")
  dir="$OUT/tile-sweep-${SWEEP:-bar}/${tile//[^A-Za-z0-9]/_}"; mkdir -p "$dir"
  python3 -m maxsim bench --quick --timeout 60 --shapes "$SHAPES" --providers maxsim --out "$dir" "${args[@]}" \
    > "$dir/bench.log" 2>&1
  python3 - "$tile" "$dir" <<'PY'
import glob, json, sys
tile, folder = sys.argv[1], sys.argv[2]
rows = [r for f in glob.glob(f"{folder}/*.jsonl") for r in map(json.loads, open(f)) if "shape" in r]
for r in rows:
    floor = r.get("pct_floor")
    print(tile, r["shape"], r["status"] if r["status"] != "ok" else f"{r['ms']:.4f} ms",
          "" if floor is None else f"{floor:.1f} % floor")
if not rows:
    print(tile, "no rows:", open(f"{folder}/bench.log").read().strip().splitlines()[-1:])
PY
done <<< "$TILES"
