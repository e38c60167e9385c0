"""``POST /v1/completions``: text or token-id prompts (one or a list), streaming or not.

With several prompts and ``n`` samples each, choice ``i * n + j`` is sample
``j`` of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from fastapi import Request, Response

from dovetail.engine.async_engine import NewRequest
from dovetail.errors import RequestError
from dovetail.outputs import CompletionOutput, RequestOutput
from dovetail.server.logprobs import completion_logprobs
from dovetail.server.metrics import RequestTracker
from dovetail.server.protocol import CompletionRequest
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond, sse
from dovetail.server.structured import structured_outputs_of


@dataclass
class _Prompt:
    text: Optional[str]
    ids: list[int]


class _Completion:
    """One completions request: its prompts, its engine requests and how to format their outputs."""

    def __init__(self, state: ServerState, body: CompletionRequest):
        self.state, self.body = state, body
        self.model = state.check_model(body.model)
        self.id = state.new_id("cmpl")
        self.created = int(time.time())
        self.n = body.n or 1
        self.echo = bool(body.echo)
        body.check_stream_options()
        if body.suffix:
            raise RequestError("suffix: not supported", field="suffix")
        if body.best_of is not None and body.best_of != self.n:
            raise RequestError(f"best_of: only best_of equal to n ({self.n}) is supported", field="best_of")
        self.structured_outputs = structured_outputs_of(body)
        self.prompts = self._prompts()
        self.engine_ids = [f"{self.id}-{i}" for i in range(len(self.prompts))]
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}

    def _prompts(self) -> list[_Prompt]:
        p = self.body.prompt
        items = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        self.state.check_sequences(self.n, len(items))
        prompts = []
        for i, item in enumerate(items):
            field = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                prompt = _Prompt(item, self.state.tokenize(item, self.body.add_special_tokens is not False, field))
            else:
                prompt = _Prompt(None, list(item))
            self.state.check_prompt(prompt.ids, field)
            prompts.append(prompt)
        return prompts

    def engine_requests(self) -> list[NewRequest]:
        body, state = self.body, self.state
        prompt_logprobs = body.logprobs if self.echo and body.logprobs is not None else None
        requests = []
        for rid, prompt in zip(self.engine_ids, self.prompts):
            max_tokens = state.max_tokens(len(prompt.ids), body.max_tokens, state.default_sampling.get(
                "max_tokens", state.settings.default_completion_max_tokens))
            params = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs,
                                          structured_outputs=self.structured_outputs, defaults=state.default_sampling)
            engine_prompt = {"prompt_token_ids": prompt.ids, "prompt": prompt.text}
            requests.append(NewRequest(rid, engine_prompt, params, lora_request=state.lora_for(self.model)))
        return requests

    # -- formatting ---------------------------------------------------------------------------------

    def decode(self, token_id: int) -> str:
        tokenizer = self.state.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    def echo_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.state.tokenizer
        return tokenizer.decode(prompt.ids) if tokenizer is not None else ""

    def choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        prompt = self.prompts[prompt_index]
        text, logprobs = c.text, None
        if self.echo:
            text = self.echo_text(prompt) + text
        if self.body.logprobs is not None:
            ids, positions = list(c.token_ids), list(c.logprobs or [])
            if self.echo:
                ids, positions = prompt.ids + ids, list(out.prompt_logprobs or [None] * len(prompt.ids)) + positions
            logprobs = completion_logprobs(ids, positions, self.decode)
        return {"index": prompt_index * self.n + c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def usage(self, finals: dict[str, RequestOutput]) -> dict:
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return self.state.settings.usage(prompt_tokens, completion_tokens, cached)

    def response(self, finals: dict[str, RequestOutput]) -> dict:
        choices = []
        for rid, i in self.prompt_index.items():
            out = finals[rid]
            choices.extend(self.choice(i, out, c) for c in out.outputs)
        choices.sort(key=lambda c: c["index"])
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals), "system_fingerprint": None}

    async def events(self, stream, tracker: RequestTracker):
        body = self.body
        include_usage = body.include_usage
        sent_chars: dict[int, int] = {}
        finished: set[int] = set()
        finals: dict[str, RequestOutput] = {}
        async for item in stream:
            tracker.observe(item)
            out = item.output
            if out.finished:
                finals[out.request_id] = out
            prompt_index = self.prompt_index[out.request_id]
            prompt = self.prompts[prompt_index]
            for c, (delta_text, delta_ids) in zip(out.outputs, out.deltas):
                index = prompt_index * self.n + c.index
                first = index not in sent_chars
                done = c.finish_reason is not None and index not in finished
                if not (delta_text or delta_ids or done or (first and self.echo)):
                    continue
                text, ids = delta_text, list(delta_ids)
                positions = list(c.logprobs[len(c.logprobs) - len(ids):]) if c.logprobs is not None and ids else []
                if first and self.echo:
                    text = self.echo_text(prompt) + text
                    ids = prompt.ids + ids
                    positions = list(out.prompt_logprobs or [None] * len(prompt.ids)) + positions
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(ids, positions, self.decode, sent_chars.get(index, 0))
                sent_chars[index] = sent_chars.get(index, 0) + len(text)
                if done:
                    finished.add(index)
                chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                         "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": c.finish_reason if done else None,
                                      "stop_reason": c.stop_reason if done else None}]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if include_usage:
            yield sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": self.usage(finals)})


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await respond(request, body, _Completion)
