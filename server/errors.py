"""OpenAI-style errors: one exception type, one body shape, every failure mapped to it.

Every error the server sends looks like OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

except on Anthropic's routes (/v1/messages...), where it looks like Anthropic's:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

Handlers raise `APIError` (or one of the helpers below); the exception
handlers registered by `install_error_handlers` turn it, and anything
FastAPI/Starlette would otherwise render in its own format, into that body.
An unexpected exception becomes a 500 in the same shape, and the server serves on.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedserve.server")

# OpenAI's `type` for each status we send.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "invalid_request_error",
    503: "service_unavailable",
}

# OpenAI (and Anthropic) endpoints this server does not serve: a 501 that says so, so a client
# reports the missing API rather than a missing model or a typo.
_UNSERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/audio": "audio",
    "/v1/images": "images",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/batches": "batches",
    "/v1/fine_tuning": "fine-tuning",
    "/v1/fine-tunes": "fine-tuning",
    "/v1/assistants": "assistants",
    "/v1/threads": "assistants' threads",
    "/v1/vector_stores": "vector stores",
    "/v1/uploads": "uploads",
    "/v1/realtime": "the Realtime API",
    "/v1/edits": "edits",
    "/v1/engines": "engines",
    "/v1/rerank": "reranking",
    "/v1/score": "scoring",
    "/v1/classify": "classification",
}
SERVED_ROUTES = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
)


class APIError(Exception):
    """An error the client should see, with OpenAI's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The error as OpenAI's body, or Anthropic's on Anthropic's routes (`path`)."""
        body = anthropic_error_body(self.status, self.message) if is_anthropic_route(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# Anthropic's `type` for each status (its error docs); other 4xx are invalid requests.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict:
    error_type = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is well-formed JSON but a value is wrong."""
    return APIError(400, message, param=param, code=code)


def not_supported(param: str, detail: str = "") -> APIError:
    """400 for a field OpenAI defines that this server does not implement (yet)."""
    message = f"'{param}' is not supported by this server" + (f": {detail}" if detail else "")
    return APIError(400, message, param=param, code="unsupported_parameter")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'.",
        param="model",
        code="model_not_found",
    )


def route_error(method: str, path: str, status: int, headers: dict | None = None) -> JSONResponse:
    """A request no route takes: 501 naming the API for an OpenAI endpoint we do not serve, 405
    naming the method, else 404 naming the route, each with the routes we do serve."""
    shown = path[:200]
    served = "; this server serves " + ", ".join(SERVED_ROUTES)
    unserved = next(
        (name for prefix, name in _UNSERVED.items() if path == prefix or path.startswith(prefix + "/")), None
    )
    if unserved is not None:
        error = APIError(501, f"{method} {shown}: pagedserve does not serve {unserved}{served}", code="not_implemented")
    elif status == 405:
        error = APIError(405, f"{method} is not allowed on {shown}{served}", code="method_not_allowed", headers=headers)
    else:
        error = APIError(404, f"Unknown route: {method} {shown}{served}", code="not_found")
    return error.response(path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through the OpenAI body (Anthropic's on its routes)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404), wrong methods (405) and the like.
        if exc.status_code in (404, 405):
            return route_error(request.method, request.url.path, exc.status_code, getattr(exc, "headers", None))
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only reached for query/path parameters: bodies are parsed by protocol.parse_body.
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, first.get("msg", "invalid request"), param=param).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response(request.url.path)
