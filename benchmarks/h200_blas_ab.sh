#!/usr/bin/env bash
# One H200 call: B1 on llama-3.1-8b (`dovetail bench throughput`, TRITON, bf16) with torch's default BLAS
# (cuBLAS) and with cuBLASLt (torch.backends.cuda.preferred_blas_library), alternating over two rounds in
# one process each. Usage (on the H200, .whl carried): bash benchmarks/h200_blas_ab.sh ; $OUT/ab.jsonl.
set -u
source benchmarks/h200_setup.sh >/dev/null || exit 1
for round in 1 2; do
  for lib in default cublaslt; do
    timeout 200 python3 - "$lib" <<'PY' 2>>"$OUT/err.log" | tail -1 | tee -a "$OUT/ab.jsonl"
import json
import sys

import torch

lib = sys.argv[1]
if lib != "default":
    torch.backends.cuda.preferred_blas_library(lib)
from dovetail.cli.main import main

rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", "llama-3.1-8b", "--dtype", "bfloat16",
           "--attention-backend", "TRITON", "--output-json", "/tmp/r.json"])
r = json.load(open("/tmp/r.json"))["dovetail"]
print(json.dumps({"blas": lib, "rc": rc, "blas_now": str(torch.backends.cuda.preferred_blas_library()),
                  "output_tokens_per_s": r.get("output_tokens_per_s")}))
PY
  done
done
