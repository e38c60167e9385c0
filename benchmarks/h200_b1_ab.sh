#!/usr/bin/env bash
# One H200 call: B1 (`dovetail bench throughput`, TRITON, bf16) with this tree's core against BASE's core
# (a scratch worktree put first on PYTHONPATH; the plugins are this tree's), alternating over ROUNDS rounds
# on one machine, so that a change's effect is not lost among the H200s' differences.
# Usage (on the H200, .whl carried): BASE=8c8cbb5 [MODELS="llama-3.1-8b qwen3-0.6b"] [ROUNDS=2]
#   bash benchmarks/h200_b1_ab.sh ; results in $OUT/b1_ab.jsonl.
set -u
source benchmarks/h200_setup.sh >/dev/null || exit 1
rm -rf /tmp/base && git worktree add -f --detach /tmp/base "${BASE:?BASE=commit}" >/dev/null 2>&1 || exit 1
for round in $(seq "${ROUNDS:-2}"); do
  for model in ${MODELS:-llama-3.1-8b}; do
    for tree in head base; do
      path=$PYTHONPATH; [ "$tree" = base ] && path=/tmp/base/core:$PYTHONPATH
      PYTHONPATH=$path timeout 240 dovetail --log-level WARNING bench throughput --model "$model" --dtype bfloat16 \
        --attention-backend TRITON --output-json /tmp/r.json >/dev/null 2>>"$OUT/err.log" \
        || { echo "$model $tree failed"; continue; }
      PYTHONPATH=$path python3 - "$round" "$model" "$tree" <<'PY' | tee -a "$OUT/b1_ab.jsonl"
import json, sys
import dovetail
r = json.load(open("/tmp/r.json"))["dovetail"]
print(json.dumps({"round": int(sys.argv[1]), "model": sys.argv[2], "tree": sys.argv[3],
                  "core": dovetail.__file__, "output_tokens_per_s": r.get("output_tokens_per_s")}))
PY
    done
  done
done
git worktree remove --force /tmp/base
