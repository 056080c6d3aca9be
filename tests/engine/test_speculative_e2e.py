"""Speculative decoding end to end: the same tokens, text and logprobs as without it.

On models whose products are row-invariant (quantized weights on our kernels; a dense model
put on the row-by-row method) greedy and seeded requests must be bit-identical with
speculation on and off: alone, among prefills and other decodes, through preemptions with a
tiny KV pool, with stop strings and under a grammar: on Llama, Qwen3 and DeepSeek (MLA + MoE,
whose absorbed products and router run csrc/rows_matmul.cpp). On a dense DeepSeek (torch's GEMMs
round a row by its step) greedy tokens must match.
"""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from engine.speculative import SpeculativeConfig
from engine.structured import StructuredOutput
from models.layers import cpu_kernels

SPEC = SpeculativeConfig(num_speculative_tokens=4, max_batch_size=8)
# Repetitive prompts: tiny random models fall into loops that n-gram drafts predict.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [40, 41, 42] * 7 + [43], list(range(100, 137)), [11, 12] * 3]


@pytest.fixture(autouse=True)
def kernels():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: the eager paths are not row-invariant")


def params_set():
    return [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=12, top_k=20, presence_penalty=0.8, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=18, repetition_penalty=1.3, ignore_eos=True),
    ]


def key(prompt_token_ids, params):
    return tuple(prompt_token_ids), params.seed, params.temperature


class Oracle:
    """Drafts from a run without drafts (every fifth token wrong on purpose): tiny random models
    seldom repeat themselves, and the point here is what verification does with drafts."""

    def __init__(self, outputs_by_key, k=4):
        self.outputs, self.k, self.calls = outputs_by_key, k, 0

    def __call__(self, request, limit):
        self.calls += 1
        done = request.num_output_tokens
        drafts = list(self.outputs[key(request.prompt_token_ids, request.params)][done : done + min(self.k, limit)])
        if self.calls % 5 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % 64
        return drafts


def generate(loaded, speculative, prompts, params, oracle=None, **config):
    llm = LLM.from_loaded(loaded, speculative=speculative, **config)
    if oracle is not None:
        llm.engine.scheduler.speculator.propose = oracle
    outputs = llm.generate(prompts, params)
    core = llm.engine
    assert core.audit() == [] and core.scheduler.block_manager.num_used_blocks == 0
    return outputs, core


def assert_same(with_drafts, without):
    for a, b in zip(with_drafts, without, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.logprobs == b.logprobs  # ids, values and alternatives, bit for bit
        assert a.finish_reason == b.finish_reason


def oracle_for(prompts, params, outputs):
    return Oracle({key(p, q): o.token_ids for p, q, o in zip(prompts, params, outputs)})


def check_model(loaded, **config):
    params = params_set()
    # Alone, one request at a time: n-gram drafts, then drafts that are mostly right.
    for prompt, p in zip(PROMPTS, params):
        base, _ = generate(loaded, None, [prompt], p, **config)
        spec, core = generate(loaded, SPEC, [prompt], p, **config)
        assert_same(spec, base)
        spec, core = generate(loaded, SPEC, [prompt], p, oracle_for([prompt], [p], base), **config)
        assert_same(spec, base)
        assert core.scheduler.speculator.stats.num_accepted_tokens > 0
    # All together: prefills beside decodes with drafts, chunked (a budget of 24 tokens a step).
    chunked = dict(max_num_batched_tokens=24, max_num_seqs=8, **config)
    base, _ = generate(loaded, None, PROMPTS, params, **chunked)
    spec, core = generate(loaded, SPEC, PROMPTS, params, **chunked)
    assert_same(spec, base)
    spec, core = generate(loaded, SPEC, PROMPTS, params, oracle_for(PROMPTS, params, base), **chunked)
    assert_same(spec, base)
    stats = core.scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats


def test_tiny_llama_int4_is_identical_with_and_without_drafts(tiny_llama):
    from models.loader import load_model

    check_model(load_model(tiny_llama[0], dtype="float32", quantization="int4"), block_size=8, num_kv_blocks=64)


def test_tiny_llama_dense_on_the_row_by_row_method_is_identical(tiny_llama):
    from models.loader import load_model
    from tests.models.test_row_invariance import row_by_row

    check_model(row_by_row(load_model(tiny_llama[0], dtype="float32")), block_size=8, num_kv_blocks=64)


def test_tiny_llama_dense_with_batch_invariant_is_identical(tiny_llama):
    from models.loader import load_model

    loaded = load_model(tiny_llama[0], dtype="bfloat16", batch_invariant=True)
    assert loaded.model.row_invariant()
    check_model(loaded, block_size=8, num_kv_blocks=64)


def test_tiny_qwen3_int8_is_identical_with_and_without_drafts(tmp_path):
    from models.loader import load_model
    from tests.models.conftest import make_hf_model, save_checkpoint

    path = save_checkpoint(make_hf_model("qwen3", seed=4, max_position_embeddings=256), tmp_path / "qwen3")
    loaded = load_model(path, dtype="float32", quantization="int8")
    assert loaded.model.row_invariant()
    check_model(loaded, block_size=8, num_kv_blocks=64)


@pytest.mark.parametrize("case", ["v2-group-limited-q-lora-yarn", "v3-q-lora"])
def test_tiny_deepseek_int8_is_identical_with_and_without_drafts(tmp_path, case):
    from models.loader import load_model
    from tests.models.test_deepseek import save_quantizable_deepseek

    loaded = load_model(str(save_quantizable_deepseek(case, tmp_path / case)), dtype="float32", quantization="int8")
    assert loaded.model.row_invariant()
    check_model(loaded, block_size=8, num_kv_blocks=64)


def test_tiny_dense_deepseek_v3_gives_the_same_greedy_tokens(tmp_path_factory):
    from models.loader import load_model
    from tests.models.test_deepseek import _make_checkpoint

    path = _make_checkpoint("v3-q-lora", tmp_path_factory)[0]
    loaded = load_model(str(path), dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [[p % 90 + 3 for p in prompt] for prompt in PROMPTS]
    base, _ = generate(loaded, None, prompts, greedy, block_size=8, num_kv_blocks=64)
    oracle = oracle_for(prompts, [greedy] * len(prompts), base)
    spec, core = generate(loaded, SPEC, prompts, greedy, oracle, block_size=8, num_kv_blocks=64)
    for a, b in zip(spec, base, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert core.scheduler.speculator.stats.num_accepted_tokens > 0


def test_preemption_with_a_tiny_pool_keeps_outputs_identical(tiny_llama):
    from models.loader import load_model

    loaded = load_model(tiny_llama[0], dtype="float32", quantization="int4")
    prompts = [PROMPTS[i % 4] for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True, logprobs=0) for i in range(6)]
    base, _ = generate(loaded, None, prompts, params, block_size=4, num_kv_blocks=40)
    oracle = oracle_for(prompts, params, base)
    spec, core = generate(loaded, SPEC, prompts, params, oracle, block_size=4, num_kv_blocks=40)
    assert_same(spec, base)
    assert core.scheduler.num_preemptions > 0 or core.scheduler.speculator.stats.num_cut_by_budget > 0


@pytest.fixture(scope="module")
def smollm2():
    from models.fetch import default_model_path
    from models.loader import load_model

    return load_model(str(default_model_path()))


QUOTE = (
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed "
    "by their Creator with certain unalienable Rights, that among these are Life, Liberty and the "
    "pursuit of Happiness."
)


def chat(llm_tokenizer, text):
    return llm_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_smollm2_quoting_is_identical_and_accepts_drafts(smollm2):
    prompt = chat(smollm2.tokenizer, f"Repeat this sentence word for word: {QUOTE}")
    params = [
        SamplingParams(temperature=0, max_tokens=48, logprobs=3),
        SamplingParams(temperature=0.8, seed=123, max_tokens=48, logprobs=1),
        SamplingParams(temperature=0, max_tokens=48, stop=["Liberty"]),
    ]
    for p in params:
        base, _ = generate(smollm2, None, [prompt], p, num_kv_blocks=64)
        spec, core = generate(smollm2, SPEC, [prompt], p, num_kv_blocks=64)
        assert_same(spec, base)
    assert "Liberty" not in spec[0].text and spec[0].finish_reason == "stop"
    # Among other requests, prefills included.
    others = [chat(smollm2.tokenizer, "Name three colours."), chat(smollm2.tokenizer, QUOTE[:60])]
    batch_params = [params[0], params[1], params[0]]
    base, _ = generate(smollm2, None, [prompt, *others], batch_params, num_kv_blocks=64)
    spec, core = generate(smollm2, SPEC, [prompt, *others], batch_params, num_kv_blocks=64)
    assert_same(spec, base)
    stats = core.scheduler.speculator.stats
    assert stats.num_accepted_tokens >= 10, stats


def test_smollm2_under_a_grammar_is_identical_and_valid(smollm2):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    prompt = chat(smollm2.tokenizer, "Describe Ada Lovelace, born in London, as JSON with name, age and city.")
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=1, structured=StructuredOutput.json_schema(schema))
    base, _ = generate(smollm2, None, [prompt], params, num_kv_blocks=64)
    spec, core = generate(smollm2, SPEC, [prompt], params, num_kv_blocks=64)
    assert_same(spec, base)
    value = json.loads(spec[0].text)
    assert set(value) == {"name", "age", "city"}
    assert core.scheduler.speculator.stats.num_accepted_tokens > 0  # the grammar's forced keys at least


def test_drafts_never_enter_the_prefix_cache(smollm2):
    """A second request whose prompt is the first one's prompt and output: its prefix hits must
    give the same logits as computing it all (a cached block with a rejected draft's KV would not)."""
    prompt = chat(smollm2.tokenizer, f"Repeat this sentence word for word: {QUOTE}")
    greedy = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    llm = LLM.from_loaded(smollm2, speculative=SPEC, num_kv_blocks=64, block_size=16)
    first = llm.generate([prompt], greedy)[0]
    ids = llm.tokenizer(prompt)["input_ids"] + first.token_ids
    hit = llm.generate([ids], greedy)[0]
    fresh = LLM.from_loaded(smollm2, num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    cold = fresh.generate([ids], greedy)[0]
    assert hit.num_cached_tokens >= 32
    assert hit.token_ids == cold.token_ids and hit.logprobs == cold.logprobs
