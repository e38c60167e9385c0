#!/usr/bin/env bash
# One H200 call: the quantization GPU tests, then where llama-3.1-8b's batch-1 decode step spends its GPU
# time (bf16 and fp8, eager, per kernel) and the cuBLAS GEMV bandwidth at M=1.
# Usage (on the H200, .whl carried): bash benchmarks/h200_round1.sh ; results in $OUT.
set -u
source benchmarks/h200_setup.sh || exit 1
echo "== quantization tests (t=${SECONDS}s)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_quant_kernels.py \
  tests/test_quant_triton.py 2>&1 | tail -4
echo "== decode profile bf16 (t=${SECONDS}s)"
timeout 170 python3 benchmarks/h200_profile_decode.py --model llama-3.1-8b --gemv > "$OUT/profile_bf16.log" 2>&1
tail -36 "$OUT/profile_bf16.log"
echo "== decode profile fp8 (t=${SECONDS}s)"
timeout $((585 - SECONDS)) python3 benchmarks/h200_profile_decode.py --model llama-3.1-8b --quantization fp8 \
  > "$OUT/profile_fp8.log" 2>&1
tail -32 "$OUT/profile_fp8.log"
echo "== done (t=${SECONDS}s)"
