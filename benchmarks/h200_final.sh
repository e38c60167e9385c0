#!/usr/bin/env bash
# The recorded H200 figures in one call: GPU checks of the engine, then B2 and B1 (`dovetail bench`) for
# qwen3-0.6b and llama-3.1-8b with TRITON (B1 of qwen3-0.6b also with the pre-vLLM-default 8192 x 256 limits), llama-3.1-8b with
# --quantization fp8 against bf16, HF transformers in the same run, and the start-up time to the first token.
# Usage (on the H200, .whl carried): bash benchmarks/h200_final.sh ; JSON lines in $OUT/results.jsonl.
# PART=engine runs only the checks and Dovetail's figures, PART=peers only the start-up time and HF (two calls
# when one does not fit in the device's 10 minutes).
set -u
source benchmarks/h200_setup.sh || exit 1
left() { echo $((575 - SECONDS)); }
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['label']=sys.argv[2]; print(json.dumps(d))" "$1" "$2" \
  >> "$OUT/results.jsonl"; python3 - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = d["dovetail"]
print(sys.argv[2], {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
                    if k in ("ms_per_token", "output_tokens_per_s", "prefill_ms", "load_seconds", "attention_backend")})
PY
}
bench() {  # bench LABEL TIMEOUT MODEL ARGS...
  [ "$(left)" -gt 30 ] || { echo "skip $1: out of time"; return; }
  local t=$2; [ "$t" -gt "$(left)" ] && t=$(left)
  timeout "$t" dovetail --log-level WARNING bench "${@:4}" --model "$3" --dtype bfloat16 --attention-backend TRITON \
    --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" && json /tmp/r.json "$1"; }

PART=${PART:-all}
if [ "$PART" != peers ]; then
log "GPU checks: overlapped scheduling, engine, sampler, FP8 GEMV"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_async_scheduling.py tests/test_cuda_engine.py \
  tests/test_cuda_sampler.py tests/test_gemv.py -k "not FLASHINFER" 2>&1 | tee "$OUT/tests.log" | tail -4

bench B2-qwen3 90 qwen3-0.6b latency
bench B2-llama 120 llama-3.1-8b latency
bench B2-llama-fp8 120 llama-3.1-8b latency --quantization fp8
bench B1-qwen3 120 qwen3-0.6b throughput
bench B1-qwen3-8192x256 120 qwen3-0.6b throughput --max-num-batched-tokens 8192 --max-num-seqs 256
bench B1-llama 150 llama-3.1-8b throughput
bench B1-llama-fp8 150 llama-3.1-8b throughput --quantization fp8
fi
[ "$PART" = engine ] && { log done; exit 0; }
log "start-up to first token"
[ "$(left)" -gt 60 ] && timeout 60 python3 benchmarks/cuda_startup.py --model qwen3-0.6b --attention-backend TRITON \
  2>>"$OUT/err.log" | tee -a "$OUT/results.jsonl"
log "HF transformers"
for m in qwen3-0.6b llama-3.1-8b; do
  [ "$(left)" -gt 40 ] || break
  timeout "$(left)" python3 benchmarks/cuda_hf_peer.py --model $m --b1-prompts 64 2>>"$OUT/err.log" \
    | tee -a "$OUT/results.jsonl"
done
grep -h "Error\|error" "$OUT/err.log" | tail -5
log done
