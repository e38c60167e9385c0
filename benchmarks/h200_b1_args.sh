#!/usr/bin/env bash
# One H200 call: B1 on llama-3.1-8b (`dovetail bench throughput`, TRITON, bf16) once per set of engine
# arguments, alternating over two rounds, to see whether another default would be faster.
# Usage (on the H200, .whl carried): ARG_SETS="default|--max-num-seqs 512|..." bash benchmarks/h200_b1_args.sh
# ("default" adds nothing; sets are separated by |); results in $OUT/b1_args.jsonl.
set -u
source benchmarks/h200_setup.sh >/dev/null || exit 1
IFS='|' read -r -a sets <<< "${ARG_SETS:-default|--max-num-batched-tokens 32768|--max-num-seqs 512}"
for round in 1 2; do
  for set in "${sets[@]}"; do
    args=$set; [ "$set" = default ] && args=""
    timeout 200 dovetail --log-level WARNING bench throughput --model llama-3.1-8b --dtype bfloat16 \
      --attention-backend TRITON $args --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" \
      || { echo "$set failed"; continue; }
    python3 - "$round" "$set" <<'PY' | tee -a "$OUT/b1_args.jsonl"
import json, sys
r = json.load(open("/tmp/r.json"))["dovetail"]
print(json.dumps({"round": int(sys.argv[1]), "args": sys.argv[2], "output_tokens_per_s": r.get("output_tokens_per_s")}))
PY
  done
done
