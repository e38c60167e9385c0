"""The ``mp`` executor: one worker process per device on this host (the default with several ranks).

Workers are started as the engine begins, so that their imports and the reading of the model's
configuration overlap the engine's own configuration; they then get their spec and build their part of the
model. They are forked from multiprocessing's fork server, which imports what every rank needs
(:mod:`dovetail.worker_imports`) once per engine process; a rank then starts with those in place instead
of importing them itself, seconds of CPU a rank. The fork server never touches a device, so each rank
still opens its own, and each takes the engine's environment as it is when the rank starts.

They talk to the engine over one pipe each: a call is pickled once and written to every rank's pipe;
rank 0 answers the steps, every rank answers the collective calls. While it waits, the engine watches
every pipe and every process, so a rank that raises (its error comes down its pipe) or dies (killed, out of
memory, a communication failure that aborts it) fails the engine at once with the rank named, and the
other ranks are stopped. Workers ignore Ctrl-C (the engine shuts them down) and exit by themselves when
the engine process is gone, so none is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from dovetail.engine.step import StepDescription, StepOutput
from dovetail.engine.worker import Worker, WorkerSpec
from dovetail.errors import DovetailError, WorkerError
from dovetail.executor.base import RemoteExecutor, ctrl_c_held

logger = logging.getLogger("dovetail")

#: Who answers a call: every rank, only rank 0, or nobody.
_ALL, _DRIVER, _NONE = 0, 1, 2


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden():
    """Start processes without re-running the user's script in each child.

    ``spawn`` and ``forkserver`` import the parent's ``__main__`` in every child; a script that builds an
    engine at top level (no ``if __name__ == "__main__":`` guard) would build it again
    there. The workers need nothing from ``__main__``, so it is hidden while they start (in the thread that
    starts them; the engine's own thread, configuring meanwhile, reads neither attribute).
    """
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        for name in saved:
            if name == "__spec__":
                main.__spec__ = None
            else:
                delattr(main, name)
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _exit_with_engine(engine_alive) -> None:
    """Exit this worker as soon as the engine's process ends, however it ended: only the engine holds the
    other end of ``engine_alive`` and never writes to it, so the pipe reads as closed exactly then. (The
    worker's parent is the fork server, not the engine, so its parent process id tells nothing.)"""
    def watch():
        multiprocessing.connection.wait([engine_alive])
        os._exit(1)

    threading.Thread(target=watch, name="dovetail-engine-watch", daemon=True).start()


def _worker_main(rank: int, world_size: int, init_method: str, conn, engine_alive, environment: dict,
                 log_level: int, started_at: float, model_path: str) -> None:
    os.environ.clear()  # the engine's environment now, not the fork server's from when it started
    os.environ.update(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    _exit_with_engine(engine_alive)
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    worker = None
    try:
        _read_model_config(model_path)
        ready = time.time()
        spec = pickle.loads(conn.recv_bytes())
        if not isinstance(spec, WorkerSpec):  # stopped before it was given work
            return
        phases = {"process_start_s": max(0.0, ready - started_at), "spec_wait_s": time.time() - ready}
        worker = Worker(spec, rank, world_size, init_method, startup_phases=phases, owns_process=True)
        conn.send((True, None, 0))
        while True:
            call, method, args, reply = pickle.loads(conn.recv_bytes())
            if method is None:
                break
            result = getattr(worker, method)(*args)
            if reply == _ALL or (reply == _DRIVER and rank == 0):
                conn.send((True, result, call))
    except EOFError:  # the engine is gone
        return
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        try:
            conn.send((False, (_picklable(exc), text), -1))
        except Exception:
            pass
        os._exit(1)
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()


def _read_model_config(model_path: str) -> None:
    """Read the model's configuration once while the engine still configures: the imports it takes
    (transformers') are then done when the worker reads it again. A configuration that cannot be read is the
    engine's to report."""
    from pathlib import Path

    from dovetail import model_loader

    with contextlib.suppress(Exception):
        model_loader.load_hf_config(Path(model_path))


def _picklable(exc: BaseException) -> BaseException | None:
    """``exc`` if it survives pickling as itself (Dovetail's own errors do), else None."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _start_ranks(ctx, world_size: int, init_method: str, engine_alive, environment: dict, log_level: int,
                 started_at: float, model_path: str, processes: list, conns: list, errors: list) -> None:
    """Start a process for each rank, appending it and the engine's end of its pipe to ``processes`` and
    ``conns`` (in a thread of the engine's: the first start waits for the fork server's imports)."""
    try:
        with _main_module_hidden():
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"dovetail-worker-{rank}", daemon=True,
                                   args=(rank, world_size, init_method, child_end, engine_alive, environment,
                                         log_level, started_at, model_path))
                proc.start()
                child_end.close()
                processes.append(proc)
                conns.append(parent_end)
    except BaseException as exc:
        errors.append(exc)
    finally:
        engine_alive.close()


def _stop(starting: threading.Thread, processes: list, conns: list, wake, engine_alive) -> None:
    """Ask the workers to stop, then terminate and kill whatever is still alive."""
    starting.join()
    with contextlib.suppress(Exception):
        wake.send_bytes(b"")  # the watcher is not to report these exits
    stop = pickle.dumps((0, None, (), _NONE))
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.send_bytes(stop)
    deadline = time.monotonic() + 5
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    for conn in [*conns, engine_alive]:
        with contextlib.suppress(Exception):
            conn.close()


def _watch(executor_ref, sentinels: list, wake) -> None:
    """Notice a rank that dies while the engine is idle (between steps the engine waits on no rank).

    It holds the executor only weakly, so a dropped engine still stops its workers."""
    ready = multiprocessing.connection.wait([*sentinels, wake])
    executor = executor_ref()
    if wake in ready or executor is None or executor._failure is not None:
        return
    rank = next(i for i, s in enumerate(sentinels) if s in ready)
    logger.error("worker rank %d (pid %d) died", rank, executor.pids[rank])
    if executor.on_worker_death is not None:
        executor.on_worker_death()


class MultiprocExecutor(RemoteExecutor):
    """``world_size`` worker processes on this host, rank ``r`` on device ``r``.

    The processes start as soon as the executor is made, before the engine has worked out what they will run:
    each imports Dovetail and reads the model's configuration meanwhile, then waits for :meth:`build`.
    """

    name = "mp"

    def __init__(self, world_size: int, model_path: str):
        self.world_size = world_size
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["dovetail.worker_imports"])  # for the fork server this process starts first
        self._processes: list = []
        self._conns: list = []
        self._calls = 0  # calls sent so far; an answer carries its call's number
        self._start_errors: list = []
        wake_r, wake_w = ctx.Pipe(duplex=False)
        alive_r, alive_w = ctx.Pipe(duplex=False)
        args = (ctx, world_size, f"tcp://127.0.0.1:{free_port()}", alive_r, dict(os.environ),
                logging.getLogger("dovetail").getEffectiveLevel(), time.time(), model_path)
        # A first start waits for the fork server's imports: the engine configures meanwhile.
        self._starting = threading.Thread(target=_start_ranks, args=(*args, self._processes, self._conns,
                                                                    self._start_errors),
                                          name="dovetail-worker-start", daemon=True)
        self._finalizer = weakref.finalize(self, _stop, self._starting, self._processes, self._conns, wake_w,
                                           alive_w)
        self._starting.start()
        self._wake_reader = wake_r
        self._built = False

    def _started(self) -> None:
        """Wait until every rank's process has started; a WorkerError if one could not be."""
        self._starting.join()
        if self._start_errors:
            exc = self._start_errors[0]
            raise self._fail(WorkerError(f"the worker processes did not start: {type(exc).__name__}: {exc}"))

    def build(self, spec: WorkerSpec) -> None:
        """Give every rank ``spec`` and wait until each has built its part of the model."""
        self._started()
        self._write_to_every_rank(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL),
                                  "stopped before it was given its work")
        self._receive(range(self.world_size))
        self._built = True
        threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self._processes],
                                              self._wake_reader),
                         name="dovetail-worker-watch", daemon=True).start()
        logger.info("mp executor: %d worker processes (pids %s)", self.world_size,
                    ", ".join(str(p.pid) for p in self._processes))

    @property
    def pids(self) -> list[int]:
        self._starting.join()
        return [p.pid for p in self._processes]

    # -- calls -------------------------------------------------------------------------------

    def _send(self, method: str, args: tuple, reply: int) -> None:
        self._check_alive()
        self._calls += 1
        self._write_to_every_rank(pickle.dumps((self._calls, method, args, reply), protocol=pickle.HIGHEST_PROTOCOL),
                                  "stopped taking work")

    def _write_to_every_rank(self, payload: bytes, gone: str) -> None:
        """Write ``payload`` to every rank's pipe, or to none if Ctrl-C comes first; a closed pipe fails the
        executor with the rank and ``gone``."""
        with ctrl_c_held():
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(payload)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self._receive([])  # raises for the rank that is gone
                    raise self._fail(WorkerError(f"worker rank {rank} {gone}", rank))

    def _receive(self, ranks) -> list[Any]:
        """Wait for an answer to the last call from each of ``ranks``; any rank's error or death fails the
        executor. An answer to an earlier call (whose wait was interrupted) is dropped."""
        results: dict[int, Any] = {}
        pending = set(ranks)
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._processes)}
        while True:
            if not pending:
                # A dying rank may have said why without being waited for: check before returning.
                ready = multiprocessing.connection.wait([*by_conn, *by_sentinel], timeout=0)
                if not ready:
                    return [results[r] for r in sorted(results)]
            else:
                ready = multiprocessing.connection.wait([*by_conn, *by_sentinel])
            for obj in sorted(ready, key=lambda o: o in by_sentinel):  # messages before deaths
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        with ctrl_c_held():
                            ok, value, call = obj.recv()
                    except (EOFError, OSError):
                        raise self._fail(self._death(rank)) from None
                    if not ok:
                        raise self._fail(self._error(rank, *value))
                    if call < self._calls:
                        continue
                    if rank not in pending:
                        raise self._fail(WorkerError(f"worker rank {rank} answered a call it was not asked", rank))
                    results[rank] = value
                    pending.discard(rank)
                else:
                    rank = by_sentinel[obj]
                    conn = self._conns[rank]
                    if conn.poll():
                        continue  # its last words come first
                    raise self._fail(self._death(rank))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._send(method, args, _ALL)
        return self._receive(range(self.world_size))

    def execute_model(self, step: StepDescription) -> None:
        self._send("execute_model", (step,), _NONE)

    def sample_with_bitmask(self, token_bitmask, bitmask_rows) -> None:
        self._send("sample_with_bitmask", (token_bitmask, bitmask_rows), _NONE)

    def take_output(self) -> StepOutput:
        self._send("take_output", (), _DRIVER)
        return self._receive([0])[0]

    # -- failures ----------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise :class:`WorkerError` naming the first rank that is no longer alive."""
        self._check_alive()
        for rank, proc in enumerate(self._processes):
            if not proc.is_alive():
                if self._conns[rank].poll():
                    self._receive([])  # it said why
                raise self._fail(self._death(rank))

    def _death(self, rank: int) -> WorkerError:
        proc = self._processes[rank]
        proc.join(1)
        return WorkerError(f"worker rank {rank} (pid {proc.pid}) {_describe_exit(proc.exitcode)}; the engine "
                           "stopped", rank)

    def _error(self, rank: int, exc: BaseException | None, text: str) -> BaseException:
        logger.error("worker rank %d failed:\n%s", rank, text)
        if isinstance(exc, DovetailError) and not isinstance(exc, WorkerError):
            return exc  # a configuration error found by a rank reads as it would with one device
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        return WorkerError(f"worker rank {rank} failed: {last}", rank)

    def _stop_ranks(self) -> None:
        self._starting.join()
        for proc in self._processes:
            if proc.is_alive():
                proc.terminate()

    def shutdown(self) -> None:
        if not self._built:  # nothing on a device yet: no need to wait for the ranks' imports
            self._stop_ranks()
        self._finalizer()
