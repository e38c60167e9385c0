"""The ``ray`` executor at TP=2 on the CPU with a local Ray cluster: greedy tokens as one rank, ranks agree, with
the next step queued before the last one's output is taken (async scheduling); a killed actor stops the engine
naming its rank. Then an engine joining a running cluster of two Ray nodes (``ray start``, one CPU each),
with a rank on each.

Ray runs in a child process with a deadline, so a Ray that cannot start on a starved machine fails this
test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from dovetail import LLM
from dovetail.executor.multiproc import free_port
from dovetail.executor.ray_executor import devices_per_node
from test_tp_engine import COMMON, _greedy

DEADLINE_S = 300

SCRIPT = '''
import json, sys
import ray
from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError

common = json.loads(sys.argv[2])
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[3])]
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True, **common)
engine = llm.llm_engine
result = {"executor": engine.executor.name, "pids": engine.executor.pids}
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
result["greedy"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=2, ignore_eos=True),
                       use_tqdm=False)
result["logprob_steps"] = [len(o.outputs[0].logprobs) for o in sampled]
digests = engine.executor.collective_rpc("token_digest")
result["ranks_agree"] = all(d == digests[0] for d in digests) and len(digests) == 2
described = engine.executor.collective_rpc("describe")
result["heaps_frozen"] = [info["heap_frozen"] for info in described]
result["all_reduce"] = [info["all_reduce"] for info in described]
result["cpus"] = int(ray.cluster_resources()["CPU"])
if result["cpus"] < 4:  # the model's four heads allow four ranks at most
    try:
        LLM(sys.argv[1], tensor_parallel_size=4, distributed_executor_backend="ray", **common)
    except ConfigError as exc:
        result["too_many"] = str(exc)
import time
from dovetail.errors import WorkerError
sys.path.insert(0, sys.argv[4])
from test_tp_engine import kill_rank_one_mid_generation
from test_tp_failures import _wait_gone
pids = kill_rank_one_mid_generation(engine)
killed_at = time.monotonic()
try:
    while engine.has_unfinished_requests():
        engine.step()
except WorkerError as exc:
    result["killed"] = [str(exc), exc.rank, round(time.monotonic() - killed_at, 1)]
try:
    _wait_gone(pids)
    result["actors_gone"] = True
except AssertionError:
    result["actors_gone"] = False
engine.shutdown()
result["ray_stopped"] = not ray.is_initialized()
print("RESULT " + json.dumps(result), flush=True)
'''


def _run(script: str, args: list[str], env: dict[str, str]) -> dict:
    """Run ``script`` in a process group of its own with a deadline; the JSON of its ``RESULT`` line."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the ray executor did not finish in {DEADLINE_S}s:\n{output[-3000:]}")
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, output[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_actors_on_one_node_are_shown_every_device_their_node_holds():
    """Ray gives each actor one GPU; a peer-to-peer all-reduce needs the others on its node visible too."""
    placements = [("a", ["3"]), ("b", ["0"]), ("a", ["1"]), ("b", ["GPU-x"]), ("a", ["10"])]
    assert devices_per_node(placements) == [(["1", "3", "10"], 1), (["0", "GPU-x"], 0), (["1", "3", "10"], 0),
                                            (["0", "GPU-x"], 1), (["1", "3", "10"], 2)]
    assert devices_per_node([("a", []), ("a", [])]) is None, "CPU actors hold no device ids"
    assert devices_per_node([("a", ["0", "1"])]) is None


def test_ray_tp2_matches_one_rank(tiny_llama_dir, tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs Ray (pip install 'dovetail[ray]')")
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 47)), [42, 17] * 9 + [3]]
    one = _greedy(LLM(str(tiny_llama_dir), **COMMON), prompts)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    env["RAY_memory_monitor_refresh_ms"] = "0"  # Ray's own OOM killer would count other processes' memory
    result = _run(SCRIPT, [str(tiny_llama_dir), json.dumps(COMMON), json.dumps(prompts), os.path.dirname(__file__)],
                  env)
    assert result["executor"] == "ray" and len(result["pids"]) == 2
    assert result["greedy"] == one
    assert result["logprob_steps"] == [6, 6, 6] and result["ranks_agree"]
    assert result["heaps_frozen"] == [True, True], "each actor's process freezes its heap once its rank is up"
    assert result["all_reduce"] == ["backend", "backend"], "the CPU platform sums through gloo"
    if result["cpus"] < 4:
        assert result["too_many"] == (f"tensor_parallel_size: 4 ranks need 4 CPU in the Ray cluster, but it has "
                                      f"{result['cpus']}")
    message, rank, seconds = result["killed"]
    assert rank == 1 and message.startswith("worker rank 1 (Ray actor) died"), message
    assert seconds < 30, "a killed actor stops the engine within seconds, not at a timeout"
    assert result["actors_gone"], "the executor kills the other actor once one died"
    assert result["ray_stopped"], "the engine stops the local Ray it started"


JOIN_SCRIPT = '''
import json, sys, time
import ray
from dovetail import LLM, SamplingParams

def alive_nodes():
    ray.init()
    try:
        return sum(node["Alive"] for node in ray.nodes())
    finally:
        ray.shutdown()

deadline = time.monotonic() + 60
while alive_nodes() < 2 and time.monotonic() < deadline:
    time.sleep(1)
common = json.loads(sys.argv[2])
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[3])]
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", **common)
engine = llm.llm_engine
result = {"nodes": engine.executor.nodes}
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
result["greedy"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
engine.shutdown()
result["alive_after"] = alive_nodes()
print("RESULT " + json.dumps(result), flush=True)
'''


def test_ray_tp2_joins_a_running_two_node_cluster_and_leaves_it_running(tiny_llama_dir):
    """``ray start --head`` and a second node joined to it (``ray start --address``), one CPU each, on this
    host: the engine joins them through ``RAY_ADDRESS``, its ranks land on the two nodes and meet across them,
    and stopping the engine leaves the cluster up."""
    pytest.importorskip("ray", reason="the ray executor needs Ray (pip install 'dovetail[ray]')")
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_cli is None:
        pytest.skip("the ray command is not installed beside this Python")
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 47))]
    one = _greedy(LLM(str(tiny_llama_dir), **COMMON), prompts)
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="dt-ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_memory_monitor_refresh_ms="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    common = ["--num-cpus", "1", "--disable-usage-stats", "--block"]
    nodes = [subprocess.Popen([ray_cli, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                               "--temp-dir", temp_dir, *common], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        nodes.append(subprocess.Popen([ray_cli, "start", "--address", f"127.0.0.1:{port}", *common], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        result = _run(JOIN_SCRIPT, [str(tiny_llama_dir), json.dumps(COMMON), json.dumps(prompts)],
                      {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        for node in reversed(nodes):  # each node's processes are its process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert len(result["nodes"]) == 2 and len(set(result["nodes"])) == 2, "one rank on each node"
    assert result["greedy"] == one
    assert result["alive_after"] == 2, "the engine leaves a cluster it joined running"
