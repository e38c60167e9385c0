#!/usr/bin/env bash
# One H200 call: B1 or B2 (`dovetail bench`, TRITON, bf16) for several variants of the engine, alternating
# over ROUNDS rounds on one machine, so that a change's effect is not lost among the H200s' differences.
# A variant is a list of words: `@COMMIT` runs that commit's core, models and cuda plugins (a scratch
# worktree, or .trees/COMMIT when the machine's git lacks it, first on PYTHONPATH), `NAME=VALUE` sets an
# environment variable, anything else is an engine
# argument; `head` alone is this tree as it is. Variants are separated by `|`:
#   VARIANTS="head|@e12c42b|DOVETAIL_CUDA_BLAS=cublas|--max-num-seqs 512" [MODELS="llama-3.1-8b qwen3-0.6b"]
#   [ROUNDS=2] [KIND=throughput|latency] bash benchmarks/h200_variants.sh ; JSON lines in $OUT/variants.jsonl.
# (Earlier sessions ran the same loop as h200_b1_ab.sh, h200_blas_ab.sh and h200_b1_args.sh.)
set -u
source benchmarks/h200_setup.sh >/dev/null || exit 1
IFS='|' read -r -a variants <<< "${VARIANTS:?VARIANTS=\"head|@commit|...\"}"
for variant in "${variants[@]}"; do
  for word in $variant; do
    [[ "$word" == @* && ! -d /tmp/tree_${word#@} ]] || continue
    if [ -d ".trees/${word#@}" ]; then ln -s "$PWD/.trees/${word#@}" "/tmp/tree_${word#@}"; continue; fi
    git worktree add -f --detach "/tmp/tree_${word#@}" "${word#@}" >/dev/null 2>&1 || { echo "no commit ${word#@}"; exit 1; }
  done
done
for round in $(seq "${ROUNDS:-2}"); do
  for model in ${MODELS:-llama-3.1-8b}; do
    for variant in "${variants[@]}"; do
      path=$PYTHONPATH; assignments=(); args=()
      for word in $variant; do
        case $word in
          head) ;;
          -*) args+=("$word") ;;
          @*) tree=/tmp/tree_${word#@}; path=$tree/core:$tree/plugins/models:$tree/plugins/cuda:$PYTHONPATH ;;
          *=*) assignments+=("$word") ;;
          *) args+=("$word") ;;
        esac
      done
      env PYTHONPATH="$path" "${assignments[@]}" timeout 300 dovetail --log-level WARNING bench "${KIND:-throughput}" \
        --model "$model" --dtype bfloat16 --attention-backend TRITON "${args[@]}" --output-json /tmp/r.json \
        >/dev/null 2>>"$OUT/err.log" || { echo "$model [$variant] failed"; continue; }
      env PYTHONPATH="$path" python3 - "$round" "$model" "$variant" <<'PY' | tee -a "$OUT/variants.jsonl"
import json, sys
import dovetail, dovetail_models
r = json.load(open("/tmp/r.json"))["dovetail"]
print(json.dumps({"round": int(sys.argv[1]), "model": sys.argv[2], "variant": sys.argv[3],
                  "core": dovetail.__file__, "models": dovetail_models.__file__,
                  **{k: r[k] for k in ("output_tokens_per_s", "ms_per_token") if k in r}}))
PY
    done
  done
done
for tree in /tmp/tree_*; do [ -L "$tree" ] && rm "$tree" || git worktree remove --force "$tree" 2>/dev/null; done
exit 0
