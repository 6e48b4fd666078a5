# Ad-hoc device call (2026-11-29, fourth session): forward GPU tests, the forward benchmark with
# the peers, and the sweep against the peers (naive left out of the sweep for time).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/tests"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/dense/test_forward_gpu.py tests/dense/test_forward.py 2>&1 | tee $OUT/tests-forward.log | tail -3
timeout 210 python3 -m maxsim bench --out $OUT > $OUT/bench.log 2>&1; tail -14 $OUT/bench.log | cut -c1-140
timeout 270 python3 -m maxsim bench --shapes sweep --quick --providers maxsim,late-interaction-kernels,flash-maxsim --out $OUT > $OUT/sweep.log 2>&1; tail -3 $OUT/sweep.log | cut -c1-200
