"""Read a llama.cpp GGUF file as an HF checkpoint: config, weights, tokenizer.

Everything that names things comes from the two projects' own tables, not from ours:

    metadata -> config     transformers' GGUF_CONFIG_MAPPING (`{arch}.*` keys -> config fields),
                           then transformers' config class for the architecture; for DeepSeek's
                           `deepseek2`, which that map lacks, our one small table (_DEEPSEEK2_KEYS)
    tensor names           gguf-py's TensorNameMap over the state-dict names of transformers'
                           model for that config (transformers' `get_gguf_hf_weights_map`); for
                           the MoE architectures also over the converter's names for what it writes
                           in its own layout (_CONVERTER_TENSORS: stacked experts, deepseek2's split
                           kv_b_proj), which are then regrouped (_to_hf_layout)
    per-tensor fixes       transformers' TensorProcessor for the architecture (llama's Q/K row
                           order, Gemma's norm offset), applied to the stored tensor
    parsing, dequantizing  gguf-py (GGUFReader, quants.dequantize)

An architecture is served when transformers reads its metadata (or, for `deepseek2`, we do) and
our registry has its model class. Weights are read one tensor at a time as the loader iterates,
so the float model is never held twice. The tokenizer comes from transformers' GGUF support;
converting it takes seconds, so the result is saved under the cache directory, keyed by the metadata.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from models.layers.quantization import (
    QuantizedWeight,
    StoredFormat,
    pack_int2,
    pack_int4,
    pack_int5,
    pack_int6,
    with_sub_scales,
)
from models.registry import MODEL_REGISTRY

# GGUF `general.architecture` -> the key of transformers' GGUF_CONFIG_MAPPING, and -> the
# transformers model_type, where they differ (transformers' load_gguf_checkpoint renames the same).
_CONFIG_KEYS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# `{arch}.*` keys that transformers' map leaves out -> the HF config field they fill (its qwen2moe /
# qwen3moe maps drop the expert sizes, which its own GGUF loader then takes from the config defaults).
_UNMAPPED_KEYS = {
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# transformers has no GGUF map for DeepSeek V2/V3 (llama.cpp's `deepseek2`): the `deepseek2.*` keys that
# llama.cpp's converter (DeepseekV2Model) writes, named as the HF DeepseekV2/V3 config field they fill.
_DEEPSEEK2_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "rope.dimension_count": "qk_rope_head_dim",
    "attention.q_lora_rank": "q_lora_rank",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.value_length_mla": "v_head_dim",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
}
# What llama.cpp takes an absent key to mean, where HF's config defaults differ (V3's are DeepSeek-V3's sizes).
_DEEPSEEK2_ABSENT = {
    "q_lora_rank": None,
    "n_routed_experts": None,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
}
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # deepseek2.expert_gating_func; absent: softmax, as llama.cpp
# Per layer, the names llama.cpp's converter gives what it writes in its own layout (gguf-py's
# TensorNameMap knows them): routed experts stacked into 3-D tensors; for deepseek2 also kv_b_proj split
# into k_b (transposed per head) and v_b, V3's correction bias as a `.bias`. transformers' map names the
# stacked gate and up experts only as its fused `experts.gate_up_proj`, which its processor fills from
# both inside its own loader; ours regroups them into per-expert tensors instead.
_STACKED_EXPERT_TENSORS = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")
_CONVERTER_TENSORS = {
    "deepseek2": _STACKED_EXPERT_TENSORS
    + ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight", "mlp.gate.e_score_correction.bias"),
    "qwen2moe": _STACKED_EXPERT_TENSORS,
    "qwen3moe": _STACKED_EXPERT_TENSORS,
}
_STACKED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_KV_B_HALF = re.compile(r"(.+)\.(k|v)_b_proj\.weight$")
# Tensors that carry metadata rather than weights; read into the config.
_ROPE_FREQS = "rope_freqs.weight"

# GGUF types kept as stored (models/layers/quantization.py). Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 keep their fp16 factors.
# The K-quants keep their fp16 d (and -dmin) per 256 as the scales and their 6-bit sub-scales in the groups'
# bytes: Q4_K's and Q5_K's uint8 sc and mn behind each 32 values' nibbles (and Q5_K's high bits): 4.625 bits a
# weight for Q4_K's 4.5, 5.625 for Q5_K's 5.5; Q3_K's and Q6_K's int8 sc (per 16) in int6's groups.
# Q3_K's q3 in [-4, 3] is int6's q - 32: served as int6, exact, 6.5625 bits a weight for its 3.4375.
# Q2_K keeps its scale bytes (sc | mn << 4 per 16) behind each 32 values' 2-bit bytes: 2.625 bits, its own.
# IQ4_NL and IQ4_XS keep their nibbles as indices into the IQ4 table (int4 through a table): IQ4_NL its fp16 d
# per 32 (4.5 bits a weight, the file's), IQ4_XS its fp16 d per 256 and ls - 32 as an int8 per 32 (4.3125 for 4.25).
EXACT_FORMATS = {
    GGMLQuantizationType.Q2_K: StoredFormat(2, 256, torch.float16, sub_scales=True),
    GGMLQuantizationType.IQ4_NL: StoredFormat(4, 32, torch.float16, table=True),
    GGMLQuantizationType.IQ4_XS: StoredFormat(4, 256, torch.float16, sub_scales=True, table=True),
    GGMLQuantizationType.Q3_K: StoredFormat(6, 256, torch.float16),
    GGMLQuantizationType.Q4_0: StoredFormat(4, 32, torch.float16),
    GGMLQuantizationType.Q4_1: StoredFormat(4, 32, torch.float16),
    GGMLQuantizationType.Q4_K: StoredFormat(4, 256, torch.float16, sub_scales=True),
    GGMLQuantizationType.Q5_0: StoredFormat(5, 32, torch.float16),
    GGMLQuantizationType.Q5_1: StoredFormat(5, 32, torch.float16),
    GGMLQuantizationType.Q5_K: StoredFormat(5, 256, torch.float16, sub_scales=True),
    GGMLQuantizationType.Q6_K: StoredFormat(6, 256, torch.float16),
    GGMLQuantizationType.Q8_0: StoredFormat(8, 32, torch.float16),
}
_DENSE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_REQUIRED = object()  # _field default: the key must be present


class GGUFError(ValueError):
    """A GGUF file this reader cannot turn into a checkpoint we serve."""


@cache
def supported_architectures() -> dict[str, str]:
    """GGUF architecture -> HF architecture name, for every architecture whose metadata
    transformers reads (and `deepseek2`, which we read) and whose model class our registry has."""
    supported = {}
    for config_key in GGUF_CONFIG_MAPPING:
        arch = next((a for a, k in _CONFIG_KEYS.items() if k == config_key), config_key)
        hf_architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(_MODEL_TYPES.get(arch, arch))
        if hf_architecture in MODEL_REGISTRY:
            supported[arch] = hf_architecture
    if {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"} <= set(MODEL_REGISTRY):
        supported["deepseek2"] = "DeepseekV2ForCausalLM"  # or V3: read_config tells them apart per file
    return supported


def check_architecture(path: str | os.PathLike) -> str:
    """The file's GGUF architecture if we serve it; GGUFError (one line naming the file, the
    architecture and what is supported) otherwise. Reads the header only: cheap."""
    reader = _open(Path(path))
    return _architecture(reader, Path(path))


def load_gguf(
    path: str | os.PathLike, cache: Path | None = None, keep_quantized: bool = False
) -> tuple[PretrainedConfig, GGUFWeights, PreTrainedTokenizerBase, tuple[int, ...]]:
    """-> (hf_config, weights, tokenizer, eos_token_ids) for a GGUF file of an architecture we serve.

    `weights` is re-iterable and yields (HF name, float32 or float16 tensor) one tensor at
    a time; with `keep_quantized`, tensors of an EXACT_FORMATS type come as QuantizedWeight
    instead. `cache` is where the converted tokenizer is kept (default: models.fetch.cache_dir()).
    """
    path = Path(path)
    reader = _open(path)
    config = read_config(reader, path)
    weights = GGUFWeights(reader, config, path, keep_quantized)
    tokenizer = load_tokenizer(path, cache, reader)
    chat_template = _field(reader, "tokenizer.chat_template", None)
    if chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    return config, weights, tokenizer, eos_token_ids(reader)


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:  # the package's messages ("GGUF magic invalid") name no file
        raise GGUFError(f"{path}: not a readable GGUF file: {exc}") from exc


def _architecture(reader: GGUFReader, path: Path) -> str:
    arch = _field(reader, "general.architecture", None)
    if arch not in supported_architectures():
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(supported_architectures()))})"
        )
    return arch


def read_config(reader: GGUFReader, path: Path) -> PretrainedConfig:
    """The HF config: `{arch}.*` metadata through transformers' map into its config class, plus what
    that map leaves out (head_dim, rotary dim, RoPE scaling, biases, tied embeddings, special ids)."""
    arch = _architecture(reader, path)
    model_type = _MODEL_TYPES.get(arch, arch)
    config_key = _CONFIG_KEYS.get(arch, arch)

    def meta(key, default=_REQUIRED):
        return _field(reader, f"{arch}.{key}", default, path)

    for key in ("embedding_length", "block_count", "attention.head_count"):
        meta(key)  # required: a clear error rather than a config class default
    hidden_size, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    tensors = {t.name: t for t in reader.tensors}
    if arch == "deepseek2":
        model_type, params = _deepseek2_params(reader, meta, tensors, path)
        head_dim = params["qk_rope_head_dim"]  # HF's DeepSeek configs: head_dim is the rotary part
    else:
        params = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(config_key, {}))
        mapping = GGUF_CONFIG_MAPPING[config_key]
        for key in reader.fields:
            if key.startswith(f"{arch}.") and mapping.get(key[len(arch) + 1 :]) not in (None, -1):
                params[mapping[key[len(arch) + 1 :]]] = _field(reader, key)
        head_dim = int(meta("attention.key_length", hidden_size // num_heads))
        params["head_dim"] = head_dim
        if isinstance(params.get("num_key_value_heads"), list):  # per-layer counts: one value or refuse
            counts = set(params["num_key_value_heads"])
            if len(counts) != 1:
                raise GGUFError(f"{path}: per-layer KV head counts {sorted(counts)} are not supported")
            params["num_key_value_heads"] = counts.pop()
    rotary_dim = int(meta("rope.dimension_count", head_dim))

    vocab_size = len(_field(reader, "tokenizer.ggml.tokens", _REQUIRED, path))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    if int(embed.shape[1]) != vocab_size:  # GGUF shapes are reversed: ne = (hidden, vocab)
        raise GGUFError(f"{path}: {vocab_size} tokens but token_embd.weight has {int(embed.shape[1])} rows")
    params["vocab_size"] = vocab_size
    params["tie_word_embeddings"] = "output.weight" not in tensors
    if "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors:
        params["attention_bias"] = True
    if "blk.0.ffn_up.bias" in tensors:
        params["mlp_bias"] = True
    for key in ("bos", "eos", "padding"):
        if (token := _field(reader, f"tokenizer.ggml.{key}_token_id", None)) is not None:
            params[f"{'pad' if key == 'padding' else key}_token_id"] = int(token)

    for key, field in _UNMAPPED_KEYS.items():
        if (value := meta(key, None)) is not None:
            params[field] = value
    if model_type in _GEMMA_27B_LAYERS:
        # Not in the file: llama.cpp scales queries by head_dim, or by hidden / heads for the 27B
        # models (recognised by their layer count), as their HF configs' query_pre_attn_scalar say.
        big = int(meta("block_count")) == _GEMMA_27B_LAYERS[model_type]
        params["query_pre_attn_scalar"] = hidden_size // num_heads if big else head_dim
    try:
        config = AutoConfig.for_model(model_type, **params)
    except (TypeError, ValueError) as exc:
        raise GGUFError(f"{path}: metadata does not make a {model_type} config: {exc}") from None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    scaling = _rope_scaling(meta, path)
    log_mul = meta("rope.scaling.yarn_log_multiplier", None) if arch == "deepseek2" else None
    if log_mul and scaling.get("rope_type") == "yarn":
        # deepseek2 writes 0.1 * mscale_all_dim, and llama.cpp scales attention as if mscale were the
        # same (DeepSeek's releases set both equal); HF's YaRN reads both.
        scaling["mscale"] = scaling["mscale_all_dim"] = float(np.float32(log_mul) / np.float32(0.1))
    if rotary_dim != head_dim:
        scaling["partial_rotary_factor"] = rotary_dim / head_dim
    if _ROPE_FREQS in tensors:
        # Llama 3.x stores its scaling as per-frequency divisors of the base frequencies
        # (llama.cpp's converter computes them from HF's llama3 parameters, which it drops).
        factors = np.asarray(dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type), np.float32)
        if factors.size != rotary_dim // 2:
            raise GGUFError(f"{path}: {_ROPE_FREQS} has {factors.size} factors for a rotary dim of {rotary_dim}")
        config.rope_freq_factors = factors.reshape(-1).tolist()
    if scaling:
        rope = config.rope_parameters
        # Per-layer-kind RoPE (Gemma 3): the file's scaling is the global layers'.
        target = rope["full_attention"] if "full_attention" in rope else rope
        target.update(scaling)
    return config


def _deepseek2_params(reader: GGUFReader, meta, tensors: dict, path: Path) -> tuple[str, dict]:
    """-> (model_type, config fields) of a `deepseek2` file. V3 is told from V2 as llama.cpp does:
    sigmoid gating with `exp_probs_b` (the router's correction bias) tensors."""
    params = dict(_DEEPSEEK2_ABSENT)
    params.update(
        {
            field: _field(reader, f"deepseek2.{key}")
            for key, field in _DEEPSEEK2_KEYS.items()
            if reader.get_field(f"deepseek2.{key}") is not None
        }
    )
    params["qk_nope_head_dim"] = int(meta("attention.key_length_mla")) - int(params["qk_rope_head_dim"])
    # head_count_kv is 1: llama.cpp runs MLA as MQA over the latent; HF counts the decompressed heads.
    params["num_key_value_heads"] = params["num_attention_heads"]
    gating = int(meta("expert_gating_func", 1))
    if gating not in _GATING_FUNCS:
        raise GGUFError(f"{path}: expert gating function {gating} is not supported (1 softmax, 2 sigmoid)")
    params["scoring_func"] = _GATING_FUNCS[gating]
    if params["scoring_func"] == "softmax":
        # DeepSeek's V2 releases group experts (n_group > 1) exactly when they route group-limited.
        params["topk_method"] = "group_limited_greedy" if params["n_group"] > 1 else "greedy"
        return "deepseek_v2", params
    if not any(name.endswith(".exp_probs_b.bias") for name in tensors):
        raise GGUFError(f"{path}: sigmoid expert gating without exp_probs_b tensors is not supported")
    params["topk_method"] = "noaux_tc"
    params["rope_interleave"] = True  # llama.cpp rotates deepseek2's rope dims as adjacent pairs
    return "deepseek_v3", params


def _rope_scaling(meta, path: Path) -> dict:
    scaling = meta("rope.scaling.type", None)
    factor = meta("rope.scaling.factor", None)
    if scaling is None and meta("rope.scale_linear", None) is not None:  # older files
        scaling, factor = "linear", meta("rope.scale_linear")
    if scaling in (None, "none"):
        return {}
    if scaling not in ("linear", "yarn"):
        raise GGUFError(f"{path}: unsupported rope scaling type {scaling!r} (supported: linear, yarn)")
    params = {"rope_type": scaling, "factor": float(factor)}
    original = meta("rope.scaling.original_context_length", None)
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    if scaling == "yarn":
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if (value := meta(gguf_key, None)) is not None:
                params[hf_key] = float(value)
    return params


def eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn when the file names a different one."""
    ids = [_field(reader, f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def tensor_name_map(config: PretrainedConfig, arch: str) -> dict[str, str]:
    """GGUF tensor name -> HF name, from gguf-py's TensorNameMap over the parameter names of
    transformers' model for `config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    if arch not in _CONVERTER_TENSORS:
        return get_gguf_hf_weights_map(hf_model, _processor(config, arch))
    names = get_gguf_hf_weights_map(hf_model, _processor(config, arch), model_type=arch)
    gguf_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    gguf_names = get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    for layer in range(config.num_hidden_layers):
        for name in _CONVERTER_TENSORS[arch]:  # named as the converter had them; _to_hf_layout regroups
            name = f"model.layers.{layer}.{name}"
            gguf_name = gguf_names.get_name(name, try_suffixes=(".weight", ".bias"))
            names[gguf_name] = name.replace("e_score_correction.bias", "e_score_correction_bias")
    return names


def _to_hf_layout(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The converter's layout back to the HF names our MoE models load (models/layers/moe.py):

    experts.gate_proj.weight (E, inter, hidden)  ->  experts.{e}.gate_proj.weight (inter, hidden)
    k_b_proj.weight (H, L, nope) + v_b_proj.weight (H, v, L)
                                                 ->  kv_b_proj.weight (H * (nope + v), L), per head nope rows then v
                                                         (deepseek2)
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in pairs:
        if m := _STACKED_EXPERTS.match(name):
            for expert in range(tensor.shape[0]):
                yield f"{m[1]}.{expert}.{m[2]}.weight", tensor[expert]
        elif m := _KV_B_HALF.match(name):
            halves.setdefault(m[1], {})[m[2]] = tensor
            if len(halves[m[1]]) == 2:
                pair = halves.pop(m[1])
                k_b, v_b = pair["k"], pair["v"]
                per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # (H, nope + v, L)
                yield f"{m[1]}.kv_b_proj.weight", per_head.reshape(-1, per_head.shape[-1])
        else:
            yield name, tensor
    if halves:
        raise GGUFError(f"k_b / v_b without its other half: {sorted(halves)}")


def _processor(config: PretrainedConfig, arch: str) -> TensorProcessor:
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


class GGUFWeights:
    """(HF name, tensor) pairs of a GGUF file, read lazily as they are iterated: dequantized,
    or (`keep_quantized`) as QuantizedWeight where the type maps exactly onto one."""

    def __init__(self, reader: GGUFReader, config: PretrainedConfig, path: Path, keep_quantized: bool = False):
        self._reader = reader
        self.keep_quantized = keep_quantized
        arch = _field(reader, "general.architecture")
        self._processor = _processor(config, arch)
        names = tensor_name_map(config, arch)
        self._regroup = arch in _CONVERTER_TENSORS
        self._names: list[tuple[int, str]] = []
        checked: set[GGMLQuantizationType] = set()
        for index, tensor in enumerate(reader.tensors):
            if tensor.name == _ROPE_FREQS:
                continue  # read into the config
            if tensor.tensor_type not in checked:
                _check_dequantizable(tensor.tensor_type, tensor.name, path)
                checked.add(tensor.tensor_type)
            hf_name = names.get(tensor.name)
            if hf_name is None:
                raise GGUFError(f"{path}: unexpected tensor {tensor.name!r} for a {arch} model")
            self._names.append((index, hf_name))

    def __len__(self) -> int:
        return len(self._names)

    def stored_types(self) -> dict[str, GGMLQuantizationType]:
        """HF name -> the GGUF type the file stores it in."""
        types = {}  # under the names __iter__ yields
        for index, name in self._names:
            tensor = self._reader.tensors[index]
            if self._regroup and (m := _STACKED_EXPERTS.match(name)):
                num_experts = int(tensor.shape[-1])  # GGUF dims fastest-first: (hidden, inter, experts)
                types.update({f"{m[1]}.{e}.{m[2]}.weight": tensor.tensor_type for e in range(num_experts)})
            elif self._regroup and (m := _KV_B_HALF.match(name)):
                types[f"{m[1]}.kv_b_proj.weight"] = tensor.tensor_type
            else:
                types[name] = tensor.tensor_type
        return types

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        pairs = ((hf_name, self._tensor(self._reader.tensors[index])) for index, hf_name in self._names)
        # 3-D tensors (stacked experts, deepseek2's k_b / v_b) come dequantized: _tensor keeps only 2-D
        # ones quantized; the expert slices are then requantized at load where the model quantizes.
        yield from _to_hf_layout(pairs) if self._regroup else pairs

    def _process(self, array: np.ndarray, name: str) -> np.ndarray:
        processed = self._processor.process(weights=array, name=name).weights
        if processed.ndim > max(array.ndim, 2) and processed.shape[0] == 1:
            # qwen2moe's processor puts a unit axis in front of the shared expert gate, for files that
            # store it 1-D; one stored as its (1, hidden) matrix already has it.
            processed = processed[0]
        return processed

    def _tensor(self, tensor) -> torch.Tensor | QuantizedWeight:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        if self.keep_quantized and tensor.tensor_type in EXACT_FORMATS and len(shape) == 2:
            # What the architecture's processor does to a column of row numbers: nothing, or a
            # reordering of rows (llama's Q/K), which the stored blocks follow; else dequantize.
            rows = self._process(np.arange(shape[0], dtype=np.float64).reshape(-1, 1), tensor.name).reshape(-1)
            if rows.shape == (shape[0],) and np.array_equal(np.sort(rows), np.arange(shape[0])):
                weight = quantized_weight(np.asarray(tensor.data), tensor.tensor_type, *shape)
                if not np.array_equal(rows, np.arange(shape[0])):
                    weight = weight.rows(torch.from_numpy(rows.astype(np.int64)))
                return weight
        if tensor.tensor_type == GGMLQuantizationType.F16:
            array = np.asarray(tensor.data).reshape(shape)  # stays float16: half the memory
        else:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        array = self._process(array, tensor.name)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # still a view of the read-only memmap: copy it out
        return torch.from_numpy(array)


def serving_format(qtype: GGMLQuantizationType) -> StoredFormat | None:
    """The format that a tensor of this type is served in by `--quantization auto` (None: dense).
    Q2_K (int2 with its sub-scales), Q4_0/Q4_1/Q4_K (int4), Q5_0/Q5_1/Q5_K (int5: int4 plus a plane of high
    bits; the K-quants with their sub-scales), Q3_K and Q6_K (int6: int4 plus two planes of high bits and the
    sub-scales; Q3_K's 3-bit values and 6-bit scales are a subset of Q6_K's), Q8_0 (int8) and IQ4_NL, IQ4_XS
    (int4 through their table) are served as stored, every weight the same number (EXACT_FORMATS). Types with
    no exact mapping are requantized from their dequantized values: 5 bits and more (Q8_1, Q8_K) to int8,
    fewer (the other IQ*) to int4."""
    if qtype in EXACT_FORMATS:
        return EXACT_FORMATS[qtype]
    if qtype in _DENSE_TYPES:
        return None
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    return StoredFormat(8 if block_bytes * 8 / block_values >= 5 else 4, 32, torch.float32)


def quantized_weight(data: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> QuantizedWeight:
    """Raw GGUF blocks (rows, bytes per row) uint8 of an EXACT_FORMATS tensor -> the same
    numbers as a QuantizedWeight (Q2_K, Q4_K, Q5_K: d, -dmin and their sc, mn as stored).

        Q8_0  [d f16 | 32 x int8]                          w = d q
        Q4_0  [d f16 | 16 bytes]                           w = d q - 8 d
        Q4_1  [d f16 | m f16 | 16 bytes]                   w = d q + m
        Q4_K  [d f16 | dmin f16 | 12 bytes of 6-bit (sc, mn) x 8 | 128 bytes]
              8 sub-blocks of 32:                          w = d sc q - dmin mn
        Q5_0  [d f16 | qh 4 bytes | 16 bytes]              w = d q - 16 d    (q's bit 4: bit j of qh)
        Q5_1  [d f16 | m f16 | qh 4 bytes | 16 bytes]      w = d q + m
        Q5_K  [d f16 | dmin f16 | 12 bytes of (sc, mn) | qh 32 bytes | 128 bytes]
              as Q4_K; sub-block s's bit 4 of value j: bit s of qh[j]
        Q2_K  [16 bytes sc | mn << 4 | qs 64 bytes | d f16 | dmin f16]
              16 sub-blocks of 16:                         w = d sc q - dmin mn, q in [0, 3]
        Q6_K  [ql 128 bytes | qh 64 bytes | 16 x int8 sc | d f16]
              16 sub-blocks of 16:                         w = d sc (q - 32)
        Q3_K  [hmask 32 bytes | qs 64 bytes | 12 bytes of 6-bit sc x 16 | d f16]
              16 sub-blocks of 16:                         w = d (sc - 32) q3, q3 in [-4, 3]
              -> int6 with q = q3 + 32 and sub-scale sc - 32
        IQ4_NL [d f16 | 16 bytes]                          w = d IQ4[q]
        IQ4_XS [d f16 | scales_h u16 | scales_l 4 bytes | 128 bytes]
              8 sub-blocks of 32, 6-bit ls:                w = d (ls - 32) IQ4[q]
    Q4_0/Q4_1/IQ4_NL/IQ4_XS pack 32 values as we do (low nibbles: values 0-15), Q5_0/Q5_1 too with their qh
    moved behind the nibbles; the K-quants pack two sub-blocks per 32 bytes (low nibbles: the
    first, high: the second) and are repacked.
    """
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(rows, cols // block_values, block_bytes)  # (rows, blocks, bytes)

    def f16(lo: int) -> np.ndarray:  # the fp16 factor at byte `lo` of every block, (rows, blocks) float16
        return np.ascontiguousarray(blocks[..., lo : lo + 2]).view(np.float16)[..., 0]

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    if qtype == GGMLQuantizationType.Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return QuantizedWeight(8, tensor(q), tensor(f16(0)), None, cols)
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        d = f16(0)
        m = (d.astype(np.float32) * -8.0).astype(np.float16) if qtype == GGMLQuantizationType.Q4_0 else f16(2)
        qs = blocks[..., 2:] if qtype == GGMLQuantizationType.Q4_0 else blocks[..., 4:]
        return QuantizedWeight(4, tensor(qs.reshape(rows, cols // 2)), tensor(d), tensor(m), cols)
    if qtype == GGMLQuantizationType.IQ4_NL:
        return QuantizedWeight(
            4, tensor(blocks[..., 2:].reshape(rows, cols // 2)), tensor(f16(0)), None, cols, table=True
        )
    if qtype == GGMLQuantizationType.IQ4_XS:
        # gguf-py's own unpacking (quants.IQ4_XS): sub-block s's ls is nibble s % 2 of scales_l[s // 2], then
        # bits 2s, 2s + 1 of scales_h as its bits 4, 5
        high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # (rows, sb, 1)
        high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (rows, sb, 8)
        low = (blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F  # (rows, sb, 4, 2)
        sc = (low.reshape(rows, -1, 8) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        packed = with_sub_scales(tensor(blocks[..., 8:]), tensor(sc.reshape(rows, -1)), None)
        return QuantizedWeight(4, packed, tensor(f16(0)), None, cols, sub_scales=True, table=True)
    if qtype == GGMLQuantizationType.Q4_K:
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))  # (rows * sb, 8)
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 pairs of sub-blocks of 32 bytes
        values = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # (rows, sb, 4, 2, 32)
        packed = pack_int4(torch.from_numpy(np.ascontiguousarray(values.reshape(rows, cols))))
        packed = with_sub_scales(packed, tensor(sc.reshape(rows, -1)), tensor(mn.reshape(rows, -1)))
        return QuantizedWeight(4, packed, tensor(f16(0)), tensor(-f16(2)), cols, sub_scales=True)
    if qtype in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        d = f16(0)
        m = (d.astype(np.float32) * -16.0).astype(np.float16) if qtype == GGMLQuantizationType.Q5_0 else f16(2)
        body = blocks[..., 2:] if qtype == GGMLQuantizationType.Q5_0 else blocks[..., 4:]  # [qh 4 | qs 16]
        packed = np.concatenate((body[..., 4:], body[..., :4]), axis=-1)  # [qs 16 | qh 4]: our int5 group
        return QuantizedWeight(5, tensor(packed.reshape(rows, -1)), tensor(d), tensor(m), cols)
    if qtype == GGMLQuantizationType.Q5_K:
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))  # (rows * sb, 8)
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)  # bit s of byte j: sub-block s, value j
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # (rows, sb, 8, 32)
        qs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)
        low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # (rows, sb, 4, 2, 32)
        values = low.reshape(rows, -1, 8, 32) | (high << 4)
        packed = pack_int5(torch.from_numpy(np.ascontiguousarray(values.reshape(rows, cols))))
        packed = with_sub_scales(packed, tensor(sc.reshape(rows, -1)), tensor(mn.reshape(rows, -1)))
        return QuantizedWeight(5, packed, tensor(f16(0)), tensor(-f16(2)), cols, sub_scales=True)
    if qtype == GGMLQuantizationType.Q2_K:
        # gguf-py's own unpacking (quants.Q2_K): value 128 h + 32 s + j is bits 2s, 2s + 1 of qs[32 h + j]
        qs = blocks[..., 16:80].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 1, 4, 1
        )
        values = torch.from_numpy(np.ascontiguousarray((qs & 0x03).reshape(rows, cols)))
        scale_bytes = blocks[..., :16].reshape(rows, -1, 2)  # (rows, K/32, 2): each group's two sub-blocks
        packed = with_sub_scales(pack_int2(values), tensor(scale_bytes[..., 0]), tensor(scale_bytes[..., 1]))
        return QuantizedWeight(2, packed, tensor(f16(80)), tensor(-f16(82)), cols, sub_scales=True)
    if qtype == GGMLQuantizationType.Q6_K:
        # gguf-py's own unpacking (quants.Q6_K): each 128 values take 64 bytes of ql (low nibbles, then
        # high) and 32 of qh (2 bits each of 4 runs of 32).
        ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(rows, -1, 256)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 1, 4, 1
        )
        qh = (qh & 0x03).reshape(rows, -1, 256)
        values = torch.from_numpy(np.ascontiguousarray((ql | (qh << 4)).reshape(rows, cols)))
        sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1))
        return QuantizedWeight(6, pack_int6(values, sc), tensor(f16(208)), None, cols)
    if qtype == GGMLQuantizationType.Q3_K:
        # gguf-py's own unpacking (quants.Q3_K): value 128 c + 32 s + j has bits 2s, 2s + 1 of qs[32 c + j]
        # as its low 2 bits and bit 4 c + s of hmask[j] as its third (q3 = low - 4 where that bit is 0).
        qs = blocks[..., 32:96].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 1, 4, 1
        )
        hmask = blocks[..., :32].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = (qs & 0x03).reshape(rows, -1, 256) | ((hmask & 1).reshape(rows, -1, 256) << 2)  # q3 + 4 in [0, 7]
        values = torch.from_numpy(np.ascontiguousarray((q + 28).reshape(rows, cols)))  # q3 + 32
        # 16 6-bit scales: low nibbles in bytes 0-7 (scale k: byte k % 8, nibble k // 8), 2 high bits in
        # bytes 8-11 (scale k: byte k % 4, bits 2 (k // 4)); stored + 32.
        low = blocks[..., 96:104].reshape(rows, -1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        high = blocks[..., 104:108].reshape(rows, -1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 4, 1
        )
        sc = ((low & 0x0F).reshape(rows, -1, 16) | ((high & 0x03).reshape(rows, -1, 16) << 4)).astype(np.int8) - 32
        return QuantizedWeight(6, pack_int6(values, tensor(sc.reshape(rows, -1))), tensor(f16(108)), None, cols)
    raise GGUFError(f"GGUF type {qtype.name} is not kept quantized")


def _check_dequantizable(qtype: GGMLQuantizationType, name: str, path: Path) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:  # one zero block: cheap, and asks the gguf package itself what it supports
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:  # also integer tensors (I8, I32, ...), which are no weights
        raise GGUFError(
            f"{path}: tensor {name!r} has type {qtype.name}, which the installed gguf package cannot dequantize"
        ) from None


# LoRA adapters as llama.cpp's convert_lora_to_gguf.py writes them (served by models/layers/lora.py):
# general.type "adapter", adapter.type "lora", adapter.lora.alpha, and per adapted weight W of the
# base (GGUF-named: blk.N.attn_q.weight) W.lora_a (r, in) and W.lora_b (out, r), in the base file's
# row order (llama's Q/K rows permuted, as in the base model's own file).
_LORA_TYPE_KEY, _LORA_ALPHA_KEY = "adapter.type", "adapter.lora.alpha"
_ALORA_KEY = "adapter.alora.invocation_tokens"


def read_lora_gguf(path: str | os.PathLike) -> tuple[str, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """-> (GGUF architecture, alpha, base weight name -> (lora_a, lora_b) in float32) of a LoRA GGUF;
    GGUFError naming the file and the problem for any other GGUF (a model, another adapter type)."""
    path = Path(path)
    reader = _open(path)
    file_type = _field(reader, "general.type", None)
    if file_type != "adapter":
        raise GGUFError(f"{path}: general.type is {file_type!r}, not 'adapter': this GGUF is not a LoRA adapter")
    adapter_type = _field(reader, _LORA_TYPE_KEY, None)
    if adapter_type != "lora":
        raise GGUFError(f"{path}: {_LORA_TYPE_KEY} is {adapter_type!r}, only 'lora' adapters are supported")
    if reader.get_field(_ALORA_KEY) is not None:
        raise GGUFError(f"{path}: activated LoRA ({_ALORA_KEY}) is not supported")
    arch = _field(reader, "general.architecture", None)
    if arch not in supported_architectures():
        raise GGUFError(
            f"{path}: adapter architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(supported_architectures()))})"
        )
    alpha = _field(reader, _LORA_ALPHA_KEY, 0.0)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise GGUFError(f"{path}: {_LORA_ALPHA_KEY} must be a number, got {alpha!r}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        base, _, kind = tensor.name.rpartition(".")
        if kind not in ("lora_a", "lora_b") or not base:
            raise GGUFError(f"{path}: tensor {tensor.name!r} is not a LoRA weight (<weight>.lora_a / .lora_b)")
        _check_dequantizable(tensor.tensor_type, tensor.name, path)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        pairs.setdefault(base, {})[kind] = torch.from_numpy(np.array(array))
    weights = {}
    for base, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise GGUFError(f"{path}: {base} has {next(iter(pair))} but not its pair")
        weights[base] = (pair["lora_a"], pair["lora_b"])
    if not weights:
        raise GGUFError(f"{path}: the adapter holds no LoRA weights")
    return arch, float(alpha), weights


def gguf_architecture(config: PretrainedConfig) -> str | None:
    """The GGUF architecture name of an HF config's model (what a LoRA GGUF for it declares); None
    when we read no GGUF of that architecture."""
    model_type = config.model_type
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return "deepseek2"
    arch = next((a for a, t in _MODEL_TYPES.items() if t == model_type), model_type)
    return arch if arch in supported_architectures() else None


def lora_target_names(arch: str, module_paths: list[str], num_layers: int) -> dict[str, str]:
    """GGUF weight name (blk.N.attn_q.weight) -> HF module path, for the given module paths of a
    model, from gguf-py's TensorNameMap (the converter's own table)."""
    gguf_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(gguf_arch, num_layers)
    found = {}
    for module_path in module_paths:
        gguf_name = names.get_name(module_path)
        if gguf_name is not None:
            found[f"{gguf_name}.weight"] = module_path
    return found


def lora_b_rows(arch: str, config: PretrainedConfig, name: str, lora_b: torch.Tensor) -> torch.Tensor:
    """lora_b (out, r) of GGUF weight `name` in the HF model's row order: the base weight's own
    per-tensor fix (transformers' TensorProcessor: llama's Q/K rows) applied to B's rows."""
    processed = _processor(config, arch).process(weights=lora_b.numpy(), name=name).weights
    return torch.from_numpy(np.array(processed, dtype=np.float32))


def load_tokenizer(path: Path, cache: Path | None = None, reader: GGUFReader | None = None) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a GGUF file, converted once and then read from the cache, where
    it is kept under a hash of the file's metadata (all that the conversion reads) and
    transformers' version: files with the same metadata share one conversion wherever they lie (it
    was keyed by path and mtime, and every GGUF a test wrote added ~0.5 MB to the cache for good).
    `reader`: the file's, where the caller has one (else one is made: ~1-2 s for a 49k-token vocabulary)."""
    if cache is None:
        from models.fetch import cache_dir

        cache = cache_dir()
    path = Path(path).resolve()
    if reader is None:
        reader = GGUFReader(path)
    saved = Path(cache) / "tokenizers" / f"gguf-{_metadata_key(reader)}"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    arch = _field(reader, "general.architecture", None)
    if _CONFIG_KEYS.get(arch, arch) in GGUF_CONFIG_MAPPING:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        # AutoTokenizer first builds transformers' config, which it cannot for deepseek2; the
        # tokenizer itself comes from the file's tokenizer.ggml.* fields alone.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, saved)  # atomic; fails harmlessly if a concurrent load got there first
    except OSError:
        pass  # an unwritable cache only costs the conversion time on the next load
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _metadata_key(reader: GGUFReader) -> str:
    """A hash of every metadata field's bytes as the file holds them (not the tensors), and of
    transformers' version."""
    digest = hashlib.sha256(transformers.__version__.encode())
    for field in reader.fields.values():
        nbytes = sum(int(part.nbytes) for part in field.parts)
        digest.update(reader.data[field.offset : field.offset + nbytes])
    return digest.hexdigest()[:16]


def _field(reader: GGUFReader, key: str, default=_REQUIRED, path: Path | None = None):
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise GGUFError(f"{path}: missing GGUF metadata key {key!r}")
    return default
