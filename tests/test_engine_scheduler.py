"""The scheduler's queues: order (FCFS, priority), abort and preemption, and no per-request scan of the queue."""

from __future__ import annotations

import random

import pytest

from dovetail import SamplingParams
from dovetail.config import EngineArgs
from dovetail.engine.kv_cache_manager import KVCacheManager
from dovetail.engine.request import Request, RequestStatus
from dovetail.engine.scheduler import Scheduler


def _scheduler(policy="fcfs", num_blocks=64, max_num_seqs=4, budget=64):
    config = EngineArgs("unused", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        scheduling_policy=policy, enable_prefix_caching=False).create_engine_config()
    return Scheduler(config, KVCacheManager(num_blocks, 16, enable_prefix_caching=False), max_model_len=256)


def _request(rid, arrival, priority=0, cls=Request, tokens=4):
    return cls(str(rid), None, list(range(5, 5 + tokens)), SamplingParams(max_tokens=4), set(),
               arrival_time=arrival, priority=priority)


def _scheduled_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.schedule().requests]


def test_fcfs_takes_requests_by_arrival_and_equal_arrivals_in_the_order_added():
    scheduler = _scheduler()
    for rid, arrival in (("late", 3.0), ("first", 1.0), ("second-a", 2.0), ("second-b", 2.0), ("last", 4.0)):
        scheduler.add(_request(rid, arrival))
    assert _scheduled_ids(scheduler) == ["first", "second-a", "second-b", "late"]
    assert [r.request_id for r in scheduler.waiting] == ["last"]
    assert [r.request_id for r in scheduler.running] == ["first", "second-a", "second-b", "late"]


def test_priority_policy_takes_the_lowest_value_first_then_arrival():
    scheduler = _scheduler("priority", max_num_seqs=3)
    for rid, arrival, priority in (("a", 1.0, 5), ("b", 2.0, 0), ("c", 3.0, 0), ("d", 0.5, 9)):
        scheduler.add(_request(rid, arrival, priority))
    assert _scheduled_ids(scheduler) == ["b", "c", "a"]


def test_abort_removes_a_request_wherever_it_is_and_frees_its_blocks():
    scheduler = _scheduler(max_num_seqs=2)
    requests = [_request(i, float(i)) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    scheduler.schedule()
    running, waiting = requests[0], requests[3]
    assert scheduler.kv.block_ids(running.request_id)
    scheduler.abort(running)
    scheduler.abort(waiting)
    scheduler.abort(waiting)  # twice is harmless
    assert running not in scheduler.running and waiting not in scheduler.waiting
    assert not scheduler.kv.block_ids(running.request_id)
    assert [r.request_id for r in scheduler.running] == ["1"] and [r.request_id for r in scheduler.waiting] == ["2"]
    assert scheduler.has_work()
    for r in requests[1:3]:
        scheduler.finish(r)
    assert not scheduler.has_work() and scheduler.kv.usage() == 0


def test_a_preempted_request_waits_again_ahead_of_later_arrivals():
    # Two blocks of 16 tokens: two running requests of 16 prompt tokens fill them, and the first decode of the
    # earlier one needs a third block, so the later one (the victim under FCFS) is preempted.
    scheduler = _scheduler(num_blocks=2, max_num_seqs=4, budget=64)
    early, late, later = _request("early", 1.0, tokens=16), _request("late", 2.0, tokens=16), _request("later", 3.0)
    for r in (early, late):
        scheduler.add(r)
    assert _scheduled_ids(scheduler) == ["early", "late"]
    for r in (early, late):
        r.append_token(7)
    scheduler.add(later)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.preempted] == ["late"] and late.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in batch.requests] == ["early"]
    assert [r.request_id for r in scheduler.waiting] == ["late", "later"]


class _CountedRequest(Request):
    """A request that counts how often the scheduler looks at it (attribute reads and comparisons)."""

    looks = 0

    def __getattribute__(self, name):
        _CountedRequest.looks += 1
        return super().__getattribute__(name)

    def __eq__(self, other):
        _CountedRequest.looks += 1
        return self is other

    __hash__ = Request.__hash__


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_adding_and_aborting_never_scans_the_queue(policy):
    """The issue's fan-out queued 20,480 sequences: each add or abort must look at a bounded number of them."""
    scheduler = _scheduler(policy, num_blocks=16)
    count = 2000
    rng = random.Random(0)
    requests = [_request(i, rng.random(), rng.randrange(3) if policy == "priority" else 0, _CountedRequest)
                for i in range(count)]
    _CountedRequest.looks = 0
    for r in requests:
        scheduler.add(r)
    rng.shuffle(requests)
    for r in requests:
        scheduler.abort(r)
    assert not scheduler.waiting and not scheduler.running
    # A few dozen looks per add and abort; scanning the queue would take about count / 2 each.
    assert _CountedRequest.looks < 40 * count, f"{_CountedRequest.looks} looks for {count} requests"
