"""LoRA adapters as llama.cpp GGUF files (models/gguf.py read_lora_gguf) against their PEFT twins.

Each GGUF is written with gguf-py's GGUFWriter from a PEFT directory the way llama.cpp's
convert_lora_to_gguf.py writes one: general.type "adapter", adapter.type "lora", adapter.lora.alpha,
`<base GGUF weight name>.lora_a` (r, in) / `.lora_b` (out, r), llama's Q/K rows of B permuted as
the converter permutes the base weights. Served side by side, the twins must give the same tokens
and logprobs, and those must be transformers + peft's; llama.cpp's own converter writes the same
files.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from safetensors.torch import load_file

from engine.llm import LLM
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_lora import PROMPTS, check, greedy, make_adapter, reference

GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3"}


def converter_permute(weights: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (Q/K rows for llama.cpp's rope), on B's rows."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_lora_gguf(
    peft_dir: str,
    path,
    arch: str,
    config,
    *,
    alpha: float | None = None,
    file_type: str = "adapter",
    extra: dict[str, np.ndarray] | None = None,
) -> str:
    """The GGUF of a PEFT LoRA directory, as llama.cpp's converter writes it. `alpha` defaults to
    the directory's lora_alpha (times sqrt(r) for rsLoRA: llama.cpp scales by alpha / r)."""
    import json

    peft_config = json.loads(open(f"{peft_dir}/adapter_config.json").read())
    rank = peft_config["r"]
    if alpha is None:
        alpha = peft_config["lora_alpha"] * (math.sqrt(rank) if peft_config.get("use_rslora") else 1)
    gguf_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_type(file_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    tensors = load_file(f"{peft_dir}/adapter_model.safetensors")
    for key in sorted(tensors):
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
        name = f"{names.get_name(module)}.weight"
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            kv_heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            b = converter_permute(b, config.num_attention_heads, kv_heads)
        writer.add_tensor(f"{name}.lora_a", a.float().numpy())
        writer.add_tensor(f"{name}.lora_b", b.float().contiguous().numpy())
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def twins(request, tmp_path_factory):
    """A checkpoint and two adapters, each as a PEFT directory and as a GGUF: all targets; rsLoRA on a subset."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-gguf-{arch}")
    hf = make_hf_model(arch)
    checkpoint = save_checkpoint(hf, root / "base")
    peft_dirs = {
        "all": make_adapter(arch, root / "all", seed=1),
        "rs": make_adapter(
            arch, root / "rs", seed=2, targets=["q_proj", "k_proj", "down_proj"], r=4, alpha=6, use_rslora=True
        ),
    }
    ggufs = {
        name: write_lora_gguf(path, root / f"{name}.gguf", GGUF_ARCHS[arch], hf.config)
        for name, path in peft_dirs.items()
    }
    return arch, str(checkpoint), peft_dirs, ggufs


def test_a_gguf_adapter_matches_its_peft_twin_and_peft(twins):
    arch, checkpoint, peft_dirs, ggufs = twins
    modules = tuple((f"{name}-peft", path) for name, path in peft_dirs.items())
    modules += tuple((f"{name}-gguf", path) for name, path in ggufs.items())
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=128, lora_modules=modules)
    jobs = [(prompt, name) for prompt in PROMPTS[:2] for name in peft_dirs]
    peft_results = llm.generate([p for p, _ in jobs], [greedy(f"{name}-peft") for _, name in jobs])
    gguf_results = llm.generate([p for p, _ in jobs], [greedy(f"{name}-gguf") for _, name in jobs])
    for (prompt, name), ours_peft, ours_gguf in zip(jobs, peft_results, gguf_results):
        assert ours_gguf.token_ids == ours_peft.token_ids
        assert [lp.logprob for lp in ours_gguf.logprobs] == pytest.approx(
            [lp.logprob for lp in ours_peft.logprobs], abs=1e-6
        )
        check(ours_gguf, reference(arch, peft_dirs[name], prompt))


def test_llama_cpps_own_converter_writes_these_tensors_and_serves_the_same(twins, tmp_path):
    """convert_lora_to_gguf.py (tests/models/llama_cpp.py) on the same PEFT directories: the same
    metadata and tensors, bit for bit, as write_lora_gguf's, and the same tokens when served."""
    from models.gguf import read_lora_gguf
    from tests.models.llama_cpp import convert_lora

    arch, checkpoint, peft_dirs, ggufs = twins
    converted = convert_lora(Path(checkpoint), Path(peft_dirs["all"]), tmp_path / "all.gguf")
    (got_arch, got_alpha, got), (want_arch, want_alpha, want) = read_lora_gguf(converted), read_lora_gguf(ggufs["all"])
    assert (got_arch, got_alpha, sorted(got)) == (want_arch, want_alpha, sorted(want))
    for name, (a, b) in want.items():
        assert torch.equal(got[name][0], a) and torch.equal(got[name][1], b), name
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=32, lora_modules=(("converted", str(converted)),))
    check(llm.generate(PROMPTS[0], greedy("converted"))[0], reference(arch, peft_dirs["all"], PROMPTS[0]))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf-bad")
    hf = make_hf_model("llama")
    return root, hf.config, str(save_checkpoint(hf, root / "base")), make_adapter("llama", root / "peft", seed=5)


@pytest.mark.parametrize(
    "case, message",
    [
        ("model", "general.type is 'model', not 'adapter': this GGUF is not a LoRA adapter"),
        ("arch", "the adapter is for architecture 'qwen3', the model is 'llama'"),
        ("unknown", "tensor 'blk.0.attn_fancy.weight': no LoRA on this weight"),
        ("kv_b", "tensor 'blk.1.attn_kv_b.weight': no LoRA on this weight \\(MLA's kv_b_proj is absorbed"),
        ("not-lora", "tensor 'blk.0.attn_q.weight' is not a LoRA weight"),
        ("no-layer", "the model has no layer for tensor 'blk.7.attn_q.weight'"),
    ],
)
def test_a_bad_gguf_adapter_is_refused_by_name(llama, case, message):
    root, config, checkpoint, peft_dir = llama
    pair = {"a": np.zeros((4, 64), np.float32), "b": np.zeros((64, 4), np.float32)}
    extra = {
        "unknown": {"blk.0.attn_fancy.weight.lora_a": pair["a"], "blk.0.attn_fancy.weight.lora_b": pair["b"]},
        "kv_b": {"blk.1.attn_kv_b.weight.lora_a": pair["a"], "blk.1.attn_kv_b.weight.lora_b": pair["b"]},
        "not-lora": {"blk.0.attn_q.weight": pair["b"]},
        "no-layer": {"blk.7.attn_q.weight.lora_a": pair["a"], "blk.7.attn_q.weight.lora_b": pair["b"]},
    }.get(case)
    path = write_lora_gguf(
        peft_dir,
        root / f"{case}.gguf",
        "qwen3" if case == "arch" else "llama",
        config,
        file_type="model" if case == "model" else "adapter",
        extra=extra,
    )
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, dtype="float32", num_kv_blocks=32, lora_modules=(("bad", path),))
