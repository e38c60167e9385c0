"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's endpoints)."""

from __future__ import annotations

from fastapi import Request

from dovetail.errors import RequestError
from dovetail.server.protocol import DetokenizeRequest, TokenizeRequest, conversation
from dovetail.server.state import ServerState
from dovetail.server.tools import template_messages


async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("prompt: give exactly one of prompt and messages", field="prompt")

    def token_ids() -> list[int]:
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            return state.render_chat(template_messages(conversation(body.messages)),
                                     body.add_generation_prompt is not False, tools, body.chat_template_kwargs)[1]
        return state.tokenize(body.prompt, body.add_special_tokens is not False, allow_empty=True)

    ids = await state.off_loop(token_ids)
    result = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return result


async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    state.check_token_ids(body.tokens, "tokens")
    tokenizer = state.require_tokenizer("tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
