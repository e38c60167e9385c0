"""torch.profiler around engine steps, on every rank: where a step's time goes, kernel by kernel.

Set ``DOVETAIL_TORCH_PROFILER_DIR`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``) and call
``LLM.start_profile()`` / ``LLM.stop_profile()`` (or ``POST /start_profile`` and ``/stop_profile`` on the
server). Each rank profiles its own process, the host and its device, so a tensor-parallel run shows every
rank's kernels and collectives; on stop it writes a Chrome/Perfetto trace (``rank{R}.*.pt.trace.json.gz``,
viewable at ui.perfetto.dev or in TensorBoard) and a table of the operators that took the most time
(``rank{R}_summary.txt``) into the directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dovetail.errors import ConfigError

logger = logging.getLogger("dovetail")

PROFILER_DIR_ENV = "DOVETAIL_TORCH_PROFILER_DIR"
#: Rows of the summary table.
SUMMARY_ROWS = 40


def profiler_dir() -> str:
    """The trace directory ``DOVETAIL_TORCH_PROFILER_DIR`` names (made absolute, created); a ConfigError when unset."""
    directory = os.environ.get(PROFILER_DIR_ENV, "").strip()
    if not directory:
        raise ConfigError(f"profiling is off: set {PROFILER_DIR_ENV} to the directory for the traces before "
                          f"starting the engine")
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _activities(device_type: str) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    device_activity = {"cuda": "CUDA", "xpu": "XPU"}.get(device_type)
    if device_activity and hasattr(torch.profiler.ProfilerActivity, device_activity):
        activities.append(getattr(torch.profiler.ProfilerActivity, device_activity))
    return activities


class StepProfiler:
    """One rank's profiler: :meth:`start` begins recording the host and its ``device_type`` device;
    :meth:`stop` ends it and writes the trace and the summary."""

    def __init__(self, rank: int, device_type: str):
        self.rank, self.device_type = rank, device_type
        self._profile: torch.profiler.profile | None = None
        self._directory = ""

    def start(self, directory: str) -> None:
        if self._profile is not None:
            raise ConfigError("the profiler is already running: stop it first")
        self._directory = directory
        self._profile = torch.profiler.profile(
            activities=_activities(self.device_type), record_shapes=True, with_stack=False,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{self.rank}",
                                                                    use_gzip=True))
        self._profile.start()

    def stop(self) -> str:
        """Stop recording; write the trace and the summary; return the summary's path."""
        if self._profile is None:
            raise ConfigError("the profiler is not running: start it first")
        profile, self._profile = self._profile, None
        profile.stop()  # (waits for the device, then calls the trace handler)
        summary = Path(self._directory) / f"rank{self.rank}_summary.txt"
        averages = profile.key_averages()
        keys = ["self_cpu_time_total"]
        if self.device_type in ("cuda", "xpu"):
            keys.insert(0, "self_device_time_total")
        for key in keys:
            try:
                summary.write_text(averages.table(sort_by=key, row_limit=SUMMARY_ROWS))
                break
            except (KeyError, AttributeError, ValueError) as exc:  # a torch without this column
                logger.warning("profiler: no summary sorted by %s (%s)", key, exc)
        return str(summary)
