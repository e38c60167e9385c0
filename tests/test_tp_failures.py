"""Tensor parallelism fails loudly: bad sizes are refused up front, a dead or failing rank stops the engine
with its rank named, and neither an error nor Ctrl-C nor SIGTERM leaves a worker process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dovetail import LLM, SamplingParams
from dovetail.engine.step import StepDescription
from dovetail.errors import ConfigError, WorkerError
from fake_plugins import install_fake_plugin
from test_tp_engine import COMMON, assert_workers_gone, kill_rank_one_mid_generation
from tiny_models import assert_greedy_matches, hf_greedy


def _wait_gone(pids: list[int], seconds: float = 20.0) -> None:
    """Nothing may hang: give the processes a bounded time to go, then check."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            assert_workers_gone(pids)
            return
        except AssertionError:
            time.sleep(0.2)
    assert_workers_gone(pids)


def test_heads_not_divisible_by_the_size_is_refused(tiny_llama_dir):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: the model's 4 attention heads are not divisible "
                                          r"by tensor_parallel_size=3$") as caught:
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **COMMON)
    # While the error (and so its frames) is still held, as a caller that logs or keeps it would:
    left = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
    assert caught.value and not left, "the rank processes started while the engine configured stop with its error"


def test_uni_with_several_ranks_is_refused(tiny_llama_dir):
    with pytest.raises(ConfigError, match="distributed_executor_backend: 'uni' runs one rank"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, distributed_executor_backend="uni", **COMMON)


ONE_CARD = '''
from dovetail.hookspecs import hookimpl
from dovetail.platform import Platform, ProbeResult
from dovetail_cpu.platform import CpuPlatform


def probe():
    return ProbeResult.ok("one card")


class OneCard(CpuPlatform):
    """The CPU under another name, counting one device and refusing more ranks, as a GPU platform does."""

    name = "onecard"
    check_world_size = Platform.check_world_size

    def device_count(self):
        return 1


DOVETAIL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_platforms(register):
    register(name="onecard", cls="onecard_mod:OneCard", probe="onecard_mod:probe", priority=-1)
'''


def test_more_ranks_than_devices_names_both_counts(tiny_llama_dir, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "plugin", monkeypatch, "onecard", "onecard_mod", ONE_CARD)
    kwargs = dict(COMMON, device="onecard")
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 2 ranks need 2 onecard devices, but 1 is "
                                          r"visible$"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs)
    assert LLM(str(tiny_llama_dir), **kwargs).llm_engine.platform.name == "onecard"


def test_a_killed_worker_stops_the_engine_naming_the_rank(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    pids = kill_rank_one_mid_generation(engine)
    _wait_gone(pids[1:])  # the kernel takes a moment to end a process; meanwhile steps may still finish
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL") as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert info.value.rank == 1
    _wait_gone(pids)
    with pytest.raises(WorkerError, match="the engine stopped: worker rank 1"):
        engine.step()


def test_a_failing_worker_names_its_rank_and_its_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **COMMON)
    executor = llm.llm_engine.executor
    pids = executor.pids
    executor.execute_model(StepDescription(["ghost"], [1]))  # a request no worker was told of
    with pytest.raises(WorkerError, match=r"worker rank [01] failed: KeyError: 'ghost'"):
        executor.take_output()
    _wait_gone(pids)


def test_a_configuration_error_found_by_the_ranks_reads_as_with_one_device(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"the KV cache holds 2 blocks of 16 tokens .* on rank [01], fewer than one "
                                          r"sequence of max_model_len=128 needs \(8\)"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_gpu_blocks_override=2, **COMMON)


SCRIPT = '''
import sys
from dovetail import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", attention_backend="REFERENCE", tensor_parallel_size=2, max_model_len=128)
print("PIDS", *llm.llm_engine.executor.pids, flush=True)
while True:
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
'''


@contextlib.contextmanager
def generating_forever(tmp_path, model_dir):
    """:data:`SCRIPT` in a session of its own, generating: yields its process and its ranks' pids, and kills
    whatever of the session is left when the engine's process is still running afterwards."""
    script = tmp_path / "generate_forever.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else line
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # let it generate
        yield proc, pids
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_no_worker_outlives_ctrl_c_or_sigterm(tiny_llama_dir, tmp_path, how):
    """A script without a ``__main__`` guard (the workers must not run it again as they start), stopped while it
    generates: Ctrl-C reaches the whole process group, SIGTERM only the engine's process."""
    with generating_forever(tmp_path, tiny_llama_dir) as (proc, pids):
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        _wait_gone(pids)


CTRL_C_BETWEEN_RANKS = '''
import signal
import sys
from multiprocessing.connection import Connection

from dovetail import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", attention_backend="REFERENCE", dtype="float32", tensor_parallel_size=2,
          max_model_len=128)
rank0 = llm.llm_engine.executor._conns[0]
send_bytes = Connection.send_bytes
armed = True


def send_then_ctrl_c(self, buf, *args):
    """Ctrl-C lands just after a step reached rank 0, before it reaches rank 1."""
    global armed
    send_bytes(self, buf, *args)
    if armed and self is rank0 and b"execute_model" in bytes(buf):
        armed = False
        signal.raise_signal(signal.SIGINT)


Connection.send_bytes = send_then_ctrl_c
prompt, params = {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
try:
    llm.generate(prompt, params, use_tqdm=False)
    print("NOT INTERRUPTED", flush=True)
except KeyboardInterrupt:
    pass
print("TOKENS", *llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids, flush=True)
'''


def test_ctrl_c_between_two_ranks_writes_leaves_the_engine_working(tiny_llama_dir, tmp_path, tiny_llama_hf):
    """A step reaches every rank or none: Ctrl-C after rank 0 was told to run one (rank 0 then waits in a
    collective for rank 1) is held until rank 1 is told too, so the ranks can be reset and generate again."""
    script = tmp_path / "ctrl_c_between_ranks.py"
    script.write_text(textwrap.dedent(CTRL_C_BETWEEN_RANKS))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the engine hung after Ctrl-C between two ranks' writes")
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[-1].startswith("TOKENS") and "NOT INTERRUPTED" not in out, out
    expected, logprobs = hf_greedy(tiny_llama_hf, [5, 6, 7], 12)
    assert_greedy_matches([int(t) for t in lines[-1].split()[1:]], expected, logprobs)


def test_ctrl_c_held_delivers_it_once_the_block_is_done():
    from dovetail.executor.base import ctrl_c_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
        done.append("after the block")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with ctrl_c_held():
        pass  # no Ctrl-C: nothing is raised


def test_the_ray_executor_submits_a_call_to_every_actor_even_when_ctrl_c_comes_between():
    from dovetail.executor.ray_executor import RayExecutor

    class Actor:
        """Records the calls it is given; the first one submitted also presses Ctrl-C."""

        def __init__(self, rank, calls):
            self.rank, self.calls, self.call = rank, calls, self

        def remote(self, method, *args):
            self.calls.append((self.rank, method))
            if len(self.calls) == 1:
                signal.raise_signal(signal.SIGINT)
            return (self.rank, method)

    calls = []
    executor = object.__new__(RayExecutor)
    executor._actors = [Actor(0, calls), Actor(1, calls)]
    with pytest.raises(KeyboardInterrupt):
        executor._call_every_rank("execute_model", "step")
    assert calls == [(0, "execute_model"), (1, "execute_model")]


def test_plugins_command_says_the_world_size_and_the_executor():
    from dovetail.cli import plugins_cmd

    data = plugins_cmd.collect(2)
    assert data["parallelism"]["world_size"] == 2 and data["parallelism"]["executor"] == "mp"
    text = plugins_cmd.render(data)
    assert "parallelism: world size 2, executor mp" in text and "ray: Ray actors" in text
    assert "world size 1, executor uni" in plugins_cmd.render(plugins_cmd.collect())


def test_the_kv_cache_is_the_smallest_any_rank_can_hold():
    from dovetail.executor.base import Executor

    class Ranks(Executor):
        """Ranks whose devices hold different numbers of blocks (their memory differs)."""

        world_size = 3

        def collective_rpc(self, method, *args):
            return {"determine_num_blocks": [412, 377, 390]}[method]

        def execute_model(self, step):
            raise NotImplementedError

        def sample_with_bitmask(self, token_bitmask, bitmask_rows):
            raise NotImplementedError

        def take_output(self):
            raise NotImplementedError

    assert Ranks().determine_num_blocks() == 377
