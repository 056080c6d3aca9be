"""LoRA adapters on MoE experts (Qwen2-MoE, Qwen3-MoE, DeepSeek V2/V3): each routed expert adds its own
s * B_e(A_e x) on the tokens routed to it, the shared experts theirs on every token. Adapters as peft
makes them on transformers 5 (target_parameters on the fused experts) and in transformers 4's
per-expert form (`mlp.experts.N.gate_proj`, the same weights re-keyed); the reference is transformers
+ peft on the same adapter directory, alone and in one batch with base requests and another adapter.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_lora_coverage import PROMPTS, check, greedy, make_adapter, reference, with_adapter

peft = pytest.importorskip("peft")

FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def qwen_moe(arch: str):
    shared = dict(shared_expert_intermediate_size=24) if arch == "qwen2_moe" else {}
    return make_hf_model(arch, **MOE, **shared)


def deepseek(case: str = "v3-q-lora"):
    from tests.models.test_deepseek import make_hf_deepseek

    return make_hf_deepseek(case)


MODELS = {"qwen2_moe": lambda: qwen_moe("qwen2_moe"), "qwen3_moe": lambda: qwen_moe("qwen3_moe"), "deepseek": deepseek}
# Targets beside the fused experts: the shared experts' and dense layers' gate/up/down_proj (Linear
# layers in transformers 5), and one attention projection.
TARGETS = {
    "qwen2_moe": ["q_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_moe": ["o_proj"],
    "deepseek": ["q_b_proj", "gate_proj", "up_proj", "down_proj"],
}


def per_expert_form(fused_dir: str, path) -> str:
    """The same adapter in transformers 4's per-expert form: peft's fused (E * r, in) A and (out, r * E)
    B (expert e: A's rows e*r.., B's columns e, E + e, ...; gate_up_proj's rows [gate | up]) as
    `experts.N.{gate,up,down}_proj` modules."""
    config = json.loads(open(f"{fused_dir}/adapter_config.json").read())
    r = config["r"]
    tensors, out = load_file(f"{fused_dir}/adapter_model.safetensors"), {}
    for key, tensor in tensors.items():
        if ".experts." not in key:
            out[key] = tensor
            continue
        if ".lora_B." in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        prefix = key.split(".experts.")[0] + ".experts"
        param = "gate_up_proj" if ".base_layer." in key else "down_proj"  # both targeted: FUSED
        num_experts = tensor.shape[0] // r
        for e in range(num_experts):
            a_e = tensor[e * r : (e + 1) * r]
            b_e = b[:, e::num_experts]
            if param == "down_proj":
                parts = {"down_proj": b_e}
            else:
                parts = dict(zip(("gate_proj", "up_proj"), b_e.chunk(2)))
            for proj, b_part in parts.items():
                out[f"{prefix}.{e}.{proj}.lora_A.weight"] = a_e.clone()
                out[f"{prefix}.{e}.{proj}.lora_B.weight"] = b_part.clone()
    path.mkdir()
    save_file(out, str(path / "adapter_model.safetensors"))
    targets = sorted(set(config["target_modules"]) | {"gate_proj", "up_proj", "down_proj"})
    config.update(target_modules=targets, target_parameters=None)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    checkpoint = save_checkpoint(MODELS[arch](), root / "base")
    experts = make_adapter(
        MODELS[arch](), root / "experts", seed=1, targets=TARGETS[arch], target_parameters=FUSED, std=0.3
    )
    other = make_adapter(MODELS[arch](), root / "other", seed=2, targets=["gate_proj", "up_proj", "down_proj"], r=2)
    return arch, str(checkpoint), experts, other


def test_expert_adapters_match_peft_alone_and_batched_with_others(moe):
    arch, checkpoint, experts, other = moe
    llm = LLM(
        checkpoint,
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        lora_modules=(("experts", experts), ("other", other)),
    )
    model = llm.engine.runner.model
    adapted = [m for name, m in model.named_modules() if ".experts.gate_up." in name and m.lora is not None]
    assert adapted, "no routed expert holds the adapter"
    peft_model, base = with_adapter(MODELS[arch](), experts), MODELS[arch]()
    expected = [reference(peft_model, p) for p in PROMPTS]
    assert [e[0] for e in expected] != [reference(base, p)[0] for p in PROMPTS]  # the adapter changes tokens
    for prompt, want in zip(PROMPTS, expected):  # alone
        check(llm.generate([prompt], [greedy("experts")])[0], want)
    batch = llm.generate(PROMPTS * 3, [greedy("experts")] * 2 + [greedy(None)] * 2 + [greedy("other")] * 2)
    for prompt, result, want in zip(PROMPTS, batch[:2], expected):
        check(result, want)
    for prompt, result in zip(PROMPTS, batch[2:4]):
        check(result, reference(base, prompt))
    other_model = with_adapter(MODELS[arch](), other)
    for prompt, result in zip(PROMPTS, batch[4:]):
        check(result, reference(other_model, prompt))


def test_the_per_expert_form_serves_the_same_tokens(moe, tmp_path):
    arch, checkpoint, experts, _ = moe
    if arch == "deepseek":
        pytest.skip("one architecture's re-keying suffices: the reader is shared")
    v4 = per_expert_form(experts, tmp_path / "v4")
    llm = LLM(
        checkpoint, dtype="float32", num_kv_blocks=64, block_size=4, lora_modules=(("fused", experts), ("v4", v4))
    )
    fused, per_expert = llm.generate(PROMPTS * 2, [greedy("fused")] * 2 + [greedy("v4")] * 2)[::2]
    peft_model = with_adapter(MODELS[arch](), experts)
    check(fused, reference(peft_model, PROMPTS[0]))
    check(per_expert, reference(peft_model, PROMPTS[0]))


def test_an_expert_adapter_of_the_wrong_shape_is_refused_by_name(tmp_path):
    checkpoint = save_checkpoint(qwen_moe("qwen3_moe"), tmp_path / "base")
    adapter = make_adapter(qwen_moe("qwen3_moe"), tmp_path / "a", seed=1, targets=["o_proj"], target_parameters=FUSED)
    v4 = per_expert_form(adapter, tmp_path / "v4")
    tensors = load_file(f"{v4}/adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.9.down_proj.lora_A.weight"
    tensors[key] = tensors[key.replace(".9.", ".0.")].clone()
    tensors[key.replace("lora_A", "lora_B")] = tensors[key.replace(".9.", ".0.").replace("lora_A", "lora_B")].clone()
    save_file(tensors, f"{v4}/adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"the model has no layer model\.layers\.0\.mlp\.experts\.9\.down_proj"):
        LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, lora_modules=(("v4", v4),))
    shutil.rmtree(v4)
    fused = load_file(f"{adapter}/adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"  # down_proj's: 4 experts of rank 4
    save_file({**fused, key: fused[key][:-1].clone()}, f"{adapter}/adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj: lora_A \(15, 16\) is not 4 experts"):
        LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, lora_modules=(("a", adapter),))
    save_file(fused, f"{adapter}/adapter_model.safetensors")
    config = json.loads(open(f"{adapter}/adapter_config.json").read())
    config["target_parameters"] = ["mlp.gate.weight"]
    open(f"{adapter}/adapter_config.json", "w").write(json.dumps(config))
    with pytest.raises(ValueError, match="target_parameters=.*is not supported \\(only MoE experts' fused"):
        LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, lora_modules=(("a", adapter),))


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_a_gguf_of_expert_adapters_serves_its_peft_twins_tokens(arch, tmp_path):
    """llama.cpp's convert_lora_to_gguf.py (tests/models/llama_cpp.py) on the per-expert form stacks
    each layer's experts (ffn_*_exps: lora_a (E, r, in), lora_b (E, out, r)); served, it gives the
    PEFT directory's tokens and logprobs, and peft's."""
    from tests.models.llama_cpp import convert_lora

    checkpoint = save_checkpoint(MODELS[arch](), tmp_path / "base")
    fused = make_adapter(MODELS[arch](), tmp_path / "fused", seed=1, targets=TARGETS[arch], target_parameters=FUSED)
    v4 = per_expert_form(fused, tmp_path / "v4")
    gguf = convert_lora(checkpoint, tmp_path / "v4", tmp_path / "experts.gguf")
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        lora_modules=(("gguf", str(gguf)), ("peft", v4)),
    )
    from_gguf, from_peft = llm.generate(PROMPTS[:1] * 2, [greedy("gguf"), greedy("peft")])
    check(from_gguf, reference(with_adapter(MODELS[arch](), fused), PROMPTS[0]))
    assert [lp.logprob for lp in from_gguf.logprobs] == pytest.approx(
        [lp.logprob for lp in from_peft.logprobs], abs=1e-6
    )
