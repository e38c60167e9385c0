#!/usr/bin/env bash
# FP8 against bf16 on llama-3.1-8b (random weights at the real shape), B2 and B1 of BENCHMARKS.md, in one run
# on the H200. bf16 is the peer: same engine, same flags, same process environment, minutes apart.
#
#   bash benchmarks/quant_fp8_h200.sh [check|b2|b1|all] [extra `dovetail bench` flags...]
#
#   check  the quantization tests on the GPU (the @gpu ones run there), the kernels the cuda platform hands
#          the FP8 method, and one fp8-vs-bf16 greedy comparison on qwen3-0.6b with random weights
#   b2     batch-1 decode: 128-token prompt, 256 output tokens, ms per output token (median of 3 runs)
#   b1     offline throughput: 256 requests, prompt and output uniform in [100, 1024], output tokens/s
#   all    check, b2, b1 (default; about 10-15 minutes: split it over calls of `run` if needed)
#
# Results: $OUT/quant_fp8_<bench>_<bf16|fp8>.json, and a table printed last. Goal of issue 9: fp8 B2 at most
# 0.6x the bf16 time per token. --quantization fp8 quantizes the bf16 weights at load (per-channel scales,
# per-token dynamic activation scales); lm_head and embeddings stay bf16.
set -u
what=${1:-all}
shift || true
extra=("$@")
source benchmarks/h200_setup.sh || exit 1

run_check() {
  log "quantization tests on the GPU"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py tests/test_quant_triton.py \
    2>&1 | tee "$OUT/quant_tests.log" | tail -15
  log "kernels and a greedy comparison (qwen3-0.6b shape, random weights)"
  timeout 240 python3 - <<'EOF' 2>&1 | tee "$OUT/quant_check.log"
import gc

import torch
from dovetail import LLM, SamplingParams
from dovetail.bench import shapes

model_dir, defaults = shapes.materialize("qwen3-0.6b")
prompts = [{"prompt_token_ids": list(range(1000 + 37 * i, 1064 + 37 * i))} for i in range(4)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
runs = {}
for quant in (None, "fp8"):
    llm = LLM(model_dir, quantization=quant, gpu_memory_utilization=0.4, **defaults)
    layer = llm.llm_engine.model.get_submodule("model.layers.0.mlp.down_proj")
    print(f"{quant or 'bf16'}: weight {layer.weight.dtype}, kernels {type(layer.quant_kernels).__name__} "
          f"({layer.quant_kernels.name}), attention {llm.llm_engine.attention_backend.name}")
    runs[quant] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm, layer
    gc.collect()
    torch.cuda.empty_cache()
same = sum(a == b for x, y in zip(runs[None], runs["fp8"]) for a, b in zip(x, y))
total = sum(len(x) for x in runs[None])
first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(runs[None], runs["fp8"])]
print(f"fp8 vs bf16 greedy tokens equal: {same}/{total}; first divergence per prompt: {first}")
EOF
}

run_bench() {  # $1: latency|throughput, $2: tag
  for quant in bf16 fp8; do
    flag=()
    [ "$quant" = fp8 ] && flag=(--quantization fp8)
    log "$2 llama-3.1-8b $quant"
    timeout 560 dovetail bench "$1" --model llama-3.1-8b "${flag[@]}" "${extra[@]}" \
      --output-json "$OUT/quant_fp8_$2_$quant.json" 2>>"$OUT/quant_fp8_bench.err" | tail -8
  done
}

case "$what" in
  check) run_check ;;
  b2) run_bench latency b2 ;;
  b1) run_bench throughput b1 ;;
  all) run_check; run_bench latency b2; run_bench throughput b1 ;;
  *) echo "usage: $0 [check|b2|b1|all] [dovetail bench flags...]"; exit 2 ;;
esac

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None
print("\nllama-3.1-8b on the H200, fp8 (quantized at load) vs bf16, same engine and flags")
print(f"{'benchmark':<28} {'bf16':>12} {'fp8':>12} {'fp8/bf16':>9}")
b2 = [load(f"quant_fp8_b2_{q}.json") for q in ("bf16", "fp8")]
if all(b2):
    a, b = (r["dovetail"]["ms_per_token"] for r in b2)
    print(f"{'B2 ms per output token':<28} {a:>12.3f} {b:>12.3f} {b / a:>9.3f}   (goal: <= 0.6)")
b1 = [load(f"quant_fp8_b1_{q}.json") for q in ("bf16", "fp8")]
if all(b1):
    a, b = (r["dovetail"]["output_tokens_per_s"] for r in b1)
    print(f"{'B1 output tokens/s':<28} {a:>12.1f} {b:>12.1f} {b / a:>9.3f}")
for r in filter(None, b2 + b1):
    env = r["environment"]
    print(f"  {r['benchmark']} {r['engine_args'].get('quantization', 'bf16')}: commit {env['commit']} {env['date']} "
          f"{env['gpu']} torch {env['torch']}, attention {r['dovetail']['attention_backend']}, "
          f"load {r['dovetail']['load_seconds']:.0f}s")
EOF
