#!/usr/bin/env bash
# Everything the CUDA path needs checked, in one run on one GPU (the `device` tool runs it
# from the repository root), in under 8 minutes on an H200 (each part has its own time
# limit; a part that fails or runs out of time is reported and the next one runs):
#   1. engine tests on CUDA in bf16, eagerly (no graphs, nothing compiled);
#   2. the same tests as CUDA runs by default: CUDA graphs and torch.compile on;
#   3. step_profile.py --cuda, eager and with graphs (syncs; kernels by torch.profiler);
#   4. engine_bench.py --gpu with graphs (the default) and without;
#   5. sampler_passes.py --cuda (passes over [B, vocab] and their traffic).
# Logs and summary.txt land in $OUT (or ./gpu-check); the last line is the summary:
#   GPU CHECK: tests eager PASS, tests graphs PASS, ..., HBM bound 31.2% (graphs) 9.8% (eager)
# The fraction is DESIGN.md §4's: tokens/s over B * BW / (2P + B * C * k) for the bench's
# Qwen2.5-0.5B shape at B = 256 (engine_bench.py prints how it gets C and k).
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
# The device machine has no network: its own Python and torch, this tree on PYTHONPATH.
PY=${PY:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Compiled kernels are cached here across the parts (the first compile is the slow one).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
  > "$OUT/torch.txt" 2>&1
declare -a RESULTS=()
run() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS rc
  echo "== $name (limit ${limit}s)" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local verdict=PASS
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict=TIMEOUT; elif [ "$rc" -ne 0 ]; then verdict="FAIL($rc)"; fi
  echo "$verdict after $((SECONDS - start))s" | tee -a "$SUMMARY"
  tail -n 12 "$OUT/$name.log" >> "$SUMMARY"
  RESULTS+=("$name $verdict")
}
TESTS=(tests/engine/test_cuda_path.py tests/engine/test_step_work.py tests/engine/test_paged.py
       tests/engine/test_semantics.py tests/engine/test_graphs.py tests/engine/test_prefix.py)
export BATCHWRIGHT_TEST_DEVICE=cuda BATCHWRIGHT_TEST_DTYPE=bfloat16
BATCHWRIGHT_TEST_CUDA_GRAPHS=0 BATCHWRIGHT_TEST_COMPILE=0 run tests-eager 90 \
  "$PY" -m pytest -q -x "${TESTS[@]}" -p no:cacheprovider
BATCHWRIGHT_TEST_CUDA_GRAPHS=1 BATCHWRIGHT_TEST_COMPILE=1 run tests-graphs 100 \
  "$PY" -m pytest -q -x "${TESTS[@]}" -p no:cacheprovider
unset BATCHWRIGHT_TEST_DEVICE BATCHWRIGHT_TEST_DTYPE
run step-profile 45 "$PY" bench/step_profile.py --cuda --rows 256
run step-profile-graphs 45 "$PY" bench/step_profile.py --cuda --graphs --rows 256
run bench-graphs 90 "$PY" bench/engine_bench.py --gpu --engine-only
run bench-eager 70 "$PY" bench/engine_bench.py --gpu --engine-only --no-graphs
run sampler-passes 40 "$PY" bench/sampler_passes.py --cuda --rows 256 --vocab 151936
bound() {  # the HBM-bound fraction an engine_bench log printed, or "n/a"
  local f
  f=$(grep -o 'engine reaches [0-9.]*% of the HBM bound' "$OUT/$1.log" 2>/dev/null | grep -o '[0-9.]*%')
  echo "${f:-n/a}"
}
line="GPU CHECK: $(IFS=,; echo "${RESULTS[*]}" | sed 's/,/, /g'); HBM bound at B=256: $(bound bench-graphs) with graphs, $(bound bench-eager) eager"
echo "$line" | tee -a "$SUMMARY"
