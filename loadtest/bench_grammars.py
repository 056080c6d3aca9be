"""Grammar engines side by side: llguidance (what pagedserve uses) against xgrammar, on one tokenizer.

    python -m loadtest.bench_grammars [--model PATH]

For each schema: compile time of a fresh grammar, then the cost of one decoding step (the next-token
mask, then accepting the token) along the tokens of a valid instance, median and max. xgrammar is not
a dependency (on Linux x86-64 it requires triton); to include it, install it by hand first:
`pip install --no-deps xgrammar apache-tvm-ffi`. A library that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from loadtest.compare import cpu_description

if TYPE_CHECKING:
    import llguidance
    import xgrammar
    from transformers import PreTrainedTokenizerBase

_Matcher = TypeVar("_Matcher")

SCHEMAS = {
    "pattern": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            },
            "required": ["name", "age"],
        },
        {"name": "Alice Smith", "age": 31, "email": "alice@example.com"},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                    },
                    "required": ["id", "tags"],
                },
                "status": {"enum": ["active", "inactive", "banned"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["user", "status", "score"],
        },
        {"user": {"id": 12345, "tags": ["alpha", "beta", "gamma"]}, "status": "active", "score": 0.75},
    ),
    "any object": ({"type": "object"}, {"a": [1, 2, {"b": "hello world"}], "c": None}),
}


def _report(name: str, setup_s: float, rows: list[tuple[str, float, list[float], bool]]) -> None:
    print(f"{name}: tokenizer view {1000 * setup_s:.0f} ms")
    for schema, compile_s, steps, ok in rows:
        print(
            f"  {schema}: compile {1000 * compile_s:.2f} ms, {len(steps)} steps, mask + accept median "
            f"{1e6 * statistics.median(steps):.0f} us, max {1e6 * max(steps):.0f} us{'' if ok else ', REJECTED'}"
        )


def _rows(
    tokenizer: PreTrainedTokenizerBase, compile_schema: Callable[[str], _Matcher], step: Callable[[_Matcher, int], bool]
) -> list[tuple[str, float, list[float], bool]]:
    """Per schema: compile_schema(schema) -> matcher, timed; then step(matcher, token) -> accepted,
    timed for each token of the instance."""
    rows = []
    for schema_name, (schema, instance) in SCHEMAS.items():
        start = time.perf_counter()
        matcher = compile_schema(json.dumps(schema))
        compile_s = time.perf_counter() - start
        steps: list[float] = []
        ok = True
        for token in tokenizer.encode(json.dumps(instance), add_special_tokens=False):
            start = time.perf_counter()
            ok = step(matcher, token)
            steps.append(time.perf_counter() - start)
            if not ok:
                break
        rows.append((schema_name, compile_s, steps, ok))
    return rows


def llguidance_rows(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"llguidance needs a fast tokenizer, not {type(tokenizer).__name__}")
    start = time.perf_counter()
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - start
    mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def step(matcher: llguidance.LLMatcher, token: int) -> bool:
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        return matcher.consume_token(token)

    compile_schema = lambda text: llguidance.LLMatcher(view, llguidance.LLMatcher.grammar_from_json_schema(text))  # noqa: E731
    _report("llguidance", setup, _rows(tokenizer, compile_schema, step))


def xgrammar_rows(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    import xgrammar

    start = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    setup = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def step(matcher: xgrammar.GrammarMatcher, token: int) -> bool:
        matcher.fill_next_token_bitmask(mask, 0)
        return matcher.accept_token(token)

    compile_schema = lambda text: xgrammar.GrammarMatcher(compiler.compile_json_schema(text, any_whitespace=True))  # noqa: E731
    _report("xgrammar", setup, _rows(tokenizer, compile_schema, step))


def main(argv: list[str] | None = None) -> int:
    from models.fetch import default_model_path
    from models.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="GGUF or checkpoint whose tokenizer is used (default: the default model)"
    )
    args = p.parse_args(argv)
    loaded = load_model(args.model or str(default_model_path()), dtype="float32")
    print(f"CPU: {cpu_description()}; vocabulary {loaded.config.vocab_size}")
    for name, run in (("llguidance", llguidance_rows), ("xgrammar", xgrammar_rows)):
        try:
            run(loaded.tokenizer, loaded.config.vocab_size)
        except ImportError:
            print(f"{name}: not installed, skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
