"""This process's place in the tensor-parallel group, and the collectives over it.

Every collective goes through ``torch.distributed`` with the platform's
``dist_backend`` (NCCL, RCCL, xccl, gloo). With one rank (the default, and what
a process that never called :func:`init_tensor_parallel` has) the collectives
are identities, so single-device code pays nothing.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

_group: Optional[dist.ProcessGroup] = None
_rank = 0
_size = 1
#: Whether the backend gathers into one tensor (gloo has no ``all_gather_into_tensor``); read once, so a
#: gather captured in a device graph asks the host nothing.
_gathers_into_tensor = True
#: A platform's faster all-reduce for the messages it takes (see :func:`set_all_reduce_kernel`).
_all_reduce_kernel: Optional[Callable[[torch.Tensor], bool]] = None
#: The same kernel's all-reduce fused with the residual add and RMSNorm, where it has one.
_fused_add_rms_norm: Optional[Callable] = None
#: Row-parallel layers of at least ``_chunk_min_rows`` rows sum their output in ``_row_chunks`` chunks of rows,
#: each chunk's sum started as soon as it is computed (see :func:`row_chunks`); 0: never. Read from
#: ``DOVETAIL_ROW_REDUCE_CHUNKS`` and ``DOVETAIL_ROW_REDUCE_MIN_ROWS`` when the group forms (an experiment).
_row_chunks = 0
_chunk_min_rows = 4096
#: Whether two micro-batches are in flight (:func:`backend_collectives`): no chunked sums then.
_in_micro_batches = False
#: The last output a row-parallel layer summed itself although its consumer sums it (see :func:`mark_summed`).
_summed: Optional[weakref.ref] = None


def init_tensor_parallel(world_size: int, rank: int, backend: str, init_method: str,
                         device: torch.device | None = None) -> None:
    """Join the group of ``world_size`` ranks at ``init_method`` (e.g. ``tcp://127.0.0.1:PORT``) as ``rank``."""
    global _group, _rank, _size, _gathers_into_tensor, _row_chunks, _chunk_min_rows
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    _rank, _size = rank, world_size
    _row_chunks = _env_int("DOVETAIL_ROW_REDUCE_CHUNKS", 0)
    _chunk_min_rows = _env_int("DOVETAIL_ROW_REDUCE_MIN_ROWS", 4096)
    if world_size == 1:
        _group = None
        return
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device is not None and device.type != "cpu" else {}
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs)
    _group = dist.group.WORLD
    _gathers_into_tensor = dist.get_backend(_group) != "gloo"


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a whole number of 0 or more")
    return int(text)


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op with one rank)."""
    global _group, _rank, _size, _all_reduce_kernel, _fused_add_rms_norm
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group, _rank, _size, _all_reduce_kernel, _fused_add_rms_norm = None, 0, 1, None, None


def set_all_reduce_kernel(kernel: Optional[Callable[[torch.Tensor], bool]]) -> None:
    """Sum over the group with ``kernel(tensor)`` where it returns True (it took the tensor and summed it in
    place); the backend's all-reduce runs where it returns False. None: the backend's everywhere.

    A platform's :meth:`~dovetail.platform.Platform.all_reduce_kernel` supplies one (small decode messages
    through torch symmetric memory on NVLink); every rank must install the same. A kernel with an
    ``add_rms_norm(x, residual, weight, eps)`` method also serves :func:`all_reduce_add_rms_norm`: it returns
    ``(rms_norm(sum(x) + residual) * weight, sum(x) + residual)`` in one pass, or None for what it does not take.
    A kernel's ``across_streams`` attribute, where not None, is a kernel of the same form that stays on inside
    :func:`backend_collectives`."""
    global _all_reduce_kernel, _fused_add_rms_norm
    _all_reduce_kernel = kernel
    _fused_add_rms_norm = getattr(kernel, "add_rms_norm", None)


@contextlib.contextmanager
def backend_collectives() -> Iterator[None]:
    """Every all-reduce through the backend while this is open, but for those the kernel's ``across_streams``
    takes: the platform's kernel (see :func:`set_all_reduce_kernel`) keeps one buffer between calls, so two
    all-reduces in flight on different streams (:mod:`dovetail.engine.micro_batches`) must not both use it,
    unless the platform says they may."""
    global _all_reduce_kernel, _fused_add_rms_norm, _in_micro_batches
    saved = _all_reduce_kernel, _fused_add_rms_norm
    _all_reduce_kernel, _fused_add_rms_norm = getattr(_all_reduce_kernel, "across_streams", None), None
    _in_micro_batches = True
    try:
        yield
    finally:
        _all_reduce_kernel, _fused_add_rms_norm = saved
        _in_micro_batches = False


def is_initialized() -> bool:
    return _group is not None


def tp_size() -> int:
    return _size


def tp_rank() -> int:
    return _rank


def tp_group() -> Optional[dist.ProcessGroup]:
    return _group


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it. A tensor its producer already summed
    (:func:`mark_summed`) is returned as it is."""
    if _size > 1 and not _take_summed(tensor) and not (_all_reduce_kernel is not None and _all_reduce_kernel(tensor)):
        dist.all_reduce(tensor, group=_group)
    return tensor


def row_chunks(num_rows: int) -> int:
    """In how many chunks of rows a row-parallel layer with ``num_rows`` rows of input computes and sums its
    output: each chunk's sum starts (:func:`all_reduce_started`) while the next chunk is multiplied, so only
    the last chunk's sum is waited for. 1: in one piece (one rank, short inputs, micro-batches in flight)."""
    if _size == 1 or _row_chunks < 2 or num_rows < _chunk_min_rows or _in_micro_batches:
        return 1
    return _row_chunks


def all_reduce_started(tensor: torch.Tensor):
    """Start summing ``tensor`` over the ranks, in place; returns what to ``wait()`` on before reading it. The
    platform kernel's ``start(tensor)`` where it has one and takes the message, else the backend's asynchronous
    all-reduce (whose ``wait()`` makes the current stream, or for a backend without streams the host, wait)."""
    start = getattr(_all_reduce_kernel, "start", None)
    started = start(tensor) if start is not None else None
    return started if started is not None else dist.all_reduce(tensor, group=_group, async_op=True)


def mark_summed(tensor: torch.Tensor) -> None:
    """``tensor``, which its consumer would sum over the ranks (:func:`all_reduce`,
    :func:`all_reduce_add_rms_norm`), is summed already: the next of those calls on it returns it as it is."""
    global _summed
    _summed = weakref.ref(tensor)


def _take_summed(tensor: torch.Tensor) -> bool:
    global _summed
    if _summed is not None and _summed() is tensor:
        _summed = None
        return True
    return False


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            add_rms_norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(x), residual, weight, eps)``: the platform kernel's fused pass where it takes the
    message (one kernel instead of two, and the sum never round-trips through memory), else the two steps."""
    if _size > 1 and not _take_summed(x):
        if _fused_add_rms_norm is not None:
            fused = _fused_add_rms_norm(x, residual, weight, eps)
            if fused is not None:
                return fused
        all_reduce(x)
    return add_rms_norm(x, residual, weight, eps)


def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    if _size == 1:
        return tensor
    dim = dim % tensor.dim()
    tensor = tensor.contiguous()
    out = torch.empty((_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if _gathers_into_tensor:
        dist.all_gather_into_tensor(out, tensor, group=_group)
    else:
        dist.all_gather(list(out.unbind(0)), tensor, group=_group)
    return out.movedim(0, dim).flatten(dim, dim + 1)
