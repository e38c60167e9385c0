"""This process's place in the tensor-parallel group, and the collectives over it.

Every collective goes through ``torch.distributed`` with the platform's
``dist_backend`` (NCCL, RCCL, xccl, gloo). With one rank (the default, and what
a process that never called :func:`init_tensor_parallel` has) the collectives
are identities, so single-device code pays nothing.
"""

from __future__ import annotations

import contextlib
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


def init_tensor_parallel(world_size: int, rank: int, backend: str, init_method: str,
                         device: torch.device | None = None) -> None:
    """Join the group of ``world_size`` ranks at ``init_method`` (e.g. ``tcp://127.0.0.1:PORT``) as ``rank``."""
    global _group, _rank, _size, _gathers_into_tensor
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    _rank, _size = rank, world_size
    if world_size == 1:
        _group = None
        return
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device is not None and device.type != "cpu" else {}
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs)
    _group = dist.group.WORLD
    _gathers_into_tensor = dist.get_backend(_group) != "gloo"


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
    ``(rms_norm(sum(x) + residual) * weight, sum(x) + residual)`` in one pass, or None for what it does not take."""
    global _all_reduce_kernel, _fused_add_rms_norm
    _all_reduce_kernel = kernel
    _fused_add_rms_norm = getattr(kernel, "add_rms_norm", None)


@contextlib.contextmanager
def backend_collectives() -> Iterator[None]:
    """Every all-reduce through the backend while this is open: the platform's kernel (see
    :func:`set_all_reduce_kernel`) keeps one buffer between calls, so two all-reduces in flight on different
    streams (:mod:`dovetail.engine.micro_batches`) must not both use it."""
    global _all_reduce_kernel, _fused_add_rms_norm
    saved = _all_reduce_kernel, _fused_add_rms_norm
    _all_reduce_kernel = _fused_add_rms_norm = None
    try:
        yield
    finally:
        _all_reduce_kernel, _fused_add_rms_norm = saved


def is_initialized() -> bool:
    return _group is not None


def all_reduce_kernel_name() -> Optional[str]:
    """The class of the platform's all-reduce kernel in use, ``"backend"`` where the backend's sums everything,
    None with one rank (for logs and tests)."""
    if _size == 1:
        return None
    return type(_all_reduce_kernel).__name__ if _all_reduce_kernel is not None else "backend"


def tp_size() -> int:
    return _size


def tp_rank() -> int:
    return _rank


def tp_group() -> Optional[dist.ProcessGroup]:
    return _group


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    if _size > 1 and not (_all_reduce_kernel is not None and _all_reduce_kernel(tensor)):
        dist.all_reduce(tensor, group=_group)
    return tensor


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            add_rms_norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(x), residual, weight, eps)``: the platform kernel's fused pass where it takes the
    message (one kernel instead of two, and the sum never round-trips through memory), else the two steps."""
    if _size > 1:
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
