"""POST /v1/responses: a Responses request runs as a chat request (protocol_responses.py) and
is rendered as a `response` object, or streamed as the Responses API's typed events:

    response.created, response.in_progress
    reasoning:     response.output_item.added, response.reasoning_text.delta ...,
                   response.reasoning_text.done, response.output_item.done
    a message:     response.output_item.added, response.content_part.added,
                   response.output_text.delta ..., response.output_text.done,
                   response.content_part.done, response.output_item.done
    a tool call:   response.output_item.added, response.function_call_arguments.delta ...,
                   response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens)

Each event carries `type` and `sequence_number`, as the official client parses them. With a
reasoning parser (server/reasoning.py), the model's thinking is a `reasoning` item (its text as
`reasoning_text` content, no summary) before the message and tool calls, which are read from the
text after it; a follow-up through `previous_response_id` continues from the answer alone, as
the chat templates of reasoning models drop earlier turns' thinking.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from server.errors import APIError
from server.guided import ToolPlan
from server.protocol_responses import ResponsesRequest, ResponseStore, input_messages, parse_responses_body
from server.reasoning import CLOSE, ReasoningStream
from server.reasoning import split as split_reasoning
from server.respond import check_succeeded
from server.serving_chat import serve_chat
from server.serving_common import Choice, read_body, usage
from server.tool_parsers import ToolCallStream


async def create_response(request: Request) -> Response:
    arrival = time.monotonic()
    state = request.app.state.server
    raw = await read_body(request, state.max_body_bytes)
    engine = state.require_engine()
    body = parse_responses_body(raw)
    state.check_model(body.model)
    store: ResponseStore = state.responses
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    new = input_messages(body.input)
    chat = body.to_chat(history, new)
    conversation = history + new  # what a follow-up continues from (instructions are not carried)

    def view(request_id: str, tools: ToolPlan | None) -> _ResponsesView:
        keep = store if body.store is not False else None
        return _ResponsesView(
            request_id,
            state.response_model(body.model),
            body,
            tools,
            keep,
            conversation,
            state.reasoning_parser,
            engine.tokenizer,
        )

    try:
        return await serve_chat(request, state, engine, chat, arrival, "resp", view)
    except APIError as exc:  # the chat field's name -> this API's
        if exc.param == "max_completion_tokens":
            exc.param, exc.message = (
                "max_output_tokens",
                exc.message.replace("max_completion_tokens", "max_output_tokens"),
            )
        raise


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _ResponsesView:
    """One choice rendered as a Responses API `response`, whole or as typed events."""

    def __init__(
        self,
        request_id: str,
        model: str,
        body: ResponsesRequest,
        tools: ToolPlan | None,
        store: ResponseStore | None,
        conversation: list[dict[str, Any]],
        reasoning: str | None = None,
        tokenizer: Any = None,
    ):
        self.id, self.model, self.body, self.tools = request_id, model, body, tools
        self.store, self.conversation = store, conversation
        self.reasoning, self.tokenizer = reasoning, tokenizer  # the parser, or None: all text is the answer
        self.created_at = time.time()
        self.message_id = _item_id("msg")
        self.reasoning_id = _item_id("rs")
        self._thought = ""  # the reasoning text, once known (usage counts its tokens)
        self._sequence = 0

    # ---------------------------------------------------------------- whole
    def response(self, choices: list[Choice]) -> dict[str, Any]:
        choice = choices[0]
        thought, answer = split_reasoning(self.reasoning, choice.text, True) if self.reasoning else ("", choice.text)
        content: str | None = answer
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = ToolCallStream(self.tools.parser, self.tools.max_calls).final(answer)
        self._thought = thought
        output = [self._reasoning_item(thought, "completed")] if thought else []
        output += [self._message(content or "", "completed")] if content or not (calls or thought) else []
        output += [
            self._call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed")
            for call in calls
        ]
        return self._finished(choice, output)

    # ---------------------------------------------------------------- events
    async def chunks(self, events: AsyncIterator) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._envelope("in_progress", []))
        yield self._event("response.in_progress", response=self._envelope("in_progress", []))
        stream = ToolCallStream(self.tools.parser, self.tools.max_calls) if self.tools is not None else None
        output: list[dict[str, Any]] = []  # items opened so far, in order
        text = ""
        thinking = ReasoningStream(self.reasoning) if self.reasoning else None
        calls: dict[int, dict[str, Any]] = {}  # tool call index -> its output item
        choice = None
        async for choice, out in events:
            check_succeeded(choice, out)
            new_text, answer = out.text, choice.text
            if thinking is not None:
                thought, new_text = thinking.feed(choice.text, final=out.finished)
                answer = thinking.content
                if thought:
                    if not self._thought:
                        output.append(self._reasoning_item("", "in_progress"))
                        yield self._event(
                            "response.output_item.added",
                            output_index=len(output) - 1,
                            item=self._reasoning_item("", "in_progress"),
                        )
                    self._thought += thought
                    yield self._event(
                        "response.reasoning_text.delta",
                        item_id=self.reasoning_id,
                        output_index=self._index_of(output, self.reasoning_id),
                        content_index=0,
                        delta=thought,
                    )
            deltas: list[dict]
            if stream is None:
                content, deltas = new_text, []
            else:
                content, deltas = stream.feed(answer, final=out.finished)
                deltas = deltas or []
            if content:
                if not text and not any(item["type"] == "message" for item in output):
                    output.append(self._message("", "in_progress"))
                    yield self._event(
                        "response.output_item.added",
                        output_index=len(output) - 1,
                        item=self._message("", "in_progress", parts=False),
                    )
                    yield self._event(
                        "response.content_part.added",
                        item_id=self.message_id,
                        output_index=len(output) - 1,
                        content_index=0,
                        part=_text_part(""),
                    )
                text += content
                yield self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=self._index_of(output, self.message_id),
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            for delta in deltas:
                index = delta["index"]
                if index not in calls:
                    function = delta.get("function", {})
                    item = self._call_item(
                        delta.get("id") or _item_id("call"), function.get("name", ""), "", "in_progress"
                    )
                    calls[index] = item
                    output.append(item)
                    yield self._event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                piece = delta.get("function", {}).get("arguments") or ""
                if piece:
                    calls[index]["arguments"] += piece
                    yield self._event(
                        "response.function_call_arguments.delta",
                        item_id=calls[index]["id"],
                        output_index=self._index_of(output, calls[index]["id"]),
                        delta=piece,
                    )
        for index, item in enumerate(output):
            if item["type"] == "reasoning":
                yield self._event(
                    "response.reasoning_text.done",
                    item_id=self.reasoning_id,
                    output_index=index,
                    content_index=0,
                    text=self._thought,
                )
                output[index] = self._reasoning_item(self._thought, "completed")
            elif item["type"] == "message":
                yield self._event(
                    "response.output_text.done",
                    item_id=self.message_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
                yield self._event(
                    "response.content_part.done",
                    item_id=self.message_id,
                    output_index=index,
                    content_index=0,
                    part=_text_part(text),
                )
                output[index] = self._message(text, "completed")
            else:
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
                item["status"] = "completed"
            yield self._event("response.output_item.done", output_index=index, item=output[index])
        if choice is not None:
            if not output:
                output.append(self._message("", "completed"))
            final = self._finished(choice, output)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield self._event(kind, response=final)

    # ---------------------------------------------------------------- pieces
    def _finished(self, choice: Choice, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = choice.final is not None and choice.final.finish_reason == "length"
        counts = usage([choice], 1)
        result = self._envelope("incomplete" if incomplete else "completed", output)
        result["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        result["usage"] = {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(choice)},
            "total_tokens": counts["total_tokens"],
            "timings": counts["timings"],  # ours, as in chat usage (the X-Timing headers read it)
        }
        if self.store is not None:
            self.store.put(self.id, self.conversation + _as_messages(output))
        return result

    def _envelope(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        b = self.body
        fmt = (
            b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": {"format": fmt},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "truncation": "disabled",
            "user": b.user,
            "usage": None,
        }

    def _reasoning_tokens(self, choice: Choice) -> int:
        """How many of the output's tokens are thinking: all of them while </think> has not come,
        else those up to the first whose text reaches past it (a binary search over decoded
        prefixes: re-encoding the thinking's text would not give back the tokens sampled)."""
        if not self._thought:
            return 0
        ids, end = choice.token_ids, choice.text.find(CLOSE)
        if end < 0 or self.tokenizer is None:
            return len(ids)
        end += len(CLOSE)
        low, high = 0, len(ids)
        while low < high:
            mid = (low + high) // 2
            text = self.tokenizer.decode(
                ids[:mid], skip_special_tokens=choice.params.skip_special_tokens, clean_up_tokenization_spaces=False
            )  # as the detokenizer decodes
            if len(text) >= end:
                high = mid
            else:
                low = mid + 1
        return low

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
        }

    def _message(self, text: str, status: str, parts: bool = True) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [_text_part(text)] if parts else [],
        }

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    @staticmethod
    def _index_of(output: list[dict[str, Any]], item_id: str) -> int:
        return next(i for i, item in enumerate(output) if item["id"] == item_id)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "reasoning":
            continue  # a follow-up continues from the answer, as reasoning models' templates do
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"] if item["content"] else ""})
        else:
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages
