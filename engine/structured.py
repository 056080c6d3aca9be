"""Structured output: a request's grammar, compiled once, advanced token by token.

llguidance does the grammar work (JSON schema, regex, choice, Lark/GBNF grammars;
docs/structured-output.md says why it and not xgrammar). Here is what the engine needs of it:

    StructuredOutput   what the request asked for (kind + canonical text): hashable,
                       part of SamplingParams, the key of the compile cache
    GrammarCompiler    StructuredOutput -> CompiledGrammar, cached, bounded in time and
                       memory; called off the engine thread (AsyncEngine) before the
                       request is admitted, so no step ever waits for a compile
    GrammarMatcher     one request's position in its grammar: the tokens allowed next
                       (a bitmask row), accept(token), done when only EOS is left
    allowed_tokens()   the bitmasks of every constrained row of a step, in one call

Preemption recomputes a request's KV cache but keeps its tokens, so its matcher
stays where it is; nothing is rolled back (see engine/scheduler.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported where a mask is built: engine.request imports this module
    import llguidance
    import torch
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json", "regex", "choice", "grammar"]
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # server/reasoning.py's
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar")

# JSON is generated compactly and always the same way (", " and ": ", no other whitespace):
# free whitespace lets a weak model pad forever, and these are the separators models
# learned from json.dumps. Clients parse either.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on one grammar: a schema or regex past them is refused (400), never a stall.
MAX_SPEC_CHARS = 256 * 1024
_MAX_LEXER_STATES = 50_000  # ~1-2 kB each: at most ~100 MB for one grammar's lexer
_CACHE_SIZE = 256


# Bounds a JSON schema gets where it sets none of its own: a JSON number or string has no end of
# its own, and a weak model can write digits or characters until max_tokens (SmolLM2 wrote 8,157
# digits of a float). Numbers: at most 15 integer digits and 6 decimals, no exponent; strings up
# to 1,024 characters; arrays up to 1,024 items. A schema's own minimum / maximum / multipleOf /
# maxLength / pattern / format / maxItems / enum / const wins.
MAX_NUMBER = 10**15
NUMBER_STEP = 1e-6
DEFAULT_MAX_LENGTH = 1024
DEFAULT_MAX_ITEMS = 1024
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def bounded(schema: Any) -> Any:
    """`schema` with the default bounds above added to each subschema that types a number,
    string or array without bounding it (a copy; the input is not changed)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), list):  # draft-4 tuple items
            out[key] = [bounded(sub) for sub in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = bounded(out[key])
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "enum" in out or "const" in out:
        return out
    if types & {"integer", "number"}:
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -MAX_NUMBER
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = MAX_NUMBER
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    if "string" in types and not {"maxLength", "pattern", "format"} & out.keys():
        out["maxLength"] = DEFAULT_MAX_LENGTH
    if "array" in types and "maxItems" not in out:
        out["maxItems"] = DEFAULT_MAX_ITEMS
    return out


class GrammarError(ValueError):
    """The grammar is invalid, unsupported or too complex: the request gets a 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is canonical text: a JSON schema without whitespace
    (its key order kept: properties are generated in that order), a regex, a JSON list of
    choices, a Lark or GBNF grammar; equal asks share one compiled grammar.

    `reasoning` (a server/reasoning.py parser: "qwen3", "deepseek_r1"): the model thinks first,
    freely, and the grammar applies to what follows `</think>` (as vLLM's reasoning-aware
    structured output does): qwen3 may open `<think>` (or answer at once), deepseek_r1's
    prompt already opened it."""

    kind: Kind
    spec: str
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise GrammarError(f"the {self.kind} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        """JSON matching `schema`, with the default bounds of `bounded` where it sets none."""
        return cls("json", json.dumps(bounded(schema), separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if not choices:
            raise GrammarError("choice needs at least one option")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls("grammar", text)

    def after_reasoning(self, parser: str | None) -> StructuredOutput:
        """This grammar applied after the thinking of a model read with reasoning `parser`."""
        if parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {parser!r}")
        return replace(self, reasoning=parser)


class CompiledGrammar:
    """A grammar ready to match: every request under it gets a copy of the same fresh matcher."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher  # never advanced; copied

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy())


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._m.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """Only EOS can follow: the output is complete."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def forced_tokens(self, limit: int) -> list[int]:
        """The next tokens the grammar allows alone (up to `limit`): drafts that cannot miss."""
        return self._m.compute_ff_tokens()[:limit]

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order from here, the grammar accepts (nothing consumed)."""
        return self._m.validate_tokens(list(token_ids)) if token_ids else 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask_row = bitmask[row]
        self._m.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(
    matchers: Sequence[GrammarMatcher], vocab_size: int, drafts: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """(len(matchers), vocab_size) bool: which tokens each matcher allows next. Several rows are
    computed in one llguidance call, on its own threads (the model is idle while it runs).

    With `drafts` (speculative decoding; each matcher's drafts, which it accepts: the
    speculator cut them at the first it refuses), each matcher has 1 + len(drafts) rows: what
    it allows now, then after each draft, the matcher left where it was."""
    import torch

    if drafts is not None and any(drafts):
        offsets = [0]
        for d in drafts:
            offsets.append(offsets[-1] + 1 + len(d))
        bitmask = torch.empty((offsets[-1], bitmask_words(vocab_size)), dtype=torch.int32)
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            [(m._m, row, list(d)) for m, row, d in zip(matchers, offsets, drafts)],
            bitmask.data_ptr(),
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )
        return unpack_bitmask(bitmask, vocab_size)
    bitmask = torch.empty((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].fill(bitmask, 0)
    else:
        _executor().unsafe_compute_mask_ptr(
            [(m._m, row) for row, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
    return unpack_bitmask(bitmask, vocab_size)


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance
        import torch

        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _EXECUTOR


@cache
def _bits() -> torch.Tensor:
    import torch

    return torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int32 words, bit b of word w = token 32 w + b -> (N, vocab_size) bool."""
    bits = (bitmask.unsqueeze(-1) >> _bits().to(bitmask.device)) & 1  # (N, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarCompiler:
    """StructuredOutput -> CompiledGrammar for one tokenizer; thread-safe, LRU-cached.

    The llguidance view of the tokenizer is built on first use (about half a second for a
    50k vocabulary). Compiling never raises anything but GrammarError for a bad grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = _CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache: held for a lookup only (the event loop takes it)
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer view is built
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self.num_compiled = 0

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        import llguidance

        grammar = _llguidance_grammar(spec, self._special_tags() if spec.reasoning else False)
        limits = llguidance.LLParserLimits(max_lexer_states=_MAX_LEXER_STATES, verbose_errors=False)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_first_line(matcher.get_error())}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _special_tags(self) -> bool:
        """Whether <think> / </think> are special tokens of this tokenizer (then a grammar names
        them as tokens; otherwise as text)."""
        special = set(getattr(self._hf_tokenizer, "all_special_tokens", ()) or ())
        return THINK_OPEN in special and THINK_CLOSE in special

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._ll_tokenizer


def _llguidance_grammar(spec: StructuredOutput, special_tags: bool = False) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    matcher = llguidance.LLMatcher
    try:
        if spec.kind == "json":
            grammar = matcher.grammar_from_json_schema(spec.spec, defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = matcher.grammar_from_regex(spec.spec)
        elif spec.kind == "choice":
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
        else:
            grammar = matcher.grammar_from_lark(any_to_lark(spec.spec))
    except Exception as exc:  # noqa: BLE001 - every parse failure of the user's text is a GrammarError
        raise GrammarError(f"invalid {spec.kind}: {_first_line(str(exc))}") from None
    return _after_reasoning(grammar, spec.reasoning, special_tags) if spec.reasoning else grammar


def _after_reasoning(grammar: str, parser: str, special_tags: bool) -> str:
    """`grammar` (llguidance's: TopLevelGrammar JSON, or Lark text) as the subgrammar `answer`
    after free thinking: `<think> ... </think>` (optional for qwen3; for deepseek_r1 the prompt
    opened it, and the output may repeat the tag). The thinking ends at the first </think>."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar)["grammars"]
    else:
        grammars = [{"lark_grammar": grammar}]
    answer = {**grammars[0], "name": "answer"}
    if special_tags:  # one token each: any text between them (the docs' reasoning pattern)
        think = f"{THINK_OPEN} /(.|\\n)*/ {THINK_CLOSE}"
        opened = f"/(.|\\n)*/ {THINK_CLOSE}"
        open_tag = THINK_OPEN
    else:  # text: a lazy lexeme, the shortest text that ends with the closing tag
        think = f"{json.dumps(THINK_OPEN)} thought"
        opened = "thought"
        open_tag = json.dumps(THINK_OPEN)
    if parser == "qwen3":
        start = f"start: ({think})? @answer"
    else:
        start = f"start: {open_tag}? {opened} @answer"
    lark = start + ("" if special_tags else "\nthought[lazy]: /(.|\\n)*<\\/think>/")
    return json.dumps({"grammars": [{"lark_grammar": lark}, answer, *grammars[1:]]})


def _first_line(message: str, limit: int = 500) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line[:limit]
