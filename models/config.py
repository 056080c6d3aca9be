"""HF config.json (+ generation_config.json) -> one frozen `ModelConfig`.

Model classes read their hyper-parameters from `hf_config` (like vLLM); this file
only decides the few things the engine needs to agree on: architecture, serving
dtype, `max_model_len` and the EOS ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from models.registry import MODEL_REGISTRY, get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    path: str

    def __post_init__(self) -> None:
        if self.architecture not in MODEL_REGISTRY:
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} outside the vocabulary ({self.vocab_size})")


def _cpu_has_bf16() -> bool:
    if "AVX512_BF16" in torch.backends.cpu.get_cpu_capability() or "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' = bfloat16 where the hardware computes it natively, else float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and _cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def read_architecture(config_path: Path) -> str:
    """The checkpoint's architecture, checked against the registry before transformers parses anything."""
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json at {config_path}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    architectures = raw.get("architectures") or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch
    raise ValueError(
        f"{config_path}: unsupported architecture {architectures or '(none given)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )


def load_hf_config(checkpoint_dir: Path) -> tuple[PretrainedConfig, str]:
    """(transformers config, architecture) of a checkpoint directory.

    transformers 5 folds the classic `rope_theta` / `rope_scaling` keys into
    `rope_parameters`, so both spellings of config.json give the same config.
    """
    architecture = read_architecture(checkpoint_dir / "config.json")
    hf_config = AutoConfig.from_pretrained(checkpoint_dir)  # never trust_remote_code
    return hf_config, architecture


def _as_ids(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_eos_token_ids(checkpoint_dir: Path, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """generation_config.json wins (chat models list several EOS ids there), then config.json."""
    gen_path = checkpoint_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            ids = _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{gen_path}: cannot read eos_token_id: {e}") from None
        if ids:
            return ids
    return _as_ids(getattr(hf_config, "eos_token_id", None))


def sliding_window(hf_config: PretrainedConfig) -> int | None:
    """The attention window if any layer uses one (Mistral; Gemma 2/3; Qwen2/3 with use_sliding_window)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def layer_windows(hf_config: PretrainedConfig) -> list[int | None]:
    """Each layer's attention window as transformers applies it (None: full causal attention):
    Mistral's `sliding_window` on every layer; Qwen2/3's and Gemma's on the layers that
    `layer_types` marks "sliding_attention" (Qwen2/3: only with use_sliding_window)."""
    window = sliding_window(hf_config)
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None or hf_config.model_type == "mistral":  # transformers' Mistral ignores layer_types
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _rope_types(hf_config: PretrainedConfig) -> set[str]:
    """The rope_type of every layer type (transformers 5 nests rope_parameters by layer type for Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)]
    return {p.get("rope_type", "default") for p in nested or [params]}


def resolve_max_model_len(hf_config: PretrainedConfig, requested: int | None, serves_windows: bool = False) -> int:
    """Default: max_position_embeddings.  Longer only with RoPE scaling, and past a sliding window
    only where the model class attends within it (`serves_windows`).

    A class without windows in its attention computes full causal attention.  Up to the window
    length that is exactly what a sliding-window model computes, so instead of silently attending
    too far it serves at most `sliding_window` tokens per sequence.
    """
    trained = getattr(hf_config, "max_position_embeddings", None)
    if requested is not None and requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested is not None:
        max_len = requested
    elif trained is not None:
        max_len = trained
    else:
        raise ValueError("config has no max_position_embeddings; pass max_model_len")
    if trained is not None and max_len > trained:
        rope_type = ", ".join(sorted(_rope_types(hf_config) - {"default"})) or "default"
        if rope_type == "default":
            raise ValueError(
                f"max_model_len {max_len} > max_position_embeddings {trained} and the config has no RoPE scaling"
            )
        logger.warning(
            "max_model_len %d exceeds max_position_embeddings %d (rope_type %s)", max_len, trained, rope_type
        )
    window = sliding_window(hf_config)
    if window is not None and window < max_len and not serves_windows:
        logger.warning(
            "sliding_window %d < max_model_len %d: capping max_model_len to %d (attention here is full, "
            "which equals sliding-window attention only up to the window)",
            window,
            max_len,
            window,
        )
        max_len = window
    return max_len


def build_model_config(
    hf_config: PretrainedConfig,
    architecture: str,
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> ModelConfig:
    if getattr(hf_config, "rope_parameters", None) is not None or getattr(hf_config, "rope_theta", None):
        hf_config.standardize_rope_params()  # one `rope_parameters` dict whatever the spelling
    return ModelConfig(
        hf_config=hf_config,
        architecture=architecture,
        dtype=resolve_dtype(dtype, device),
        max_model_len=resolve_max_model_len(
            hf_config, max_model_len, getattr(get_model_class(architecture), "serves_sliding_window", False)
        ),
        vocab_size=int(hf_config.vocab_size),
        eos_token_ids=tuple(eos_token_ids),
        path=str(path),
    )
