#!/usr/bin/env bash
# One H200 call on programmatic dependent launch (PDL) and the Triton GEMV: the GPU tests of the kernels it
# touches, benchmarks/gemv_pdl_h200.py, then B2 (`dovetail bench latency`) with PDL on and off
# (DOVETAIL_TRITON_PDL=1/0), alternating, for llama-3.1-8b bf16 and fp8 and qwen3-0.6b.
# Usage (on the H200, .whl carried): bash benchmarks/h200_pdl.sh ; results in $OUT (b2.jsonl, gemv_pdl.json).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/h200_setup.sh || exit 1
log() { echo "== $* (t=${SECONDS}s)"; }
left() { echo $((580 - SECONDS)); }
log "GPU tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_triton_pdl.py tests/test_fp8_gemv.py \
  tests/test_triton_gpu.py tests/test_triton_fused_ops.py tests/test_cuda_engine.py 2>&1 | tee "$OUT/tests.log" | tail -6
log "GEMV and PDL microbenchmark"
timeout 150 python3 benchmarks/gemv_pdl_h200.py 2>&1 | tee "$OUT/gemv_pdl.log" | grep -v Warning
b2() {  # b2 LABEL PDL MODEL ARGS...
  [ "$(left)" -gt 45 ] || { echo "skip $1: out of time"; return; }
  DOVETAIL_TRITON_PDL=$2 timeout "$(left)" dovetail --log-level WARNING bench latency --model "$3" --dtype bfloat16 \
    --attention-backend TRITON "${@:4}" --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" || { echo "$1 failed"; return; }
  python3 - "$1" <<'PY' | tee -a "$OUT/b2.jsonl"
import json, sys
d = json.load(open("/tmp/r.json"))
print(json.dumps({"label": sys.argv[1], "ms_per_token": d["dovetail"]["ms_per_token"],
                  "runs": d["dovetail"]["ms_per_token_runs"]}))
PY
}
log "B2"
b2 llama-pdl1 1 llama-3.1-8b
b2 llama-pdl0 0 llama-3.1-8b
b2 llama-fp8-pdl1 1 llama-3.1-8b --quantization fp8
b2 llama-fp8-pdl0 0 llama-3.1-8b --quantization fp8
b2 qwen-pdl1 1 qwen3-0.6b
b2 qwen-pdl0 0 qwen3-0.6b
grep -h "Error" "$OUT/err.log" | tail -5
log done
