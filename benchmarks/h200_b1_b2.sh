#!/usr/bin/env bash
# The recorded GPU figures for one named shape on the H200: B2 and B1 (`dovetail bench`) for each CUDA
# attention backend that runs there, the start-up time to the first token, and HF transformers in the
# same run (benchmarks/cuda_hf_peer.py). Usage: bash benchmarks/h200_b1_b2.sh MODEL [--tests]
# JSON lines in $OUT/results.jsonl, each with a "label".
set -u
MODEL=$1
source benchmarks/h200_setup.sh || exit 1
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['label']=sys.argv[2]; print(json.dumps(d))" "$1" "$2" \
  | tee -a "$OUT/results.jsonl" | cut -c1-300; }
bench() {  # bench LABEL TIMEOUT ARGS...
  timeout "$2" dovetail bench "${@:3}" --model "$MODEL" --dtype bfloat16 --output-json /tmp/r.json >/dev/null \
    2>>"$OUT/err.log" && json /tmp/r.json "$1"; }

if [ "${2:-}" = "--tests" ]; then
  log "tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_sampler.py \
    tests/test_cuda_backends.py -k "not test_backend_matches" 2>&1 | tee "$OUT/tests.log" | tail -4
fi
log "$MODEL"
for backend in FLASHINFER TRITON; do
  bench "B2-$backend" 150 latency --attention-backend $backend
  bench "B1-$backend" 200 throughput --attention-backend $backend
done
timeout 150 python3 benchmarks/cuda_startup.py --model "$MODEL" 2>>"$OUT/err.log" | tee -a "$OUT/results.jsonl"
log "HF transformers"
timeout $((590 - SECONDS)) python3 benchmarks/cuda_hf_peer.py --model "$MODEL" 2>>"$OUT/err.log" \
  | tee -a "$OUT/results.jsonl"
grep -h "engine ready\|KV cache gets" "$OUT/err.log" | tail -3
grep -h "Error" "$OUT/err.log" | tail -5
log done
