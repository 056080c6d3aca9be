"""LoRA adapters beyond Llama/Qwen3 in float32 (tests/models/test_lora.py): DeepSeek's MLA projections,
a quantized base (kept as stored, the adapter added unmerged), and adapter requests under speculative
decoding and structured output. References are transformers + peft on the same adapter directory.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from engine.speculative import SpeculativeConfig
from engine.structured import StructuredOutput
from models.layers import cpu_kernels
from models.layers.linear import Embedding, Linear, MergedLinear
from tests.models.conftest import make_hf_model, save_checkpoint

peft = pytest.importorskip("peft")

NUM_TOKENS = 6
PROMPTS = [[5, 17, 42, 9, 100, 33], [12, 80, 80, 81, 90, 4, 66, 23, 1]]


def make_adapter(
    model, path, seed: int, targets: list[str], r: int = 4, alpha: int = 8, std: float = 0.3, **options
) -> str:
    """A PEFT LoRA directory over `model` (changed in place: pass a fresh one), random A and B."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **options)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # large enough that greedy tokens change, not only logits
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(path)
    return str(path)


def reference(model, prompt: list[int], num_tokens: int = NUM_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, a full forward per token."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def with_adapter(model, adapter: str):
    return peft.PeftModel.from_pretrained(model, adapter).eval()


def greedy(lora_name: str | None, num_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0, lora_name=lora_name)


def check(result, expected, abs_tol: float = 1e-4) -> None:
    tokens, logprobs = expected
    assert result.token_ids == tokens
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(logprobs, abs=abs_tol)


# DeepSeek: the attention's Linear layers in transformers' DeepseekV2/V3 (the experts' adapters:
# tests/models/test_lora_moe.py); kv_b_proj is absorbed by MLA (refused below).
MLA_TARGETS = {
    "v3-q-lora": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    "v2-greedy-no-q-lora": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
}


@pytest.mark.parametrize("case", list(MLA_TARGETS))
def test_deepseek_mla_adapter_matches_peft(tmp_path, case):
    from tests.models.test_deepseek import make_hf_deepseek

    checkpoint = save_checkpoint(make_hf_deepseek(case), tmp_path / "base")
    adapter = make_adapter(make_hf_deepseek(case), tmp_path / "adapter", seed=1, targets=MLA_TARGETS[case], std=0.2)
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=4, lora_modules=(("mla", adapter),))
    peft_model, base = with_adapter(make_hf_deepseek(case), adapter), make_hf_deepseek(case)
    results = llm.generate(PROMPTS * 2, [greedy("mla")] * 2 + [greedy(None)] * 2)  # adapter and base in one batch
    for prompt, result in zip(PROMPTS, results[:2]):
        expected = reference(peft_model, prompt)
        assert expected[0] != reference(base, prompt)[0]  # the adapter changes the greedy tokens
        check(result, expected)
    for prompt, result in zip(PROMPTS, results[2:]):
        check(result, reference(base, prompt))


@pytest.mark.parametrize(
    "targets, message",
    [
        (["q_b_proj", "kv_b_proj"], "target module 'kv_b_proj' is not supported \\(MLA's kv_b_proj is absorbed"),
    ],
)
def test_deepseek_targets_we_cannot_serve_are_refused_by_name(tmp_path, targets, message):
    from tests.models.test_deepseek import make_hf_deepseek

    checkpoint = save_checkpoint(make_hf_deepseek("v3-q-lora"), tmp_path / "base")
    adapter = make_adapter(make_hf_deepseek("v3-q-lora"), tmp_path / "adapter", seed=1, targets=targets)
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, lora_modules=(("mla", adapter),))


def dequantized_twin(model, hf):
    """`hf` given our (quantized) model's weights as they are served: each Linear's dense_weight."""
    state = {}
    for path, layer in model.named_modules():
        if isinstance(layer, MergedLinear):
            parent = path.rpartition(".")[0]
            weight = layer.quant_method.dense_weight(layer)
            for shard in layer.shard_sizes:
                state[f"{parent}.{shard}.weight"] = weight[layer.shard_rows(shard)]
        elif isinstance(layer, (Linear, Embedding)):
            state[f"{path}.weight"] = layer.quant_method.dense_weight(layer)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in state:
                p.copy_(state.pop(name).float())
    assert not state, sorted(state)
    return hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama, every linear input a multiple of 32 (int4/int8 take them all), and an adapter on all targets."""
    root = tmp_path_factory.mktemp("lora-quant")
    checkpoint = save_checkpoint(make_hf_model("llama"), root / "base")
    adapter = make_adapter(
        make_hf_model("llama"),
        root / "all",
        seed=1,
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return str(checkpoint), adapter


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_base_stays_as_stored_and_adds_the_adapter(llama, quantization):
    """The base runs its quantized weights; the adapter adds s * B(A x) in float32 beside them: the
    dequantized base + peft, within the quantized kernels' rounding of activations to int16 (over
    six tokens up to 2e-3 in a logprob, as 2e-4 of the logits' largest in test_quantization)."""
    checkpoint, adapter = llama
    llm = LLM(
        checkpoint, dtype="float32", quantization=quantization, num_kv_blocks=64, lora_modules=(("all", adapter),)
    )
    model = llm.engine.runner.model
    assert {m.quant_method.name for m in model.modules() if isinstance(m, Linear) and m.lora is not None} == {
        quantization
    }
    twin = dequantized_twin(model, make_hf_model("llama"))
    results = llm.generate(PROMPTS * 2, [greedy("all")] * 2 + [greedy(None)] * 2)
    peft_twin = with_adapter(dequantized_twin(model, make_hf_model("llama")), adapter)
    for prompt, result in zip(PROMPTS, results[:2]):
        check(result, reference(peft_twin, prompt), abs_tol=4e-3)
    for prompt, result in zip(PROMPTS, results[2:]):
        check(result, reference(twin, prompt), abs_tol=4e-3)


def test_adapter_requests_are_bit_identical_with_and_without_speculation(llama):
    """n-gram drafts and drafts copied from the run without them (so that many are accepted):
    verification runs an adapter's rows through the adapter as decoding does."""
    from tests.engine.test_speculative_e2e import oracle_for

    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: the eager paths are not row-invariant")
    from models.loader import load_model

    checkpoint, adapter = llama
    loaded = load_model(checkpoint, dtype="float32", quantization="int4")
    prompts = [[5, 6, 7, 8, 9, 10] * 5, [40, 41, 42] * 7 + [43], [11, 12] * 3]
    params = [greedy("all", 20), greedy(None, 20), greedy("all", 20)]
    config = dict(block_size=8, num_kv_blocks=64, lora_modules=(("all", adapter),))
    base = LLM.from_loaded(loaded, **config).generate(prompts, params)
    for oracle in (None, oracle_for(prompts, params, base)):
        llm = LLM.from_loaded(
            loaded, speculative=SpeculativeConfig(num_speculative_tokens=4, max_batch_size=8), **config
        )
        if oracle is not None:
            llm.engine.scheduler.speculator.propose = oracle
        spec = llm.generate(prompts, params)
        for a, b in zip(spec, base, strict=True):
            assert a.token_ids == b.token_ids
            assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]  # bit for bit: rows_matmul
    assert llm.engine.scheduler.speculator.stats.num_accepted_tokens > 0
    assert base[0].token_ids != LLM.from_loaded(loaded, **config).generate(prompts[0], greedy(None, 20))[0].token_ids


def test_an_adapter_request_under_a_json_schema_gives_valid_json(llama):
    checkpoint, adapter = llama
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=64, lora_modules=(("all", adapter),))
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(temperature=0, max_tokens=60, lora_name=name, structured=StructuredOutput.json_schema(schema))
        for name in ("all", None)
    ]
    results = llm.generate([PROMPTS[0], PROMPTS[0]], params)
    for result in results:
        value = json.loads(result.text)
        assert isinstance(value["a"], int) and value["b"] in ("x", "y") and set(value) == {"a", "b"}
    assert results[0].token_ids != results[1].token_ids  # the adapter's request ran the adapter


SMOLLM2_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real default model (Q4_1 GGUF) and an adapter on all seven projections, as a PEFT
    directory and as its llama.cpp GGUF; the reference is transformers' float32 model of the same
    file (its weights dequantized) with that adapter."""
    from transformers import AutoModelForCausalLM

    from models.fetch import default_model_path
    from tests.models.test_lora_gguf import write_lora_gguf

    path = default_model_path()
    root = tmp_path_factory.mktemp("lora-smollm2")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    config = hf.config
    torch.manual_seed(7)
    peft_model = peft.get_peft_model(
        hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=SMOLLM2_TARGETS, init_lora_weights=False)
    ).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.15)
    peft_model.save_pretrained(root / "peft")
    gguf = write_lora_gguf(str(root / "peft"), root / "adapter.gguf", "llama", config)
    return str(path), str(root / "peft"), gguf, peft_model


def test_smollm2_q4_1_with_an_adapter_on_every_projection_matches_peft(smollm2):
    """The base served as stored (Q4_1 on our kernels) plus the adapter unmerged, from its PEFT
    directory and from its GGUF: peft's tokens on the dequantized model, within the kernels' rounding
    (seen: 1.7e-3 in a logprob)."""
    path, peft_dir, gguf, peft_model = smollm2
    llm = LLM(path, dtype="float32", num_kv_blocks=32, lora_modules=(("peft", peft_dir), ("gguf", gguf)))
    assert {
        m.quant_method.name for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.lora is not None
    } == {"int4"}
    prompt = llm.tokenizer("The capital of France is").input_ids
    ours = llm.generate([prompt] * 3, [greedy("peft", 4), greedy("gguf", 4), greedy(None, 4)])
    expected = reference(peft_model, prompt, 4)
    with peft_model.disable_adapter():
        base = reference(peft_model, prompt, 4)
    # the adapter changes the output well beyond the tolerance
    assert expected[0] != base[0] or max(abs(x - y) for x, y in zip(expected[1], base[1])) > 0.2
    check(ours[0], expected, abs_tol=5e-3)
    check(ours[1], expected, abs_tol=5e-3)
    assert [lp.logprob for lp in ours[1].logprobs] == pytest.approx([lp.logprob for lp in ours[0].logprobs], abs=1e-6)
    check(ours[2], base, abs_tol=5e-3)
