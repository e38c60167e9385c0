#!/usr/bin/env bash
# One H200 call on the CUDA C++ FP8 GEMV (dovetail_cuda.fp8_gemv): its GPU tests, the microbenchmark against the
# Triton GEMV (benchmarks/cuda_fp8_gemv_h200.py), then B2 on llama-3.1-8b: fp8 with the CUDA GEMV (default config, and
# the config fastest over one step's layer linears), fp8 with the Triton GEMV, bf16, and B2_VARIANTS (h200_variants.sh syntax), in ROUNDS rounds.
# Usage (on the H200, .whl carried): bash benchmarks/h200_cuda_gemv.sh ; results in $OUT.
set -u
source benchmarks/h200_setup.sh || exit 1
[ "${SKIP_TESTS:-0}" = 1 ] || log "CUDA GEMV tests"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fp8_gemv.py 2>&1 | tee "$OUT/tests.log" | tail -4
if [ "${SKIP_MICRO:-0}" != 1 ]; then
  log "microbenchmark"
  timeout 240 python3 benchmarks/cuda_fp8_gemv_h200.py 2>&1 | tee "$OUT/micro.log" | grep -v Warning
fi
best=$(python3 -c "
import json; s = json.load(open('$OUT/cuda_fp8_gemv.json'))['step']
k = min((k for k in s if k.startswith('cuda_') and k[5].isdigit()), key=s.get)[5:-3].split('_')
print(','.join(f'{n}={v}' for n, v in zip(('rows', 'unroll', 'trigger', 'warps', 'split'), k)))" 2>/dev/null || echo rows=1)
log "B2 (the step's fastest uniform config: $best)"
KIND=latency ROUNDS=${ROUNDS:-1} VARIANTS="head --quantization fp8|DOVETAIL_CUDA_FP8_GEMV_CONFIG=$best --quantization fp8|DOVETAIL_CUDA_FP8_GEMV=triton --quantization fp8|head${B2_VARIANTS:+|$B2_VARIANTS}" \
  bash benchmarks/h200_variants.sh
log done
