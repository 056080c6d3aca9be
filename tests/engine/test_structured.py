"""Structured output in the engine: grammars compiled and cached, masks in the batched sampler,
matchers advanced with each token, EOS only where the grammar ends; on a tiny random Llama,
where only the grammar can make the output valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from engine.sampler import SamplingBatch, sample
from engine.structured import GrammarCompiler, GrammarError, StructuredOutput, allowed_tokens, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(loaded):
    return GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids)


def llm(loaded, **kwargs):
    return LLM.from_loaded(loaded, **{"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 8, **kwargs})


def test_unpack_bitmask_reads_bit_b_of_word_w_as_token_32w_plus_b():
    words = torch.tensor([[0b101, -(2**31)], [0, 1]], dtype=torch.int32)  # bit 31 of word 1 is token 63
    allowed = unpack_bitmask(words, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    assert unpack_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_compile_is_cached_by_spec_and_bad_grammars_raise_grammar_error(compiler):
    spec = StructuredOutput.json_schema(SCHEMA)
    first = compiler.compile(spec)
    compiled = compiler.num_compiled
    assert compiler.compile(StructuredOutput.json_schema(json.loads(json.dumps(SCHEMA)))) is first
    assert compiler.num_compiled == compiled
    for bad in (
        StructuredOutput("json", "{oops"),
        StructuredOutput.json_schema({"type": "wat"}),
        StructuredOutput.regex("a(b"),
        StructuredOutput.grammar("start: undefined_rule"),
        StructuredOutput.json_schema({"type": "string", "pattern": "(?=lookahead)"}),
    ):
        with pytest.raises(GrammarError):
            compiler.compile(bad)
    with pytest.raises(GrammarError, match="at most"):
        StructuredOutput.regex("a" * (300 * 1024))


def test_gbnf_and_lark_grammars_are_both_accepted(compiler):
    for text in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        matcher = compiler.compile(StructuredOutput.grammar(text)).matcher()
        allowed = allowed_tokens([matcher], compiler.vocab_size)[0]
        assert 0 < allowed.sum() < compiler.vocab_size


def test_sampler_draws_only_allowed_tokens_and_logprobs_show_the_mask(compiler, loaded):
    vocab = loaded.config.vocab_size
    grammar = compiler.compile(StructuredOutput.regex("[0-9]+"))
    matcher, other = grammar.matcher(), grammar.matcher()
    allowed = allowed_tokens([matcher], vocab)[0]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=1.0, logprobs=0, structured=StructuredOutput.regex("[0-9]+")),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0.0, top_k=5),
    ]
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed) for _ in params]
        batch = SamplingBatch.from_params(
            params, [[1]] * 3, [[]] * 3, gens, vocab, "cpu", grammars=[matcher, None, other]
        )
        out = sample(logits, batch)
        assert allowed[out.token_ids[0]] and allowed[out.token_ids[2]]
        assert out.logprobs[0].logprob > float("-inf")
    # The unconstrained row draws exactly what it draws alone.
    alone = sample(
        logits[1:2],
        SamplingBatch.from_params(params[1:2], [[1]], [[]], [torch.Generator().manual_seed(19)], vocab, "cpu"),
    )
    assert alone.token_ids[0] == out.token_ids[1]
    # Greedy under a grammar is the argmax over the allowed tokens.
    assert out.token_ids[2] == int(logits[2].masked_fill(~allowed, float("-inf")).argmax())


def test_constrained_outputs_validate_and_end_where_the_grammar_ends(loaded):
    engine = llm(loaded)
    schema_params = [
        SamplingParams(max_tokens=120, temperature=t, seed=s, structured=StructuredOutput.json_schema(SCHEMA))
        for t, s in [(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3)]
    ]
    others = [
        SamplingParams(
            max_tokens=30, temperature=1.0, seed=4, structured=StructuredOutput.regex(r"[a-c]{2,4}-[0-9]{3}")
        ),
        SamplingParams(
            max_tokens=30, temperature=1.0, seed=5, structured=StructuredOutput.choice(["red", "green", "blue"])
        ),
        SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutput.grammar('root ::= "ok" | "no"')),
    ]
    results = engine.generate(["hello"] * 7, schema_params + others)
    for r in results[:4]:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert results[4].finish_reason == "stop" and re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", results[4].text)
    assert results[5].text in ("red", "green", "blue")
    assert results[6].text in ("ok", "no")


def test_unconstrained_neighbours_get_the_tokens_they_get_alone(loaded):
    plain = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=1.0, seed=7)]
    alone = [r.token_ids for r in llm(loaded).generate(["abc", "xyz"], plain)]
    constrained = SamplingParams(
        max_tokens=60, temperature=1.0, seed=1, structured=StructuredOutput.json_schema(SCHEMA)
    )
    mixed = llm(loaded).generate(["abc", "q", "xyz", "r"], [plain[0], constrained, plain[1], constrained])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone


def test_a_preempted_constrained_request_still_produces_valid_output(loaded):
    # 40 blocks of 4 tokens for four requests that grow to ~20-30 blocks each: some are
    # preempted and recomputed, their matchers kept where they were.
    engine = llm(loaded, num_kv_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=StructuredOutput.json_schema(SCHEMA))
        for s in range(4)
    ]
    results = engine.generate(["a b c d e"] * 4, params)
    assert engine.engine.stats().num_preemptions > 0
    for r in results:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)
        else:  # cut by max_tokens: still a prefix the grammar allows
            assert r.finish_reason == "length"
    assert any(r.finish_reason == "stop" for r in results)


def test_schemas_get_bounds_where_they_set_none():
    """A number or string has no end of its own: unbounded ones get the documented defaults,
    a schema's own bounds (and enums, consts, patterns) win, nested schemas too."""
    from engine.structured import DEFAULT_MAX_ITEMS, DEFAULT_MAX_LENGTH, MAX_NUMBER, NUMBER_STEP, bounded

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number"},
            "i": {"type": ["integer", "null"], "maximum": 9},
            "s": {"type": "string"},
            "p": {"type": "string", "pattern": "^a+$"},
            "e": {"type": "string", "enum": ["x"]},
            "a": {"type": "array", "items": {"type": "number", "multipleOf": 0.5}},
        },
        "$defs": {"d": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]}},
    }
    out = bounded(schema)
    props = out["properties"]
    assert props["n"] == {"type": "number", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER, "multipleOf": NUMBER_STEP}
    assert props["i"] == {"type": ["integer", "null"], "maximum": 9, "minimum": -MAX_NUMBER}
    assert (
        props["s"]["maxLength"] == DEFAULT_MAX_LENGTH
        and "maxLength" not in props["p"]
        and props["e"] == schema["properties"]["e"]
    )
    assert props["a"]["maxItems"] == DEFAULT_MAX_ITEMS and props["a"]["items"]["multipleOf"] == 0.5
    assert out["$defs"]["d"]["anyOf"] == [
        {"type": "string", "maxLength": 3},
        {"type": "integer", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER},
    ]
    assert "minimum" not in schema["properties"]["n"]  # the caller's schema is left as it was


def _accepts(compiled, tokenizer, text: str) -> tuple[bool, bool]:
    """(whether the grammar takes every token of `text`, whether it is then complete)."""
    matcher = compiled.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.valid_prefix(ids) < len(ids):
        return False, False
    for t in ids:
        assert matcher.accept(t)
    return True, matcher.is_done


ANSWER = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("special", [False, True], ids=["tags as text", "tags as special tokens"])
def test_after_reasoning_the_grammar_starts_at_the_closing_tag(special):
    from copy import deepcopy

    from tests.models.conftest import tiny_tokenizer

    tokenizer = deepcopy(tiny_tokenizer())
    if special:  # as a reasoning model's tokenizer may hold them: one special token each
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    qwen3, r1 = (compiler.compile(ANSWER.after_reasoning(p)) for p in ("qwen3", "deepseek_r1"))
    free = '<think>first {"a": oops, then more</think>{"a": 1}'  # the thinking is any text, JSON or not
    assert _accepts(qwen3, tokenizer, free) == (True, True)
    assert _accepts(qwen3, tokenizer, '{"a": 1}') == (True, True)  # qwen3 may answer without thinking
    assert _accepts(qwen3, tokenizer, '<think>x</think>{"a": "no"}')[0] is False  # the answer is held to it
    assert _accepts(qwen3, tokenizer, 'plain{"a": 1}')[0] is False
    # deepseek_r1: the prompt opened <think>; the output thinks until </think> (repeating the tag or not)
    assert _accepts(r1, tokenizer, 'weigh it</think>{"a": 2}') == (True, True)
    assert _accepts(r1, tokenizer, free) == (True, True)
    assert _accepts(r1, tokenizer, '{"a": 1}') == (True, False)  # still thinking
    assert ANSWER.after_reasoning("qwen3") != ANSWER and compiler.compile(ANSWER) is not qwen3
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ANSWER.after_reasoning("o1")
