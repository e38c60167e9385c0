"""Tensor-parallel ranks as real processes over gloo, for tests: every rank runs the same job (SPMD).

:class:`SpmdRanks` spawns ``world`` processes once; each joins the group with
:func:`dovetail.distributed.init_tensor_parallel` and then runs the jobs it is
given, so a test can build an ordinary engine on every rank (its layers shard
because the group exists first) and compare what the ranks return. A job is a
module-level function (pickled by name) and returns something picklable.

These ranks are cheap to reuse (started once per session); the engine's own
``mp`` executor (tests/test_tp_engine.py) starts its workers per engine.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def cuda_tensor_parallel_rank(rank: int, world: int, port: int):
    """In a spawned process: GPU ``rank`` made current and joined to a ``world``-rank NCCL group for the block,
    which gets the device; the group is torn down after it."""
    import torch

    from dovetail import distributed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    distributed.init_tensor_parallel(world, rank, "nccl", f"tcp://127.0.0.1:{port}", device=device)
    try:
        yield device
    finally:
        distributed.destroy_tensor_parallel()


def _rank_loop(rank: int, world: int, port: int, jobs, results) -> None:
    import torch

    from dovetail import distributed

    torch.set_num_threads(1)
    distributed.init_tensor_parallel(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    _run_engines_as_this_rank()
    try:
        while (job := jobs.get()) is not None:
            fn, args, kwargs = job
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # the test shows the rank's traceback
                results.put((rank, False, traceback.format_exc()))
    finally:
        distributed.destroy_tensor_parallel()


def _run_engines_as_this_rank() -> None:
    """An engine built on a rank (one in-process worker) runs its worker as this rank of the group, and
    every rank's worker reports its tokens to its own engine (in the engine's own multi-rank executors only
    rank 0 reports)."""
    from dovetail import distributed
    from dovetail.executor import uni

    class RankWorker(uni.Worker):
        def __init__(self, spec, platform=None):
            super().__init__(spec, rank=distributed.tp_rank(), world_size=distributed.tp_size(), platform=platform)
            self.rank = 0

    uni.Worker = RankWorker


class SpmdRanks:
    """``world`` rank processes in one tensor-parallel group; :meth:`run` runs a job on all of them."""

    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.procs = [ctx.Process(target=_rank_loop, args=(rank, world, port, self.jobs[rank], self.results),
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
