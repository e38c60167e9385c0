"""Executors run the engine's steps on its workers: ``uni`` (in process), ``mp`` (a process per device
on this host) or ``ray`` (Ray actors, across machines)."""

from __future__ import annotations

from dovetail.engine.worker import WorkerSpec
from dovetail.executor.base import Executor
from dovetail.platform import Platform

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def executor_backend(tensor_parallel_size: int, requested: str | None) -> str:
    """The executor for a world of ``tensor_parallel_size`` ranks: ``requested``, else ``uni`` for one
    rank and ``mp`` for more."""
    return requested or ("uni" if tensor_parallel_size == 1 else "mp")


def create_executor(spec: WorkerSpec, platform: Platform) -> Executor:
    """Start the workers of ``spec``'s world on the executor it names; ``platform`` serves ``uni``."""
    parallel = spec.config.parallel
    backend = executor_backend(parallel.tensor_parallel_size, parallel.distributed_executor_backend)
    if backend == "uni":
        from dovetail.executor.uni import UniProcExecutor

        return UniProcExecutor(spec, platform)
    if backend == "mp":
        from dovetail.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, parallel.tensor_parallel_size)
    from dovetail.executor.ray_executor import RayExecutor

    return RayExecutor(spec, parallel.tensor_parallel_size, platform)


__all__ = ["EXECUTOR_BACKENDS", "Executor", "create_executor", "executor_backend"]
