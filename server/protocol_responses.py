"""POST /v1/responses, OpenAI's Responses API, as a chat request.

A Responses request maps onto the chat endpoint's machinery field by field, so the template,
sampling, structured output and tool calls are the chat endpoint's own:

    input (a string, or message / function_call / function_call_output items)   -> messages
                                         (reasoning items passed back are dropped, as templates do)
    instructions                         -> a system message first (not carried to a follow-up)
    previous_response_id                 -> that response's messages and output first (ResponseStore)
    max_output_tokens                    -> max_completion_tokens
    text.format (text / json_object / json_schema)  -> response_format
    tools (flat function tools), tool_choice        -> chat tools, tool_choice

What it cannot honour (built-in tools, background mode, reasoning effort, `include`) is a 400
naming the field.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any, Literal

from pydantic import Field

from server.errors import invalid, not_supported
from server.protocol import (
    MAX_CACHE_SALT,
    MAX_TOOLS,
    ChatCompletionRequest,
    _from_validation_error,
    _load_json,
    _check_values,
    _Strict,
)
from pydantic import ValidationError

MAX_INPUT_ITEMS = 1024
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only value a non-reasoning model honours


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Strict):
    model: str
    input: Any  # str | list of items; checked in chat_messages()
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=1e-8, le=1)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = Field(None, max_length=0)
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)  # vLLM's, as on chat

    def to_chat(self, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that computes this response: `history` (a stored conversation), then
        `new` (this request's input as messages, `input_messages`)."""
        if self.reasoning:
            raise not_supported("reasoning", "reasoning effort (this server's models do not take it)")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + new
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        for key, value in (
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("user", self.user),
            ("metadata", self.metadata),
            ("cache_salt", self.cache_salt),
        ):
            if value is not None:
                body[key] = value
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            fmt = self.text.format
            if fmt.type == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                schema = {
                    "name": fmt.name or "response",
                    "schema": fmt.schema_,
                    "strict": fmt.strict,
                    "description": fmt.description,
                }
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {k: v for k, v in schema.items() if v is not None},
                }
        if self.tools:
            body["tools"] = [chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _from_validation_error(exc) from None


def parse_responses_body(raw: bytes) -> ResponsesRequest:
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object")
    _check_values(data)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise not_supported(f"tools[{index}].type", f"tools of type {str(tool.get('type'))[:40]!r} (only 'function')")
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as exc:
        raise invalid(
            f"Invalid value for 'tools[{index}]': {exc.errors(include_url=False)[0]['msg']}", param=f"tools[{index}]"
        ) from None
    return {"type": "function", "function": function.model_dump(exclude={"type"}, exclude_none=True)}


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(
        "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses `input` -> chat messages: consecutive function calls become one assistant turn
    with tool_calls, their outputs tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty array of input items", param="input")
    if len(items) > MAX_INPUT_ITEMS:
        raise invalid(f"'input' takes at most {MAX_INPUT_ITEMS} items, got {len(items)}", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role", ""))
            if role is None:
                raise invalid(f"'{param}.role' must be one of {', '.join(_ROLES)}", param=f"{param}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), param)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking, passed back: the templates drop it, and so do we
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
        else:
            raise not_supported(f"{param}.type", f"input items of type {str(kind)[:40]!r}")
    return messages


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"'{param}.{key}' must be a string", param=f"{param}.{key}")
    return value


def _text_of(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{param}.content' must be a string or an array of text parts", param=f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise not_supported(f"{param}.content[{j}].type", f"content parts of type {str(kind)[:40]!r} (only text)")
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{param}.content[{j}].text' must be a string", param=f"{param}.content[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


class ResponseStore:
    """Finished responses kept for `previous_response_id`: the conversation each one ends (its
    messages and its output as chat messages), the most recent `capacity` only, in memory."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = conversation
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        with self._lock:
            conversation = self._items.get(response_id)
        if conversation is None:
            raise invalid(
                f"Previous response with id '{response_id[:128]}' not found (this server keeps the last "
                f"{self.capacity} stored responses, in memory)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return copy.deepcopy(conversation)
