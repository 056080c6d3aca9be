"""What completions and chat share: server state, admission, request -> engine -> choices.

One HTTP request becomes several engine requests ("choices"): n samples of
each prompt, with ids `<http id>-<index>` and choice index
`prompt_index * n + sample_index` (as OpenAI and vLLM number them).

    HTTP request ─► validate, tokenize ─► stream_choices(): admit (429 if full)
                                            ├─ pump(choice 0) ─┐
                                            ├─ pump(choice 1) ─┼─► one queue ─► (choice, output)
                                            └─ ...            ─┘
Leaving `stream_choices` early (client gone, error, cancel) aborts every
engine request that has not finished, so its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel

from engine.config import EngineLimits
from engine.lora import LoRANotFoundError
from engine.request import QueueFullError, RequestOutput, SamplingParams, TokenLogprob
from engine.structured import StructuredOutput
from server.cpu_work import new_cpu_pool, off_loop, prompt_char_limit
from server.errors import APIError, invalid, model_not_found
from server.protocol import parse_body
from server.protocol_responses import ResponseStore
from server.metrics import ServerMetrics
from server.serving_logprobs import LogprobFormatter
from server.reasoning import parser_for_template as reasoning_for_template
from server.tool_parsers import parser_for_template

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger("pagedserve.server")
_END = object()  # a pump's last item: its engine stream is over
_SHUTDOWN = object()  # put in every open stream's queue when the shutdown grace runs out
_SEED_LIMIT = 2**64
# Bodies larger than this are parsed in the CPU worker thread: parsing megabytes of JSON on
# the event loop would stall every stream.
_PARSE_OFF_LOOP_BYTES = 64 * 1024


@dataclass
class ServerState:
    """Everything a route needs, on app.state.server; `engine` is None while the model loads."""

    served_model_name: str  # what responses carry
    metrics: ServerMetrics
    max_body_bytes: int
    api_key: str | None = None
    model_aliases: tuple[str, ...] = ()  # other names a request may give
    lora_names: tuple[str, ...] = ()  # the engine's LoRA adapters: a request names one as its model
    lora_runtime_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    lora_root: str | None = None  # adapters are read from under this directory only (server/serving_lora.py)
    engine: Any = None
    load_error: str | None = None
    # Filled by attach() from the engine:
    limits: EngineLimits | None = None  # what a request must fit, and how many are admitted at once
    num_in_flight: int = 0  # engine requests admitted (running + queued)
    logprobs: LogprobFormatter | None = None
    max_prompt_chars: int = 0  # a longer text certainly exceeds max_model_len tokens (cpu_work)
    tool_call_parser: str = "auto"  # resolved from the chat template by attach()
    reasoning_parser: str | None = "auto"  # server/reasoning.py's, resolved by attach(); None: no split
    # Parsing, chat templates and tokenization run here, never on the event loop.
    cpu_pool: ThreadPoolExecutor = field(default_factory=new_cpu_pool)
    shutting_down: bool = False  # end_streams() was called: new requests get 503
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    open_streams: set[asyncio.Queue] = field(default_factory=set)  # of the requests in stream_choices

    def attach(self, engine: Any) -> None:
        self.limits = engine.limits
        self.max_prompt_chars = prompt_char_limit(engine.tokenizer, engine.limits.max_model_len)
        self.logprobs = LogprobFormatter(engine.tokenizer)
        if self.tool_call_parser == "auto":
            self.tool_call_parser = parser_for_template(getattr(engine.tokenizer, "chat_template", None))
        logger.info("tool calls are read with the %s parser", self.tool_call_parser)
        if self.reasoning_parser == "auto":
            self.reasoning_parser = reasoning_for_template(getattr(engine.tokenizer, "chat_template", None))
        if self.reasoning_parser in (None, "none"):
            self.reasoning_parser = None
        else:
            logger.info("reasoning is returned apart, read with the %s parser", self.reasoning_parser)
        config = getattr(engine, "config", None)
        self.lora_names = tuple(name for name, _ in getattr(config, "lora_modules", ()))
        self.metrics.watch_engine(engine.stats, self.served_model_name, getattr(config, "enable_prefix_caching", True))
        self.engine = engine

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the CPU worker thread: tokenizing must not stall the streams."""
        return await off_loop(self.cpu_pool, fn, *args, **kwargs)

    def end_streams(self) -> None:
        """End every request in flight with a 503 (an error event and [DONE] on a stream), and
        refuse new ones: called just before the server's shutdown grace runs out, so that no
        client sees its connection cut without a final event."""
        self.shutting_down = True
        for queue in self.open_streams:
            queue.put_nowait((None, _SHUTDOWN))

    def require_engine(self) -> Any:
        if self.engine is None:
            raise APIError(
                503, "The model is still loading; retry shortly.", code="model_loading", headers={"Retry-After": "5"}
            )
        return self.engine

    def check_model(self, model: str | None) -> None:
        if (
            model is not None
            and model != self.served_model_name
            and model not in self.model_aliases
            and model not in self.lora_names
        ):
            raise model_not_found(model, self.served_model_name)

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (vLLM's way of picking one); None: the base."""
        return model if model in self.lora_names else None

    def response_model(self, model: str | None) -> str:
        """What a response's `model` says: the adapter a request named, else the served name."""
        return model if model is not None and model in self.lora_names else self.served_model_name

    def admit(self, num_requests: int) -> None:
        """Reserve room for `num_requests` engine requests, or refuse with 429 (400 if they never fit).

        The engine refuses beyond the same bound (QueueFullError), which a client would
        only hear inside a 200 stream; it never comes first, as every request the engine
        holds is counted here until its stream has ended."""
        assert self.limits is not None  # attach()ed: the engine is loaded
        limit = self.limits.max_in_flight
        if limit is not None:
            if num_requests > limit:
                raise invalid(
                    f"this request needs {num_requests} sequences (prompts x n) but the server "
                    f"holds at most {limit} at once",
                    param="n",
                )
            if self.num_in_flight + num_requests > limit:
                self.metrics.requests_rejected.labels(reason="queue_full").inc()
                raise APIError(
                    429,
                    f"The server is at capacity ({self.num_in_flight} requests in flight); retry shortly.",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
        if self.shutting_down:
            raise _shutdown_error()
        self.num_in_flight += num_requests


@dataclass
class Choice:
    """One engine request and what it has produced so far."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs
    final: RequestOutput | None = None  # the last output, once finished
    num_outputs: int = 0

    @property
    def final_output(self) -> RequestOutput:
        """`final`, read once the choice has finished."""
        assert self.final is not None, f"choice {self.index} has not finished"
        return self.final

    def add(self, output: RequestOutput) -> None:
        self.num_outputs += 1
        self.text_parts.append(output.text)
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or ())
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.final = output

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_choices(request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[Choice]:
    """n = len(params) samples per prompt."""
    n = len(params)
    return [
        Choice(index=p * n + i, request_id=f"{request_id}-{p * n + i}", prompt_token_ids=ids, params=params[i])
        for p, ids in enumerate(prompts)
        for i in range(n)
    ]


def log_request(request_id: str, choices: list[Choice], user: str | None, stream: bool) -> None:
    """One line per request; OpenAI's `user` is there for tracing abuse, so it goes in the log."""
    logger.info(
        "%s: %d choice(s), %d prompt tokens, max_tokens %d, stream %s, user %r",
        request_id,
        len(choices),
        len(choices[0].prompt_token_ids),
        choices[0].params.max_tokens,
        stream,
        user,
    )


def sampling_params(
    body: Any,
    *,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredOutput | None = None,
    skip_special_tokens: bool = True,
    prompt_logprobs: int | None = None,
    lora_name: str | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per sample (n of them): a seeded request seeds sample i with seed + i,
    so the n samples differ and the whole response is still reproducible."""
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({body.min_tokens}) must not exceed the maximum number of tokens ({max_tokens})",
            param="min_tokens",
        )
    common = dict(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias={int(k): float(v) for k, v in (body.logit_bias or {}).items()},
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens or 0,
        structured=structured,
        skip_special_tokens=skip_special_tokens and body.skip_special_tokens is not False,
        cache_salt=body.cache_salt,
        lora_name=lora_name,
    )
    seeds = [None] * body.num_choices
    if body.seed is not None:
        seeds = [(body.seed + i) if body.seed + i < _SEED_LIMIT else body.seed - i for i in range(body.num_choices)]
    try:
        return [SamplingParams(seed=seed, **common) for seed in seeds]
    except ValueError as exc:  # the pydantic models check ranges first; this is a backstop
        raise invalid(str(exc)) from None


def check_context(
    state: ServerState, num_prompt_tokens: int, max_tokens: int, param: str, max_tokens_param: str = "max_tokens"
) -> None:
    """400 for a request longer than the context or than the whole KV cache (the engine's
    limits), before the engine sees it: the one check of the server."""
    limits = state.limits
    assert limits is not None  # attach()ed: the engine is loaded
    total = num_prompt_tokens + max_tokens
    longest = limits.max_request_tokens - 1  # with a one-token prompt
    if max_tokens > longest:
        raise invalid(
            f"{max_tokens_param} is too large: {max_tokens}. This model supports at most {longest} completion tokens.",
            param=max_tokens_param,
            code="invalid_value",
        )
    if total > limits.max_model_len:
        raise invalid(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the {param}, {max_tokens} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    if total > limits.num_kv_cache_tokens:
        raise invalid(
            f"This request needs {total} tokens of KV cache ({num_prompt_tokens} in the {param}, {max_tokens} "
            f"in the completion) but the server's whole cache holds {limits.num_kv_cache_tokens}. "
            f"Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )


def default_max_tokens(state: ServerState, num_prompt_tokens: int, param: str) -> int:
    """OpenAI chat's default: as many tokens as fit after the prompt (in the context and the cache)."""
    assert state.limits is not None  # attach()ed: the engine is loaded
    room = state.limits.max_request_tokens - num_prompt_tokens
    if room < 1:
        check_context(state, num_prompt_tokens, 1, param)
    return room


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is {declared} bytes; the limit is {limit}.", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body exceeds the limit of {limit} bytes.", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_request(request: Request, model_cls: type[M]) -> tuple[ServerState, Any, M]:
    """(state, engine, validated body) for a JSON endpoint, or the APIError that answers it."""
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.max_body_bytes)
    engine = state.require_engine()
    if len(raw) > _PARSE_OFF_LOOP_BYTES:
        body = await state.off_loop(parse_body, raw, model_cls)
    else:
        body = parse_body(raw, model_cls)
    state.check_model(body.model)
    return state, engine, body


async def stream_choices(
    state: ServerState, choices: list[Choice], arrival: float
) -> AsyncGenerator[tuple[Choice, RequestOutput] | None, None]:
    """Run every choice on the engine; yield (choice, output) as outputs arrive.

    The first item is None and marks "accepted": by then admission is taken (429
    if full) and no generate() has refused synchronously (ValueError -> 400); the
    caller has checked each choice against the engine's limits (check_context). So
    a caller can await the first item, then still answer with a plain error or
    start a 200 stream.
    Admission is given back when iteration ends, however it ends. `arrival`
    (time.monotonic() when the HTTP request came in) starts the latency clocks.
    """
    engine = state.engine
    state.admit(len(choices))
    queue: asyncio.Queue = asyncio.Queue()
    state.open_streams.add(queue)

    async def pump(choice: Choice) -> None:
        timer = state.metrics.timer(arrival)
        finished = False
        try:
            async for output in engine.generate(choice.prompt_token_ids, choice.params, choice.request_id):
                timer.on_output(output)
                finished = output.finished
                queue.put_nowait((choice, output))
        except asyncio.CancelledError:
            if not finished:
                timer.on_finished("abort", len(choice.prompt_token_ids))
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which decides
            if not isinstance(exc, (ValueError, QueueFullError)):
                timer.on_finished("error", len(choice.prompt_token_ids))
            queue.put_nowait((choice, exc))
        queue.put_nowait((choice, _END))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    remaining = len(choices)
    try:
        # One turn of the loop runs every pump up to its first real wait: a refusal raised
        # synchronously by generate() is in the queue by then.
        await asyncio.sleep(0)
        early = [queue.get_nowait() for _ in range(queue.qsize())]
        refusal = next((item for _, item in early if isinstance(item, Exception)), None)
        if refusal is not None:
            raise _engine_error(refusal)
        for entry in early:
            queue.put_nowait(entry)
        yield None
        while remaining:
            choice, item = await queue.get()
            if item is _SHUTDOWN:
                raise _shutdown_error()
            if item is _END:
                remaining -= 1
                if choice.final is None:
                    raise RuntimeError(f"the engine stream of {choice.request_id} ended without a final output")
            elif isinstance(item, Exception):
                raise _engine_error(item)
            else:
                choice.add(item)
                yield choice, item
    finally:
        unfinished = [c for c in choices if c.final is None]
        for task in tasks:
            task.cancel()
        # Shielded: this runs when the client has gone and our task is being cancelled,
        # which is exactly when the engine must hear about it.
        with anyio.CancelScope(shield=True):
            for choice in unfinished:
                await engine.abort(choice.request_id)
            await asyncio.gather(*tasks, return_exceptions=True)
        state.num_in_flight -= len(choices)
        state.open_streams.discard(queue)


def _shutdown_error() -> APIError:
    return APIError(
        503,
        "The server is shutting down and this request did not finish within its shutdown "
        "timeout; retry on another instance.",
        code="server_shutting_down",
    )


def _engine_error(exc: Exception) -> Exception:
    """The engine refuses before any output with ValueError (never fits) or QueueFullError."""
    if isinstance(exc, QueueFullError):
        return APIError(
            429, f"The server's queue is full ({exc}); retry shortly.", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, LoRANotFoundError):  # unloaded after the request was checked
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return invalid(str(exc))
    return exc


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once (not n times), plus where the time went."""
    finals = [c.final for c in choices if c.final is not None]
    per_prompt = [choices[i : i + n] for i in range(0, len(choices), n)]
    prompt_tokens = sum(len(group[0].prompt_token_ids) for group in per_prompt)
    # The prompt tokens every sample of a prompt got from the prefix cache.
    cached = sum(min((c.final.num_cached_tokens if c.final else 0) for c in group) for group in per_prompt)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "timings": timings_ms(finals),
    }


def timings_ms(finals: list[RequestOutput]) -> dict[str, float]:
    """Queue, prefill and decode milliseconds; with several choices, the slowest of each."""

    def slowest(attr: str) -> float:
        return round(1000 * max((getattr(f, attr) for f in finals), default=0.0), 3)

    return {
        "queue_ms": slowest("queue_time"),
        "prefill_ms": slowest("prefill_time"),
        "decode_ms": slowest("decode_time"),
    }


def timing_headers(timings: dict[str, float]) -> dict[str, str]:
    """The same numbers as response headers (Server-Timing is the standard spelling)."""
    return {
        "Server-Timing": ", ".join(f"{k.removesuffix('_ms')};dur={v}" for k, v in timings.items()),
        "X-Queue-Ms": str(timings["queue_ms"]),
        "X-Prefill-Ms": str(timings["prefill_ms"]),
        "X-Decode-Ms": str(timings["decode_ms"]),
    }
