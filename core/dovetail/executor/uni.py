"""The ``uni`` executor: one worker in the engine's own process (the default with one rank).

No process, no copy: a step description is handed over by reference, so one
device pays nothing for the seam.
"""

from __future__ import annotations

from typing import Any

from dovetail.engine.step import StepDescription, StepOutput
from dovetail.engine.worker import Worker, WorkerSpec
from dovetail.executor.base import Executor
from dovetail.platform import Platform


class UniProcExecutor(Executor):
    """Drives a single in-process :class:`~dovetail.engine.worker.Worker`."""

    name = "uni"

    def __init__(self, spec: WorkerSpec, platform: Platform):
        self.world_size = 1
        self.worker = Worker(spec, platform=platform)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, step: StepDescription) -> None:
        self.worker.execute_model(step)

    def sample_with_bitmask(self, token_bitmask, bitmask_rows) -> None:
        self.worker.sample_with_bitmask(token_bitmask, bitmask_rows)

    def take_output(self) -> StepOutput:
        return self.worker.take_output()
