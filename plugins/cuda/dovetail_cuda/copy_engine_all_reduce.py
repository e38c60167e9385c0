"""All-reduce of long messages by the GPUs' copy engines: peer memory reads instead of a kernel on the SMs.

NCCL moves a prefill chunk's all-reduce (hundreds of MiB over NVLink) with a kernel that holds multiprocessors
for the whole transfer. Overlapped with the other micro-batch's matrix products
(:mod:`dovetail.engine.micro_batches`), those multiprocessors are taken from the products. Here the transfer
is ``cudaMemcpyAsync`` between peers (a copy engine, no multiprocessor), and only the sum of each rank's share
is a kernel: every rank copies its message into a buffer in torch symmetric memory, pulls its share (one
``1/world_size`` chunk) of every peer's buffer, adds them into its own buffer, then pulls every peer's summed
chunk. Three barriers (a small kernel each) line the ranks up: buffers filled, chunks summed, chunks read.

It runs on a stream of its own that the calling stream waits for on both sides, so two micro-batches' sums
(issued in turns on two streams) take the buffer one after the other, in the order every rank issues them.
``DOVETAIL_LARGE_ALL_REDUCE=copy_engine`` turns it on (:mod:`dovetail_cuda.symm_mem_all_reduce`).
"""

from __future__ import annotations

import torch

#: Bytes of a message below which this all-reduce is not taken: there NCCL's whole sum takes tens of
#: microseconds, the order of what three barriers and the copies' start cost here.
MIN_BYTES = 8 << 20
#: Elements of each rank's chunk are a multiple of this (16-byte aligned bfloat16 copies).
ALIGN_ELEMENTS = 8


def supported() -> bool:
    """Whether this torch has symmetric memory's peer buffers and barrier."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


class SumInFlight:
    """A copy-engine sum started on its stream: :meth:`wait` makes the current stream wait for it."""

    def __init__(self, done: torch.cuda.Event):
        self.done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class CopyEngineAllReduce:
    """``kernel(tensor) -> bool``: sums a contiguous tensor of ``min_bytes`` to ``max_bytes`` (its elements a
    multiple of ``world_size * 8``) over ``group`` in place through peer copies; False for anything else.

    The buffers are allocated at the first message taken and grown for a longer one (every rank sums the same
    messages, so every rank grows them at the same call: a collective, which a CUDA graph capture cannot hold;
    captured steps are decode steps, whose messages are below ``min_bytes``). The engine's profiling run sums
    its longest messages first, so the KV cache is sized with the buffers counted.
    """

    def __init__(self, group, device: torch.device, max_bytes: int = 1 << 30, min_bytes: int = MIN_BYTES,
                 dtype: torch.dtype = torch.bfloat16):
        import torch.distributed as dist

        self.group_name = group.group_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device, self.dtype = device, dtype
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.buffer = self.handle = self.received = None
        # High priority: its few small kernels (barriers, the add) take the next free multiprocessor slot
        # ahead of the other micro-batch's product tiles, so the copies behind them start sooner.
        self.stream = torch.cuda.Stream(device=device, priority=-1)

    def takes(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return (tensor.dtype == self.dtype and tensor.is_contiguous() and tensor.device == self.device
                and self.min_bytes <= nbytes <= self.max_bytes
                and tensor.numel() % (self.world_size * ALIGN_ELEMENTS) == 0)

    def __call__(self, tensor: torch.Tensor) -> bool:
        started = self.start(tensor)
        if started is None:
            return False
        started.wait()
        return True

    def start(self, tensor: torch.Tensor) -> "SumInFlight | None":
        """Start the sum of ``tensor`` behind the work already queued on the current stream, and return it
        without waiting (None where it does not take the tensor): the caller neither reads nor frees
        ``tensor`` before ``wait()``."""
        if not self.takes(tensor):
            return None
        caller = torch.cuda.current_stream(tensor.device)
        self._reserve(tensor.numel())
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            self._sum(tensor.view(-1))
        done = torch.cuda.Event()
        done.record(self.stream)
        return SumInFlight(done)

    def _reserve(self, elements: int) -> None:
        if self.buffer is not None and self.buffer.numel() >= elements:
            return
        import torch.distributed._symmetric_memory as symm_mem

        granule = (16 << 20) // self.dtype.itemsize
        elements = -(-elements // granule) * granule
        self.stream.synchronize()  # the old buffers' last sum has finished on every rank (its last barrier)
        self.buffer = symm_mem.empty(elements, dtype=self.dtype, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.received = torch.empty(max(1, self.world_size - 1) * (elements // self.world_size), dtype=self.dtype,
                                    device=self.device)

    def _peer_chunk(self, peer: int, index: int, chunk: int) -> torch.Tensor:
        return self.handle.get_buffer(peer, (chunk,), self.dtype, index * chunk)

    def _sum(self, flat: torch.Tensor) -> None:
        n, rank = self.world_size, self.rank
        chunk = flat.numel() // n
        peers = [(rank + step) % n for step in range(1, n)]
        staged = self.buffer[:flat.numel()]
        mine = staged[rank * chunk:(rank + 1) * chunk]
        staged.copy_(flat)
        self.handle.barrier(channel=0)
        received = self.received[:(n - 1) * chunk].view(n - 1, chunk)
        for row, peer in enumerate(peers):
            received[row].copy_(self._peer_chunk(peer, rank, chunk))
        if n == 2:
            mine.add_(received[0])
        else:
            mine.add_(received.sum(dim=0, dtype=self.dtype))
        self.handle.barrier(channel=0)
        for peer in peers:
            flat[peer * chunk:(peer + 1) * chunk].copy_(self._peer_chunk(peer, peer, chunk))
        flat[rank * chunk:(rank + 1) * chunk].copy_(mine)
        self.handle.barrier(channel=0)
