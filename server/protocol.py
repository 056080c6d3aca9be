"""The OpenAI wire format for requests: strict pydantic models and the body parser.

Strict on purpose: a field is either honoured exactly as OpenAI defines it
or rejected with a 400 that names it. Types are not coerced ("5" is not an
integer), unknown fields are rejected, and fields OpenAI defines that this
server does not implement get a 400 saying so rather than being ignored.
(vLLM's extensions top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, guided_json/regex/choice/grammar and structured_outputs are accepted
too; they mean what they mean in vLLM.)

Responses are plain dicts built next to their handlers (serving_*.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import JsonDict, models_json_schema

from server.errors import APIError, invalid, not_supported

_INT64 = 2**63
# The smallest top_p served: below it the nucleus is the best token alone anyway, and
# values such as 1e-300 underflow to 0 in float32.
MIN_TOP_P = 1e-8
# repetition_penalty divides positive logits and multiplies negative ones (HF / vLLM):
# 1 is off, above 1 discourages repeats, below 1 encourages them. Outside these bounds it
# only pushes logits towards 0 or infinity (1e-88 is 0 in float32).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
# A logit_bias key: a token id in ASCII decimal. Not str.isdigit(), which is true of "²"
# (int() refuses it) and of "١٢" (int() reads 12); ten digits exceed any vocabulary.
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
# Bodies nest a few levels (messages[0].content[0].text); deeper is refused, and so is
# anything json.loads itself cannot hold (recursion, integers over Python's 4,300 digits).
MAX_JSON_DEPTH = 32
# OpenAI's 4 stop sequences, each at most this many characters (text that could start one
# is held back from the stream, so a long one delays output by that much).
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 4, 1024
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
MAX_TEMPLATE_KWARGS = 16
MAX_CACHE_SALT = 256  # characters of a cache_salt
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs and prompt_logprobs (OpenAI's and vLLM's bound)
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# What the server itself gives apply_chat_template (or transformers reads from its kwargs).
_TEMPLATE_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)


# For the OpenAPI document of the fields typed Any above (their checks are hand-written).
_STOP_STRING: JsonDict = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
_TOKEN_ID: JsonDict = {"type": "integer", "minimum": 0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


# Structured output (OpenAI's response_format, vLLM's guided_* and structured_outputs).
MAX_CHOICES = 1024
_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` object: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (null = OpenAI's default)."""

    model: str
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"minimum": -100, "maximum": 100},
        },
    )
    seed: int | None = Field(None, ge=-_INT64, lt=2 * _INT64)
    # str | list[str] (up to 4); checked in stop_strings() for a clear message.
    stop: Any = Field(
        None,
        json_schema_extra={
            "anyOf": [
                {"type": "null"},
                _STOP_STRING,
                {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
            ]
        },
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool | None = None  # vLLM/SGLang: False keeps special tokens in the text
    # vLLM: prefix-cache hits only among requests with the same salt (a tenant's secret, e.g. 43
    # characters of base64 for 256 bits; a bound well above that).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    # OpenAI's metadata: stored nowhere, accepted within OpenAI's bounds (checked in check_common).
    metadata: dict[str, str] | None = None
    # vLLM: each prompt token's logprob and the top k there, on each choice (not streamed, as vLLM).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def stop_strings(self) -> tuple[str, ...]:
        stop = self.stop
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("'stop' must be a string or a list of strings", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise invalid(f"'stop' takes up to {MAX_STOP_STRINGS} sequences, got {len(stop)}", param="stop")
        if any(s == "" for s in stop):
            raise invalid("'stop' sequences must be non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise invalid(
                f"'stop' sequences must be at most {MAX_STOP_LENGTH} characters, got one of {max(map(len, stop))}",
                param="stop",
            )
        return tuple(stop)

    def check_common(self, vocab_size: int) -> None:
        """Cross-field checks pydantic cannot express; raise a 400 naming the field."""
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise invalid(
                    f"'metadata' takes at most {MAX_METADATA_PAIRS} pairs, got {len(self.metadata)}", param="metadata"
                )
            for key, value in self.metadata.items():
                if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                    raise invalid(
                        f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values at most "
                        f"{MAX_METADATA_VALUE}",
                        param=f"metadata.{key[:MAX_METADATA_KEY]}",
                    )
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        for key, bias in (self.logit_bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key) or not int(key) < vocab_size:
                raise invalid(
                    f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
                )
            if not -100 <= bias <= 100:
                raise invalid(
                    f"'logit_bias' values must be in [-100, 100], got {bias} for token {key}", param="logit_bias"
                )
        for token_id in self.stop_token_ids or ():
            if not 0 <= token_id < vocab_size:
                raise invalid(
                    f"'stop_token_ids' must be token ids in [0, {vocab_size}), got {token_id}", param="stop_token_ids"
                )

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; checked in prompts().
    prompt: Any = Field(
        json_schema_extra={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1},
            ]
        }
    )
    # OpenAI: null means the default, 16. 0 only with echo: the prompt's logprobs, nothing generated.
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None

    def check_echo(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise invalid(
                "'max_tokens' must be at least 1 unless 'echo' is true", param="max_tokens", code="invalid_value"
            )

    def prompts(self, vocab_size: int) -> list[str | list[int]]:
        """The prompts of the request, each a non-empty string or token-id list."""
        p = self.prompt
        shape_error = invalid(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
            param="prompt",
        )
        if isinstance(p, str):
            prompts: list = [p]
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            prompts = [p]
        elif (
            isinstance(p, list)
            and p
            and (
                all(isinstance(s, str) for s in p) or all(isinstance(s, list) and all(_is_int(t) for t in s) for s in p)
            )
        ):
            prompts = p
        elif isinstance(p, list) and not p:
            raise invalid("'prompt' must not be empty", param="prompt")
        else:
            raise shape_error
        for prompt in prompts:
            if len(prompt) == 0:
                raise invalid("'prompt' must not be empty", param="prompt")
            if isinstance(prompt, list):
                check_token_ids(prompt, vocab_size, "prompt")
        return prompts


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(pattern=_NAME)
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only on an assistant message with tool_calls
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = Field(None, max_length=256)  # tool only

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects, as
        Hugging Face templates expect them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(pattern=_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM/SGLang: variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, checked: a few named JSON scalars that do not replace what the
        server passes the template itself."""
        kwargs = self.chat_template_kwargs or {}
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise invalid(
                f"'chat_template_kwargs' takes at most {MAX_TEMPLATE_KWARGS} variables, got {len(kwargs)}",
                param="chat_template_kwargs",
            )
        for key, value in kwargs.items():
            param = f"chat_template_kwargs.{key[:64]}"
            if not _TEMPLATE_VARIABLE.fullmatch(key) or key in _TEMPLATE_RESERVED:
                raise invalid(
                    f"'chat_template_kwargs' keys must be template variable names other than "
                    f"{', '.join(sorted(_TEMPLATE_RESERVED))}; got {key[:64]!r}",
                    param=param,
                )
            if not (
                value is None
                or isinstance(value, (bool, int, float))
                or (isinstance(value, str) and len(value) <= MAX_STOP_LENGTH)
            ):
                raise invalid(
                    f"'chat_template_kwargs' values must be null, booleans, numbers or strings of at most "
                    f"{MAX_STOP_LENGTH} characters",
                    param=param,
                )
        return dict(kwargs)

    def check_messages(self) -> None:
        """The roles' rules for tool calls, which pydantic cannot express."""
        for i, m in enumerate(self.messages):
            if m.tool_calls is not None and m.role != "assistant":
                raise invalid(
                    f"'messages[{i}].tool_calls' is only allowed on assistant messages",
                    param=f"messages[{i}].tool_calls",
                )
            if m.role == "tool" and m.tool_call_id is None:
                raise invalid(
                    f"'messages[{i}].tool_call_id' is required on a tool message", param=f"messages[{i}].tool_call_id"
                )
            if m.role != "tool" and m.tool_call_id is not None:
                raise invalid(
                    f"'messages[{i}].tool_call_id' is only allowed on tool messages",
                    param=f"messages[{i}].tool_call_id",
                )
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise invalid(
                    f"'messages[{i}].content' is required (it may be null only on an assistant "
                    "message with tool_calls)",
                    param=f"messages[{i}].content",
                )


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # for prompt
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # for messages
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # for messages, rendered as chat would

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages or ()]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# Fields OpenAI defines that this server does not implement, with the values
# that mean "off" (OpenAI's own defaults), which are honoured exactly and so accepted.
# The fields LLM-aware routers add to every request they forward (vllm-router, SGLang's router),
# likewise: accepted with the values we honour. Without a reasoning parser the reasoning switches
# change nothing, so any boolean is honoured.
_BOOLEANS = (None, True, False)
_ROUTER_FIELDS = {
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    "separate_reasoning": _BOOLEANS,
    "stream_reasoning": _BOOLEANS,
    "include_reasoning": _BOOLEANS,
}
_UNSUPPORTED_COMPLETION = {"best_of": (None, 1), "suffix": (None,), **_ROUTER_FIELDS}
_UNSUPPORTED_CHAT = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "web_search_options": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "continue_final_message": (None, False),
    **_ROUTER_FIELDS,
}
# vllm-router's cache_aware policy tokenizes each chat request here first, with this field.
_UNSUPPORTED_TOKENIZE = {"continue_final_message": (None, False)}
_UNSUPPORTED_MESSAGE_KEYS = ("name", "function_call", "audio", "refusal")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def openapi_schemas(*more: type[BaseModel]) -> dict[str, Any]:
    """The request models (and `more`) as OpenAPI component schemas (name -> JSON schema), with their bounds."""
    _, top = models_json_schema(
        [(m, "validation") for m in (*REQUEST_MODELS, *more)], ref_template="#/components/schemas/{model}"
    )
    return top["$defs"]


def openapi_body(model_cls: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model_cls` (parse_body still validates it)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model_cls.__name__}"}}},
        }
    }


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model_cls: type[M]) -> M:
    """JSON bytes -> a validated request, or an APIError naming what is wrong."""
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object")
    _check_values(data)
    if model_cls is CompletionRequest:
        data = _reject_unsupported(data, _UNSUPPORTED_COMPLETION)
        data = _completion_tokens_alias(data)
    if model_cls is ChatCompletionRequest:
        data = _reject_unsupported(data, _UNSUPPORTED_CHAT)
    if model_cls is TokenizeRequest:
        data = _reject_unsupported(data, _UNSUPPORTED_TOKENIZE)
    if model_cls in (ChatCompletionRequest, TokenizeRequest):
        _reject_unsupported_messages(data.get("messages"))
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def _load_json(raw: bytes) -> Any:
    """json.loads, with every way it can fail on hostile input turned into a 400."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise invalid(
            f"The request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json"
        ) from None
    except ValueError as exc:  # an integer literal over sys.get_int_max_str_digits() digits
        raise invalid(f"The request body has a number too long to parse: {exc}", code="invalid_json") from None


def _reject_constant(name: str) -> None:
    raise invalid(f"The request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def _check_values(data: dict) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH, and for a string no UTF-8 can encode:
    JSON's \\uXXXX escapes can spell a lone surrogate ("\\ud800"), which json.loads
    accepts and a tokenizer then fails on. Iterative, so the depth is checked, not recursed;
    numbers (a long token-id prompt) are skipped without building their paths."""
    stack: list[tuple[Any, tuple]] = [(data, ())]  # (value, its path as keys and indices)
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise invalid(
                f"The request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json"
            )
        if isinstance(value, str):
            if not _encodes(value):
                name = _param_name(path)
                raise invalid(
                    f"Invalid value for '{name}': the string is not valid Unicode (it holds a lone surrogate)",
                    param=name,
                    code="invalid_value",
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    name = _param_name(path)
                    raise invalid(
                        f"Invalid value for '{name or 'body'}': a key is not valid Unicode (it holds a lone surrogate)",
                        param=name,
                        code="invalid_value",
                    )
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, key)))
        # A list of numbers only (a token-id prompt) is skipped at C speed.
        elif isinstance(value, list) and not _SCALAR_TYPES.issuperset(map(type, value)):
            stack.extend((item, (*path, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


_SCALAR_TYPES = frozenset((int, float, bool, type(None)))


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise invalid(f"'{param}' has token id {token_id}, outside the vocabulary [0, {vocab_size})", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unsupported(data: dict, unsupported: dict[str, tuple]) -> dict:
    """400 for an unsupported field set to anything but "off"; the "off" ones are dropped."""
    for key, allowed in unsupported.items():
        if key in data and data[key] not in allowed:
            raise not_supported(key)
    return {key: value for key, value in data.items() if key not in unsupported}


def _completion_tokens_alias(data: dict) -> dict:
    """/v1/completions: `max_completion_tokens` (what SGLang's router renames `max_tokens` to) as
    `max_tokens`; both, and different, is a 400."""
    if "max_completion_tokens" not in data:
        return data
    data = dict(data)
    value = data.pop("max_completion_tokens")
    if data.get("max_tokens") is not None and value is not None and data["max_tokens"] != value:
        raise invalid("'max_tokens' and 'max_completion_tokens' differ; send one", param="max_completion_tokens")
    if value is not None:
        data["max_tokens"] = value
    return data


def _reject_unsupported_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        return  # pydantic reports the type error
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "function":
            raise not_supported(f"messages[{i}].role", "role 'function' (deprecated; use 'tool')")
        for key in _UNSUPPORTED_MESSAGE_KEYS:
            if message.get(key) is not None:
                raise not_supported(f"messages[{i}].{key}")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise not_supported(
                        f"messages[{i}].content[{j}].type", f"content parts of type '{part.get('type')}' (only 'text')"
                    )


def _param_name(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> "messages[0].content", skipping pydantic's union tags."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            continue  # a union member's tag, e.g. 'list[TextPart]'
        else:
            name += f".{part}" if name else part
    return name or None


def _from_validation_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]
    param = _param_name(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param=param, code="unrecognized_argument")
    if kind == "missing":
        return invalid(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if kind in _JSON_TYPES:
        got = _JSON_TYPE_OF.get(type(error.get("input")), "another type")
        return invalid(
            f"Invalid type for '{param}': expected {_JSON_TYPES[kind]}, but got {got} instead.",
            param=param,
            code="invalid_type",
        )
    return invalid(f"Invalid value for '{param}': {error['msg']}", param=param, code="invalid_value")


# pydantic's error type -> OpenAI's wording of the JSON type expected and given.
_JSON_TYPES = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}
_JSON_TYPE_OF = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
    type(None): "null",
}
