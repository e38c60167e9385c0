"""The ``ray`` executor: one Ray actor per rank, placed with a placement group, on one machine or many.

The engine joins the Ray cluster it finds (``RAY_ADDRESS``, or the one ``ray
start --head`` runs on this machine) and otherwise starts a local one. Each
rank's actor reserves one of the platform's Ray resource (``ray_device_key``:
``GPU``, or ``CPU`` on the CPU). Ray makes that device the actor's only
visible one; where the platform names its variable for that
(``visible_devices_env``), each actor is shown every device its machine's
actors hold, as :mod:`~dovetail.executor.mp` ranks see them, and uses its own
by index: a peer-to-peer all-reduce needs the peer's device. Ranks meet over
torch.distributed at the address of rank 0's node. A step's description is
pickled once and travels with the call that takes the output of the step
before it, one Ray call a rank a step (a large one goes once through Ray's
object store). Every call's result is
awaited from every rank, so an actor that dies or raises fails the engine with
its rank named, and the executor then kills the others.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from dovetail.engine.step import StepDescription, StepOutput
from dovetail.engine.worker import Worker, WorkerSpec
from dovetail.errors import ConfigError, DovetailError, WorkerError
from dovetail.executor.base import RemoteExecutor, ctrl_c_held
from dovetail.platform import Platform

logger = logging.getLogger("dovetail")

INSTALL_HINT = "pip install 'dovetail[ray]'"
#: A pickled step description up to this size travels inside each call; a larger one goes once into Ray's
#: object store (Ray would copy it there for every call).
INLINE_STEP_BYTES = 100_000


class RayWorkerActor:
    """What runs inside each rank's actor: a :class:`Worker`, built once the ranks know where to meet."""

    def __init__(self):
        self.worker: Worker | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP address and a free port on it (asked of rank 0, where the ranks meet)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def placement(self, key: str) -> tuple[str, list[str]]:
        """This actor's node and the ids of the ``key`` devices Ray gave it (none for ``CPU``)."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), [str(i) for i in context.get_accelerator_ids().get(key, [])]

    def start(self, spec: WorkerSpec, rank: int, world_size: int, init_method: str, started_at: float,
              visible_devices: tuple[str, str] | None = None, local_rank: int = 0) -> int:
        """Build this rank's worker; ``visible_devices`` (variable, value) is set first, before the device
        starts, and ``local_rank`` is then this rank's device among them."""
        import os

        phases = {"process_start_s": max(0.0, time.time() - started_at)}  # the actor's process, its imports
        if visible_devices is not None:
            os.environ[visible_devices[0]] = visible_devices[1]
        self.worker = Worker(spec, rank, world_size, init_method, local_rank=local_rank, startup_phases=phases,
                             owns_process=True)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute(self, step: bytes) -> None:
        """:meth:`Worker.execute_model` on a pickled step description."""
        self.worker.execute_model(pickle.loads(step))

    def execute_then_take(self, step: bytes) -> StepOutput | None:
        """:meth:`Worker.execute_then_take` on a pickled step description."""
        return self.worker.execute_then_take(pickle.loads(step))


def devices_per_node(placements: list[tuple[str, list[str]]]) -> list[tuple[list[str], int]] | None:
    """Given each rank's (node, device ids) from :meth:`RayWorkerActor.placement`: for each rank, the ids of
    every device its node's ranks hold, in Ray's order, and the index of its own among them. None unless every
    rank holds exactly one device."""
    if not placements or any(len(ids) != 1 for _, ids in placements):
        return None
    on_node: dict[str, set[str]] = {}
    for node, ids in placements:
        on_node.setdefault(node, set()).update(ids)

    def ray_order(device: str):
        return (0, int(device), "") if device.isdigit() else (1, 0, device)

    shown = {node: sorted(ids, key=ray_order) for node, ids in on_node.items()}
    return [(shown[node], shown[node].index(ids[0])) for node, ids in placements]


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"distributed_executor_backend: 'ray' needs Ray, which is not installed ({INSTALL_HINT})") \
            from None
    return ray


class RayExecutor(RemoteExecutor):
    """``world_size`` Ray actors, one per device, placed together by a placement group (``PACK``)."""

    name = "ray"

    def __init__(self, spec: WorkerSpec, world_size: int, platform: Platform):
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        self._actors: list = []
        self._launched: list = []  # the refs of the calls sent since the last output, awaited with it
        self._deferred: Any = None  # the pickled step (or its ref) that the next take_output carries
        self._placement = None
        self.nodes: list[str] = []  # each rank's Ray node id
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        key = platform.ray_device_key
        total = int(ray.cluster_resources().get(key, 0))
        if total < world_size:
            self.shutdown()
            raise ConfigError(f"tensor_parallel_size: {world_size} ranks need {world_size} {key} in the Ray cluster, "
                              f"but it has {total}")
        try:
            self._placement = placement_group([{key: 1.0}] * world_size, strategy="PACK")
            ray.get(self._placement.ready(), timeout=120)
            if key == "GPU":
                resources = {"num_gpus": 1, "num_cpus": 0}
            elif key == "CPU":
                resources = {"num_cpus": 1}
            else:
                resources = {"num_cpus": 0, "resources": {key: 1}}
            actor_cls = ray.remote(RayWorkerActor)
            started_at = time.time()
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._placement,
                                                            placement_group_bundle_index=rank)
                self._actors.append(actor_cls.options(name=None, scheduling_strategy=strategy, max_concurrency=1,
                                                      **resources).remote())
            ip, port = self._gather([self._actors[0].address.remote()], [0])[0]
            init_method = f"tcp://{ip}:{port}"
            placements = self._gather([a.placement.remote(key) for a in self._actors], range(world_size))
            shared = devices_per_node(placements) if platform.visible_devices_env else None
            self.nodes = [node for node, _ in placements]
            starts = []
            for rank, actor in enumerate(self._actors):
                visible, local_rank = None, 0
                if shared is not None:
                    visible = (platform.visible_devices_env, ",".join(shared[rank][0]))
                    local_rank = shared[rank][1]
                starts.append(actor.start.remote(spec, rank, world_size, init_method, started_at, visible,
                                                 local_rank))
            self.pids = self._gather(starts, range(world_size))
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d actors (pids %s) on %d node(s), meeting at %s; %s", world_size,
                    ", ".join(map(str, self.pids)), len(set(self.nodes)), init_method,
                    "each sees its node's ranks' devices" if shared is not None else "each sees its own device")

    # -- calls -------------------------------------------------------------------------------

    def _gather(self, refs: list, ranks) -> list[Any]:
        """The results of ``refs`` (``ranks[i]`` runs ``refs[i]``), in order, waiting for all; any failure
        fails the executor."""
        ray = self.ray
        from ray.exceptions import RayActorError, RayTaskError

        index_of = {ref: i for i, ref in enumerate(refs)}
        ranks = list(ranks)
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = ranks[index_of[ref]]
                try:
                    results[index_of[ref]] = ray.get(ref)
                except RayActorError as exc:
                    raise self._fail(WorkerError(f"worker rank {rank} (Ray actor) died: "
                                                 f"{str(exc).strip().splitlines()[0]}; the engine stopped", rank)) \
                        from None
                except RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, DovetailError) and not isinstance(cause, WorkerError):
                        raise self._fail(cause) from None
                    text = str(cause if cause is not None else exc).strip().splitlines()
                    raise self._fail(WorkerError(f"worker rank {rank} failed: {text[-1] if text else exc}", rank)) \
                        from None
        return results

    def _call_actors(self, actor_method: str, *args: Any) -> list:
        """Submit ``actor_method`` to every actor, or to none if Ctrl-C comes first; the refs in rank order."""
        with ctrl_c_held():
            return [getattr(a, actor_method).remote(*args) for a in self._actors]

    def _call_every_rank(self, method: str, *args: Any) -> list:
        """Every rank's worker's ``method``; the refs in rank order."""
        return self._call_actors("call", method, *args)

    def _send_deferred_step(self) -> None:
        """Send the step :meth:`execute_model` kept back, on its own, before any other call."""
        if self._deferred is not None:
            step, self._deferred = self._deferred, None
            self._launched += self._call_actors("execute", step)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._check_alive()
        self._send_deferred_step()
        return self._gather(self._call_every_rank(method, *args), range(self.world_size))

    def execute_model(self, step: StepDescription) -> None:
        """Keep the step back until the next call: the engine takes the step before it right after launching
        this one, and that call carries it (each Ray call costs the driver and every actor time)."""
        self._check_alive()
        self._send_deferred_step()
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        self._deferred = payload if len(payload) <= INLINE_STEP_BYTES else self.ray.put(payload)

    def sample_with_bitmask(self, token_bitmask, bitmask_rows) -> None:
        self._check_alive()
        self._send_deferred_step()
        self._launched += self._call_every_rank("sample_with_bitmask", token_bitmask, bitmask_rows)

    def take_output(self) -> StepOutput:
        self._check_alive()
        launched, self._launched = self._launched, []
        if self._deferred is not None:
            step, self._deferred = self._deferred, None
            refs = self._call_actors("execute_then_take", step)
        else:
            refs = self._call_every_rank("take_output")
        ranks = list(range(self.world_size))  # each call queued one ref per rank, in rank order
        results = self._gather(launched + refs, ranks * (len(launched) // self.world_size) + ranks)
        return results[len(launched)]

    # -- failures and shutdown ----------------------------------------------------------------

    def shutdown(self) -> None:
        ray = self.ray
        self._deferred = None
        if not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self._actors = []
        if self._placement is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement)
            except Exception:
                pass
            self._placement = None
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False
