"""Upload a captured CUDA graph to the device when it is captured, not when it is first launched.

torch instantiates a graph at the end of its capture but leaves its upload to the first
``cudaGraphLaunch``, which then holds the host for a time that grows with the graph's node count
(1-3 ms for a decode step of a 32-layer model). The engine captures a decode graph per padded batch
size, and a batch shrinking through the sizes launches each for the first time mid-run, while the
device waits for the host (benchmarks/RESULTS.md, graph upload). ``cuGraphUpload`` from the driver
(``libcuda.so.1``, installed with it) does that work at capture, where it belongs.
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger("dovetail")

_upload = None  # cuGraphUpload, or False where the driver library or the entry point is missing


def _driver_upload():
    global _upload
    if _upload is None:
        try:
            function = ctypes.CDLL("libcuda.so.1").cuGraphUpload
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            function.restype = ctypes.c_int
            _upload = function
        except (OSError, AttributeError) as exc:
            logger.warning("CUDA graphs are uploaded at their first launch: cuGraphUpload unavailable (%s)", exc)
            _upload = False
    return _upload


def upload(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None) -> bool:
    """Upload ``graph``'s executable on ``stream`` (the current stream: where it will be replayed).

    Returns whether it was uploaded; a graph that cannot be still runs, uploaded by its first launch.
    """
    function = _driver_upload()
    executable = getattr(graph, "raw_cuda_graph_exec", None)
    if not function or executable is None:
        return False
    stream = stream if stream is not None else torch.cuda.current_stream()
    code = function(ctypes.c_void_p(executable()), ctypes.c_void_p(stream.cuda_stream))
    if code != 0:
        logger.warning("cuGraphUpload failed with CUresult %d; the graph uploads at its first launch", code)
        return False
    return True
