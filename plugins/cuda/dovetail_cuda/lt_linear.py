"""Decode-sized 16-bit linears on the cuBLASLt algorithm timed fastest for their shape.

torch's ``F.linear`` runs cuBLASLt's first heuristic choice. For a linear whose token
count is one of the engine's decode graph sizes from 2 to :data:`MAX_TUNED_ROWS`
(:data:`TUNED_ROWS`; each size is captured once in a CUDA graph, and other counts are
left alone so that eager steps of every length do not each pay a tuning), :class:`TunedLinear` asks cuBLASLt for up to :data:`CANDIDATES` algorithms the
first time it meets the shape, times each on the real operands (evicting L2 before
every call, as a decode step finds its weights in HBM) and keeps the fastest, unless it
beats the first choice by less than :data:`MARGIN` (so that timing noise does not change
the choice, and with it the rounding, from one run to the next). Later calls with that
shape run the kept algorithm through ``csrc/lt_linear.cu``. While a graph is being
captured nothing is timed: a shape met first there runs ``F.linear``; the engine's graph
warm-up runs every captured shape eagerly first.

On the H200 the fastest candidate was up to 21% faster than the first choice on
llama-3.1-8b's shapes at 160-256 tokens (``benchmarks/cublaslt_algos.cu``).
``DOVETAIL_CUDA_GEMM_TUNING=0`` keeps every linear on ``F.linear``.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from dovetail.engine.model_runner import graph_batch_sizes
from dovetail_cuda import native

logger = logging.getLogger("dovetail")

SOURCE = "lt_linear.cu"
MAX_TUNED_ROWS = 512
TUNED_ROWS = frozenset(graph_batch_sizes(MAX_TUNED_ROWS)) - {1}
CANDIDATES = 8
MARGIN = 0.03
WORKSPACE_BYTES = 32 * 2**20
_FLUSH_BYTES = 128 * 2**20
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


def tuning_enabled() -> bool:
    """``DOVETAIL_CUDA_GEMM_TUNING`` (default on): 0/false/off keeps linears on ``F.linear``."""
    return os.environ.get("DOVETAIL_CUDA_GEMM_TUNING", "1").strip().lower() not in ("0", "false", "off", "no")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :class:`TunedLinear` takes ``F.linear(x, weight, bias)``: no bias, a contiguous 16-bit
    ``[rows, K]`` input with a count of rows in :data:`TUNED_ROWS` and a contiguous ``[N, K]`` weight of its
    dtype on the same CUDA device, all 256-byte aligned (what cuBLASLt's heuristic assumes)."""
    return (bias is None and x.is_cuda and x.dim() == 2 and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.device == x.device and x.shape[1] == weight.shape[1]
            and x.shape[0] in TUNED_ROWS and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 256 == 0 and weight.data_ptr() % 256 == 0)


class TunedLinear:
    """``x @ weight.T`` for :func:`applies` operands on the cuBLASLt algorithm timed fastest per shape (module
    docstring); None where its library is unavailable or a shape is first met inside a graph capture."""

    def __init__(self):
        self._chosen: dict[tuple, int | None] = {}  # (device, dtype, m, n, k) -> candidate, None: F.linear
        self._workspaces: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        m, (n, k) = x.shape[0], weight.shape
        key = (device, _DTYPES[x.dtype], m, n, k)
        if key not in self._chosen:
            if torch.cuda.is_current_stream_capturing():
                return None
            self._chosen[key] = self._tune(key, x, weight)
        algo = self._chosen[key]
        if algo is None:
            return None
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if self._run(key, algo, x, weight, out) != 0:
            raise RuntimeError(f"cuBLASLt linear failed for x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        return out

    def chosen(self) -> dict[tuple, int | None]:
        """The candidate kept per ``(device, dtype code, m, n, k)`` (0: cuBLASLt's first choice; None: F.linear)."""
        return dict(self._chosen)

    def _run(self, key, algo: int, x, weight, out) -> int:
        lib = native.library(SOURCE, x.device)
        workspace = self._workspace(key[0])
        stream = torch.cuda.current_stream(x.device).cuda_stream
        return lib.dovetail_lt_matmul(
            ctypes.c_int(key[0]), ctypes.c_int(key[1]), ctypes.c_int(key[2]), ctypes.c_int(key[3]),
            ctypes.c_int(key[4]), ctypes.c_int(algo), ctypes.c_void_p(weight.data_ptr()),
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_ulonglong(WORKSPACE_BYTES), ctypes.c_void_p(stream))

    def _workspace(self, device: int) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        return self._workspaces[device]

    def _tune(self, key, x, weight) -> int | None:
        lib = native.library(SOURCE, x.device)
        if lib is None:
            return None
        count = lib.dovetail_lt_algos(*(ctypes.c_int(v) for v in key), ctypes.c_int(CANDIDATES),
                                      ctypes.c_ulonglong(WORKSPACE_BYTES))
        if count <= 0:
            logger.debug("cuBLASLt has no algorithm for %s (%d): F.linear", key, count)
            return None
        out = torch.empty((key[2], key[3]), dtype=x.dtype, device=x.device)
        flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=x.device)
        times = [self._time(key, algo, x, weight, out, flush) for algo in range(count)]
        valid = [(t, algo) for algo, t in enumerate(times) if t is not None]
        if times[0] is None or not valid:
            return None
        best_time, best = min(valid)
        return best if best_time < times[0] * (1 - MARGIN) else 0

    def _time(self, key, algo: int, x, weight, out, flush, calls: int = 5) -> float | None:
        """Median milliseconds of one call of candidate ``algo``, L2 evicted (``flush`` rewritten) before each;
        None if it fails."""
        if self._run(key, algo, x, weight, out) != 0:
            return None
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in events:
            flush.zero_()
            start.record()
            self._run(key, algo, x, weight, out)
            end.record()
        torch.cuda.synchronize(x.device)
        return sorted(start.elapsed_time(end) for start, end in events)[calls // 2]
