"""HF architecture name (config.json `architectures`) -> model class.

Entries are (module, class name) and imported only when a checkpoint asks for
them, so listing an architecture costs nothing and a model file with heavy
imports is not loaded by a server that never serves it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PretrainedConfig

    from models.causal_lm import CausalLM

    # A model class, as the loader builds it: cls(hf_config, max_model_len).
    ModelClass = Callable[[PretrainedConfig, int], CausalLM]

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("models.qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.qwen_moe", "QwenMoeForCausalLM"),
    "Phi3ForCausalLM": ("models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("models.gemma", "Gemma2ForCausalLM"),  # model_type gemma2
    "Gemma3ForCausalLM": ("models.gemma", "Gemma3ForCausalLM"),  # model_type gemma3_text
    "DeepseekV2ForCausalLM": ("models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek", "DeepseekV3ForCausalLM"),
}


def get_model_class(architecture: str) -> ModelClass:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    module_name, class_name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module_name), class_name)
