#!/usr/bin/env bash
# Everything the CUDA path needs checked, in one run on a GPU machine (the `device` tool
# runs it from the repository root): the engine tests on CUDA in bf16, eager and with CUDA
# graphs; the sampler's passes over the vocabulary as inductor compiles it for CUDA; the
# step profile; engine_bench and prefix_bench in their GPU modes. Figures and logs land
# in $OUT (or ./gpu-check). Sized for about 10 minutes on an H200 (untried).
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
# The device machine has no network: its own Python and torch, this tree on PYTHONPATH
# (packages it lacks travel as wheels; see the device tool's notes).
PY=${PY:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/summary.txt"
  tail -n 15 "$OUT/$name.log" >> "$OUT/summary.txt"
}
export BATCHWRIGHT_TEST_DEVICE=cuda BATCHWRIGHT_TEST_DTYPE=bfloat16
run engine-tests 240 "$PY" -m pytest -q -x tests/engine -p no:cacheprovider
BATCHWRIGHT_TEST_CUDA_GRAPHS=1 run engine-tests-graphs 240 \
  "$PY" -m pytest -q tests/engine -p no:cacheprovider
unset BATCHWRIGHT_TEST_DEVICE BATCHWRIGHT_TEST_DTYPE
run sampler-passes 180 "$PY" bench/sampler_passes.py --cuda --rows 256 --vocab 151936
run step-profile 120 "$PY" bench/step_profile.py --cuda
run step-profile-graphs 120 "$PY" bench/step_profile.py --cuda --graphs
run engine-bench 300 "$PY" bench/engine_bench.py --gpu
run engine-bench-graphs 300 "$PY" bench/engine_bench.py --gpu --graphs
run prefix-bench 300 "$PY" bench/prefix_bench.py --gpu
cat "$OUT/summary.txt"
