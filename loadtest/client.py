"""One streaming request against an OpenAI-compatible server -> RequestRecord.

Times are time.perf_counter() seconds; a record keeps them relative to the
moment the request was sent. TTFT is the first chunk that carries generated
text (a chat stream's opening role-only chunk does not count), inter-token
latencies are gaps between such chunks, E2E runs to the end of the stream.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from loadtest.sse import SSEDecoder, StreamValidator
from loadtest.workload import RequestSpec


class Outcome(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    DISCONNECTED = "disconnected"  # closed on purpose by --disconnect-fraction; not a failure


@dataclass
class RequestRecord:
    index: int
    outcome: Outcome
    start: float  # perf_counter() when sent
    prompt_len: int  # tokens the workload counted; -1 when unknown
    output_len: int  # max_tokens asked for
    prompt_tokens: int | None = None  # from the usage chunk
    output_tokens: int = 0  # usage completion_tokens, else the number of content chunks
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, seconds after start
    error_kind: str | None = None
    error: str = ""
    violations: list[str] = field(default_factory=list)
    stale_retries: int = 0  # sends that met a kept-alive connection the server had closed (see send_request)
    text: str = ""  # the generated text as streamed (a multi-turn conversation's next history)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when there is no second token."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_payload(
    spec: RequestSpec, model: str, endpoint: str, ignore_eos: bool, extra_body: dict | None = None
) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,  # greedy: the same work on every server compared
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        prompt = spec.prompt
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        payload["messages"] = prompt
    else:
        payload["prompt"] = spec.prompt
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM / SGLang extension; OpenAI itself rejects it
    return {**payload, **(extra_body or {})}


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    spec: RequestSpec,
    endpoint: str,
    disconnect_after: int | None = None,
) -> RequestRecord:
    """Stream one request. With `disconnect_after`, close the connection once
    that many content chunks have arrived, as a client going away would."""
    record = RequestRecord(spec.index, Outcome.FAILED, time.perf_counter(), spec.prompt_len, spec.output_len)
    decoder = SSEDecoder()
    validator = StreamValidator(endpoint)
    try:
        async with _stream(client, url, payload, record) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                return _fail(record, f"http_{response.status_code}", body[:300])
            content_type = response.headers.get("content-type", "").lower()
            if not content_type.startswith("text/event-stream"):
                return _fail(record, "not_event_stream", f"content-type {content_type!r}")
            async for text in response.aiter_text():
                for event in decoder.feed(text, time.perf_counter()):
                    validator.on_event(event)
                    if disconnect_after is not None and len(validator.content_times) >= disconnect_after:
                        # Events after the cut are dropped as if never read, so a
                        # cut stream always ends after exactly `disconnect_after` chunks.
                        record.outcome = Outcome.DISCONNECTED
                        break
                if record.outcome is Outcome.DISCONNECTED:
                    # Leaving the `async with` unread closes the connection, which
                    # is what the server must notice and clean up after.
                    break
            end = time.perf_counter()  # before closing: teardown is not latency
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        return _fail(record, "connect_error", str(e))
    except httpx.TimeoutException as e:
        return _fail(record, "timeout", f"{type(e).__name__}: {e}")
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        _measure(record, validator, time.perf_counter())
        return _fail(record, "connection_closed", str(e))
    except httpx.HTTPError as e:
        return _fail(record, "http_error", f"{type(e).__name__}: {e}")

    _measure(record, validator, end)
    if record.outcome is Outcome.DISCONNECTED:
        record.output_tokens = len(validator.content_times)
        return record
    decoder.close()
    validator.finish()
    record.violations = decoder.violations + validator.violations
    if record.violations:
        return _fail(record, record.violations[0], validator.error_message or ", ".join(record.violations))
    assert validator.usage is not None  # finish() flags a missing usage chunk
    record.prompt_tokens = validator.usage["prompt_tokens"]
    record.output_tokens = validator.usage["completion_tokens"]
    record.outcome = Outcome.COMPLETED
    return record


def _measure(record: RequestRecord, validator: StreamValidator, end: float) -> None:
    record.chunk_times = [t - record.start for t in validator.content_times]
    record.text = "".join(validator.content)
    record.ttft = record.chunk_times[0] if record.chunk_times else None
    record.e2e = end - record.start


# A server may close a kept-alive connection just as the pool hands it to a new request (llama.cpp's
# llama-server did so for 2-5 of 16 sequential requests, each failing within ~1 ms with no byte
# of response; the same request on a new connection succeeded). Like the openai client, which
# retries such errors, the request is sent again on a new connection: at most this many times, and
# only when no response had begun, so the server never saw it. Counted in the summary.
STALE_CONNECTION_RETRIES = 2


@contextlib.asynccontextmanager
async def _stream(
    client: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord
) -> AsyncIterator[httpx.Response]:
    for attempt in range(STALE_CONNECTION_RETRIES + 1):
        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(client.stream("POST", url, json=payload))
            except httpx.RemoteProtocolError as exc:
                # httpx has dropped the dead connection: the next send takes another or a new one.
                if attempt == STALE_CONNECTION_RETRIES or "without sending a response" not in str(exc):
                    raise
                record.stale_retries += 1
                continue
            yield response  # errors while reading the stream leave through the stack, never resent
            return


def _fail(record: RequestRecord, kind: str, message: str) -> RequestRecord:
    record.outcome = Outcome.FAILED
    record.error_kind = kind
    record.error = message
    if not record.violations:
        record.violations = [kind]
    return record
