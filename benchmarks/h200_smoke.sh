#!/usr/bin/env bash
# First H200 call: install, the CUDA tests that matter most, a first look at qwen3-0.6b speed,
# and FlashInfer's JIT cache back as $OUT/flashinfer.tgz (carry it as .fi_cache/ next time).
set -u
source benchmarks/h200_setup.sh || exit 1

log "tests: h128 attention, graphs, engine, sampler, platform"
timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=12 tests/test_cuda_platform.py \
  tests/test_cuda_sampler.py tests/test_cuda_engine.py \
  "tests/test_cuda_backends.py" -k "h128 or negative or captured or not test_backend_matches" \
  2>&1 | tee "$OUT/tests.log" | tail -40

log "qwen3-0.6b: step profile, latency, throughput (FLASHINFER)"
for eager in "" "--enforce-eager"; do
  timeout 120 python3 benchmarks/cuda_step_profile.py --model qwen3-0.6b --attention-backend FLASHINFER $eager \
    2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
done
timeout 150 dovetail bench throughput --model qwen3-0.6b --attention-backend FLASHINFER \
  --output-json "$OUT/b1_qwen_flashinfer.json" 2>>"$OUT/bench.err" | tail -12
[ "$SECONDS" -lt 470 ] && timeout 90 python3 benchmarks/cuda_step_profile.py --model qwen3-0.6b \
  --attention-backend TRITON 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"

if [ "$SECONDS" -lt 480 ]; then
  log "tests: the other attention cases"
  timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backends.py \
    -k "test_backend_matches and not h128" 2>&1 | tee "$OUT/tests2.log" | tail -25
fi
tar czf "$OUT/flashinfer.tgz" -C ~/.cache flashinfer 2>/dev/null && ls -la "$OUT"
tail -30 "$OUT/bench.err"
log done
