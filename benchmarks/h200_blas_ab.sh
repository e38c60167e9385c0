#!/usr/bin/env bash
# One H200 call: B1 (`dovetail bench throughput`, TRITON, bf16) with DOVETAIL_CUDA_BLAS=cublas and =cublaslt
# (the cuda platform's choice of torch's BLAS library), alternating over ROUNDS rounds, one process each.
# Usage (on the H200, .whl carried): [MODELS="llama-3.1-8b qwen3-0.6b"] [ROUNDS=2] bash benchmarks/h200_blas_ab.sh
# Results in $OUT/ab.jsonl (the library each run reported using).
set -u
source benchmarks/h200_setup.sh >/dev/null || exit 1
for round in $(seq "${ROUNDS:-2}"); do
  for model in ${MODELS:-llama-3.1-8b}; do
    for lib in cublas cublaslt; do
      DOVETAIL_CUDA_BLAS=$lib timeout 240 python3 - "$lib" "$model" <<'PY' 2>>"$OUT/err.log" | tail -1 | tee -a "$OUT/ab.jsonl"
import json
import sys

import torch

from dovetail.cli.main import main

rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", sys.argv[2], "--dtype", "bfloat16",
           "--attention-backend", "TRITON", "--output-json", "/tmp/r.json"])
r = json.load(open("/tmp/r.json"))["dovetail"]
print(json.dumps({"model": sys.argv[2], "blas": sys.argv[1], "rc": rc,
                  "blas_used": str(torch.backends.cuda.preferred_blas_library()),
                  "output_tokens_per_s": r.get("output_tokens_per_s")}))
PY
    done
  done
done
