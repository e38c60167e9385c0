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


def start_processes_early(backend: str, world_size: int, model_path: str) -> Executor | None:
    """For ``mp``, the executor with its worker processes already starting (they import and read the model's
    configuration while the engine configures; :func:`create_executor` then gives them their work); else None."""
    if backend != "mp":
        return None
    from dovetail.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(world_size, model_path)


def create_executor(spec: WorkerSpec, platform: Platform, started: Executor | None = None) -> Executor:
    """Start the workers of ``spec``'s world on the executor it names; ``platform`` serves ``uni``; ``started``
    is :func:`start_processes_early`'s executor, if any."""
    parallel = spec.config.parallel
    backend = executor_backend(parallel.tensor_parallel_size, parallel.distributed_executor_backend)
    if backend == "uni":
        from dovetail.executor.uni import UniProcExecutor

        return UniProcExecutor(spec, platform)
    if backend == "mp":
        from dovetail.executor.multiproc import MultiprocExecutor

        executor = started or MultiprocExecutor(parallel.tensor_parallel_size, spec.model_path)
        executor.build(spec)
        return executor
    from dovetail.executor.ray_executor import RayExecutor

    return RayExecutor(spec, parallel.tensor_parallel_size, platform)


__all__ = ["EXECUTOR_BACKENDS", "Executor", "create_executor", "executor_backend", "start_processes_early"]
