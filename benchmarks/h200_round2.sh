#!/usr/bin/env bash
# One H200 call: where B1's GPU time goes (the first 128 requests of B1, eager, per kernel) for both shapes.
# Usage (on the H200, .whl carried): bash benchmarks/h200_round2.sh ; results in $OUT.
set -u
source benchmarks/h200_setup.sh || exit 1
for model in qwen3-0.6b llama-3.1-8b; do
  echo "== B1 profile $model (t=${SECONDS}s)"
  timeout $(( (580 - SECONDS) / 2 + 60 )) python3 benchmarks/h200_profile_decode.py --model $model --b1 128 \
    > "$OUT/b1_$model.log" 2>&1
  grep -v Warning "$OUT/b1_$model.log" | grep -v _warn_once | tail -27
done
echo "== done (t=${SECONDS}s)"
