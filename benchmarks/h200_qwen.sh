#!/usr/bin/env bash
# H200 call: the GPU tests, then qwen3-0.6b: where a step's time goes, B2 and B1 for each backend that runs
# (FlashInfer's decode on CUDA cores, the default here, and on tensor cores; TRITON), start-up to the first
# token, and HF transformers in the same run. JSON results in $OUT/results.jsonl.
set -u
source benchmarks/h200_setup.sh || exit 1
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['label']=sys.argv[2]; print(json.dumps(d))" "$1" "$2" \
  | tee -a "$OUT/results.jsonl" | cut -c1-400; }
bench() {  # bench LABEL TIMEOUT ARGS...
  timeout "$2" dovetail bench "${@:3}" --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" && json /tmp/r.json "$1"; }

log "tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_sampler.py \
  tests/test_cuda_backends.py -k "not test_backend_matches" 2>&1 | tee "$OUT/tests.log" | tail -5

log "qwen3-0.6b step profiles"
for backend in FLASHINFER TRITON; do
  timeout 60 python3 benchmarks/cuda_step_profile.py --model qwen3-0.6b --attention-backend $backend --kernels \
    2>>"$OUT/err.log" | tee -a "$OUT/profile.jsonl" | cut -c1-1500
done

log "qwen3-0.6b B2 and B1"
M="--model qwen3-0.6b"
bench B2-flashinfer 60 latency $M --attention-backend FLASHINFER
DOVETAIL_FLASHINFER_TENSOR_CORES=1 bench B2-flashinfer-tensorcores 60 latency $M --attention-backend FLASHINFER
bench B2-triton 60 latency $M --attention-backend TRITON
bench B1-flashinfer 90 throughput $M --attention-backend FLASHINFER
DOVETAIL_FLASHINFER_TENSOR_CORES=1 bench B1-flashinfer-tensorcores 90 throughput $M --attention-backend FLASHINFER
bench B1-triton 90 throughput $M --attention-backend TRITON
for backend in FLASHINFER TRITON; do
  timeout 60 python3 benchmarks/cuda_startup.py $M --attention-backend $backend 2>>"$OUT/err.log" \
    | tee -a "$OUT/results.jsonl"
done

log "HF transformers peer"
bench B2-hf 120 latency $M --attention-backend FLASHINFER --repeats 1 --compare-hf
[ "$SECONDS" -lt 440 ] && bench B1-64-requests-hf $((570 - SECONDS)) throughput $M --attention-backend FLASHINFER \
  --num-prompts 64 --compare-hf
grep -h "engine ready\|KV cache gets" "$OUT/err.log" | tail -4
grep -h "Error\|error" "$OUT/err.log" | tail -5
log done
