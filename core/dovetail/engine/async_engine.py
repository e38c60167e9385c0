"""AsyncLLMEngine: one background thread drives an LLMEngine; coroutines stream its outputs.

Every call into the engine (add, abort, step, stats) runs in that thread, one
after another, so the engine itself needs no locks. Coroutines hand it
commands through a thread-safe queue and read their requests' outputs from
a :class:`RequestStream` each, which the thread fills through the event loop. An
exception raised by a step fails the requests in flight with
:class:`EngineStepError`; the loop itself keeps serving, unless a worker died
or failed (:class:`dovetail.errors.WorkerError`): then the engine cannot go on,
so the loop fails the requests in flight, refuses new ones, stops, and calls
``on_failure`` (the server exits on it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from dovetail.engine.frozen_heap import frozen_heap
from dovetail.engine.llm_engine import LLMEngine, PromptType
from dovetail.errors import DovetailError, WorkerError
from dovetail.lora.request import LoRARequest
from dovetail.outputs import RequestOutput
from dovetail.pooling import PoolingParams
from dovetail.sampling_params import SamplingParams

logger = logging.getLogger("dovetail.async_engine")


class QueueFullError(DovetailError):
    """The engine's waiting queue cannot take the request's sequences now (``max_waiting_requests``)."""


class EngineStepError(DovetailError):
    """The engine failed while running a step that included this request."""


class EngineStoppedError(DovetailError):
    """The engine loop is shutting down or has stopped; no new requests are taken."""


@dataclass
class NewRequest:
    """One prompt to add: its id, prompt and parameters, and the LoRA adapter it runs with (None: none)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int = 0
    lora_request: Optional[LoRARequest] = None


@dataclass
class TimedOutput:
    """An output and the moment (``time.monotonic``) its step finished."""

    output: RequestOutput
    time: float


class RequestStream:
    """The outputs of a group of requests added together, as they arrive.

    Iterating yields :class:`TimedOutput` until every request of the group has
    finished. A consumer that falls behind gets one output per request that
    merges the steps it missed (the latest cumulative output, the deltas of all
    of them), so a slow client costs no memory per step. A consumer that
    leaves early calls :meth:`abort`, which frees the requests' KV-cache blocks.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._pending: dict[str, TimedOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: TimedOutput | BaseException) -> None:
        """Hand over an output or a failure (on the event loop's thread)."""
        if isinstance(item, BaseException):
            self._error = item
        else:
            rid = item.output.request_id
            earlier = self._pending.get(rid)
            self._pending[rid] = item if earlier is None else _merge(earlier, item)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[TimedOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TimedOutput]:
        while self.unfinished:
            while not self._pending and self._error is None:
                self._ready.clear()
                await self._ready.wait()
            if self._error is not None and not self._pending:
                self.unfinished.clear()
                raise self._error
            rid = next(iter(self._pending))
            item = self._pending.pop(rid)
            if item.output.finished:
                self.unfinished.discard(rid)
            yield item

    def abort(self) -> None:
        """Abort the group's unfinished requests (a no-op once all finished)."""
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()


def _merge(earlier: TimedOutput, later: TimedOutput) -> TimedOutput:
    """One output standing for two consecutive ones of a request: the later state, both deltas."""
    deltas = [(t0 + t1, ids0 + ids1) for (t0, ids0), (t1, ids1) in zip(earlier.output.deltas, later.output.deltas)]
    return TimedOutput(dataclasses.replace(later.output, deltas=deltas), later.time)


class AsyncLLMEngine:
    """Serves one :class:`LLMEngine` to many coroutines through a single engine loop.

    ``max_waiting_requests`` (default: the engine's ``scheduler.max_waiting_requests``)
    caps the sequences waiting to be scheduled: :meth:`add` raises :class:`QueueFullError`
    for requests whose sequences (``n`` each) would take the queue past it.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        #: Called (in the engine thread) once the engine stopped for good: a worker died or failed.
        self.on_failure = on_failure
        #: The error that stopped the engine for good, if one did.
        self.failure: BaseException | None = None
        self.max_waiting_requests = (max_waiting_requests if max_waiting_requests is not None
                                     else engine.config.scheduler.max_waiting_requests)
        self._commands: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stats: dict = dict(engine.stats())
        self.num_steps = 0
        self.num_step_errors = 0

    # -- life cycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self.engine.executor.on_worker_death = lambda: self._commands.put(self._check_health)
        self._thread = threading.Thread(target=self._run, name="dovetail-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        """Stop taking requests, abort what still runs, and stop the engine thread."""
        self._accepting = False
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    # -- the coroutine side -----------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread, between steps, and return its result."""
        if not self.is_running or not self._accepting:
            raise EngineStoppedError("the engine is shutting down")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, never raised in the loop
                future.set_exception(exc)

        self._commands.put(command)
        return await asyncio.wrap_future(future)

    async def add(self, requests: Sequence[NewRequest], arrival_time: float | None = None) -> RequestStream:
        """Queue requests together: all are added, or none (the first error is raised).

        Raises :class:`dovetail.errors.RequestError` for invalid input and
        :class:`QueueFullError` when the waiting queue is full.
        """
        stream = RequestStream(self, [r.request_id for r in requests])
        arrival = arrival_time if arrival_time is not None else time.monotonic()

        def add_all(engine: LLMEngine) -> None:
            self._check_capacity(engine, requests)
            added: list[str] = []
            try:
                for r in requests:
                    engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority,
                                       arrival_time=arrival, lora_request=r.lora_request)
                    added.append(r.request_id)
            except BaseException:
                engine.abort_request(added)
                raise
            for rid in added:
                self._streams[rid] = stream

        await self.call(add_all)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe, does not wait); their blocks are freed before the next step."""
        def abort_now():
            self.engine.abort_request(request_ids)
            for rid in request_ids:
                self._streams.pop(rid, None)

        self._commands.put(abort_now)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (:class:`EngineStoppedError`); running ones continue."""
        self._accepting = False

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Abort every request in flight (thread-safe); each one's stream raises :class:`EngineStoppedError`."""
        self._commands.put(lambda: self._abort_all(EngineStoppedError(reason)))

    def stats(self) -> dict:
        """The engine's stats as of the end of the loop's last iteration."""
        return self._stats

    # -- the engine thread ------------------------------------------------------------------------

    def _check_capacity(self, engine: LLMEngine, requests: Sequence[NewRequest]) -> None:
        """Refuse requests whose sequences (``n`` each) would not fit the waiting queue's limit."""
        limit = self.max_waiting_requests
        if limit is None:
            return
        adding = sum(r.params.n for r in requests)
        if adding > limit:
            raise QueueFullError(f"the request makes {adding} sequences, more than may ever wait "
                                 f"(max_waiting_requests={limit}); send fewer prompts or a smaller n")
        waiting = len(engine.scheduler.waiting)
        if waiting + adding > limit:
            raise QueueFullError(f"the waiting queue is full ({waiting} sequences waiting, {adding} more asked for, "
                                 f"max_waiting_requests={limit}); retry later")

    def _run(self) -> None:
        engine = self.engine
        try:
            with frozen_heap():
                while True:
                    if not self._drain_commands(block=not engine.has_unfinished_requests()):
                        break
                    if self.failure is None and engine.has_unfinished_requests():
                        self._step()
                    self._stats = dict(engine.stats())
                    if self.failure is not None:
                        break
        finally:
            self._accepting = False
            self._abort_all(EngineStoppedError("the engine stopped before the request finished"))
            self._stats = dict(engine.stats())
        if self.failure is not None and self.on_failure is not None:
            self.on_failure(self.failure)

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when ``block``); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _check_health(self) -> None:
        try:
            self.engine.check_health()
        except WorkerError as exc:
            self._stop_for_good(exc)

    def _stop_for_good(self, exc: WorkerError) -> None:
        self.failure = exc
        self._accepting = False
        logger.error("the engine stopped: %s; failing the %d request(s) in flight", exc,
                     self.engine.num_unfinished_requests())
        self._abort_all(EngineStepError(f"the engine failed while running this request: {exc}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerError as exc:
            self.num_step_errors += 1
            self._stop_for_good(exc)
            return
        except Exception as exc:
            self.num_step_errors += 1
            logger.exception("engine step failed; failing the %d request(s) in flight",
                             self.engine.num_unfinished_requests())
            self._abort_all(EngineStepError(f"the engine failed while running this request: "
                                            f"{type(exc).__name__}: {exc}"))
            return
        self.num_steps += 1
        if not outputs:
            return
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            for completion in out.outputs if isinstance(out, RequestOutput) else ():
                # The engine keeps appending to this list; hand the other thread a snapshot.
                if completion.logprobs is not None:
                    completion.logprobs = list(completion.logprobs)
            deliveries.append((stream, TimedOutput(out, now)))
        self._deliver(deliveries)

    def _abort_all(self, error: BaseException) -> None:
        ids = list(self._streams)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the requests in flight failed")
        deliveries = []
        for stream in {id(s): s for s in self._streams.values()}.values():
            deliveries.append((stream, error))
        self._streams.clear()
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[RequestStream, Any]]) -> None:
        if not deliveries or self._loop is None or self._loop.is_closed():
            return

        def put_all():
            for stream, item in deliveries:
                stream.put(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop closed under us during shutdown
            pass
