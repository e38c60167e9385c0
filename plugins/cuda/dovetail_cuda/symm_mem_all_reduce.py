"""All-reduce of decode-sized messages through torch symmetric memory (peer memory over NVLink), without multicast.

``DOVETAIL_ALL_REDUCE`` chooses the tensor-parallel all-reduce on NVIDIA GPUs: ``auto`` (the default),
``nccl``, ``symm_mem`` or ``flashinfer``. ``auto`` is ``flashinfer`` where every rank's GPU reaches every
other's directly over NVLink on one host (NVML says so, and the ranks agree before building anything) and
FlashInfer's communication kernels load on every rank, ``symm_mem`` where they do not, ``nccl`` elsewhere
(PCIe, several hosts, a torch without the kernels). ``flashinfer`` is ``symm_mem`` plus the all-reduce fused
with the residual add and RMSNorm after it (:mod:`dovetail_cuda.flashinfer_all_reduce`).

With ``symm_mem`` each rank keeps one buffer in torch symmetric memory
(``torch.distributed._symmetric_memory``); a bfloat16 message that fits is summed by torch's one-shot kernel
(small messages: it copies the message into the buffer, then each rank reads every peer's) or copied in and
summed by the two-shot kernel (reduce-scatter then all-gather through peer memory), both capturable in CUDA
graphs; anything larger (long prefill chunks) goes to NCCL, which moves large messages as fast. The multimem
(NVLink SHARP multicast) kernels are never called, and torch's rendezvous honours
``TORCH_SYMM_MEM_DISABLE_MULTICAST``. The sizes come from ``benchmarks/kernels_all_reduce.py``
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import NamedTuple

import torch

from dovetail.errors import ConfigError

logger = logging.getLogger("dovetail")

ENV = "DOVETAIL_ALL_REDUCE"
CHOICES = ("auto", "nccl", "symm_mem", "flashinfer")


class Limits(NamedTuple):
    """Up to ``one_shot`` bytes the one-shot kernel, up to ``largest`` the two-shot one, NCCL above."""

    one_shot: int
    largest: int


#: Two ranks: the one-shot kernel leads up to 1 MiB (7 against NCCL's 10 µs at 8 KiB), the two-shot kernel up
#: to 32 MiB, where NCCL draws level. More ranks read more peers per one-shot call: torch inductor's limits.
LIMITS = {2: Limits(1 << 20, 32 << 20)}
DEFAULT_LIMITS = Limits(256 << 10, 8 << 20)


def limits_for(world_size: int) -> Limits:
    return LIMITS.get(world_size, DEFAULT_LIMITS)


def all_reduce_choice() -> str:
    """``DOVETAIL_ALL_REDUCE``: ``auto`` (default), ``nccl``, ``symm_mem`` or ``flashinfer``."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def torch_has_kernels() -> bool:
    return all(hasattr(torch.ops.symm_mem, name) for name in ("one_shot_all_reduce_copy_out",
                                                                "two_shot_all_reduce_out"))


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID as NVML names it (``GPU-...``)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _nvlink_to_all(uuid: str, peers: list[str], nvml_factory) -> bool:
    try:
        with nvml_factory() as nvml:
            return nvml.nvlink_connected(uuid, peers)
    except Exception as exc:  # no NVML, a MIG slice, a driver without the call
        logger.debug("cuda: NVLink between the ranks' GPUs not known (%s)", exc)
        return False


def all_ranks_on_nvlink(group, uuid: str, visible_uuids: list[str], nvml_factory=None) -> bool:
    """Whether every rank of ``group`` runs on this host, sees every rank's GPU (a Ray actor sees only its own,
    and peer memory needs the peer's device) and every pair of their GPUs is joined by NVLink; this rank's GPU
    is ``uuid``, its process sees ``visible_uuids``. A collective: every rank gives its host and GPU, checks
    what it sees and its own links, and all take the same answer."""
    import torch.distributed as dist

    from dovetail_cuda.nvml import Nvml

    world_size = dist.get_world_size(group)
    mine = (socket.gethostname(), uuid)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    peers = [peer for _, peer in everyone]
    linked = (all(host == mine[0] for host, _ in everyone) and set(peers) <= set(visible_uuids)
              and _nvlink_to_all(uuid, peers, nvml_factory or Nvml))
    votes: list = [None] * world_size
    dist.all_gather_object(votes, linked, group=group)
    return all(votes)


class SymmMemAllReduce:
    """``kernel(tensor) -> bool`` for :func:`dovetail.distributed.set_all_reduce_kernel`: sums a contiguous
    bfloat16 tensor of at most ``max_bytes`` in place through symmetric memory; False for anything else.
    The sizes default to :data:`LIMITS` for the group's size.

    Building it is a collective (the buffer's rendezvous): every rank of ``group`` must build one.
    """

    def __init__(self, group, device: torch.device, max_bytes: int | None = None,
                 one_shot_max_bytes: int | None = None):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        limits = limits_for(dist.get_world_size(group))
        max_bytes = limits.largest if max_bytes is None else max_bytes
        one_shot_max_bytes = limits.one_shot if one_shot_max_bytes is None else one_shot_max_bytes
        self.group_name = group.group_name
        self.max_bytes, self.one_shot_max_bytes = max_bytes, one_shot_max_bytes
        self.buffer = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        self._two_shot = torch.ops.symm_mem.two_shot_all_reduce_out

    def takes(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * 2
        return (tensor.dtype == torch.bfloat16 and tensor.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0 and tensor.device == self.buffer.device)

    def __call__(self, tensor: torch.Tensor) -> bool:
        if not self.takes(tensor):
            return False
        staged = self.buffer[:tensor.numel()]
        flat = tensor.view(-1)
        if tensor.numel() * 2 <= self.one_shot_max_bytes:
            # The kernel copies the input into the buffer itself; each thread reads its input elements before
            # the ranks meet and writes the same elements after, so the output may be the input.
            self._one_shot(staged, flat, "sum", self.group_name, flat)
        else:
            staged.copy_(flat)
            self._two_shot(staged, "sum", self.group_name, flat)
        return True


def all_reduce_kernel(group, device: torch.device, nvml_factory=None):
    """The kernel ``DOVETAIL_ALL_REDUCE`` asks for (None: NCCL's all-reduce everywhere): a
    :class:`SymmMemAllReduce`, or a :class:`~dovetail_cuda.flashinfer_all_reduce.FlashInferFusedAllReduce`
    around one (``flashinfer``, compiling FlashInfer's kernels where they are not built yet; ``auto`` where
    they are built and load on every rank, so that no start waits minutes for a compiler)."""
    choice = all_reduce_choice()
    if choice == "nccl":
        return None
    if choice == "auto":
        if not torch_has_kernels():
            logger.info("cuda: tensor-parallel all-reduce through NCCL (this torch lacks the symmetric-memory "
                        "all-reduce kernels)")
            return None
        visible = [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
        if not all_ranks_on_nvlink(group, device_uuid(device), visible, nvml_factory):
            logger.info("cuda: tensor-parallel all-reduce through NCCL (the ranks' GPUs are not all joined by "
                        "NVLink on one host, or a rank does not see the others')")
            return None
    fuse = choice in ("auto", "flashinfer")
    if fuse:
        from dovetail_cuda.flashinfer_all_reduce import fused_kernels_on_every_rank

        reason = fused_kernels_on_every_rank(group, compile=choice == "flashinfer")
        if reason is not None and choice == "flashinfer":
            raise ConfigError(f"{ENV}=flashinfer: {reason}")
        if reason is not None:
            logger.info("cuda: the all-reduce is not fused with the norms after it: %s", reason)
        fuse = reason is None
    kernel = SymmMemAllReduce(group, device)
    logger.info("cuda: tensor-parallel all-reduce of bfloat16 messages up to %d bytes through torch symmetric "
                "memory (one-shot up to %d bytes), NCCL above", kernel.max_bytes, kernel.one_shot_max_bytes)
    if fuse:
        from dovetail_cuda.flashinfer_all_reduce import FlashInferFusedAllReduce

        kernel = FlashInferFusedAllReduce(group, device, kernel)
        logger.info("cuda: all-reduce, residual add and RMSNorm fused through FlashInfer for bfloat16 messages "
                    "up to %d bytes", kernel.max_bytes)
    return kernel
