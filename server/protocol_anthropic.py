"""POST /v1/messages, Anthropic's Messages API, as a chat request.

A Messages request maps onto the chat endpoint's machinery field by field, so the template,
sampling, the grammar of forced tool calls and the reasoning parser are the chat endpoint's own:

    system (a string or text blocks)           -> a system message first
    messages: text blocks                      -> the turn's text parts
              tool_use blocks (assistant)      -> tool_calls, `input` as the JSON arguments
              tool_result blocks (user)        -> tool messages, before the turn's text
              thinking, redacted_thinking      -> dropped, as the chat templates drop earlier thinking
    max_tokens, temperature, top_p, top_k, stop_sequences, metadata.user_id
                                               -> max_tokens, ..., stop, user
    tools (input_schema)                       -> function tools (parameters)
    tool_choice auto / any / tool / none       -> auto / required / the named function / none;
                disable_parallel_tool_use      -> parallel_tool_calls false
    thinking enabled / disabled                -> chat_template_kwargs enable_thinking true / false

What it cannot honour (image and document blocks, server tools, a final assistant turn to
continue) is a 400 naming the field. cache_control marks are accepted and change nothing: the
prefix cache reuses every prompt's prefix without being asked.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from server.errors import APIError, invalid, not_supported
from server.protocol import (
    _NAME,
    MAX_CACHE_SALT,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MIN_TOP_P,
    ChatCompletionRequest,
    _check_values,
    _from_validation_error,
    _load_json,
    _Strict,
)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(None, max_length=0)  # only documents cite, and they are refused


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who made the call: the client's record, not ours to act on
    toolset_name: str | None = Field(None, max_length=256)


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(block.text for block in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
_READS_TEXT_ONLY = "this server's models read text only"


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # the blocks are checked one by one (chat_turns)


class ToolDefinition(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # Hints for Anthropic's own serving, honoured trivially here: every call's input streams as it
    # is written, calls are direct, and `strict` input is what tool_choice any / tool enforce.
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: Literal[False] | None = None  # deferred tools need Anthropic's tool search
    allowed_callers: list[Literal["direct"]] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=_NAME)
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    # enabled / disabled switch the template's thinking on / off; adaptive and between_tools
    # leave it as the model's template has it (the model decides)
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; changes nothing here
    format: JsonOutputFormat | None = None  # the answer as JSON matching the schema (the chat's grammar)


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class MessagesInput(_Strict):
    """What renders the prompt: the body of /v1/messages/count_tokens."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that computes this one (its prompt is the same)."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else [_part(b.text) for b in self.system]
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            messages += chat_turns(message, f"messages[{i}]")
        if self.messages[-1].role == "assistant":
            last = f"messages[{len(self.messages) - 1}]"
            raise not_supported(f"{last}.role", "a final assistant turn to continue (prefill); end with a user turn")
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.sampling_fields()}
        if self.tools:
            body["tools"] = [chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and choice.name is None:
                raise invalid(
                    "'tool_choice.name' is required when 'tool_choice.type' is 'tool'", param="tool_choice.name"
                )
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": choice.name},
            }
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            enabled = self.thinking.type == "enabled"
            if enabled and self.thinking.budget_tokens is None:
                raise invalid(
                    "'thinking.budget_tokens' is required when thinking is enabled", param="thinking.budget_tokens"
                )
            body["chat_template_kwargs"] = {"enable_thinking": enabled}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _from_validation_error(exc) from None

    def sampling_fields(self) -> dict[str, Any]:
        return {"max_tokens": 1}  # counting renders the prompt only


_StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[_StopSequence] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)  # vLLM's, as on chat
    output_config: OutputConfig | None = None
    # Accepted and change nothing here: caching is automatic, there is one speed, one place,
    # and no account to tell apart.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = Field(None, max_length=64)
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = Field(None, max_length=256)
    workspace_id: str | None = Field(None, max_length=256)

    def sampling_fields(self) -> dict[str, Any]:
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= self.max_tokens:
            raise invalid(
                f"'thinking.budget_tokens' ({thinking.budget_tokens}) must be less than 'max_tokens' "
                f"({self.max_tokens})",
                param="thinking.budget_tokens",
            )
        fields: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "stream": bool(self.stream),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "cache_salt": self.cache_salt,
            "user": self.metadata.user_id if self.metadata else None,
        }
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": self.output_config.format.schema_},
            }
        return {key: value for key, value in fields.items() if value is not None}


def _part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def chat_turns(message: InputMessage, param: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages
    (first, as they answer the calls before them), an assistant turn's tool_use blocks its calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if not message.content:
        raise invalid(f"'{param}.content' must not be empty", param=f"{param}.content")
    parts, calls, results = [], [], []
    for j, raw in enumerate(message.content):
        block = content_block(raw, f"{param}.content[{j}]")
        if isinstance(block, TextBlock):
            parts.append(_part(block.text))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise invalid(
                    f"'{param}.content[{j}]': tool_use blocks belong to assistant turns", param=f"{param}.content[{j}]"
                )
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
                }
            )
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise invalid(
                    f"'{param}.content[{j}]': tool_result blocks belong to user turns", param=f"{param}.content[{j}]"
                )
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        # thinking and redacted_thinking: dropped (earlier turns' thinking, passed back)
    if message.role == "assistant":
        turn = {"role": "assistant", "content": parts or (None if calls else "")}
        return [{**turn, "tool_calls": calls} if calls else turn]
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def content_block(raw: dict[str, Any], param: str) -> BaseModel:
    kind = raw.get("type")
    if kind in ("image", "document"):
        raise not_supported(f"{param}.type", f"{kind} blocks ({_READS_TEXT_ONLY})")
    if kind == "tool_result" and isinstance(raw.get("content"), list):
        for k, part in enumerate(raw["content"]):
            if isinstance(part, dict) and part.get("type") != "text":
                kind_k = str(part.get("type"))[:40]
                raise not_supported(
                    f"{param}.content[{k}].type", f"tool results of type {kind_k!r} ({_READS_TEXT_ONLY})"
                )
    model_cls = _BLOCKS.get(kind) if isinstance(kind, str) else None
    if model_cls is None:
        raise not_supported(f"{param}.type", f"content blocks of type {str(kind)[:40]!r}")
    return _validate(model_cls, raw, param)


def chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    param = f"tools[{index}]"
    if tool.get("type") not in (None, "custom"):
        raise not_supported(
            f"{param}.type",
            f"server tools such as {str(tool.get('type'))[:40]!r} (only custom tools with an input_schema)",
        )
    definition = _validate(ToolDefinition, tool, param)
    function = {"name": definition.name, "parameters": definition.input_schema}
    if definition.description is not None:
        function["description"] = definition.description
    return {"type": "function", "function": function}


def _validate(model_cls: type[BaseModel], data: dict[str, Any], param: str) -> Any:
    """model_cls.model_validate(data), its error naming the field under `param`."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        error = _from_validation_error(exc)
        inner = error.param
        full = f"{param}.{inner}" if inner else param
        message = error.message.replace(f"'{inner}'", f"'{full}'") if inner else error.message
        raise APIError(400, message, param=full, code=error.code) from None


M = TypeVar("M", bound="MessagesInput")


def parse_messages_body(raw: bytes, model_cls: type[M]) -> M:
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object")
    _check_values(data)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
