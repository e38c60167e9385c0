#!/usr/bin/env bash
# Second H200 call: the GPU engine tests, then where the time goes (host stages, kernels) for
# qwen3-0.6b and llama-3.1-8b, B2 and B1, and the start-up time. Results in $OUT/profile.jsonl.
set -u
source benchmarks/h200_setup.sh || exit 1
prof() { timeout "$1" python3 benchmarks/cuda_step_profile.py "${@:2}" 2>>"$OUT/profile.err" | tee -a "$OUT/profile.jsonl"; }

log "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_sampler.py \
  tests/test_cuda_backends.py -k "not test_backend_matches" 2>&1 | tee "$OUT/tests.log" | tail -8

log "qwen3-0.6b"
prof 60 --model qwen3-0.6b --attention-backend FLASHINFER --kernels
prof 60 --model qwen3-0.6b --attention-backend TRITON --kernels
prof 60 --model qwen3-0.6b --attention-backend FLASHINFER --enforce-eager --kernels
prof 90 --model qwen3-0.6b --attention-backend FLASHINFER --workload b1
timeout 60 python3 benchmarks/cuda_startup.py --model qwen3-0.6b --attention-backend FLASHINFER \
  2>>"$OUT/profile.err" | tee -a "$OUT/profile.jsonl"

log "llama-3.1-8b"
prof 150 --model llama-3.1-8b --attention-backend FLASHINFER --kernels
[ "$SECONDS" -lt 420 ] && prof $((560 - SECONDS)) --model llama-3.1-8b --attention-backend FLASHINFER --workload b1
grep -h "engine ready\|KV cache gets" "$OUT/profile.err" | tail -6
tail -5 "$OUT/profile.err"
log done
