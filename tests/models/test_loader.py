"""Loader and ModelConfig: sharded safetensors, refusals and the clear errors they give."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import resolve_dtype, resolve_max_model_len
from models.llama import LlamaForCausalLM
from models.loader import load_model
from models.registry import MODEL_REGISTRY, get_model_class
from tests.models.conftest import assert_logits_close, paged_forward


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def logits_of(loaded, ids):
    caches = loaded.model.kv_cache_spec(torch.float32).allocate(4, 16, "cpu")
    return paged_forward(loaded.model, caches, [(0, 0, ids)], [[2, 0, 3]], 16)[0]


def test_sharded_checkpoint_loads(make_checkpoint):
    path, hf_model = make_checkpoint("llama", max_shard_size="40KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert (path / "model.safetensors.index.json").is_file() and len(shards) > 2
    loaded = load_model(str(path), dtype="float32")
    ids = list(range(3, 40))
    with torch.no_grad():
        assert_logits_close(logits_of(loaded, ids), hf_model(input_ids=torch.tensor([ids])).logits[0])


def test_model_is_eval_in_dtype_with_tokenizer_template_and_eos(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), dtype="float32")
    assert not loaded.model.training
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())
    config = loaded.config
    assert (config.architecture, config.max_model_len, config.vocab_size) == ("LlamaForCausalLM", 128, 300)
    assert config.eos_token_ids == (2,)  # generation_config.json written by save_pretrained
    assert config.path == str(tiny_llama_dir)
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_eos_list_in_generation_config_wins(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert load_model(str(path), dtype="float32").config.eos_token_ids == (2, 1)


def test_chat_template_from_jinja_file(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = load_model(str(path), dtype="float32").tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[x]"


def test_default_alias_goes_through_fetch(tiny_llama_dir, monkeypatch):
    import models.fetch

    monkeypatch.setattr(models.fetch, "fetch_model", lambda model, cache=None: tiny_llama_dir)
    assert load_model("SmolLM2-135M-Instruct", dtype="float32").config.path == str(tiny_llama_dir)
    assert load_model("smollm2", dtype="float32").config.path == str(tiny_llama_dir)


def test_pickle_checkpoint_is_refused(tiny_llama_dir, tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", path / "config.json")
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), path / "pytorch_model.bin")
    for target in (path, path / "pytorch_model.bin"):
        with pytest.raises(ValueError, match="pytorch_model.bin: refusing to load a pickle checkpoint"):
            load_model(str(target), dtype="float32")


def test_missing_paths_are_named(tiny_llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at .*nowhere"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no GGUF file at .*absent.gguf"):
        load_model(str(tmp_path / "absent.gguf"))
    path = copy_dir(tiny_llama_dir, tmp_path / "no-weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json in .*no-weights"):
        load_model(str(path), dtype="float32")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json at .*no-weights/config.json"):
        load_model(str(path), dtype="float32")


def test_missing_shard_is_named(make_checkpoint):
    path, _ = make_checkpoint("llama", max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {shard.name}, which is missing"):
        load_model(str(path), dtype="float32")


def test_unsupported_architecture_names_config_and_supported(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "gpt2")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError,
        match=r"gpt2/config.json: unsupported architecture \['GPT2LMHeadModel'\]; "
        r"supported: .*LlamaForCausalLM.*Qwen3ForCausalLM",
    ):
        load_model(str(path), dtype="float32")


def rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_shape_mismatch_names_file_tensor_and_shapes(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "bad-shape")
    name = "model.layers.1.self_attn.k_proj.weight"  # (2 kv heads * 16, 64): one of the fused q/k/v shards
    rewrite_weights(path, lambda t: t.__setitem__(name, t[name][:16]))
    with pytest.raises(
        ValueError, match=rf"model.safetensors: tensor '{name}': checkpoint shape \(16, 64\) != model shape \(32, 64\)"
    ):
        load_model(str(path), dtype="float32")


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "missing")
    rewrite_weights(path, lambda t: (t.pop("model.layers.0.mlp.up_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(
        ValueError, match="no tensor for parameter.*model.layers.0.mlp.gate_up_proj.weight, model.norm.weight"
    ):
        load_model(str(path), dtype="float32")


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "extra")
    rewrite_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.extra.weight' \(3,\) does not belong"):
        load_model(str(path), dtype="float32")


def test_max_model_len_rules(tiny_llama_dir, caplog):
    config = load_model(str(tiny_llama_dir), dtype="float32", max_model_len=50).config
    assert config.max_model_len == 50
    hf = config.hf_config
    with pytest.raises(
        ValueError, match="max_model_len 256 > max_position_embeddings 128 and the config has no RoPE scaling"
    ):
        resolve_max_model_len(hf, 256)
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        resolve_max_model_len(hf, 0)
    scaled = hf.__class__(
        **{**hf.to_dict(), "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    )
    with caplog.at_level(logging.WARNING, logger="models.config"):
        assert resolve_max_model_len(scaled, 256) == 256
    assert "exceeds max_position_embeddings" in caplog.text


def test_resolve_dtype(monkeypatch):
    import models.config

    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8")
    monkeypatch.setattr(models.config, "_cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(models.config, "_cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32


def test_registry_serves_llama_family_and_rejects_unknown():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(arch) is LlamaForCausalLM
    assert "DeepseekV2ForCausalLM" in MODEL_REGISTRY
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: "):
        get_model_class("GPT2LMHeadModel")
