"""``dovetail bench serve``: B3, an OpenAI-compatible server under Poisson arrivals.

For each request rate (requests per second, or ``inf`` for all at once) the
same seeded request set (random prompt token ids, ``ignore_eos``, lengths
uniform in the given ranges) is sent to ``/v1/completions`` as streams, with
exponential gaps between arrivals. Reported per rate: time to first token and
inter-token latency (mean, p50, p99), end-to-end latency, and output tokens
per second over the wall time of the rate's run. Inter-token latency is the
gap between a stream's chunks (the server sends one per engine step, merging
steps only for a client that lags behind). The client is plain asyncio
(HTTP/1.1 and server-sent events), so it needs nothing beyond the standard
library and measures every chunk when it arrives.

``--background-request JSON`` first sends one other completions request (not
streamed; e.g. a fan-out of many prompts and samples) and starts the measured
requests ``--background-delay`` seconds later: their latencies then say how
much that request holds up everyone else, and the report gives its status and
how long it took.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import ssl
import time
from dataclasses import dataclass, field
from typing import AsyncIterator
from urllib.parse import urlsplit

from dovetail.bench.common import emit, environment
from dovetail.bench.workload import BenchRequest, parse_range, random_requests


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="B3: a running OpenAI-compatible server under Poisson arrivals")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="bearer key (env DOVETAIL_API_KEY)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--rates", nargs="+", default=["1", "4", "16", "inf"],
                   help="request rates in requests/s; 'inf' sends all at once (default: 1 4 16 inf)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate (default 64)")
    p.add_argument("--input-len", default="100:1024", help="LOW:HIGH prompt lengths, uniform (default 100:1024)")
    p.add_argument("--output-len", default="100:1024", help="LOW:HIGH output lengths, uniform (default 100:1024)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the request set and the arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--output-json", default=None, help="also write the result to this file")
    p.add_argument("--background-request", default=None, metavar="JSON",
                   help="a /v1/completions body (JSON, or @FILE) sent before the measured requests")
    p.add_argument("--background-delay", type=float, default=1.0,
                   help="seconds between the background request and the measured ones (default 1)")
    p.set_defaults(func=run)


# -- a minimal HTTP/1.1 client for JSON requests and server-sent events ------------------------------------------


class HTTPError(Exception):
    """A non-2xx answer, or a broken connection."""


async def _open(url: str):
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port,
                                                   ssl=ssl.create_default_context() if secure else None)
    return parts, reader, writer


async def _request(url: str, method: str, headers: dict, body: bytes | None):
    parts, reader, writer = await _open(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
    await writer.drain()
    status_line = await reader.readline()
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        writer.close()
        raise HTTPError(f"bad status line {status_line!r}") from None
    response_headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        response_headers[name.strip().lower()] = value.strip()
    return status, response_headers, reader, writer


async def _body_chunks(headers: dict, reader) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def get_json(url: str, headers: dict) -> dict:
    status, response_headers, reader, writer = await _request(url, "GET", headers, None)
    try:
        body = b"".join([c async for c in _body_chunks(response_headers, reader)])
    finally:
        writer.close()
    if status != 200:
        raise HTTPError(f"GET {url}: {status} {body[:300]!r}")
    return json.loads(body)


async def post_json(url: str, headers: dict, payload: dict) -> tuple[int, bytes]:
    """POST ``payload``; the status and the body, whatever the status."""
    status, response_headers, reader, writer = await _request(url, "POST", headers, json.dumps(payload).encode())
    try:
        return status, b"".join([c async for c in _body_chunks(response_headers, reader)])
    finally:
        writer.close()


async def stream_events(url: str, headers: dict, payload: dict) -> AsyncIterator[tuple[float, bytes]]:
    """POST ``payload`` and yield ``(arrival time, data)`` for each server-sent event."""
    status, response_headers, reader, writer = await _request(url, "POST", headers, json.dumps(payload).encode())
    try:
        if status != 200:
            body = b"".join([c async for c in _body_chunks(response_headers, reader)])
            raise HTTPError(f"{status} {body[:300]!r}")
        buffer = b""
        async for chunk in _body_chunks(response_headers, reader):
            now = time.perf_counter()
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield now, line[6:]
    finally:
        writer.close()


# -- the benchmark ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request measured (seconds)."""

    error: str | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0


async def one_request(url: str, headers: dict, model: str, request: BenchRequest, timeout: float) -> Outcome:
    payload = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
               "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    outcome = Outcome()

    async def consume():
        async for now, data in stream_events(url, headers, payload):
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise HTTPError(event["error"].get("message", "error event"))
            if event.get("usage"):
                outcome.output_tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                times.append(now)

    try:
        await asyncio.wait_for(consume(), timeout)
    except (OSError, HTTPError, asyncio.TimeoutError, ValueError) as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}"[:300])
    if not times:
        return Outcome(error="no tokens streamed")
    outcome.ttft = times[0] - start
    outcome.itl = [b - a for a, b in zip(times, times[1:])]
    outcome.e2e = times[-1] - start
    return outcome


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": 1000 * sum(values) / len(values), "p50": 1000 * percentile(values, 50),
            "p99": 1000 * percentile(values, 99)}


async def run_rate(url: str, headers: dict, model: str, requests: list[BenchRequest], rate: float, seed: int,
                   timeout: float) -> dict:
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for i, request in enumerate(requests):
        tasks.append(asyncio.create_task(one_request(url, headers, model, request, timeout)))
        if math.isfinite(rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    done = [o for o in outcomes if o.error is None]
    errors = [o.error for o in outcomes if o.error is not None]
    output_tokens = sum(o.output_tokens for o in done)
    return {
        "rate": "inf" if math.isinf(rate) else rate, "num_requests": len(requests), "completed": len(done),
        "failed": len(errors), "first_error": errors[0] if errors else None, "duration_s": duration,
        "request_throughput": len(done) / duration, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration, "ttft_ms": summary_ms([o.ttft for o in done]),
        "itl_ms": summary_ms([t for o in done for t in o.itl]), "e2e_ms": summary_ms([o.e2e for o in done]),
    }


async def benchmark(args) -> dict:
    base = args.base_url.rstrip("/")
    key = args.api_key or os.environ.get("DOVETAIL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    cards = (await get_json(f"{base}/v1/models", headers))["data"]
    card = next((c for c in cards if c["id"] == args.model), None) if args.model else cards[0]
    if card is None:
        raise SystemExit(f"--model: {args.model!r} is not served at {base} (served: {[c['id'] for c in cards]})")
    in_range, out_range = parse_range(args.input_len), parse_range(args.output_len)
    max_model_len, vocab_size = card.get("max_model_len"), card.get("vocab_size")
    if vocab_size is None:
        raise SystemExit("the server's /v1/models gives no vocab_size, which random prompts need")
    if max_model_len is not None and in_range[1] + out_range[1] > max_model_len:
        raise SystemExit(f"--input-len/--output-len: up to {in_range[1]} + {out_range[1]} tokens exceed the server's "
                         f"max_model_len of {max_model_len}")
    requests = random_requests(args.num_prompts, in_range, out_range, vocab_size, args.workload_seed)
    url = f"{base}/v1/completions"
    warm = await one_request(url, headers, card["id"], BenchRequest(requests[0].prompt_token_ids, 4), args.timeout)
    if warm.error:
        raise SystemExit(f"the warm-up request failed: {warm.error}")
    rates = [float(text) for text in args.rates]
    for text, rate in zip(args.rates, rates):
        if not rate > 0:
            raise SystemExit(f"--rates: {text!r} is not a positive rate")
    background = None
    if args.background_request is not None:
        background = asyncio.create_task(_timed(post_json(url, headers, _background_body(args.background_request))))
        await asyncio.sleep(args.background_delay)
    results = []
    for rate in rates:
        results.append(await run_rate(url, headers, card["id"], requests, rate, args.workload_seed, args.timeout))
    report = {"benchmark": "serve (B3)", "base_url": base, "model": card["id"], "environment": environment(),
              "num_prompts": args.num_prompts, "input_len": list(in_range), "output_len": list(out_range),
              "workload_seed": args.workload_seed, "results": results}
    if background is not None:
        answered_first = background.done()
        seconds, (status, body) = await asyncio.wait_for(background, args.timeout)
        report["background"] = {"request": args.background_request, "status": status, "seconds": seconds,
                                "answered_before_the_measured_requests_ended": answered_first,
                                "error": None if status == 200 else _error_of(body)}
    return report


def _error_of(body: bytes):
    try:
        return json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")


def _background_body(text: str) -> dict:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    body = json.loads(text)
    if not isinstance(body, dict):
        raise SystemExit("--background-request: expected a JSON object (a /v1/completions body)")
    return body


async def _timed(awaitable):
    start = time.perf_counter()
    result = await awaitable
    return time.perf_counter() - start, result


def run(args) -> int:
    emit(asyncio.run(benchmark(args)), args.output_json)
    return 0
