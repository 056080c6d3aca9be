"""Reasoning models' thinking, returned apart from the answer (`reasoning_content`), as vLLM,
SGLang and llama.cpp return it.

    qwen3        <think> ... </think> answer      the output opens the tag itself (Qwen3; QwQ)
    deepseek_r1  ... </think> answer              the chat template's generation prompt opened
                                                  <think> (DeepSeek-R1 and its distills); an
                                                  output that repeats the tag is read the same

The split is a pure function of the text so far (`split`), so a stream's deltas are the
differences between successive splits: whatever the chunk boundaries, streamed pieces add up to
the whole response's fields. A tag cut by a chunk boundary is held back until it is whole. An
output that never closes its thinking is all reasoning (there is no answer yet).
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def parser_for_template(chat_template: str | None) -> str | None:
    """`auto`: deepseek_r1 when the generation prompt opens <think>, qwen3 when the template
    knows the tags otherwise (or Qwen3's enable_thinking switch), else none."""
    template = chat_template or ""
    if "<think>" not in template and "enable_thinking" not in template:
        return None
    tail = template[template.rfind("add_generation_prompt") :] if "add_generation_prompt" in template else ""
    return "deepseek_r1" if "<think>" in tail and "enable_thinking" not in template else "qwen3"


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of the output so far; not `final`: a partial tag at the end is left out."""
    body = text
    stripped = body.lstrip()
    if not final and OPEN.startswith(stripped):
        return "", ""  # maybe the opening tag, not yet whole
    if stripped.startswith(OPEN):
        body = stripped[len(OPEN) :]
    elif parser == "qwen3":
        return "", text  # qwen3 without <think>: an answer only
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end], body[end + len(CLOSE) :]
    keep = 0 if final else _held_back(body, CLOSE)
    return body[: len(body) - keep], ""


class ReasoningStream:
    """One choice's reasoning and content deltas as its text grows."""

    def __init__(self, parser: str):
        self.parser = parser
        self.reasoning, self.content = "", ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = split(self.parser, text, final)
        delta = (reasoning[len(self.reasoning) :], content[len(self.content) :])
        self.reasoning, self.content = reasoning, content
        return delta
