"""The CPU's quantization kernels: INT8 products on ``torch._int_mm`` where the CPU has int8 dot products."""

from __future__ import annotations

import torch

from dovetail.quantization.kernels import QuantKernels, int8_matmul_in_float32
from dovetail_cpu import cpu_info


class CpuQuantKernels(QuantKernels):
    """``torch._int_mm`` (oneDNN) for W8A8 INT8 where the CPU has VNNI or AMX-INT8, exact float32 products elsewhere.

    oneDNN's int8 kernels for CPUs without int8 dot products (AVX2-only ones) saturate 16-bit partial
    sums, so there ``torch._int_mm`` is wrong by far more than rounding; the float32 path is exact and
    runs at the speed of the float model.
    """

    name = "cpu"

    def __init__(self):
        self.uses_int_mm = cpu_info.has_int8_dot_product()

    def int8_matmul(self, xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.uses_int_mm:
            return torch._int_mm(xq, weight.t())
        return int8_matmul_in_float32(xq, weight)
