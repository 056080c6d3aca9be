"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as delta chunks.

With tools, the reply's text is read by the tool-call parser (server/tool_parsers.py):
calls become `message.tool_calls` (streamed as `delta.tool_calls`, the name first and
the arguments in pieces) and the rest stays content.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from engine.request import TokenLogprob
from server.cpu_work import check_prompt_chars
from server.errors import invalid
from server.guided import ToolPlan, chat_messages, compile_or_400, plan_tools, structured_output
from server.protocol import ChatCompletionRequest
from server.reasoning import ReasoningStream
from server.reasoning import split as split_reasoning
from server.respond import check_succeeded, respond
from server.serving_common import (
    Choice,
    check_context,
    default_max_tokens,
    make_choices,
    new_request_id,
    parse_request,
    sampling_params,
    usage,
)
from server.serving_logprobs import LogprobFormatter
from server.streaming import sse_event
from server.tool_parsers import ToolCallStream

if TYPE_CHECKING:
    from server.serving_common import ServerState


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: list[dict] | None = None,
    max_chars: int = 0,
    max_model_len: int = 0,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Messages -> prompt token ids through the model's own chat template; a rendered text over
    `max_chars` characters (when given) is refused before it is tokenized. CPU work: call it
    through ServerState.off_loop."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("This model has no chat template; use /v1/completions with a plain prompt.", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (e.g. "roles must alternate")
        raise invalid(f"The chat template rejected these messages: {exc}", param="messages") from None
    check_prompt_chars(text, max_chars, max_model_len, "messages")
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state, engine, body = await parse_request(request, ChatCompletionRequest)
    logprobs = state.logprobs
    assert logprobs is not None  # attach()ed, as the engine is

    def view(request_id: str, tools: ToolPlan | None) -> _ChatView:
        return _ChatView(
            request_id,
            int(time.time()),
            state.response_model(body.model),
            logprobs,
            body,
            tools,
            state.reasoning_parser,
        )

    return await serve_chat(request, state, engine, body, arrival, "chatcmpl", view)


async def serve_chat(
    request: Request,
    state: ServerState,
    engine: Any,
    body: ChatCompletionRequest,
    arrival: float,
    id_prefix: str,
    make_view: Callable[[str, ToolPlan | None], Any],
) -> Response:
    """A validated chat request through the template, the grammar and the engine, rendered by
    make_view(request id, tool plan): the chat endpoint's view, or the Responses API's."""
    assert state.limits is not None  # attach()ed, as the engine is
    body.check_common(state.limits.vocab_size)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    body.check_messages()
    structured, param = structured_output(body)
    tools = plan_tools(body, state.tool_call_parser)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            raise invalid(f"'{param}' cannot be combined with a tool_choice that forces a call", param=param)
        structured, param = tools.structured, "tools"
    thinks = body.template_kwargs().get("enable_thinking") is not False  # Qwen3's switch: off, no thinking
    if structured is not None and state.reasoning_parser and thinks:  # free thinking first, then the grammar
        structured = structured.after_reasoning(state.reasoning_parser)
    await compile_or_400(engine, structured, param)
    prompt_ids = await chat_prompt_ids(state, engine, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is None:
        max_tokens = default_max_tokens(state, len(prompt_ids), "messages")
    else:
        max_tokens = requested
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        check_context(state, len(prompt_ids), max_tokens, "messages", param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    keep_special = tools is not None and tools.parser.needs_special_tokens  # the parser reads its markers
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        structured=structured,
        prompt_logprobs=body.prompt_logprobs,
        skip_special_tokens=not keep_special,
        lora_name=state.lora_name(body.model),
    )
    request_id = new_request_id(id_prefix)
    choices = make_choices(request_id, [prompt_ids], params)
    return await respond(
        request, state, choices, make_view(request_id, tools), arrival, request_id, body.user, bool(body.stream)
    )


async def chat_prompt_ids(state: ServerState, engine: Any, body: ChatCompletionRequest) -> list[int]:
    """The prompt a chat request renders to: its messages and tools through the template."""
    assert state.limits is not None  # attach()ed, as the engine is
    messages, tool_defs = chat_messages(body, engine.tokenizer)
    return await state.off_loop(
        encode_chat,
        engine.tokenizer,
        messages,
        tools=tool_defs,
        max_chars=state.max_prompt_chars,
        max_model_len=state.limits.max_model_len,
        template_kwargs=body.template_kwargs(),
    )


class _ChatView:
    """Renders choices as OpenAI chat.completion objects and chat.completion.chunk deltas."""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        logprobs: LogprobFormatter,
        body: ChatCompletionRequest,
        tools: ToolPlan | None = None,
        reasoning: str | None = None,
    ):
        self.request_id, self.created, self.model = request_id, created, model
        self.logprobs, self.body, self.tools = logprobs, body, tools
        self.reasoning = reasoning  # server/reasoning.py's parser, or None: all text is content
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its calls so far
        self._thinking: dict[int, ReasoningStream] = {}  # choice index -> its reasoning so far

    def _tool_stream(self, index: int) -> ToolCallStream | None:
        if self.tools is None:
            return None
        if index not in self._tool_streams:
            self._tool_streams[index] = ToolCallStream(self.tools.parser, self.tools.max_calls)
        return self._tool_streams[index]

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        rendered = []
        for c in choices:
            thought, text = split_reasoning(self.reasoning, c.text, True) if self.reasoning else (None, c.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = c.final_output.finish_reason
            stream = self._tool_stream(c.index)
            if stream is not None:
                content, tool_calls = stream.final(text)
                if tool_calls:
                    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            if self.reasoning:
                message["reasoning_content"] = thought or None
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.logprobs),
                "finish_reason": finish_reason,
            }
            if self.body.prompt_logprobs is not None:  # vLLM's extension, in vLLM's shape
                choice["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs or [])
            rendered.append(choice)
        return self._envelope("chat.completion", rendered, usage=usage(choices, self.body.num_choices))

    def _chunk(
        self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict[str, list] | None = None
    ) -> str:
        extra = {"usage": None} if self.body.include_usage else {}
        return sse_event(
            self._envelope(
                "chat.completion.chunk",
                [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
                **extra,
            )
        )

    async def chunks(self, events: AsyncIterator) -> AsyncIterator[str]:
        choices: dict[int, Choice] = {}
        # OpenAI's first chunk of each choice carries the role and no text.
        for index in range(self.body.num_choices):
            yield self._chunk(index, {"role": "assistant", "content": ""})
        async for choice, output in events:
            choices[choice.index] = choice
            check_succeeded(choice, output)
            logprobs = self._logprobs(output.logprobs or [])
            stream = self._tool_stream(choice.index)
            finish_reason = output.finish_reason
            new_text, text = output.text, choice.text
            if self.reasoning:
                thinking = self._thinking.setdefault(choice.index, ReasoningStream(self.reasoning))
                thought, new_text = thinking.feed(choice.text, final=output.finished)
                text = thinking.content
                if thought:
                    yield self._chunk(choice.index, {"reasoning_content": thought})
            if stream is None:
                if new_text or logprobs:
                    yield self._chunk(choice.index, {"content": new_text}, logprobs=logprobs)
            else:
                content, tool_calls = stream.feed(text, final=output.finished)
                if content or logprobs:
                    yield self._chunk(choice.index, {"content": content}, logprobs=logprobs)
                if tool_calls:
                    yield self._chunk(choice.index, {"tool_calls": tool_calls})
                if stream.ids and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if output.finished:
                yield self._chunk(choice.index, {}, finish_reason=finish_reason)
        if self.body.include_usage:
            ordered = [choices[i] for i in sorted(choices)]
            yield sse_event(self._envelope("chat.completion.chunk", [], usage=usage(ordered, self.body.num_choices)))

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, list] | None:
        if not self.body.logprobs or not logprobs:
            return None
        return self.logprobs.chat(logprobs, self.body.top_logprobs or 0)
