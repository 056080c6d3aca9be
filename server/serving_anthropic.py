"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages request runs as a chat request (protocol_anthropic.py) and is rendered as a
`message`, or streamed as the events the `anthropic` SDK parses:

    message_start, ping
    per block:  content_block_start, content_block_delta ..., content_block_stop
                (thinking: thinking_delta; text: text_delta; tool_use: input_json_delta)
    message_delta (stop_reason, stop_sequence, usage), message_stop
    a failure once streaming:  error

Blocks come in the order the model writes them: thinking first (the reasoning parser), then
text and tool calls (the tool-call parser). `usage.input_tokens` counts the prompt tokens the
prefix cache did not serve, `cache_read_input_tokens` those it did, as Anthropic counts them:
their sum is what count_tokens returns. Errors on these routes are in Anthropic's shape
(server/errors.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request import RequestOutput
from server.errors import APIError, anthropic_error_body
from server.guided import ToolPlan, plan_tools
from server.protocol_anthropic import MessagesInput, MessagesRequest, parse_messages_body
from server.reasoning import ReasoningStream
from server.reasoning import split as split_reasoning
from server.respond import check_succeeded
from server.serving_common import ServerState
from server.serving_chat import chat_prompt_ids, serve_chat
from server.serving_common import Choice, read_body, usage
from server.tool_parsers import ToolCallStream

_PARSE_OFF_LOOP_BYTES = 64 * 1024  # coding agents send their whole conversation each turn
# The chat fields errors name -> this API's.
_PARAMS = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "max_completion_tokens": "max_tokens",
    "chat_template_kwargs.enable_thinking": "thinking",
    "response_format": "output_config.format",
    "response_format.json_schema": "output_config.format",
}


M = TypeVar("M", bound=MessagesInput)


async def _parse(request: Request, model_cls: type[M]) -> tuple[ServerState, Any, M]:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.max_body_bytes)
    engine = state.require_engine()
    if len(raw) > _PARSE_OFF_LOOP_BYTES:
        body = await state.off_loop(parse_messages_body, raw, model_cls)
    else:
        body = parse_messages_body(raw, model_cls)
    state.check_model(body.model)
    return state, engine, body


async def create_message(request: Request) -> Response:
    arrival = time.monotonic()
    state, engine, body = await _parse(request, MessagesRequest)

    def view(request_id: str, tools: ToolPlan | None) -> _MessagesView:
        return _MessagesView(request_id, state.response_model(body.model), body, tools, state.reasoning_parser)

    try:
        return await serve_chat(request, state, engine, body.to_chat(), arrival, "msg", view)
    except APIError as exc:
        raise _renamed(exc) from None


async def count_tokens(request: Request) -> Response:
    """The prompt's length as /v1/messages renders it (template, tools, thinking switch)."""
    state, engine, body = await _parse(request, MessagesInput)
    try:
        chat = body.to_chat()
        chat.check_messages()
        plan_tools(chat, state.tool_call_parser)  # the same checks of tools and tool_choice
        prompt_ids = await chat_prompt_ids(state, engine, chat)
    except APIError as exc:
        raise _renamed(exc) from None
    return JSONResponse({"input_tokens": len(prompt_ids)})


def _renamed(exc: APIError) -> APIError:
    name = _PARAMS.get(exc.param or "")
    if name is not None:
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{name}'")
        exc.param = name
    return exc


def _sse(kind: str, **fields: Any) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _MessagesView:
    """One choice rendered as an Anthropic `message`, whole or as stream events."""

    end_event = ""  # Anthropic's stream ends with message_stop: no [DONE]

    def __init__(
        self, request_id: str, model: str, body: MessagesRequest, tools: ToolPlan | None, reasoning: str | None
    ):
        self.id = request_id.replace("msg-", "msg_", 1)
        self.model, self.body, self.tools, self.reasoning = model, body, tools, reasoning

    # ---------------------------------------------------------------- whole
    def response(self, choices: list[Choice]) -> dict[str, Any]:
        choice = choices[0]
        thought, answer = split_reasoning(self.reasoning, choice.text, True) if self.reasoning else ("", choice.text)
        text: str | None = answer
        calls: list[dict] = []
        if self.tools is not None:
            text, calls = ToolCallStream(self.tools.parser, self.tools.max_calls).final(answer)
        content = [_thinking_block(thought)] if thought else []
        if text or not (thought or calls):
            content.append(_text_block(text or ""))
        content += [_tool_block(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        stop_reason, stop_sequence = self._stop(choice.final_output, bool(calls))
        return {**self._message(content, stop_reason, stop_sequence), "usage": self._usage(choice)}

    # ---------------------------------------------------------------- events
    async def chunks(self, events: AsyncIterator) -> AsyncIterator[str]:
        thinking = ReasoningStream(self.reasoning) if self.reasoning else None
        calls = ToolCallStream(self.tools.parser, self.tools.max_calls) if self.tools is not None else None
        blocks = _Blocks()
        choice = None
        async for choice, out in events:
            check_succeeded(choice, out)
            if not blocks.started:
                blocks.started = True
                start = self._message([], None, None)
                start["usage"] = self._usage(choice, out.num_cached_tokens, num_output_tokens=0)
                yield _sse("message_start", message=start)
                yield _sse("ping")
            new_text, answer = out.text, choice.text
            if thinking is not None:
                thought, new_text = thinking.feed(choice.text, final=out.finished)
                answer = thinking.content
                if thought:
                    for event in blocks.open(("thinking",), _thinking_block("")):
                        yield event
                    yield blocks.delta({"type": "thinking_delta", "thinking": thought})
            text, deltas = (new_text, []) if calls is None else calls.feed(answer, final=out.finished)
            if text:
                for event in blocks.open(("text",), _text_block("")):
                    yield event
                yield blocks.delta({"type": "text_delta", "text": text})
            for delta in deltas:
                function = delta.get("function", {})
                if "id" in delta:
                    block = _tool_block(delta["id"], function["name"], {})
                    for event in blocks.open(("tool_use", delta["index"]), block):
                        yield event
                if function.get("arguments"):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        for event in blocks.close():
            yield event
        if choice is not None:
            stop_reason, stop_sequence = self._stop(choice.final, bool(calls and calls.ids))
            yield _sse(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=self._usage(choice),
            )
        yield _sse("message_stop")

    @staticmethod
    def error_event(exc: Exception) -> str:
        status, message = (exc.status, exc.message) if isinstance(exc, APIError) else (500, str(exc))
        return _sse("error", error=anthropic_error_body(status, message)["error"])

    # ---------------------------------------------------------------- pieces
    def _message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
        }

    def _stop(self, final: RequestOutput, called: bool) -> tuple[str, str | None]:
        """Anthropic's stop_reason (and the stop sequence met) for a finished choice."""
        if final.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(final.stop_reason, str) and final.stop_reason in (self.body.stop_sequences or ()):
            return "stop_sequence", final.stop_reason
        return "end_turn", None

    @staticmethod
    def _usage(choice: Choice, num_cached: int | None = None, num_output_tokens: int | None = None) -> dict[str, Any]:
        counts = usage([choice], 1) if choice.final is not None else None
        cached = counts["prompt_tokens_details"]["cached_tokens"] if counts else (num_cached or 0)
        result = {
            "input_tokens": len(choice.prompt_token_ids) - cached,
            "output_tokens": len(choice.token_ids) if num_output_tokens is None else num_output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        if counts is not None:
            result["timings"] = counts["timings"]  # ours, as in chat usage (the X-Timing headers read it)
        return result


class _Blocks:
    """The stream's content blocks: one open at a time, numbered in order; a new kind of output
    (thinking, text, the next tool call) closes the open block and starts the next."""

    def __init__(self) -> None:
        self.index = -1
        self.started = False  # message_start sent
        self._open: tuple | None = None

    def open(self, key: tuple, block: dict[str, Any]) -> list[str]:
        if key == self._open:
            return []
        events = self.close()
        self.index += 1
        self._open = key
        return events + [_sse("content_block_start", index=self.index, content_block=block)]

    def delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_sse("content_block_stop", index=self.index)]


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id.replace("call_", "toolu_", 1), "name": name, "input": arguments}
