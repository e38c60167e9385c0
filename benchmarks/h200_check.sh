#!/usr/bin/env bash
# GPU checks of the current tree on the H200 in one call: every GPU test (FLASHINFER included), then B2 on
# qwen3-0.6b with TRITON to see that nothing regressed since the recorded run.
# Usage (on the H200, .whl carried): bash benchmarks/h200_check.sh ; logs in $OUT.
set -u
source benchmarks/h200_setup.sh || exit 1
echo "== GPU tests (t=${SECONDS}s)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine_async_scheduling.py 2>&1 | tail -3
timeout 360 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_cuda_engine.py tests/test_cuda_sampler.py \
  tests/test_triton_gpu.py tests/test_quant_kernels.py tests/test_quant_triton.py \
  tests/test_cuda_backends.py tests/test_cuda_platform.py tests/test_triton_fused_ops.py 2>&1 | tee "$OUT/tests.log" | tail -25
echo "== B2 qwen3-0.6b TRITON (t=${SECONDS}s)"
timeout $((580 - SECONDS)) dovetail --log-level WARNING bench latency --model qwen3-0.6b --dtype bfloat16 \
  --attention-backend TRITON --output-json "$OUT/b2.json" >/dev/null 2>"$OUT/b2.err" && cat "$OUT/b2.json" | head -c 1500
echo "== done (t=${SECONDS}s)"
