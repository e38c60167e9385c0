"""The cuda platform's quantization kernels: the core's GPU kernels, with one-token FP8 linears in CUDA C++
(and an MLP's gate/up projection with its SiLU-and-mul in the same kernel).

``DOVETAIL_CUDA_FP8_GEMV`` chooses the one-token FP8 GEMV: ``cuda`` (the default,
:mod:`dovetail_cuda.fp8_gemv`, where nvcc can build it) or ``triton`` (:mod:`dovetail.triton.gemv`).
"""

from __future__ import annotations

import os

import torch

from dovetail.errors import ConfigError
from dovetail.quantization.gpu_kernels import GpuQuantKernels
from dovetail_cuda import fp8_gemv as native_gemv
from dovetail_cuda import native


def fp8_gemv_choice() -> str:
    """``DOVETAIL_CUDA_FP8_GEMV``: ``cuda`` (default) or ``triton``."""
    choice = os.environ.get("DOVETAIL_CUDA_FP8_GEMV", "cuda").strip().lower()
    if choice not in ("cuda", "triton"):
        raise ConfigError(f"DOVETAIL_CUDA_FP8_GEMV={choice!r}: expected 'cuda' or 'triton'")
    return choice


def native_config(gated: bool = False, outputs: int | None = None, multiprocessors: int | None = None,
                  k: int | None = None) -> native_gemv.NativeGemvConfig:
    """The CUDA GEMV's launch parameters: :func:`default_config <dovetail_cuda.fp8_gemv.default_config>` with the
    fields ``DOVETAIL_CUDA_FP8_GEMV_CONFIG`` (``DOVETAIL_CUDA_FP8_GEMV_GATED_CONFIG`` for the gated GEMV) sets
    (``rows=2,trigger=3``), for measurement."""
    config = native_gemv.default_config(gated, outputs, multiprocessors, k)
    variable = "DOVETAIL_CUDA_FP8_GEMV_GATED_CONFIG" if gated else "DOVETAIL_CUDA_FP8_GEMV_CONFIG"
    override = os.environ.get(variable, "").strip()
    if override:
        try:
            fields = {name.strip(): int(value) for name, value in (item.split("=") for item in override.split(","))}
            config = config._replace(**fields)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{variable}={override!r}: expected NAME=INT pairs of "
                              f"{native_gemv.NativeGemvConfig._fields} ({exc})") from None
        for name, allowed in native_gemv.CHOICES.items():
            if getattr(config, name) not in allowed:
                raise ConfigError(f"{variable}={override!r}: {name} must be one of {allowed}")
        if config.warps % config.split:
            raise ConfigError(f"{variable}={override!r}: split ({config.split}) must divide "
                              f"warps ({config.warps})")
    return config


class CudaQuantKernels(GpuQuantKernels):
    """:class:`GpuQuantKernels` whose one-token FP8 linears run the CUDA C++ GEMV when it builds.

    The choice is read at construction, and the config variables checked; the library, the PDL decision and the
    multiprocessor count once per device; each launch config once per device, gating and weight shape."""

    name = "cuda"

    def __init__(self):
        super().__init__()
        self._native = fp8_gemv_choice() == "cuda"
        if self._native:
            native_config(False), native_config(True)  # a bad override fails here, not at the first decode
        self._configs: dict[tuple, native_gemv.NativeGemvConfig] = {}
        self._devices: dict[torch.device, tuple] = {}

    def fp8_linear(self, x, weight, weight_scale, bias=None, *, input_scale=None, block_size=None):
        out = self._run(x, weight, weight_scale, bias, block_size, gated=False)
        if out is not None:
            return out
        return super().fp8_linear(x, weight, weight_scale, bias, input_scale=input_scale, block_size=block_size)

    def fp8_linear_gated(self, x, weight, weight_scale, bias, activation, *, input_scale=None, block_size=None):
        """SiLU-and-mul fused into the one-token CUDA GEMV (weight-only, like :meth:`fp8_linear` there)."""
        return self._run(x, weight, weight_scale, bias, block_size, gated=True) if activation == "silu" else None

    def _run(self, x, weight, weight_scale, bias, block_size, gated: bool):
        """The CUDA GEMV's result, or None where it does not take these operands or cannot be built."""
        if not (self._native and block_size is None and native_gemv.supports(x, weight, weight_scale, bias, gated)):
            return None
        if x.device not in self._devices:
            from dovetail.triton.pdl import use_pdl

            self._devices[x.device] = (native.library(native_gemv.SOURCE, x.device), use_pdl(x.device),
                                       torch.cuda.get_device_properties(x.device).multi_processor_count)
        lib, pdl, multiprocessors = self._devices[x.device]
        if lib is None:
            return None
        key = (x.device, gated, *weight.shape)
        config = self._configs.get(key)
        if config is None:
            rows, k = weight.shape
            config = self._configs[key] = native_config(gated, rows // 2 if gated else rows, multiprocessors, k)
        return native_gemv.launch(lib, x, weight, weight_scale, bias, config, pdl, gated)
