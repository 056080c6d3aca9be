"""The HTTP app: routes only. The engine lives on app.state.server.engine.

    create_app(engine, served_model_name=...)            serve a ready engine
    create_app(None, engine_factory=load, ...)           start at once, load in a thread;
                                                         /health answers 503 until ready

The app owns the engine's life: it starts the engine in the serving event
loop (lifespan startup) and shuts it down at lifespan shutdown, which uvicorn
runs after in-flight requests have finished.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, error_body, install_error_handlers, model_not_found
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    openapi_body,
    openapi_schemas,
)
from server.protocol_anthropic import MessagesInput, MessagesRequest
from server.serving_anthropic import count_tokens, create_message
from server.serving_chat import create_chat_completion
from server.serving_common import ServerState
from server.serving_completion import create_completion
from server.serving_lora import load_lora_adapter, unload_lora_adapter
from server.serving_responses import create_response
from server.serving_tokenize import detokenize, tokenize
from server.timeouts import DEFAULT_READ_TIMEOUT_S, BodyTimeoutMiddleware

logger = logging.getLogger("pagedserve.server")
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


def create_app(
    engine: Any = None,
    *,
    served_model_name: str,
    served_model_aliases: tuple[str, ...] = (),
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout: float | None = DEFAULT_READ_TIMEOUT_S,
    engine_factory: Callable[[], Any] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[Any], None] | None = None,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
    enable_lora_runtime_updates: bool = False,
    lora_root: str | None = None,
) -> FastAPI:
    """The engine's limits (engine.limits) bound the queue: at most max_num_seqs + max_waiting
    engine requests are admitted at once, and the rest get 429. A request body that has not
    arrived `read_timeout` seconds after its headers gets a 408 (None: no bound; the headers'
    own bound is the HTTP server's, server.http_server.make_server). `tool_call_parser`: how
    tool calls are read from the output (server/tool_parsers.py); auto = from the chat template.
    `served_model_aliases`: other names requests may use for the model (/v1/models lists them after
    `served_model_name`, which responses carry). `enable_lora_runtime_updates`: serve
    /v1/load_lora_adapter and /v1/unload_lora_adapter, reading adapters from under `lora_root` only
    when it is given (server/serving_lora.py)."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("give exactly one of engine or engine_factory")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    state = ServerState(
        served_model_name=served_model_name,
        model_aliases=tuple(served_model_aliases),
        metrics=ServerMetrics(),
        max_body_bytes=max_body_bytes,
        api_key=api_key or None,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        lora_runtime_updates=enable_lora_runtime_updates,
        lora_root=lora_root,
    )
    created = int(time.time())

    async def attach(ready_engine: Any) -> None:
        ready_engine.start()  # idempotent: AsyncEngine starts its thread when built
        state.attach(ready_engine)
        logger.info("model %s ready", served_model_name)
        if on_ready is not None:
            on_ready(ready_engine)

    async def load_in_background() -> None:
        assert engine_factory is not None  # started only with one
        try:
            await attach(await _in_daemon_thread(engine_factory))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which decides to exit
            state.load_error = f"{type(exc).__name__}: {exc}"
            logger.exception("loading the model failed")
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if engine is not None:
            await attach(engine)
        else:
            loader = asyncio.create_task(load_in_background())
        try:
            yield
        finally:
            if loader is not None and not loader.done():
                loader.cancel()
            if state.engine is not None:
                # shutdown() joins the engine thread: off the event loop.
                await asyncio.to_thread(state.engine.shutdown)
            state.cpu_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if read_timeout is not None:
        app.add_middleware(BodyTimeoutMiddleware, timeout=read_timeout)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            message = f"loading the model failed: {state.load_error}" if state.load_error else "model is loading"
            return JSONResponse(error_body(503, message), status_code=503)
        if not state.engine.is_running:
            return JSONResponse(error_body(503, "the engine has stopped"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": created, "owned_by": "pagedserve"}
        if state.engine is not None and state.limits is not None:
            card["max_model_len"] = state.limits.max_model_len
        return card

    def adapter_card(name: str) -> dict[str, Any]:  # a LoRA adapter: its base model is its parent, as vLLM says
        return {**model_card(name), "parent": served_model_name}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [model_card(name) for name in (served_model_name, *served_model_aliases)]
        return {"object": "list", "data": cards + [adapter_card(name) for name in state.lora_names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if model in state.lora_names:
            return adapter_card(model)
        if model != served_model_name and model not in served_model_aliases:
            raise model_not_found(model, served_model_name)
        return model_card(model)

    # Bodies are parsed by hand (protocol.parse_body, for OpenAI's error messages); the
    # document still shows each route's request model, with its bounds.
    app.add_api_route(
        "/v1/completions", create_completion, methods=["POST"], openapi_extra=openapi_body(CompletionRequest)
    )
    app.add_api_route(
        "/v1/chat/completions",
        create_chat_completion,
        methods=["POST"],
        openapi_extra=openapi_body(ChatCompletionRequest),
    )
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    # Anthropic's Messages API (its errors in Anthropic's shape: server/errors.py).
    app.add_api_route("/v1/messages", create_message, methods=["POST"], openapi_extra=openapi_body(MessagesRequest))
    app.add_api_route(
        "/v1/messages/count_tokens", count_tokens, methods=["POST"], openapi_extra=openapi_body(MessagesInput)
    )
    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"], openapi_extra=openapi_body(TokenizeRequest))
    app.add_api_route("/detokenize", detokenize, methods=["POST"], openapi_extra=openapi_body(DetokenizeRequest))
    _publish_request_schemas(app)
    return app


def _publish_request_schemas(app: FastAPI) -> None:
    """Add the request models to the generated document's components (the routes refer to them)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            schemas = openapi_schemas(MessagesRequest, MessagesInput)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a daemon thread: unlike asyncio.to_thread, a shutdown during a slow model
    load does not wait for the load to finish before the process can exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(method: Callable[[Any], object], value: Any) -> None:
        if not future.done():
            method(value)

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the server already went away
            pass

    threading.Thread(target=work, name="pagedserve-load", daemon=True).start()
    return await future


class APIKeyMiddleware:
    """401 for any /v1/* (and tokenizer) request without `Authorization: Bearer <key>` or
    Anthropic's `x-api-key: <key>`.

    Plain ASGI rather than BaseHTTPMiddleware, which would buffer and wrap the SSE streams.
    /health and /metrics stay open for load balancers and scrapers.
    """

    _PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith(self._PROTECTED_PREFIXES)):
            headers = dict(scope["headers"])
            bearer_ok = secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
            key_ok = secrets.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
            if not (bearer_ok or key_ok):
                error = APIError(
                    401,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
