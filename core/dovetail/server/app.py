"""The FastAPI application: routes, middleware, error handlers, and the engine loop's life cycle."""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from dovetail import __version__
from dovetail.engine.async_engine import AsyncLLMEngine
from dovetail.engine.profiler import PROFILER_DIR_ENV
from dovetail.errors import ConfigError
from dovetail.server.anthropic_messages import count_message_tokens, create_message
from dovetail.server.chat import create_chat_completion
from dovetail.server.completions import create_completion
from dovetail.server.embeddings import create_embedding
from dovetail.server.scoring import create_classification, create_rerank, create_score
from dovetail.server.errors import APIError, install_error_handlers
from dovetail.server.lora_adapters import load_lora_adapter, runtime_updating_allowed, unload_lora_adapter
from dovetail.server.metrics import ServerMetrics
from dovetail.server.response_store import ResponseStore
from dovetail.server.responses import create_response, delete_response, retrieve_response
from dovetail.server.middleware import AllowedHostsMiddleware, APIKeyMiddleware, BodyLimitMiddleware
from dovetail.server.state import ServerSettings, ServerState
from dovetail.server.tokens import detokenize, tokenize


def _model_card(state: ServerState, name: str) -> dict:
    """A served name's card; an adapter's names the base model as its ``parent`` and its folder as ``root``."""
    lora = state.lora_for(name)
    return {"id": name, "object": "model", "created": state.created, "owned_by": "dovetail",
            "root": lora.lora_path if lora else state.model_path, "parent": state.model_name if lora else None,
            "max_model_len": state.max_model_len, "vocab_size": state.vocab_size}


def _served_names(state: ServerState) -> list[str]:
    return [*state.settings.served_model_names, *state.settings.lora_modules]


async def health(request: Request) -> Response:
    """200 while the engine loop runs, else 503 (never needs the API key)."""
    state: ServerState = request.app.state.server
    return Response(status_code=200 if state.engine.is_running else 503)


async def version() -> dict:
    return {"version": __version__}


async def _profiler_call(request: Request, fn):
    state: ServerState = request.app.state.server
    try:
        return await state.engine.call(fn)
    except ConfigError as exc:  # started twice, or stopped while not running
        raise APIError(400, str(exc), code="profiler_state") from None


async def start_profile(request: Request) -> Response:
    """Start torch.profiler on every rank (served only with ``DOVETAIL_TORCH_PROFILER_DIR`` set)."""
    await _profiler_call(request, lambda engine: engine.start_profile())
    return Response(status_code=200)


async def stop_profile(request: Request) -> dict:
    """Stop it once the steps queued so far have run; each rank's summary path."""
    return {"summaries": await _profiler_call(request, lambda engine: engine.stop_profile())}


async def reset_prefix_cache(request: Request) -> dict:
    """Forget the prefix cache (vLLM's endpoint); ``{"reset": false}`` while requests run."""
    state: ServerState = request.app.state.server
    return {"reset": await state.engine.call(lambda engine: engine.reset_prefix_cache())}


async def list_models(request: Request) -> dict:
    state: ServerState = request.app.state.server
    return {"object": "list", "data": [_model_card(state, n) for n in _served_names(state)]}


async def retrieve_model(model: str, request: Request) -> dict:
    state: ServerState = request.app.state.server
    if model not in _served_names(state):
        raise APIError(404, f"model: {model!r} does not exist", param="model", code="model_not_found")
    return _model_card(state, model)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; the engine loop runs while the app's lifespan does."""
    from dovetail import model_loader

    llm = engine.engine
    # The HTTP layer tokenizes with its own tokenizer object; the engine thread keeps the engine's.
    tokenizer = model_loader.load_tokenizer(llm.tokenizer_path) if llm.tokenizer is not None else None
    state = ServerState(engine=engine, settings=settings, metrics=ServerMetrics(engine.stats), tokenizer=tokenizer,
                        max_model_len=llm.max_model_len, vocab_size=llm.vocab_size, model_path=str(llm.model_path),
                        created=int(time.time()), reasoning=llm.reasoning, default_sampling=llm.default_sampling,
                        classifier_labels=(llm.pooling_model.classifier.labels
                                           if llm.pooling_model and llm.pooling_model.classifier else None),
                        response_store=ResponseStore.from_environment())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            state.preparer.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Dovetail", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server of the Dovetail inference engine")
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_hosts is not None:
        app.add_middleware(AllowedHostsMiddleware, allowed_hosts=settings.allowed_hosts)

    app.api_route("/health", methods=["GET", "HEAD"])(health)
    app.get("/version")(version)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(list_models)
    app.get("/v1/models/{model:path}")(retrieve_model)
    app.post("/tokenize")(tokenize)
    app.post("/reset_prefix_cache")(reset_prefix_cache)
    app.post("/detokenize")(detokenize)
    app.post("/v1/completions", response_model=None)(create_completion)
    app.post("/v1/chat/completions", response_model=None)(create_chat_completion)
    app.post("/v1/responses", response_model=None)(create_response)
    app.get("/v1/responses/{response_id}")(retrieve_response)
    app.delete("/v1/responses/{response_id}")(delete_response)
    app.post("/v1/messages", response_model=None)(create_message)
    app.post("/v1/messages/count_tokens")(count_message_tokens)
    app.post("/v1/embeddings", response_model=None)(create_embedding)
    app.post("/classify", response_model=None)(create_classification)
    for path in ("/score", "/v1/score"):
        app.post(path, response_model=None)(create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model=None)(create_rerank)
    if os.environ.get(PROFILER_DIR_ENV, "").strip():
        app.post("/start_profile")(start_profile)
        app.post("/stop_profile")(stop_profile)
    if runtime_updating_allowed(llm.loras is not None):
        app.post("/v1/load_lora_adapter", response_model=None)(load_lora_adapter)
        app.post("/v1/unload_lora_adapter", response_model=None)(unload_lora_adapter)
    return app
