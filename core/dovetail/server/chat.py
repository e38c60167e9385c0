"""``POST /v1/chat/completions``: a conversation through the model's chat template, streaming or not.

Tools and ``tool_choice`` are in :mod:`dovetail.server.tools`, constraints on the
output in :mod:`dovetail.server.structured`, and the message built from the text
(reasoning, content, tool calls) in :mod:`dovetail.server.chat_output`.
"""

from __future__ import annotations

import time

from fastapi import Request, Response

from dovetail.engine.async_engine import NewRequest
from dovetail.outputs import CompletionOutput, RequestOutput
from dovetail.server.chat_output import ChatOutput
from dovetail.server.logprobs import chat_logprobs
from dovetail.server.metrics import RequestTracker
from dovetail.server.protocol import ChatCompletionRequest
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond, sse
from dovetail.server.structured import structured_outputs_of
from dovetail.server.tools import (check_tool_choice, output_tool_parser, template_messages, template_tools,
                                   tools_constraint)


class _Chat:
    """One chat request: the rendered prompt, its engine request and how to format its output."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest):
        self.state, self.body = state, body
        self.model = state.check_model(body.model)
        self.id = state.new_id("chatcmpl")
        self.created = int(time.time())
        self.n = body.n or 1
        state.check_sequences(self.n, 1)
        body.check_stream_options()
        body.check_supported()
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        parser = state.settings.tool_call_parser
        mode = check_tool_choice(body, parser)
        self.structured_outputs = structured_outputs_of(body, tools_constraint(body, mode))
        self.prompt_text, self.prompt_ids = state.render_chat(
            template_messages(body.conversation()), body.add_generation_prompt is not False, template_tools(body),
            body.chat_template_kwargs)
        state.check_prompt(self.prompt_ids, "messages")
        self.output = ChatOutput(state.reasoning, self.prompt_ids, output_tool_parser(body, mode, parser),
                                 body.include_reasoning is not False)

    def engine_requests(self) -> list[NewRequest]:
        body = self.body
        if body.max_completion_tokens is not None:
            max_tokens = self.state.max_tokens(len(self.prompt_ids), body.max_completion_tokens, None,
                                               "max_completion_tokens")
        else:
            max_tokens = self.state.max_tokens(len(self.prompt_ids), body.max_tokens,
                                               self.state.default_sampling.get("max_tokens"))
        params = body.sampling_params(max_tokens, self.top_logprobs, structured_outputs=self.structured_outputs,
                                      defaults=self.state.default_sampling)
        prompt = {"prompt_token_ids": self.prompt_ids, "prompt": self.prompt_text}
        return [NewRequest(self.id, prompt, params, lora_request=self.state.lora_for(self.model))]

    def decode(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id])

    def logprobs(self, token_ids, positions) -> dict | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(token_ids, positions, self.top_logprobs, self.decode)

    def usage(self, out: RequestOutput | None) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in out.outputs) if out else 0
        return self.state.settings.usage(len(self.prompt_ids), completion_tokens, out.num_cached_tokens if out else 0)

    def choice(self, c: CompletionOutput) -> dict:
        message, finish_reason = self.output.message(c.text, c.finish_reason)
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c.token_ids, c.logprobs or []),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason}

    def response(self, finals: dict[str, RequestOutput]) -> dict:
        out = finals[self.id]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self.choice(c) for c in out.outputs], "usage": self.usage(out),
                "system_fingerprint": None}

    def chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}]}
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk

    async def events(self, stream, tracker: RequestTracker):
        for index in range(self.n):
            yield sse(self.chunk(index, {"role": "assistant", "content": ""}))
        finished: set[int] = set()
        choices = [self.output.stream() for _ in range(self.n)]
        final = None
        async for item in stream:
            tracker.observe(item)
            out = item.output
            if out.finished:
                final = out
            for c, (delta_text, delta_ids) in zip(out.outputs, out.deltas):
                done = c.finish_reason is not None and c.index not in finished
                if not (delta_text or delta_ids or done):
                    continue
                logprobs = None
                if self.top_logprobs is not None:
                    positions = c.logprobs[len(c.logprobs) - len(delta_ids):] if delta_ids else []
                    logprobs = self.logprobs(list(delta_ids), positions)
                if done:
                    finished.add(c.index)
                choice = choices[c.index]
                delta = choice.delta(delta_text, final=done, new_tokens=bool(delta_ids))
                if not (delta or done or logprobs):
                    continue  # held back: it may still be the start of a tag
                finish_reason = choice.finish_reason(c.finish_reason) if done else None
                yield sse(self.chunk(c.index, delta, logprobs, finish_reason, c.stop_reason if done else None))
        if self.body.include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model, "choices": [], "usage": self.usage(final)})


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(request, body, _Chat)
