#!/usr/bin/env bash
# One device call: GPU test tier, kernel sweep and/or benchmark, logs under $OUT.
#   bash benchmarks/gpu_session.sh tests [fwdtests] [ncu] [probe] [tune] [tunetma] [clocks] [wsbench] [onequery] [profile] [overhead] [bwdprof] [bwdgather] [hostprof] [ws] [bench] [shapes] [sweep] [sweeppeers] [train] [varlen]
# Peers' wheels, when carried in .whl/, are installed into /tmp/site (the device has no network).
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
status=0
for step in "$@"; do
  case "$step" in
    tests) python3 -m pytest -q -p no:cacheprovider --deselect tests/test_compile_sm90.py tests -rs --durations=15 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 || status=1 ;;
    tune)  python3 benchmarks/tune_forward.py ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} ${TUNE_ARGS:-} 2>&1 > "$OUT/tune.log"; grep -v "^  " "$OUT/tune.log" | tail -40 ;;
    ncu) for v in ${NCU_VARIANTS:-argmax plain}; do
           timeout 200 ncu --clock-control none --set full --import-source no --launch-skip 2 --launch-count 1 -k regex:fwd_ws \
             -f -o "$OUT/ncu-$v" python3 benchmarks/ncu_ws.py "$v" > "$OUT/ncu-$v.run.log" 2>&1
           ncu -i "$OUT/ncu-$v.ncu-rep" --page details > "$OUT/ncu-$v-details.txt" 2>&1
           ncu -i "$OUT/ncu-$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$v-sass.csv" 2>&1
           python3 benchmarks/ncu_stalls.py "$OUT/ncu-$v-sass.csv" > "$OUT/ncu-$v-stalls.txt" 2>&1
           tail -3 "$OUT/ncu-$v.run.log"; grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued" "$OUT/ncu-$v-details.txt" | head -12
         done ;;
    clocks) timeout 300 python3 benchmarks/probe_ws_argmax.py --clocks --variants "${CLOCK_VARIANTS:-plain-1,values-1,argmax-2}" 2>&1 | tee "$OUT/clocks.log" ;;
    onequery) timeout 200 python3 benchmarks/probe_one_query.py 2>&1 | tee "$OUT/onequery.log" ;;
    wsbench) timeout 270 python3 benchmarks/ws_bench.py ${WS_SHAPES:+--shapes $WS_SHAPES} ${WS_ARGS:-} 2>&1 | tee "$OUT/wsbench.log" ;;
    tunetma) for flags in "" "--tma" "--tma --argmax"; do
               python3 benchmarks/tune_forward.py --row-max-only $flags --shapes 32q_x_100k,inbatch_128x128,colpali_1x1k,1x1k_128x1024
             done 2>&1 > "$OUT/tunetma.log"; grep -v "^  " "$OUT/tunetma.log" | tail -40 ;;
    fwdtests) python3 -m pytest -q -p no:cacheprovider tests/dense/test_forward_gpu.py -x 2>&1 | tee "$OUT/fwdtests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -20 || status=1 ;;
    probe) timeout 420 python3 benchmarks/probe_configs.py ${PROBES:+--only $PROBES} 2>&1 > "$OUT/probe.log"; grep -v "^  " "$OUT/probe.log" | tail -40 ;;
    profile) python3 benchmarks/profile_small.py 2>&1 | tee "$OUT/profile.log" | tail -60 ;;
    overhead) python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/overhead.log" ;;
    bwdgather) timeout 400 python3 benchmarks/probe_backward_gather.py ${BWD_SHAPES:+--shapes $BWD_SHAPES} 2>&1 | tee "$OUT/bwdgather.log" ;;
    bwdprof) python3 benchmarks/profile_backward.py 2>&1 | tee "$OUT/bwdprof.log" ;;
    hostprof) python3 benchmarks/profile_train_host.py 2>&1 | tee "$OUT/hostprof.log" ;;
    ws) { timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dense/test_forward_ws_gpu.py -x ${WS_TESTS:+-k "$WS_TESTS"} 2>&1 | tail -15; timeout 270 python3 benchmarks/ws_bench.py ${WS_SHAPES:+--shapes $WS_SHAPES} ${WS_ARGS:-}; } 2>&1 | tee "$OUT/ws.log" ;;
    train) python3 -m maxsim bench --mode train --quick --timeout 45 --pin-cpu ${PIN_CPU:-2} ${TRAIN_SHAPES:+--shapes $TRAIN_SHAPES} ${TRAIN_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -30 || status=1 ;;
    varlen) python3 benchmarks/varlen_bench.py --out "$OUT" 2>&1 | tee "$OUT/varlen.log" | tail -20 ;;
    sweep) python3 -m maxsim bench --shapes sweep --quick --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | tail -30 ;;
    sweeppeers) python3 -m maxsim bench --shapes sweep --quick --providers maxsim,late-interaction-kernels,flash-maxsim \
                  --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | tail -30 ;;
    shapes) python3 -m maxsim bench --shapes "$BENCH_SHAPES" --quick --providers ${BENCH_PROVIDERS:-maxsim,late-interaction-kernels,flash-maxsim} ${BENCH_ARGS:-} \
              --out "$OUT" 2>&1 | tee "$OUT/shapes.log" | tail -30 ;;
    bench) python3 -m maxsim bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
