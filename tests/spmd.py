"""Tensor-parallel ranks as real processes over gloo, for tests: every rank runs the same job (SPMD).

:class:`SpmdRanks` spawns ``world`` processes once; each joins the group with
:func:`dovetail.distributed.init_tensor_parallel` and then runs the jobs it is
given, so a test can build an ordinary engine on every rank (its layers shard
because the group exists first) and compare what the ranks return. A job is a
module-level function (pickled by name) and returns something picklable.
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

#: Seconds a job may take on a rank before the group is torn down and the test fails.
JOB_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_loop(rank: int, world: int, port: int, backend: str, jobs, results) -> None:
    import torch

    from dovetail import distributed

    device = None
    if backend == "nccl":  # each rank sees its own GPU as device 0, as an engine of one device expects
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    distributed.init_tensor_parallel(world, rank, backend, f"tcp://127.0.0.1:{port}", device=device)
    _join_engines_to_the_group(rank, world)
    try:
        while (job := jobs.get()) is not None:
            fn, args, kwargs = job
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # the test shows the rank's traceback
                results.put((rank, False, traceback.format_exc()))
    finally:
        distributed.destroy_tensor_parallel()


def _join_engines_to_the_group(rank: int, world: int) -> None:
    """An engine built on a rank runs its one in-process worker as this rank of the group (its device: the
    rank's only one), where it would otherwise make a world of its own."""
    try:
        from dovetail.executor import uni
    except ImportError:  # an engine without executors builds its model in the group as it stands
        return
    uni.Worker = functools.partial(uni.Worker, rank=rank, world_size=world, local_rank=0)


class SpmdRanks:
    """``world`` rank processes in one tensor-parallel group; :meth:`run` runs a job on all of them.

    ``backend="nccl"`` gives rank ``r`` the ``r``-th visible GPU (as its only device).
    """

    def __init__(self, world: int, backend: str = "gloo"):
        self.world = world
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.procs = [ctx.Process(target=_rank_loop, args=(rank, world, port, backend, self.jobs[rank], self.results),
                                  daemon=True) for rank in range(world)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order. A rank's failure fails the
        call with its traceback (and stops the group: its other ranks may wait in a collective)."""
        for jobs in self.jobs:
            jobs.put((fn, args, kwargs))
        got: dict[int, object] = {}
        while len(got) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=JOB_TIMEOUT)
            except queue.Empty:
                self.close()
                raise AssertionError(f"{fn.__name__}: no answer from ranks "
                                     f"{sorted(set(range(self.world)) - set(got))} in {JOB_TIMEOUT}s") from None
            if not ok:
                self.close()
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            got[rank] = value
        return [got[rank] for rank in range(self.world)]

    def close(self) -> None:
        self.broken = True
        for jobs, proc in zip(self.jobs, self.procs):
            if proc.is_alive():
                jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
