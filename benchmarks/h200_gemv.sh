#!/usr/bin/env bash
# One H200 call on the Triton GEMV for unquantized linears and PDL: the GPU tests of the kernels and the
# engine, benchmarks/gemv_pdl_h200.py, then B2 and B1 (`dovetail bench`) for llama-3.1-8b (bf16, fp8) and
# qwen3-0.6b. Usage (on the H200, .whl carried): bash benchmarks/h200_gemv.sh ; results in $OUT.
# SKIP_MICRO=1 skips the microbenchmark, SKIP_B1=1 the B1 runs; TESTS= runs only the GEMV and PDL tests;
# PDL_AB=1 runs each B2 with DOVETAIL_TRITON_PDL=1 and then 0 (what benchmarks/h200_pdl.sh did at 77a43ea).
# MICRO_ARGS are passed to the microbenchmark; GEMV_SETS="fp8.pdl_trigger=0 fp8.block_k=128,fp8.num_stages=5 ..."
# adds a llama-3.1-8b fp8 B2 per set of GEMV default overrides after the usual B2s
# (benchmarks/with_gemv_config.py; commas separate fields; a bf16 B2 too for a set with bf16.FIELD).
set -u
source benchmarks/h200_setup.sh || exit 1
left() { echo $((580 - SECONDS)); }
log "GPU tests"
TESTS=${TESTS-tests/test_triton_gpu.py tests/test_triton_fused_ops.py tests/test_cuda_engine.py tests/test_cuda_graph_runner.py}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_pdl.py tests/test_gemv.py $TESTS \
  2>&1 | tee "$OUT/tests.log" | tail -6
if [ "${SKIP_MICRO:-0}" != 1 ]; then
  log "GEMV microbenchmark"
  timeout 150 python3 benchmarks/gemv_pdl_h200.py ${MICRO_ARGS:-} 2>&1 | tee "$OUT/gemv_pdl.log" | grep -v Warning
fi
bench() {  # bench LABEL KIND MODEL ARGS...
  [ "$(left)" -gt 45 ] || { echo "skip $1: out of time"; return; }
  local cmd=(dovetail)
  [ -z "${GEMV_SET:-}" ] || cmd=(python3 benchmarks/with_gemv_config.py $GEMV_SET --)
  timeout "$(left)" "${cmd[@]}" --log-level WARNING bench "$2" --model "$3" --dtype bfloat16 --attention-backend TRITON \
    "${@:4}" --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" || { echo "$1 failed"; return; }
  python3 - "$1" <<'PY' | tee -a "$OUT/bench.jsonl"
import json, sys
d = json.load(open("/tmp/r.json")); r = d["dovetail"]
print(json.dumps({"label": sys.argv[1], **{k: r[k] for k in ("ms_per_token", "ms_per_token_runs",
                  "output_tokens_per_s", "elapsed_s") if k in r}}))
PY
}
log "B2"
if [ "${PDL_AB:-0}" = 1 ]; then  # B2 with programmatic dependent launch on, then off, alternating
  for args in "llama latency llama-3.1-8b" "llama-fp8 latency llama-3.1-8b --quantization fp8" "qwen latency qwen3-0.6b"; do
    set -- $args
    for pdl in 1 0; do DOVETAIL_TRITON_PDL=$pdl bench "B2-$1-pdl$pdl" "${@:2}"; done
  done
else
  bench B2-llama latency llama-3.1-8b
  bench B2-llama-fp8 latency llama-3.1-8b --quantization fp8
  bench B2-qwen latency qwen3-0.6b
fi
for set in ${GEMV_SETS:-}; do  # then llama fp8 (and bf16 if the set names it) per set of GEMV overrides
  [[ "$set" != *bf16.* ]] || GEMV_SET="${set//,/ }" bench "B2-llama-$set" latency llama-3.1-8b
  GEMV_SET="${set//,/ }" bench "B2-llama-fp8-$set" latency llama-3.1-8b --quantization fp8
done
if [ "${SKIP_B1:-0}" != 1 ]; then
  log "B1"
  bench B1-qwen throughput qwen3-0.6b
  bench B1-llama throughput llama-3.1-8b
fi
grep -h "Error" "$OUT/err.log" | tail -5
log done
