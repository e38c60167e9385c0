"""Whether Triton GEMM templates beat cuBLAS on llama-3.1-8b's decode shapes: torch.compile's max-autotune
(which benchmarks cuBLAS and Triton templates and keeps the fastest) against F.linear under cuBLASLt.

    python3 benchmarks/h200_gemm_autotune.py [--m 192 224 256]

Times each in a CUDA graph of calls rotating through weight copies (at least 256 MiB, so none stays in L2).
Also reports whether cuBLASLt's header is on the machine (for a direct cuBLASLt binding).
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
import torch.nn.functional as F
from h200_profile_decode import LLAMA_8B_SHAPES as LLAMA_8B, time_linear  # benchmarks/, this script's directory


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="*", default=[160, 192, 224, 256])
    p.add_argument("--shapes", nargs="*", default=["qkv", "o", "gate_up", "down"])
    args = p.parse_args()
    headers = [h for pattern in ("/usr/local/cuda*/include/cublasLt.h", "/usr/include/cublasLt.h")
               for h in glob.glob(pattern)]
    import site
    for root in site.getsitepackages() + [os.environ.get("PYTHONPATH", "")]:
        headers += glob.glob(os.path.join(root, "nvidia", "**", "cublasLt.h"), recursive=True)
    print("cublasLt.h:", headers or "none")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    import torch._inductor.config as inductor_config
    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    for name in args.shapes:
        n, k = LLAMA_8B[name]
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            base = time_linear(F.linear, x, weights)
            tuned = time_linear(compiled, x, weights)
            flops = 2 * m * n * k
            print(f"{name:8} M={m:4}: cuBLASLt {base:7.1f} us ({flops / base / 1e6:4.0f} TFLOP/s), "
                  f"max-autotune {tuned:7.1f} us ({flops / tuned / 1e6:4.0f} TFLOP/s)", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
