"""Server-sent events, checked strictly: the decoder splits a byte stream into
events, the validator checks each event against the OpenAI streaming format.

Both are pure (no I/O, the caller supplies arrival times) so a malformed stream
is tested by feeding it text. Every protocol violation has a kind; the first
one found is why a request counts as failed.

    data: {"id": "cmpl-1", "object": "text_completion", "choices": [...]}\\n\\n
    data: {"id": "cmpl-1", ..., "choices": [], "usage": {...}}\\n\\n      <- include_usage
    data: [DONE]\\n\\n
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_LINE_END = re.compile(r"\r\n|\r|\n")

# Violation kinds, as counted in reports.
SSE_FRAMING = "sse_framing"  # not `field: value` lines, events not separated by a blank line
INVALID_JSON = "invalid_json"
BAD_CHUNK = "bad_chunk"  # JSON, but not a chunk of the expected object type
SERVER_ERROR = "server_error"  # an {"error": ...} event mid-stream
INCONSISTENT_ID = "inconsistent_id"
DATA_AFTER_DONE = "data_after_done"
MISSING_DONE = "missing_done"
MISSING_USAGE = "missing_usage"
BAD_USAGE = "bad_usage"  # usage present but malformed, or fewer tokens than content chunks
NO_CONTENT = "no_content"

_OBJECT = {"completions": "text_completion", "chat": "chat.completion.chunk"}


@dataclass(frozen=True)
class SSEEvent:
    data_lines: tuple[str, ...]
    time: float  # when the blank line ending the event arrived

    @property
    def data(self) -> str:
        return "\n".join(self.data_lines)


class SSEDecoder:
    """Incremental event-stream decoder (WHATWG grammar, without reconnection).

    Lines end in \\r\\n, \\r or \\n; a blank line ends an event; lines starting
    with ':' are comments (keep-alives). OpenAI-compatible servers send only
    `data:` fields, so any other field name (say, a bare JSON line) is a
    framing violation rather than silently ignored as the spec would.
    """

    _KNOWN_FIELDS = ("data", "event", "id", "retry")

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._in_event = False
        self.violations: list[str] = []

    def feed(self, text: str, now: float) -> list[SSEEvent]:
        self._buffer += text
        events: list[SSEEvent] = []
        pos = 0
        while (match := _LINE_END.search(self._buffer, pos)) is not None:
            # A '\r' at the very end may be the first half of '\r\n': wait for more.
            if match.group() == "\r" and match.end() == len(self._buffer):
                break
            self._line(self._buffer[pos : match.start()], now, events)
            pos = match.end()
        self._buffer = self._buffer[pos:]
        return events

    def close(self) -> None:
        """End of stream: a half-received event (no closing blank line) is a violation."""
        if self._buffer or self._in_event:
            self.violations.append(SSE_FRAMING)
        self._buffer, self._data, self._in_event = "", [], False

    def _line(self, line: str, now: float, events: list[SSEEvent]) -> None:
        if not line:
            if self._in_event:
                if self._data:
                    events.append(SSEEvent(tuple(self._data), now))
                self._data, self._in_event = [], False
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name not in self._KNOWN_FIELDS:
            self.violations.append(SSE_FRAMING)
            return
        self._in_event = True
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass
class StreamValidator:
    """Checks one streamed response event by event; collects what is measured."""

    endpoint: str
    violations: list[str] = field(default_factory=list)
    stream_id: str | None = None
    done: bool = False
    usage: dict | None = None
    content_times: list[float] = field(default_factory=list)  # arrival of each content-bearing chunk
    content: list[str] = field(default_factory=list)  # the text of each content-bearing chunk
    finish_reason: str | None = None
    error_message: str | None = None

    def on_event(self, event: SSEEvent) -> None:
        if self.done:
            self._violation(DATA_AFTER_DONE)
            return
        if event.data == "[DONE]":
            self.done = True
            return
        if len(event.data_lines) > 1 and all(_is_json(line) for line in event.data_lines):
            self._violation(SSE_FRAMING)  # two chunks with no blank line between them
            return
        try:
            chunk = json.loads(event.data)
        except json.JSONDecodeError:
            self._violation(INVALID_JSON)
            return
        if isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error"):
            error = chunk.get("error", chunk)
            self.error_message = str(error.get("message", error) if isinstance(error, dict) else error)
            self._violation(SERVER_ERROR)
            return
        if (
            not isinstance(chunk, dict)
            or not isinstance(chunk.get("choices"), list)
            or chunk.get("object") != _OBJECT[self.endpoint]
            or not chunk.get("id")
        ):
            self._violation(BAD_CHUNK)
            return
        if self.stream_id is None:
            self.stream_id = chunk["id"]
        elif chunk["id"] != self.stream_id:
            self._violation(INCONSISTENT_ID)
        if chunk.get("usage") is not None:
            self._on_usage(chunk["usage"])
        for choice in chunk["choices"]:
            if not isinstance(choice, dict):
                self._violation(BAD_CHUNK)
                continue
            if text := _content(choice, self.endpoint):
                self.content_times.append(event.time)
                self.content.append(text)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def finish(self) -> None:
        """End-of-stream checks, once the connection has closed."""
        if not self.done:
            self._violation(MISSING_DONE)
        if self.usage is None:
            self._violation(MISSING_USAGE)
        elif self.usage["completion_tokens"] < len(self.content_times):
            self._violation(BAD_USAGE)  # every content chunk carries at least one token
        if not self.content_times:
            self._violation(NO_CONTENT)

    def _on_usage(self, usage: object) -> None:
        counts_ok = isinstance(usage, dict) and all(
            isinstance(usage.get(k), int) and usage[k] >= 0 for k in ("prompt_tokens", "completion_tokens")
        )
        if counts_ok:
            self.usage = usage  # type: ignore[assignment]
        else:
            self._violation(BAD_USAGE)

    def _violation(self, kind: str) -> None:
        self.violations.append(kind)


def _content(choice: dict, endpoint: str) -> str:
    """The generated text in a choice; reasoning models stream theirs separately."""
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    for key in ("content", "reasoning_content", "reasoning"):
        if isinstance(delta.get(key), str) and delta[key]:
            return delta[key]
    return ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
