"""The ``mp`` executor's worker processes: forked from a fork server that started with an older environment,
each still runs with the engine's environment as it is when the ranks start, and each exits when the engine's
process is gone, however it ended, even while it waits on another rank in a collective."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time

import pytest

from dovetail import LLM
from dovetail.errors import ConfigError, WorkerError
from fake_plugins import install_fake_plugin
from test_tp_engine import COMMON
from test_tp_failures import _wait_gone, generating_forever

ENV_CHECK = '''
import os

from dovetail.errors import ConfigError
from dovetail.hookspecs import hookimpl
from dovetail.platform import ProbeResult
from dovetail_cpu.platform import CpuPlatform


def probe():
    return ProbeResult.ok("the CPU")


class EnvCheck(CpuPlatform):
    """The CPU, refusing to open a rank's device while ENV_CHECK is set (only the ranks open one)."""

    name = "envcheck"

    def set_device(self, index):
        if os.environ.get("ENV_CHECK"):
            raise ConfigError(f"this rank runs with ENV_CHECK={os.environ['ENV_CHECK']}")
        return super().set_device(index)


DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="envcheck", cls="envcheck_mod:EnvCheck", probe="envcheck_mod:probe", priority=-1)
'''


def test_ranks_run_with_the_engines_environment_of_their_start(tiny_llama_dir, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "plugin", monkeypatch, "envcheck", "envcheck_mod", ENV_CHECK)
    monkeypatch.delenv("ENV_CHECK", raising=False)
    kwargs = dict(COMMON, device="envcheck", tensor_parallel_size=2)
    LLM(str(tiny_llama_dir), **kwargs).llm_engine.shutdown()  # the fork server is up, without ENV_CHECK
    monkeypatch.setenv("ENV_CHECK", "set after the fork server started")
    with pytest.raises(ConfigError, match="this rank runs with ENV_CHECK=set after the fork server started"):
        LLM(str(tiny_llama_dir), **kwargs)


def test_a_rank_waiting_in_a_collective_exits_when_the_engine_is_killed(tiny_llama_dir, tmp_path):
    """Rank 1 is stopped, so rank 0 waits for it in the step's first all-reduce; then the engine's process is
    killed, with no chance to stop its ranks. Rank 0 must still go (it reads nothing from its pipe while it
    waits), before rank 1 is let go."""
    pids = []
    try:
        with generating_forever(tmp_path, tiny_llama_dir) as (proc, pids):
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(0.5)
            proc.kill()
            proc.wait(timeout=30)
            _wait_gone(pids[:1])
    finally:
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    _wait_gone(pids)


def test_ranks_that_cannot_be_started_fail_the_engine_with_the_reason(tiny_llama_dir, monkeypatch):
    def refuse(self):
        raise OSError("no more processes")

    monkeypatch.setattr(multiprocessing.get_context("forkserver").Process, "start", refuse)
    with pytest.raises(WorkerError, match="the worker processes did not start: OSError: no more processes"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **COMMON)


def test_a_rank_of_its_own_on_an_accelerator_runs_one_host_thread_unless_omp_says_otherwise():
    from types import SimpleNamespace

    from dovetail.engine.worker import host_threads
    from dovetail_cpu.platform import CpuPlatform

    gpu = SimpleNamespace(is_accelerator=True)
    assert host_threads(gpu, owns_process=True, environ={}) == 1
    assert host_threads(gpu, owns_process=True, environ={"OMP_NUM_THREADS": "8"}) is None
    assert host_threads(gpu, owns_process=False, environ={}) is None  # the engine's own process: left as it is
    assert host_threads(CpuPlatform(), owns_process=True, environ={}) is None  # the CPU platform shares its cores out

