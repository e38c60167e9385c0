#!/usr/bin/env bash
# One H200 call after the in-place q/k norm: the fused-op and engine GPU tests, then B2 and B1 of qwen3-0.6b
# (the shape with q/k norms) with TRITON. Usage (on the H200, .whl carried): bash benchmarks/h200_qknorm.sh
set -u
source benchmarks/h200_setup.sh || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fused_ops.py tests/test_triton_gpu.py \
  tests/test_cuda_engine.py -m gpu -k "not FLASHINFER" 2>&1 | tail -2
for bench in latency throughput; do
  timeout 150 dovetail --log-level WARNING bench $bench --model ${MODEL:-qwen3-0.6b} --dtype bfloat16 --attention-backend TRITON \
    --output-json "$OUT/qwen3_$bench.json" >/dev/null 2>>"$OUT/err.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['dovetail']; print(sys.argv[2], d.get('ms_per_token'), d.get('ms_per_token_runs'), d.get('output_tokens_per_s'))" "$OUT/qwen3_$bench.json" $bench
done
echo "== done (t=${SECONDS}s)"
