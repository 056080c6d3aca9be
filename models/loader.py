"""Load a checkpoint (HF safetensors dir, .gguf file, or the default alias) for serving.

The model is built on the meta device (no memory), materialized uninitialized on
the target device in the serving dtype, and then every checkpoint tensor is read
one at a time and copied into its parameter.  Peak memory is the model plus one
tensor, never a second full copy.  Every parameter must be filled exactly once
(checked), since `to_empty` leaves garbage behind.

Pickle checkpoints (.bin/.pt/.pth) are refused: unpickling runs code from the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from models.config import ModelConfig, build_model_config, load_hf_config, read_eos_token_ids
from models.layers.linear import can_pack_weights, linear_weight_bytes, pack_linear_weights
from models.registry import MODEL_REGISTRY, get_model_class

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {"smollm2-135m-instruct", "smollm2"}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# bf16 on CPU, linear weights up to this size are kept twice (plain + oneDNN-packed): the
# plain copy makes single-token steps faster. Above it, memory matters more.
KEEP_PLAIN_WEIGHTS_MAX_BYTES = 1 << 30


@dataclass
class LoadedModel:
    model: nn.Module  # eval mode, on the device, in config.dtype
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase


def load_model(
    model: str | Path = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
) -> LoadedModel:
    """`model`: a checkpoint directory, a .gguf file, or the default alias ("SmolLM2-135M-Instruct"/"smollm2")."""
    if str(model).strip().lower() in _DEFAULT_ALIASES:
        from models.fetch import default_model_path  # lazy: downloads only when asked for

        model = default_model_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _load_gguf(path, dtype, device, max_model_len)
    if path.is_dir():
        return _load_checkpoint_dir(path, dtype, device, max_model_len)
    if path.suffix in _PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no model at {path}: expected a checkpoint directory (config.json + *.safetensors), "
            f"a .gguf file, or {DEFAULT_MODEL!r}"
        )
    raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")


def _refuse_pickle(path: Path):
    raise ValueError(
        f"{path}: refusing to load a pickle checkpoint (.bin/.pt): unpickling can execute code from the "
        "file. Convert it to safetensors first (e.g. transformers save_pretrained in a trusted environment)."
    )


def _safetensors_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {file.name}, which is missing from {checkpoint_dir}")
        return files
    single = checkpoint_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p for p in checkpoint_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        _refuse_pickle(pickles[0])
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {checkpoint_dir}")


class _SafetensorsStream:
    """(name, tensor) pairs, one tensor in memory at a time; remembers the file being read."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.current_file = files[0]

    def __iter__(self):
        for file in self.files:
            self.current_file = file
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    source: Callable[[], Path | str],
) -> nn.Module:
    """Instantiate the registered class and fill it from `weights`; `source()` names the file for errors."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config.hf_config, config.max_model_len)
    model = model.to(dtype=config.dtype).to_empty(device=device)  # uninitialized memory
    try:
        loaded = model.load_weights(weights)
    except ValueError as e:
        raise ValueError(f"{source()}: {e}") from None
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"{config.path}: checkpoint has no tensor for parameter(s) {shown}")
    if can_pack_weights(config.dtype, device):
        # bf16 on CPU: oneDNN's own layout, not reordered at every call; small models also
        # keep the plain weights, for the faster single-row gemv (see pack_linear_weights).
        pack_linear_weights(model, keep_plain=linear_weight_bytes(model) <= KEEP_PLAIN_WEIGHTS_MAX_BYTES)
    return model.requires_grad_(False).eval()


def _load_tokenizer(checkpoint_dir: Path) -> PreTrainedTokenizerBase:
    if not any((checkpoint_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {checkpoint_dir} (looked for {', '.join(_TOKENIZER_FILES)})")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)  # reads tokenizer_config.json / chat_template.jinja
    template_file = checkpoint_dir / "chat_template.jinja"
    if tokenizer.chat_template is None and template_file.is_file():
        tokenizer.chat_template = template_file.read_text()
    return tokenizer


def _load_checkpoint_dir(checkpoint_dir: Path, dtype, device, max_model_len) -> LoadedModel:
    hf_config, architecture = load_hf_config(checkpoint_dir)
    files = _safetensors_files(checkpoint_dir)
    tokenizer = _load_tokenizer(checkpoint_dir)
    eos = read_eos_token_ids(checkpoint_dir, hf_config)
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    config = build_model_config(hf_config, architecture, checkpoint_dir, dtype, device, max_model_len, eos)
    stream = _SafetensorsStream(files)
    model = build_model(config, stream, device, lambda: stream.current_file)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer)


def _load_gguf(path: Path, dtype, device, max_model_len) -> LoadedModel:
    from models.gguf import load_gguf  # lazy: only GGUF users pay for the gguf reader

    hf_config, weights, tokenizer, eos = load_gguf(path)
    architecture = next((a for a in (hf_config.architectures or []) if a in MODEL_REGISTRY), None)
    if architecture is None:
        raise ValueError(
            f"{path}: unsupported architecture {hf_config.architectures}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    config = build_model_config(hf_config, architecture, path, dtype, device, max_model_len, tuple(eos))
    model = build_model(config, weights, device, lambda: path)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer)
