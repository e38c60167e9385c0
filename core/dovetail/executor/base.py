"""The Executor contract: how the engine runs each step on its workers, wherever they live."""

from __future__ import annotations

import _signal
import signal
import threading
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from dovetail.engine.step import StepDescription, StepOutput
from dovetail.errors import WorkerError


class Executor(ABC):
    """Runs the engine's steps on ``world_size`` workers (one per rank) and returns the driver's output.

    Every call goes to every rank in the same order (or, when Ctrl-C comes first, to none: see
    :class:`ctrl_c_held`), so the ranks stay in step:
    :meth:`execute_model` queues a step without waiting for it (and a step queued
    with ``sample_later`` samples once :meth:`sample_with_bitmask` follows),
    :meth:`take_output` waits for the oldest queued step and returns rank 0's tokens. A rank that
    dies or fails raises :class:`dovetail.errors.WorkerError` naming the rank, and
    the executor stops the other ranks.
    """

    #: ``uni``, ``mp`` or ``ray`` (the ``--distributed-executor-backend`` value).
    name: str = ""
    world_size: int = 1
    #: Called from another thread when a rank dies while no call waits on it (the engine is idle).
    on_worker_death = None

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; return the results in rank order."""

    @abstractmethod
    def execute_model(self, step: StepDescription) -> None:
        """Queue ``step`` on every rank; nothing waits for the ranks."""

    @abstractmethod
    def sample_with_bitmask(self, token_bitmask: Optional[torch.Tensor], bitmask_rows: Optional[list[int]]) -> None:
        """Let every rank sample the step queued last with ``sample_later``, under ``token_bitmask``
        (see :class:`StepDescription`); nothing waits for the ranks."""

    @abstractmethod
    def take_output(self) -> StepOutput:
        """Wait for the oldest queued step and return what rank 0 sampled."""

    def determine_num_blocks(self) -> int:
        """KV-cache blocks every rank can hold: the minimum over the ranks."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def check_health(self) -> None:
        """Raise :class:`dovetail.errors.WorkerError` if a rank is gone."""

    def shutdown(self) -> None:
        """Stop the workers and free their devices (idempotent)."""

    def describe(self) -> str:
        return f"{self.name}, world size {self.world_size}"


class RemoteExecutor(Executor):
    """An executor whose ranks live outside the engine's process: the first failure stops them all, and
    every later call raises it again."""

    _failure: Optional[WorkerError] = None

    def _stop_ranks(self) -> None:
        """Stop the ranks still running (they may wait in a collective for the one that failed)."""

    def _fail(self, error: BaseException) -> BaseException:
        if self._failure is None:
            self._failure = error if isinstance(error, WorkerError) else WorkerError(str(error))
        self._stop_ranks()
        self.shutdown()
        return error

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerError(f"the engine stopped earlier: {self._failure}", self._failure.rank)


_SIGINT = int(signal.SIGINT)


class ctrl_c_held:
    """``with ctrl_c_held():`` holds Ctrl-C until the block is done, then delivers it.

    A call sent to rank 0 but not to rank 1 would leave rank 0 in a collective that rank 1 never joins (and
    the engine, resetting the ranks after the interrupt, waiting on rank 0 for ever); a message read in part
    would garble its pipe. Signals reach Python on the main thread only, and a handler installed outside
    Python cannot be put back, so elsewhere the block runs as it is. It wraps every call to the ranks, so it
    uses ``_signal``, the C module under :mod:`signal`, whose wrappers (enum conversions) cost microseconds.
    """

    __slots__ = ("_previous", "_held")

    def __enter__(self) -> None:
        self._previous = self._held = None
        if threading.current_thread() is threading.main_thread() and _signal.getsignal(_SIGINT) is not None:
            self._previous = _signal.signal(_SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self._held = signum

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            _signal.signal(_SIGINT, self._previous)
            if self._held is not None:
                signal.raise_signal(signal.SIGINT)
