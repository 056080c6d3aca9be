"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as delta chunks."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request import TokenLogprob
from server.errors import APIError, error_body, invalid
from server.protocol import ChatCompletionRequest, parse_body
from server.serving_common import (Choice, ServerState, check_context, default_max_tokens, log_request,
                                   make_choices, new_request_id, read_body, sampling_params, stream_choices,
                                   timing_headers, usage)
from server.serving_logprobs import LogprobFormatter
from server.streaming import (SSE_DONE, ClientDisconnected, disconnected_response, run_unless_disconnected,
                              sse_event, sse_response)

logger = logging.getLogger("pagedserve.server")


def encode_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt token ids through the model's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("This model has no chat template; use /v1/completions with a plain prompt.", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (e.g. "roles must alternate")
        raise invalid(f"The chat template rejected these messages: {exc}", param="messages") from None
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.max_body_bytes)
    engine = state.require_engine()
    body: ChatCompletionRequest = parse_body(raw, ChatCompletionRequest)
    state.check_model(body.model)
    body.check_common(engine.model_config.vocab_size)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    prompt_ids = encode_chat(engine.tokenizer, body.template_messages())
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is None:
        max_tokens = default_max_tokens(state, len(prompt_ids), "messages")
    else:
        max_tokens = requested
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        check_context(state, len(prompt_ids), max_tokens, "messages", param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)
    request_id = new_request_id("chatcmpl")
    choices = make_choices(request_id, [prompt_ids], params)
    view = _ChatView(request_id, int(time.time()), state.served_model_name, state.logprobs, body)

    log_request(request_id, choices, body.user, bool(body.stream))
    events = stream_choices(state, choices, arrival)
    await anext(events)  # admitted and accepted by the engine, or an APIError (429, 400)
    if body.stream:
        return sse_response(view.sse(events, len(choices)), headers={"X-Request-Id": request_id})
    try:
        await run_unless_disconnected(request, _drain(events))
    except ClientDisconnected:
        return disconnected_response()
    failed = next((c.final for c in choices if c.final.finish_reason not in ("stop", "length")), None)
    if failed is not None:
        raise APIError(500, f"The request failed in the engine: {failed.error or failed.finish_reason}",
                       code="engine_error")
    result = view.response(choices)
    headers = {"X-Request-Id": request_id, **timing_headers(result["usage"]["timings"])}
    return JSONResponse(result, headers=headers)


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


class _ChatView:
    """Renders choices as OpenAI chat.completion objects and chat.completion.chunk deltas."""

    def __init__(self, request_id: str, created: int, model: str, logprobs: LogprobFormatter,
                 body: ChatCompletionRequest):
        self.request_id, self.created, self.model = request_id, created, model
        self.logprobs, self.body = logprobs, body

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        rendered = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": self._logprobs(c.logprobs), "finish_reason": c.final.finish_reason}
                    for c in choices]
        return self._envelope("chat.completion", rendered, usage=usage(choices, self.body.num_choices))

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
        extra = {"usage": None} if self.body.include_usage else {}
        return sse_event(self._envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}], **extra))

    async def sse(self, events: AsyncIterator, num_choices: int) -> AsyncIterator[str]:
        choices: dict[int, Choice] = {}
        try:
            # OpenAI's first chunk of each choice carries the role and no text.
            for index in range(num_choices):
                yield self._chunk(index, {"role": "assistant", "content": ""})
            async for choice, output in events:
                choices[choice.index] = choice
                if output.finished and output.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"request {choice.request_id} failed: {output.error or output.finish_reason}")
                logprobs = self._logprobs(output.logprobs or [])
                if output.text or logprobs:
                    yield self._chunk(choice.index, {"content": output.text}, logprobs=logprobs)
                if output.finished:
                    yield self._chunk(choice.index, {}, finish_reason=output.finish_reason)
            if self.body.include_usage:
                ordered = [choices[i] for i in sorted(choices)]
                yield sse_event(self._envelope("chat.completion.chunk", [],
                                               usage=usage(ordered, self.body.num_choices)))
        except Exception as exc:  # noqa: BLE001 - the stream has started: report it in-band
            logger.warning("chat stream %s failed: %s", self.request_id, exc)
            status = exc.status if isinstance(exc, APIError) else 500
            yield sse_event(error_body(status, str(exc), code="engine_error" if status == 500 else None))
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
        yield SSE_DONE

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, list] | None:
        if not self.body.logprobs or not logprobs:
            return None
        return self.logprobs.chat(logprobs, self.body.top_logprobs or 0)
