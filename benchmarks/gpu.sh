#!/usr/bin/env bash
# Dovetail on a GPU machine: install from carried wheels, then run the GPU tests, `dovetail bench` for named
# shapes x attention backends x flag sets, the start-up time and the peers. JSON lines and a short table go
# under $OUT. Run it from the repository root.
#
#   [VARIABLE=value ...] bash benchmarks/gpu.sh [STEP ...]
#
# Steps, run in the order given (default: tests bench):
#   tests     pytest $TESTS
#   bench     `dovetail bench KIND` for each round x model x backend x flag set x kind
#   startup   benchmarks/startup.py (fresh process to first token) for each model x backend
#   hf        benchmarks/peer_hf.py (HF transformers, B1 and B2) for each model
#   vllm      benchmarks/peer_vllm.py (B1 and B2 on the same requests) for each model, when vLLM is installed
#   kernels   benchmarks/kernels_attention.py and benchmarks/kernels_linear.py (first model)
#   allreduce benchmarks/kernels_all_reduce.py (NCCL against torch symmetric memory, and the all-reduce fused
#             with the residual add and RMSNorm, size by size) over TP GPUs (2 when TP is 1)
#   moe       benchmarks/kernels_moe.py (the MoE layer against its bounds, vLLM's beside it when installed) for
#             each model of MODELS that is a mixture of experts (its first start on a GPU kind tunes the tiles)
#
# Variables:
#   MODELS     named shapes (dovetail.bench.shapes) or model directories  default: "qwen3-0.6b llama-3.1-8b"
#   BACKENDS   attention backends; "auto" lets the engine choose            default: TRITON
#   KINDS      throughput (B1) and/or latency (B2)                          default: "latency throughput"
#   FLAGS      extra `dovetail bench` flag sets, separated by "|"; each set is one variant, and the variants
#              alternate within a round. FLAGS="|--quantization fp8|--kv-cache-dtype fp8"    default: ""
#              Leading NAME=VALUE words of a set are environment variables for its command:
#              FLAGS="-tp 2|DOVETAIL_ALL_REDUCE=symm_mem -tp 2"
#   ROUNDS     rounds of the bench loop                                     default: 1
#   TP         tensor-parallel size of the startup and allreduce steps       default: 1
#   TESTS      pytest arguments                                             default: "-m gpu -rs tests"
#   HF_B1_PROMPTS  how many of B1's 256 requests HF runs                    default: 64
#   VLLM_TP    vLLM's tensor-parallel size                                  default: 1
#   TIMEOUT    seconds each benchmark command may take                      default: 300
#   POWER=1    log `nvidia-smi dmon` (power, clocks, power-cap violations) beside each bench command into
#              $OUT/raw/power_N.txt and print its busy samples' summary: whether the cards ran at their power cap
#   TEST_TIMEOUT  seconds the tests may take                                default: 580
#   SKIP_INSTALL=1  the machine was set up by an earlier call
#   COMMIT     the commit recorded with each figure                        default: git's HEAD here
#   PARTS=DIR  a large wheel's files carried in parts: DIR/*.part.* are the pieces of one tar.zst, unpacked
#              into /tmp/site after the wheels (checked against DIR/sha256 when present; needs the
#              zstandard wheel in .whl/)
#   OUT        where results go                                             default: /tmp/out
#
# Install: every wheel in .whl/ (built for the machine's Python, 3.12) goes to /tmp/site, put first on
# PYTHONPATH, with --no-deps; then this repository's distributions, editable (their entry points need
# installed metadata). A FlashInfer JIT cache carried as .fi_cache/flashinfer.tgz (a tar of ~/.cache/flashinfer
# from an earlier machine) is unpacked into ~/.cache.
#
# Results: $OUT/results.jsonl, one line per figure ("step", "model", "backend", "flags", "round", "value",
# "unit", "all_reduce" (the kernel rank 0 summed with; the table names it beside the backend), plus the machine
# and commit); the raw JSON of each command under $OUT/raw/; logs in $OUT/*.log; $OUT/table.md, printed last.
#
# Examples:
#   bash benchmarks/gpu.sh tests
#   MODELS=llama-3.1-8b BACKENDS="TRITON FLASHINFER" ROUNDS=2 bash benchmarks/gpu.sh bench
#   MODELS=qwen3-0.6b FLAGS="|--kv-cache-dtype fp8" bash benchmarks/gpu.sh bench hf vllm
#   MODELS=qwen3-0.6b KINDS=throughput FLAGS="--structured-output json" bash benchmarks/gpu.sh bench
#   MODELS="qwen3-moe-15b-a3b qwen3-30b-a3b" bash benchmarks/gpu.sh moe bench
#   MODELS=llama-3.1-8b KINDS=throughput FLAGS="DOVETAIL_TORCH_PROFILER_DIR=/tmp/out/prof --profile --num-prompts 32 -tp 2" \
#     bash benchmarks/gpu.sh bench        (each rank's trace and operator summary under $OUT/prof)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/raw"
MODELS=${MODELS:-"qwen3-0.6b llama-3.1-8b"}
BACKENDS=${BACKENDS:-TRITON}
KINDS=${KINDS:-"latency throughput"}
FLAGS=${FLAGS:-}
ROUNDS=${ROUNDS:-1}
TP=${TP:-1}
TESTS=${TESTS:-"-m gpu -rs tests"}
HF_B1_PROMPTS=${HF_B1_PROMPTS:-64}
VLLM_TP=${VLLM_TP:-1}
TIMEOUT=${TIMEOUT:-300}
POWER=${POWER:-0}
TEST_TIMEOUT=${TEST_TIMEOUT:-580}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# NVLink multicast stays off on hosts that run without it, in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "== $* (t=${SECONDS}s)"; }

install() {
  rm -rf /tmp/site
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  fi
  export PYTHONPATH=/tmp/site
  if [ -n "${PARTS:-}" ]; then
    (cd "$PARTS" && cat ./*.part.* > /tmp/parts.tar.zst && { [ ! -f sha256 ] || sha256sum -c sha256 >/dev/null; }) \
      || { echo "PARTS: pieces missing or corrupt in $PARTS"; return 1; }
    python3 -c "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(open(sys.argv[1], 'rb'), sys.stdout.buffer)" \
      /tmp/parts.tar.zst | tar -xf - -C /tmp/site || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cpu -e plugins/cuda -e plugins/models \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
  if [ -f .fi_cache/flashinfer.tgz ]; then
    mkdir -p ~/.cache && tar xzf .fi_cache/flashinfer.tgz -C ~/.cache
    # pip dates what it installs now, after the carried builds (FlashInfer's sources and the headers of the
    # wheels they include, tvm-ffi's among them): dated back, ninja takes the builds as current.
    find /tmp/site -type f -exec touch -d 2000-01-01 {} +
  fi
}

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  log install
  install || { echo "install failed"; exit 1; }
else
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -z "${COMMIT:-}" ]; then  # a copy of the tree without its history: pass COMMIT=<hash> instead
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && COMMIT="$COMMIT+changes"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
echo "commit $COMMIT"

# record STEP MODEL BACKEND FLAGS ROUND FILE: one results.jsonl line per figure in FILE (the command's JSON).
record() {
  python3 - "$@" <<'PY' >>"$OUT/results.jsonl"
import datetime, json, os, sys
step, model, backend, flags, rnd, path = sys.argv[1:7]
base = {"step": step, "model": model, "backend": backend, "flags": flags, "round": int(rnd),
        "gpu": os.environ.get("GPU", ""), "commit": os.environ.get("COMMIT", ""),
        "date": datetime.date.today().isoformat()}
lines = [line for line in open(path).read().splitlines() if line.strip()]
try:
    data = json.loads("\n".join(lines))
except ValueError:
    data = json.loads(lines[-1])
figures = []
if step in ("throughput", "latency"):
    base["all_reduce"] = data["dovetail"].get("all_reduce")
if step == "throughput":
    d = data["dovetail"]
    base["backend"] = d.get("attention_backend", backend)
    figures.append(("B1", d["output_tokens_per_s"], "output tok/s", {"output_tokens": d["output_tokens"],
                                                                     "load_seconds": round(d["load_seconds"], 1),
                                                                     "kv_blocks_per_rank": d.get("kv_cache_blocks_per_rank")}))
    so = data.get("structured_output")
    if so:  # --structured-output json: the same requests under one JSON schema
        figures.append(("B1 json", so["output_tokens_per_s"], "output tok/s", {
            "ratio_to_unconstrained": round(so["ratio_to_unconstrained"], 3),
            "ratio_to_full_run": round(so["ratio_to_full_run"], 3), "output_tokens": so["output_tokens"],
            "grammar_compile_seconds": round(so["grammar_compile_seconds"], 3),
            "tokenizer_setup_seconds": round(so["tokenizer_setup_seconds"], 2)}))
elif step == "latency":
    d = data["dovetail"]
    base["backend"] = d.get("attention_backend", backend)
    batch = data.get("batch_size", 1)
    figures.append(("B2" if batch == 1 else f"decode step, {batch} sequences", d["ms_per_token"],
                    "ms/token" if batch == 1 else "ms/step", {"runs": d["ms_per_token_runs"]}))
elif step == "startup":
    base["backend"] = data.get("attention_backend", backend)
    if data.get("tensor_parallel_size", 1) > 1:
        base["flags"] = f"-tp {data['tensor_parallel_size']}"
    figures.append(("start-up", data["startup_to_first_token_s"], "s", {
        "interpreter_and_imports_s": round(data["interpreter_s"] + data["imports_s"], 1),
        "engine_s": round(data["engine_s"], 1), **data.get("engine_phases", {}),
        **{f"rank_{name}": seconds for name, seconds in data.get("worker_phases", {}).items()},
        "first_token_s": round(data["first_token_s"], 2)}))
else:  # peers
    for name, unit, key in (("B1", "output tok/s", "output_tokens_per_s"), ("B2", "ms/token", "ms_per_token")):
        if name in data:
            figures.append((name, data[name][key], unit, {}))
for benchmark, value, unit, extra in figures:
    print(json.dumps({**base, "benchmark": benchmark, "value": round(value, 4), "unit": unit, **extra}))
PY
}
export GPU COMMIT

run_tests() {
  log "pytest $TESTS"
  timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider $TESTS >"$OUT/tests.log" 2>&1
  local rc=$? summary
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  # pytest's count line; a run killed by the timeout or by a crash at exit has none, and says so
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" "$OUT/tests.log" | tail -1)
  [ -n "$summary" ] || summary="no summary line (pytest exited $rc)"
  echo "$summary"
  python3 -c "import json, sys; print(json.dumps({'step': 'tests', 'args': sys.argv[1], 'summary': sys.argv[2],
'rc': int(sys.argv[5]), 'gpu': sys.argv[3], 'commit': sys.argv[4]}))" "$TESTS" "$summary" "$GPU" "$COMMIT" "$rc" \
    >>"$OUT/results.jsonl"
}

power_summary() {  # power_summary FILE: the samples of `nvidia-smi dmon -s pucv` with the SMs busy
  python3 - "$1" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")]
busy = [r for r in rows if len(r) >= 15 and r[5].isdigit() and int(r[5]) >= 90]
if busy:
    watts, clocks = [float(r[2]) for r in busy], [int(r[12]) for r in busy]
    capped = sum(r[13] not in ("0", "-") for r in busy) / len(busy)
    print(f"power: {len(busy)} busy samples (all GPUs), median {statistics.median(watts):.0f} W, SM clock median "
          f"{statistics.median(clocks)} MHz ({min(clocks)}-{max(clocks)}), {100 * capped:.0f}% at the power cap")
PY
}

run_bench() {
  local round model backend variant kind args word n=0
  IFS='|' read -r -a variants <<<"$FLAGS"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  [[ "$FLAGS" == *"|" ]] && variants+=("")  # read drops a last, empty variant: "FLAGS=x|" is x, then the defaults
  for round in $(seq "$ROUNDS"); do
    for model in $MODELS; do
      for backend in $BACKENDS; do
        for variant in "${variants[@]}"; do
          for kind in $KINDS; do
            n=$((n + 1))
            args=(bench "$kind" --model "$model" --output-json "$OUT/raw/bench_$n.json")
            [ "$backend" != auto ] && args+=(--attention-backend "$backend")
            log "round $round: dovetail ${args[*]:0:4} $backend $variant"
            local envs=() flags=()
            # shellcheck disable=SC2086  # a flag set is split into its words on purpose
            for word in $variant; do
              if [ ${#flags[@]} -eq 0 ] && [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$word"); else flags+=("$word"); fi
            done
            local dmon=""
            if [ "$POWER" = 1 ]; then
              nvidia-smi dmon -s pucv -d 1 -o T >"$OUT/raw/power_$n.txt" 2>&1 &
              dmon=$!
            fi
            if timeout "$TIMEOUT" env "${envs[@]}" dovetail --log-level WARNING "${args[@]}" "${flags[@]}" \
                >/dev/null 2>>"$OUT/bench.log"; then
              record "$kind" "$model" "$backend" "$variant" "$round" "$OUT/raw/bench_$n.json"
              tail -1 "$OUT/results.jsonl" | cut -c1-220
            else
              echo "failed; the end of $OUT/bench.log:"; tail -5 "$OUT/bench.log"
            fi
            if [ -n "$dmon" ]; then
              kill "$dmon" 2>/dev/null; wait "$dmon" 2>/dev/null
              power_summary "$OUT/raw/power_$n.txt"
            fi
          done
        done
      done
    done
  done
}

run_python() {  # run_python STEP MODEL BACKEND FILE ARGS...: a benchmark script printing JSON, recorded
  local step=$1 model=$2 backend=$3 file=$4
  shift 4
  if timeout "$TIMEOUT" python3 "$@" >"$file" 2>>"$OUT/$step.log"; then
    record "$step" "$model" "$backend" "" 1 "$file"
    tail -1 "$file" | cut -c1-300
  else
    echo "failed; the end of $OUT/$step.log:"; tail -5 "$OUT/$step.log"
  fi
}

for step in ${@:-tests bench}; do
  case $step in
    tests) run_tests ;;
    bench) run_bench ;;
    startup)
      for model in $MODELS; do
        for backend in $BACKENDS; do
          log "start-up $model $backend"
          extra=(); [ "$backend" != auto ] && extra=(--attention-backend "$backend")
          run_python startup "$model" "$backend" "$OUT/raw/startup_${model//\//_}_${backend}_tp$TP.json" \
            benchmarks/startup.py --model "$model" -tp "$TP" "${extra[@]}"
        done
      done ;;
    hf)
      for model in $MODELS; do
        log "HF transformers $model"
        run_python hf "$model" hf "$OUT/raw/hf_${model//\//_}.json" benchmarks/peer_hf.py --model "$model" \
          --b1-prompts "$HF_B1_PROMPTS"
      done ;;
    vllm)
      if ! python3 -c "import vllm" 2>/dev/null; then echo "vLLM is not installed: step vllm skipped"; continue; fi
      for model in $MODELS; do
        log "vLLM $model"
        run_python vllm "$model" vllm "$OUT/raw/vllm_${model//\//_}.json" benchmarks/peer_vllm.py --model "$model" \
          --tensor-parallel-size "$VLLM_TP"
      done ;;
    kernels)
      model=${MODELS%% *}
      log "kernels ($model)"
      timeout "$TIMEOUT" python3 benchmarks/kernels_attention.py --json "$OUT/raw/kernels_attention.json" \
        >"$OUT/kernels_attention.log" 2>&1; tail -15 "$OUT/kernels_attention.log"
      timeout "$TIMEOUT" python3 benchmarks/kernels_linear.py --model "$model" --json "$OUT/raw/kernels_linear.json" \
        >"$OUT/kernels_linear.log" 2>&1; tail -12 "$OUT/kernels_linear.log" ;;
    allreduce)
      ranks=$((TP > 1 ? TP : 2))
      log "all-reduce over $ranks GPUs"
      timeout "$TIMEOUT" python3 benchmarks/kernels_all_reduce.py --world-size "$ranks" \
        --json "$OUT/raw/kernels_all_reduce_tp$ranks.json" >"$OUT/kernels_all_reduce_tp$ranks.log" 2>&1
      tail -18 "$OUT/kernels_all_reduce_tp$ranks.log" ;;
    moe)
      for model in $MODELS; do
        case $model in *moe*|*-a3b) ;; *) continue ;; esac
        log "MoE layer ($model)"
        timeout "$TIMEOUT" python3 benchmarks/kernels_moe.py --model "$model" --vllm \
          --json "$OUT/raw/kernels_moe_${model//\//_}.json" >"$OUT/kernels_moe_${model//\//_}.log" 2>&1
        tail -20 "$OUT/kernels_moe_${model//\//_}.log"
      done ;;
    *) echo "unknown step '$step' (tests bench startup hf vllm kernels allreduce moe)"; exit 2 ;;
  esac
done

log table
python3 - "$OUT/results.jsonl" <<'PY' | tee "$OUT/table.md"
import collections, json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for r in rows:
    if r["step"] == "tests":
        print(f"tests ({r['args']}): {r['summary']}")
figures = collections.defaultdict(list)
for r in rows:
    if "benchmark" in r:
        backend = r["backend"] + (f", sums: {r['all_reduce']}" if r.get("all_reduce") else "")
        figures[(r["benchmark"], r["model"], backend, r["flags"], r["unit"])].append(r["value"])
if figures:
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "")
    commit = next((r["commit"] for r in rows if r.get("commit")), "")
    print(f"\nGPU: {gpu or 'none'}, commit {commit}\n")
    print("| benchmark | model | backend | flags | value (per round) | unit |")
    print("|---|---|---|---|---|---|")
    for (benchmark, model, backend, flags, unit), values in figures.items():
        shown = " / ".join(f"{v:,.3f}" if v < 100 else f"{v:,.0f}" for v in values)
        print(f"| {benchmark} | {model} | {backend} | {flags or '-'} | {shown} | {unit} |")
PY
log done
