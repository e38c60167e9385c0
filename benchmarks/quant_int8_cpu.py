"""INT8 W8A8 linear on the CPU: ``torch._int_mm`` against a float32 matmul and a dequantising path.

For each shape (K -> N) and token count M, times in one process:

- ``fp32``: ``F.linear`` with the float32 weight (the unquantized model's layer);
- ``int_mm``: :meth:`QuantKernels.int8_linear` (per-token quantization, ``torch._int_mm``, rescale);
- ``dequant``: the same quantization, then a float32 matmul of the int8 values converted each call
  (what a kernel without an int8 matmul would do).

Each figure is the fastest of ``--repeats`` calls (the machine is shared; the minimum is the
least disturbed). Shapes: the C1 model's layers (hidden 512, intermediate 1376) and a 4096-square.

Usage::

    python benchmarks/quant_int8_cpu.py [--threads 2] [--repeats 20] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = [(512, 1024, "C1 qkv_proj"), (512, 2752, "C1 gate_up_proj"), (1376, 512, "C1 down_proj"),
          (4096, 4096, "4096 square")]
TOKENS = [1, 16, 64, 256]


def fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from dovetail.quantization import quant_ops
    from dovetail.quantization.kernels import QuantKernels

    kernels = QuantKernels()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (fastest of {args.repeats})")
    print(f"{'layer':<16} {'K':>5} {'N':>5} {'M':>4} {'fp32':>9} {'int_mm':>9} {'dequant':>9} {'fp32/int_mm':>11}")
    for k, n, label in SHAPES:
        w = torch.randn(n, k, generator=gen)
        q, scale = quant_ops.quantize_int8_per_channel(w)
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen)

            def dequant():
                xq, sx = quant_ops.quantize_int8_per_token(x)
                return (xq.float() @ q.float().t()) * sx * scale

            fp32 = fastest(lambda: F.linear(x, w), args.repeats)
            int_mm = fastest(lambda: kernels.int8_linear(x, q, scale), args.repeats)
            deq = fastest(dequant, max(3, args.repeats // 4))
            rows.append({"layer": label, "K": k, "N": n, "M": m, "fp32_ms": fp32, "int_mm_ms": int_mm,
                         "dequant_ms": deq})
            print(f"{label:<16} {k:>5} {n:>5} {m:>4} {fp32:>9.3f} {int_mm:>9.3f} {deq:>9.3f} {fp32 / int_mm:>11.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
