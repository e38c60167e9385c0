"""All-reduce of small messages through torch symmetric memory (peer memory over NVLink), without multicast.

``DOVETAIL_ALL_REDUCE`` chooses the tensor-parallel all-reduce on NVIDIA GPUs: ``nccl`` (the default) or
``symm_mem``. With ``symm_mem`` each rank keeps one buffer of :data:`MAX_BYTES` in torch symmetric memory
(``torch.distributed._symmetric_memory``); a bfloat16 message that fits is summed by torch's one-shot kernel
(up to :data:`ONE_SHOT_MAX_BYTES`: it copies the message into the buffer, then each rank reads every peer's) or
copied in and summed by the two-shot kernel (reduce-scatter then all-gather through peer memory), both capturable in CUDA graphs; anything else goes to
NCCL. The multimem (NVLink SHARP multicast) kernels are never called, and torch's rendezvous honours
``TORCH_SYMM_MEM_DISABLE_MULTICAST``.
"""

from __future__ import annotations

import logging
import os

import torch

from dovetail.errors import ConfigError

logger = logging.getLogger("dovetail")

ENV = "DOVETAIL_ALL_REDUCE"
CHOICES = ("nccl", "symm_mem")
#: The largest message summed in symmetric memory (a decode step of 256 tokens of hidden 8192 in bfloat16
#: is 4 MiB); larger ones (prefill chunks) go to NCCL.
MAX_BYTES = 8 << 20
#: Up to this size the one-shot kernel, above it the two-shot one (torch inductor's threshold is 128 KiB).
ONE_SHOT_MAX_BYTES = 256 << 10


def all_reduce_choice() -> str:
    """``DOVETAIL_ALL_REDUCE``: ``nccl`` (default) or ``symm_mem``."""
    choice = os.environ.get(ENV, "nccl").strip().lower() or "nccl"
    if choice not in CHOICES:
        raise ConfigError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


class SymmMemAllReduce:
    """``kernel(tensor) -> bool`` for :func:`dovetail.distributed.set_all_reduce_kernel`: sums a contiguous
    bfloat16 tensor of at most ``max_bytes`` in place through symmetric memory; False for anything else.

    Building it is a collective (the buffer's rendezvous): every rank of ``group`` must build one.
    """

    def __init__(self, group, device: torch.device, max_bytes: int = MAX_BYTES,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

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


def all_reduce_kernel(group, device: torch.device) -> SymmMemAllReduce | None:
    """The kernel ``DOVETAIL_ALL_REDUCE`` asks for (None: NCCL's all-reduce everywhere)."""
    if all_reduce_choice() != "symm_mem":
        return None
    kernel = SymmMemAllReduce(group, device)
    logger.info("cuda: tensor-parallel all-reduce of bfloat16 messages up to %d bytes through torch symmetric "
                "memory (one-shot up to %d bytes), NCCL above", kernel.max_bytes, kernel.one_shot_max_bytes)
    return kernel
