"""Tool calls in model output: one parser per model family, whole and streamed.

Each family writes its calls its own way:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>      Hermes, Qwen2.5, Qwen3
                 (or a reply that is the bare object, perhaps in a ```json fence)
    llama3_json  {"name": "f", "parameters": {...}}; {...}                     Llama 3.1+ (maybe <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]         Mistral (or [TOOL_CALLS]f[ARGS]{...})
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                 ```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    json         the whole output is the call(s), as forced by tool_choice "required"
                 ([{"name": "f", "parameters": {...}}]) or a named function ({...}, its arguments)

A parser splits the text so far into content and calls (the last perhaps unfinished);
the same split serves the final response and the stream, which re-reads the text at
each delta and sends only what is new: content up to where a call might begin, then
each call's name once known and its arguments as they grow.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str | None  # None until the name is complete
    arguments: str  # the arguments' JSON text so far
    complete: bool


@dataclass
class Parsed:
    content: str  # text outside the calls (that cannot still turn out to start one)
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------ JSON scanning
_NAME = re.compile(r'\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value (object, array, string, or scalar) starting at
    text[start], or None if the text ends first."""
    depth, in_string, escaped = 0, False, False
    if start >= len(text):
        return None
    if text[start] not in '{["':
        m = re.compile(r"[^,}\]\s]*").match(text, start)
        assert m is not None  # `*` matches the empty string too
        return m.end() if m.end() < len(text) else None
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_object_call(text: str) -> ParsedCall:
    """`{"name": "f", "arguments": {...}}` (or "parameters"), possibly cut short."""
    start = text.find("{")
    if start < 0:
        return ParsedCall(None, "", False)
    m = _NAME.match(text, start + 1)
    if m is None:
        whole = _whole_object(text[start:])
        if whole is not None:  # arguments written before the name: read it whole
            return whole
        return ParsedCall(None, "", False)
    name = json.loads(f'"{m.group(1)}"')
    a = _ARGS.match(text, m.end())
    if a is None:
        tail = text[m.end() :].strip()
        done = tail.startswith("}")
        return ParsedCall(name, "{}" if done else "", done)
    end = value_end(text, a.end())
    if end is None:
        return ParsedCall(name, text[a.end() :], False)
    return ParsedCall(name, text[a.end() : end], True)


def _whole_object(text: str) -> ParsedCall | None:
    end = value_end(text, 0)
    if end is None:
        return None
    try:
        obj = json.loads(text[:end])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), True)


def split_objects(text: str) -> tuple[list[str], bool]:
    """A run of JSON objects (in an array or separated by ';' / ',' / whitespace) -> each
    object's text (the last perhaps unfinished), and whether the run is over."""
    objects: list[str] = []
    i = 0
    while True:
        j = text.find("{", i)
        if j < 0:
            return objects, "]" in text[i:]
        end = value_end(text, j)
        if end is None:
            objects.append(text[j:])
            return objects, False
        objects.append(text[j:end])
        i = end


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ------------------------------------------------------------------------ parsers
class ToolParser:
    name = ""
    needs_special_tokens = False  # its markers are special tokens: keep them in the text

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class _MarkedParser(ToolParser):
    """Calls wrapped in start/end markers, content around them."""

    start = end = ""

    def parse(self, text: str, final: bool) -> Parsed:
        content, calls, i = [], [], 0
        while True:
            j = text.find(self.start, i)
            if j < 0:
                tail = text[i:]
                hold = 0 if final else _held_back(tail, self.start)
                content.append(tail[: len(tail) - hold])
                break
            content.append(text[i:j])
            k = text.find(self.end, j + len(self.start))
            body = text[j + len(self.start) : len(text) if k < 0 else k]
            calls.extend(self.calls_in(body, complete=k >= 0))
            if k < 0:
                break
            i = k + len(self.end)
        return Parsed("".join(content), calls)

    def calls_in(self, body: str, complete: bool) -> list[ParsedCall]:
        call = scan_object_call(body)
        call.complete = call.complete and complete
        return [call]


class HermesParser(_MarkedParser):
    """Small models of this format (Qwen2.5-Coder 0.5B / 1.5B) often drop the tags and write the
    bare object, perhaps in a ```json fence: a reply that starts so is read as calls too, as
    llama.cpp's parser for this format reads it."""

    name, start, end = "hermes", "<tool_call>", "</tool_call>"
    _BARE = re.compile(r'\s*(?:```(?:json|xml)?\s*)?(?=\{\s*"name"\s*:)')
    _BARE_STARTS = ('{"name"', '```json{"name"', '```xml{"name"', '```{"name"')

    def parse(self, text: str, final: bool) -> Parsed:
        if self.start not in text:
            bare = self._BARE.match(text)
            if bare is not None:
                return Parsed("", [scan_object_call(obj) for obj in split_objects(text[bare.end() :])[0]])
            compact = re.sub(r"\s+", "", text)
            if not final and compact and any(s.startswith(compact) for s in self._BARE_STARTS):
                return Parsed("")  # could still become a bare call
        return super().parse(text, final)


class DeepSeekV3Parser(_MarkedParser):
    """Content, then every call inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>."""

    name, start, end = "deepseek_v3", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    needs_special_tokens = True
    _BEGIN, _SEP, _FENCE, _CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "```json\n", "\n```"

    def parse(self, text: str, final: bool) -> Parsed:
        j = text.find(self._BEGIN)
        if j < 0:
            return Parsed(text[: len(text) - (0 if final else _held_back(text, self._BEGIN))])
        return Parsed(text[:j], super().parse(text[j + len(self._BEGIN) :], final).calls)

    def calls_in(self, body: str, complete: bool) -> list[ParsedCall]:
        sep = body.find(self._SEP)
        newline = body.find("\n", sep + len(self._SEP)) if sep >= 0 else -1
        if newline < 0:
            return [ParsedCall(None, "", False)]
        name = body[sep + len(self._SEP) : newline].strip()
        fence = body.find(self._FENCE, newline)
        if fence < 0:
            return [ParsedCall(name, "", False)]
        args = body[fence + len(self._FENCE) :]
        close = args.find(self._CLOSE)
        if close >= 0:
            return [ParsedCall(name, args[:close], complete)]
        return [ParsedCall(name, args[: len(args) - _held_back(args, self._CLOSE)], False)]


class MistralParser(ToolParser):
    name, needs_special_tokens = "mistral", True
    _MARKER, _ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parsed:
        j = text.find(self._MARKER)
        if j < 0:
            hold = 0 if final else _held_back(text, self._MARKER)
            return Parsed(text[: len(text) - hold])
        calls = []
        for part in text[j:].split(self._MARKER)[1:]:
            if self._ARGS in part:  # [TOOL_CALLS]name[ARGS]{...}
                name, args = part.split(self._ARGS, 1)
                end = value_end(args.lstrip(), 0)
                args = args.lstrip()
                calls.append(ParsedCall(name.strip(), args if end is None else args[:end], end is not None))
                continue
            calls.extend(scan_object_call(obj) for obj in split_objects(part)[0])
        return Parsed(text[:j], calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"
    _CALL = re.compile(r'\{\s*"name"\s*:')

    def parse(self, text: str, final: bool) -> Parsed:
        body = text[len(self._TAG) :] if text.startswith(self._TAG) else text
        stripped = body.lstrip()
        if not self._CALL.match(stripped):
            compact = re.sub(r"\s+", "", stripped)
            if not final and (self._TAG.startswith(text) or '{"name"'.startswith(compact)):
                return Parsed("")  # could still become a call
            return Parsed(text)
        return Parsed("", [scan_object_call(obj) for obj in split_objects(stripped)[0]])


class JsonParser(ToolParser):
    """Forced calls: the output is exactly the JSON that tool_choice asked for."""

    name = "json"

    def __init__(self, function: str | None = None):
        self.function = function  # a named tool_choice: the whole output is its arguments

    def parse(self, text: str, final: bool) -> Parsed:
        if self.function is not None:
            end = value_end(text, 0) if text else None
            return Parsed("", [ParsedCall(self.function, text if end is None else text[:end], end is not None)])
        objects, _ = split_objects(text)
        return Parsed("", [scan_object_call(obj) for obj in objects])


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser)
}


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call format needs (hermes when it shows none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


# For templates with no tools of their own: the Hermes convention (what Qwen2.5's template writes).
HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages with the tools, past calls and tool results written into the text, for a
    chat template that has no tools of its own (as llama.cpp's generic format does)."""
    out: list[dict] = []
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] in ("system", "developer"):
            out.append({"role": messages[0]["role"], "content": messages[0]["content"] + "\n\n" + system})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


class ToolCallStream:
    """One choice's output turned into OpenAI's content and tool_calls, delta by delta.

    feed(text) takes the whole text so far and returns what to send now: a content piece
    and tool-call deltas (the id, type and name first, then argument pieces), so that the
    pieces put together equal final()'s message.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls are dropped
        self.ids: list[str] = []
        self._content_sent = 0
        self._names_sent: list[bool] = []
        self._args_sent: list[int] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls[: self.max_calls]):
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self._names_sent.append(False)
                self._args_sent.append(0)
            delta: dict = {"index": i}
            if not self._names_sent[i]:
                delta.update(id=self.ids[i], type="function", function={"name": call.name, "arguments": ""})
                self._names_sent[i] = True
            piece = call.arguments[self._args_sent[i] :]
            if piece:
                delta.setdefault("function", {})["arguments"] = piece
                self._args_sent[i] = len(call.arguments)
            if len(delta) > 1:
                deltas.append(delta)
        return content, deltas

    def final(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the finished output. Calls whose arguments are not
        JSON are left in the content, as a model's text, rather than sent as calls; but an
        output cut short inside its last call keeps the calls before it."""
        parsed = self.parser.parse(text, final=True)
        calls = [c for c in parsed.calls if c.name is not None][: self.max_calls]
        if len(calls) > 1 and not _is_json_object(calls[-1].arguments):
            calls = calls[:-1]  # cut off (max_tokens) inside its last call: the calls it completed stand
        if not calls or any(not _is_json_object(c.arguments) for c in calls):
            return text, []
        while len(self.ids) < len(calls):
            self.ids.append(new_call_id())
        tool_calls = [
            {"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
        return (parsed.content.strip() or None), tool_calls


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
