"""POST /v1/completions: prompts in, text completions out (whole, or streamed as SSE)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.core import tokenize_prompt
from server.cpu_work import check_prompt_chars
from server.guided import compile_or_400, structured_output
from server.protocol import CompletionRequest
from server.respond import check_succeeded, respond
from server.serving_common import (
    Choice,
    check_context,
    make_choices,
    new_request_id,
    parse_request,
    sampling_params,
    usage,
)
from server.serving_logprobs import LogprobFormatter
from server.streaming import sse_event

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state, engine, body = await parse_request(request, CompletionRequest)
    assert state.limits is not None and state.logprobs is not None  # attach()ed, as the engine is
    vocab_size = state.limits.vocab_size
    body.check_common(vocab_size)
    body.check_echo()
    tokenizer = engine.tokenizer
    prompts = body.prompts(vocab_size)
    for p in prompts:
        if isinstance(p, str):
            check_prompt_chars(p, state.max_prompt_chars, state.limits.max_model_len, "prompt")
    prompt_ids = await state.off_loop(lambda: [tokenize_prompt(tokenizer, p) for p in prompts])
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    # Echo with max_tokens 0 (how lm-evaluation-harness scores a text): the engine samples one
    # token, as the prefill does anyway, and the response leaves it out (as vLLM does).
    max_tokens = max(max_tokens, 1)
    for ids in prompt_ids:
        check_context(state, len(ids), max_tokens, "prompt")
    structured, param = structured_output(body)
    await compile_or_400(engine, structured, param)
    # Echo with logprobs covers the prompt's tokens too: their logprobs and the same top k.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        structured=structured,
        prompt_logprobs=prompt_logprobs,
        lora_name=state.lora_name(body.model),
    )
    request_id = new_request_id("cmpl")
    choices = make_choices(request_id, prompt_ids, params)
    echo = None
    if body.echo:
        echo = await state.off_loop(lambda: [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts])
    view = _CompletionView(request_id, int(time.time()), state.response_model(body.model), state.logprobs, body, echo)

    return await respond(request, state, choices, view, arrival, request_id, body.user, bool(body.stream))


class _CompletionView:
    """Renders choices as OpenAI completion objects and chunks."""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        logprobs: LogprobFormatter,
        body: CompletionRequest,
        echo: list[str] | None,
    ):
        self.request_id, self.created, self.model = request_id, created, model
        self.logprobs, self.body, self.echo = logprobs, body, echo
        self.n = body.num_choices
        self.echo_only = bool(body.echo) and body.max_tokens == 0  # the prompt back, nothing generated
        self.text_offsets: dict[int, int] = {}  # choice index -> characters sent so far

    def _envelope(self, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _prefix(self, choice: Choice) -> str:
        return self.echo[choice.index // self.n] if self.echo else ""

    def _echoed_logprobs(self, choice: Choice) -> tuple[list[int], list] | None:
        """The prompt's part of the legacy logprobs (echo with logprobs), else None."""
        if not self.echo or choice.prompt_logprobs is None:
            return None
        return choice.prompt_token_ids, choice.prompt_logprobs

    def _logprobs(self, choice: Choice, generated: list, offset: int, first: bool) -> dict[str, list] | None:
        if self.body.logprobs is None:
            return None
        prompt = self._echoed_logprobs(choice) if first else None
        return self.logprobs.completion([] if self.echo_only else generated, 0 if prompt else offset, prompt)

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        if self.echo_only:
            choices = [replace(c, text_parts=[], token_ids=[], logprobs=[]) for c in choices]
        rendered = []
        for c in choices:
            prefix = self._prefix(c)
            choice = {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": self._logprobs(c, c.logprobs, len(prefix), True),
                "finish_reason": c.final_output.finish_reason,
            }
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs or [])
            rendered.append(choice)
        return self._envelope(rendered, usage=usage(choices, self.n))

    async def chunks(self, events: AsyncIterator) -> AsyncIterator[str]:
        extra = {"usage": None} if self.body.include_usage else {}
        choices: dict[int, Choice] = {}
        async for choice, output in events:
            choices[choice.index] = choice
            check_succeeded(choice, output)
            text = "" if self.echo_only else output.text
            first = choice.index not in self.text_offsets
            if first:
                text = self._prefix(choice) + text
                self.text_offsets[choice.index] = 0
            logprobs = self._logprobs(choice, output.logprobs or [], self.text_offsets[choice.index], first)
            self.text_offsets[choice.index] += len(text)
            if text or output.finished or logprobs:
                yield sse_event(
                    self._envelope(
                        [
                            {
                                "index": choice.index,
                                "text": text,
                                "logprobs": logprobs,
                                "finish_reason": output.finish_reason,
                            }
                        ],
                        **extra,
                    )
                )
        if self.body.include_usage:
            ordered = [choices[i] for i in sorted(choices)]
            if self.echo_only:
                ordered = [replace(c, text_parts=[], token_ids=[], logprobs=[]) for c in ordered]
            yield sse_event(self._envelope([], usage=usage(ordered, self.n)))
