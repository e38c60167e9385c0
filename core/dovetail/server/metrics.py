"""Prometheus metrics of the server (``GET /metrics``).

Counters and histograms are fed by :class:`RequestTracker` as each request's
outputs arrive; gauges (running, waiting, KV-cache usage, prefix-cache hit
rate, preemptions, speculative decoding's draft and accepted tokens) are read
from the engine loop's latest stats at scrape time.
Each server owns its registry, so several servers can live in one process.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dovetail.engine.async_engine import TimedOutput
from dovetail.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: Outcomes of an HTTP generation request.
OUTCOMES = ("finished", "aborted", "rejected", "overloaded", "error")


class _EngineStatsCollector:
    """Gauges read from the engine loop's stats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("dovetail_num_requests_running", "Sequences in the running batch.",
                                value=s.get("running", 0))
        yield GaugeMetricFamily("dovetail_num_requests_waiting", "Sequences waiting to be scheduled.",
                                value=s.get("waiting", 0))
        yield GaugeMetricFamily("dovetail_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                                value=s.get("kv_cache_usage", 0.0))
        yield GaugeMetricFamily("dovetail_prefix_cache_hit_rate",
                                "Fraction of looked-up prompt tokens found in the prefix cache (0 to 1).",
                                value=s.get("prefix_cache_hit_rate", 0.0))
        yield CounterMetricFamily("dovetail_num_preemptions", "Sequences preempted (recomputed later).",
                                  value=s.get("num_preemptions", 0))
        yield CounterMetricFamily("dovetail_spec_decode_num_draft_tokens",
                                  "Draft tokens proposed by speculative decoding.",
                                  value=s.get("spec_decode_num_draft_tokens", 0))
        yield CounterMetricFamily("dovetail_spec_decode_num_accepted_tokens",
                                  "Draft tokens that speculative decoding accepted.",
                                  value=s.get("spec_decode_num_accepted_tokens", 0))


class ServerMetrics:
    """The server's metrics, in a registry of its own."""

    def __init__(self, engine_stats: Callable[[], dict]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dovetail_requests", "Generation requests by outcome: finished, aborted (the "
                                "client went away), rejected (400), overloaded (503), error (500).",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.finished_sequences = Counter("dovetail_finished_sequences", "Finished sequences by finish reason.",
                                          ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("dovetail_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("dovetail_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("dovetail_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dovetail_inter_token_latency_seconds", "Time between a sequence's tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dovetail_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineStatsCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Feeds the metrics with one HTTP request's outputs, then its outcome (exactly once)."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float):
        self.metrics = metrics
        self.arrival = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: dict[tuple[str, int], float] = {}
        self.prefilled: set[str] = set()
        self.done = False

    def observe(self, item: TimedOutput) -> None:
        m, out, t = self.metrics, item.output, item.time
        if out.request_id not in self.prefilled and (out.finished or any(ids for _, ids in out.deltas)):
            self.prefilled.add(out.request_id)
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        for index, (_, ids) in enumerate(getattr(out, "deltas", ())):
            if not ids:
                continue
            m.generation_tokens.inc(len(ids))
            key = (out.request_id, index)
            last = self.last_token_time.get(key)
            if last is not None:
                for _ in ids:
                    m.itl.observe((t - last) / len(ids))
            if self.first_token_time is None:
                self.first_token_time = t
                m.ttft.observe(t - self.arrival)
            self.last_token_time[key] = t
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs] if isinstance(out, RequestOutput) else ["stop"]
            for reason in reasons:
                m.finished_sequences.labels(reason or "unknown").inc()

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.requests.labels(outcome).inc()
        if outcome == "finished":
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
