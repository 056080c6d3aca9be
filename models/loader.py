"""Load a checkpoint (HF safetensors dir, .gguf file, hub id or a catalogue name) for serving.

The model is built on the meta device (no memory), materialized uninitialized on
the target device in the serving dtype, and then every checkpoint tensor is read
one at a time and copied into its parameter.  Peak memory is the model plus one
tensor, never a second full copy.  Every parameter must be filled exactly once
(checked), since `to_empty` leaves garbage behind.

Pickle checkpoints (.bin/.pt/.pth) are refused: unpickling runs code from the file.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from models.catalog import DEFAULT_MODEL
from models.causal_lm import CausalLM
from models.config import ModelConfig, build_model_config, load_hf_config, read_architecture, read_eos_token_ids
from models.fetch import resolve_model_path
from models.layers.linear import (
    Linear,
    MergedLinear,
    can_pack_weights,
    linear_weight_bytes,
    pack_linear_weights,
    process_weights_after_loading,
)
from models.layers import cpu_kernels, hugepages
from models.layers import parallel as tp_state
from models.layers.quantization import (
    DENSE,
    QUANTIZATIONS,
    ROWS_DENSE,
    DenseMethod,
    LinearMethod,
    QuantizedWeight,
    StoredFormat,
    method_for,
)
from models.registry import MODEL_REGISTRY, get_model_class

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# bf16 on CPU, linear weights up to this size are kept twice (plain + oneDNN-packed): the
# plain copy makes single-token steps faster. Above it, memory matters more.
KEEP_PLAIN_WEIGHTS_MAX_BYTES = 1 << 30


@dataclass
class LoadedModel:
    model: CausalLM  # eval mode, on the device, in config.dtype
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer resident (quantized weights as stored)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [
            m.packed_weight for m in self.model.modules() if isinstance(m, Linear) and m.packed_weight is not None
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def is_quantized(self) -> bool:
        return any(isinstance(m, Linear) and not isinstance(m.quant_method, DenseMethod) for m in self.model.modules())

    @property
    def quantization(self) -> str:
        """The layers' methods, e.g. 'int4 x 210, int8 x 1' or 'dense'."""
        counts = Counter(m.quant_method.name for m in self.model.modules() if isinstance(m, Linear))
        return ", ".join(f"{name} x {n}" for name, n in counts.most_common()) or "dense"


# (checkpoint weight names of one layer, its in_features) -> the method it is served with
MethodChoice = Callable[[list[str], int], LinearMethod]


def choose_methods(quantization: str, stored: Callable[[str], StoredFormat | None] | None = None) -> MethodChoice:
    """`--quantization`: 'auto' serves what the checkpoint stores (`stored(name)`: the format a tensor
    is kept in, None for dense; no `stored`: dense checkpoint), 'none' dense,
    'int8' per output channel, 'int4' in groups of 32, rounding to nearest at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")

    def choose(names: list[str], in_features: int) -> LinearMethod:
        if quantization == "int8":
            return method_for(8, None, in_features)
        if quantization == "int4":
            return method_for(4, 32, in_features)
        if quantization == "none" or stored is None:
            return DENSE
        found = [stored(name) for name in names]
        formats = [f for f in found if f is not None]
        if len(formats) < len(found):
            return DENSE  # a merged layer with a dense part stays dense
        if len(set(formats)) == 1 and (formats[0].sub_scales or formats[0].table):  # Q2_K, K-quant or IQ4 parts alone
            f = formats[0]
            return method_for(f.bits, f.group_size, in_features, f.scale_dtype, f.sub_scales, f.table)
        if all(f.table for f in formats):  # IQ4_XS beside IQ4_NL: both through the table, XS's d * (ls - 32) in float32
            return method_for(4, 32, in_features, torch.float32, table=True)
        bits = max(f.bits for f in formats)
        if (bits == 6 or min(f.bits for f in formats) == 2) and len(set(formats)) > 1:
            # a Q6_K part with other types (Q4_K q/k, Q6_K v): int8 for all; int6 is Q6_K's alone. A Q2_K part's
            # mins per 16 fit no group of 32: int8 too, requantized
            bits = 8
        # The parts kept exactly (4 bits join 5 as the same values) bring their factors' dtype; a K-quant part
        # joins in groups of 32 with its d * sc, -dmin * mn multiplied out, exact in float32 only.
        exact = [f for f in formats if f.bits == bits or (bits == 5 and f.bits == 4)]
        scale_dtypes = {torch.float32 if f.sub_scales else f.scale_dtype for f in exact}
        group = formats[0].group_size if bits == 6 else 32
        return method_for(bits, group, in_features, scale_dtypes.pop() if len(scale_dtypes) == 1 else torch.float32)

    return choose


def _rows_dense(choose: MethodChoice) -> MethodChoice:
    """`choose`, with RowsDenseMethod wherever it picks dense."""

    def rows(names: list[str], in_features: int) -> LinearMethod:
        method = choose(names, in_features)
        return ROWS_DENSE if method is DENSE else method

    return rows


def set_quant_methods(model: nn.Module, choose: MethodChoice) -> None:
    """Give every Linear (embedding and lm_head included) its method, on the meta device."""
    for path, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            names = [f"{parent}.{shard}.weight" if parent else f"{shard}.weight" for shard in module.shard_sizes]
        else:
            names = [f"{path}.weight"]
        module.set_quant_method(choose(names, module.in_features))


def load_model(
    model: str | Path = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    quantization: str = "auto",
    tensor_parallel: tp_state.TensorParallel | None = None,
    batch_invariant: bool = False,
) -> LoadedModel:
    """`model`: a checkpoint directory, a .gguf file, a Hugging Face hub id (safetensors, through its
    cache; models.fetch.hub_snapshot), or a catalogue name (models/catalog.py; fetched on first use).
    `quantization`: see `choose_methods`. `tensor_parallel`: build this rank's part of every
    layer (models/layers/parallel.py); every rank reads the whole checkpoint, one tensor at a time.
    `batch_invariant`: the layers left dense run on RowsDenseMethod (`--batch-invariant`), so that
    every product's row is its own bits whatever its step (needs the CPU kernels)."""
    choose_methods(quantization)  # validates the name before any file is read
    if batch_invariant and not (torch.device(device).type == "cpu" and cpu_kernels.available()):
        raise ValueError("--batch-invariant needs --device cpu and the CPU kernels (models/layers/cpu_kernels.py)")
    with tp_state.building(tensor_parallel):
        return _load_model(model, dtype, device, max_model_len, quantization, batch_invariant)


def _load_model(
    model: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    max_model_len: int | None,
    quantization: str,
    batch_invariant: bool = False,
) -> LoadedModel:
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _load_gguf(path, dtype, device, max_model_len, quantization, batch_invariant)
    if path.is_dir():
        return _load_checkpoint_dir(path, dtype, device, max_model_len, quantization, batch_invariant)
    if path.suffix in _PICKLE_SUFFIXES:
        _refuse_pickle(path)
    raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")


def check_model(model: str | Path) -> Path:
    """The path `model` names (a catalogue model fetched, a hub id from its cache), checked without
    reading any weight: a GGUF's header, architecture, metadata and tensor types, or a checkpoint
    directory's config.json architecture, weight files and tokenizer. A one-line ValueError /
    FileNotFoundError where it is not something load_model serves. The server and models.generate
    call it first, so a refusal comes before a port is bound or a model half-built."""
    path = resolve_model_path(model)
    if path.suffix == ".gguf" and path.is_file():
        _check_gguf(path)
    elif path.is_dir():
        read_architecture(path / "config.json")
        _safetensors_files(path)
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise FileNotFoundError(f"no tokenizer in {path} (looked for {', '.join(_TOKENIZER_FILES)})")
    elif path.suffix in _PICKLE_SUFFIXES:
        _refuse_pickle(path)
    else:
        raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
    return path


def _check_gguf(path: Path) -> None:
    """What the GGUF reader would refuse, from the header alone (memory-mapped: no weight read, no
    tokenizer converted): the architecture, the metadata, and every tensor type's dequantizer.
    Tensor names are left to the load, whose name map builds transformers' model (seconds)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from models.gguf import GGUFError, read_config

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:  # the package's messages ("GGUF magic invalid") name no file
        raise GGUFError(f"{path}: not a readable GGUF file: {exc}") from None
    hf_config = read_config(reader, path)
    if not any(a in MODEL_REGISTRY for a in (hf_config.architectures or [])):
        raise ValueError(
            f"{path}: unsupported architecture {hf_config.architectures}; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    for qtype, name in {t.tensor_type: t.name for t in reversed(reader.tensors)}.items():
        try:  # one zero block asks the gguf package itself, as the reader does at load
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        except NotImplementedError:  # also integer tensors (I8, I32, ...), which are no weights
            raise GGUFError(
                f"{path}: tensor {name!r} has type {qtype.name}, which the installed gguf package cannot dequantize"
            ) from None


def _refuse_pickle(path: Path) -> NoReturn:
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

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.current_file = files[0]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            self.current_file = file
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    device: str | torch.device,
    source: Callable[[], Path | str],
    choose: MethodChoice | None = None,
    batch_invariant: bool = False,
) -> CausalLM:
    """Instantiate the registered class and fill it from `weights`; `source()` names the file for errors.
    `choose` picks each linear layer's method (default: dense); `batch_invariant`: the dense ones on
    RowsDenseMethod."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config.hf_config, config.max_model_len)
    model = model.to(dtype=config.dtype)
    # Methods are set on the meta model, so a quantized layer never allocates a dense weight.
    choose = choose or choose_methods("none")
    if batch_invariant:
        choose = _rows_dense(choose)
    set_quant_methods(model, choose)
    model = model.to_empty(device=device)  # uninitialized memory
    try:
        loaded = model.load_weights(weights)
    except ValueError as e:
        raise ValueError(f"{source()}: {e}") from None
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"{config.path}: checkpoint has no tensor for parameter(s) {shown}")
    process_weights_after_loading(model)
    if can_pack_weights(config.dtype, device):
        # bf16 on CPU: oneDNN's own layout, not reordered at every call; small models also
        # keep the plain weights, for the faster single-row gemv (see pack_linear_weights).
        pack_linear_weights(model, keep_plain=linear_weight_bytes(model) <= KEEP_PLAIN_WEIGHTS_MAX_BYTES)
    if torch.device(device).type == "cpu":
        hugepages.move_to_arena(model)  # one stream for the kernels to read, on huge pages
    return model.requires_grad_(False).eval()


def _load_tokenizer(checkpoint_dir: Path) -> PreTrainedTokenizerBase:
    if not any((checkpoint_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {checkpoint_dir} (looked for {', '.join(_TOKENIZER_FILES)})")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)  # reads tokenizer_config.json / chat_template.jinja
    template_file = checkpoint_dir / "chat_template.jinja"
    if tokenizer.chat_template is None and template_file.is_file():
        tokenizer.chat_template = template_file.read_text()
    return tokenizer


def _load_checkpoint_dir(
    checkpoint_dir: Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    max_model_len: int | None,
    quantization: str,
    batch_invariant: bool = False,
) -> LoadedModel:
    hf_config, architecture = load_hf_config(checkpoint_dir)
    files = _safetensors_files(checkpoint_dir)
    tokenizer = _load_tokenizer(checkpoint_dir)
    eos = read_eos_token_ids(checkpoint_dir, hf_config)
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    dtype = _activation_dtype(dtype, device, quantized=quantization in ("int8", "int4"))
    config = build_model_config(hf_config, architecture, checkpoint_dir, dtype, device, max_model_len, eos)
    stream = _SafetensorsStream(files)
    model = build_model(
        config, stream, device, lambda: stream.current_file, choose_methods(quantization), batch_invariant
    )
    return _loaded(model, config, tokenizer)


def _activation_dtype(dtype: str | torch.dtype, device: str | torch.device, quantized: bool) -> str | torch.dtype:
    """`--dtype auto` with quantized weights on CPU: float32 activations. The integer kernel
    rounds activations to int16 from float32 and a Llama layer runs as one op in float32;
    bfloat16 (auto's choice for dense weights on CPUs with AVX512-BF16/AMX) would only round
    the residual stream and leave the one-op path, a third slower a token."""
    if dtype == "auto" and quantized and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def _loaded(model: CausalLM, config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    loaded = LoadedModel(model=model, config=config, tokenizer=tokenizer)
    logger.info("weights: %s; %.1f MiB resident (%s)", loaded.quantization, loaded.weight_bytes / 2**20, config.dtype)
    return loaded


def _load_gguf(
    path: Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    max_model_len: int | None,
    quantization: str,
    batch_invariant: bool = False,
) -> LoadedModel:
    from models.gguf import EXACT_FORMATS, load_gguf, serving_format  # lazy: only GGUF users pay for the reader

    hf_config, weights, tokenizer, eos = load_gguf(path, keep_quantized=quantization != "none")
    architecture = next((a for a in (hf_config.architectures or []) if a in MODEL_REGISTRY), None)
    if architecture is None:
        raise ValueError(
            f"{path}: unsupported architecture {hf_config.architectures}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    types = weights.stored_types()
    quantized = quantization in ("int8", "int4") or (
        quantization == "auto" and any(serving_format(t) for t in types.values())
    )
    dtype = _activation_dtype(dtype, device, quantized)
    config = build_model_config(hf_config, architecture, path, dtype, device, max_model_len, tuple(eos))
    requantized = Counter(t.name for t in types.values() if serving_format(t) and t not in EXACT_FORMATS)
    if quantization == "auto" and requantized:
        logger.info(
            "%s: GGUF types with no exact int4/int8 form, requantized at load (round to nearest): %s",
            path.name,
            dict(requantized),
        )
    for fused, shards in getattr(get_model_class(architecture), "fused_checkpoint_tensors", {}).items():
        # A projection the checkpoint stores fused with others (Phi-3's qkv_proj) has the fused tensor's type.
        for name, qtype in list(types.items()):
            if name.endswith(f".{fused}.weight"):
                types.update({name.replace(f".{fused}.", f".{shard}."): qtype for shard in shards})
    choose = choose_methods(quantization, lambda name: serving_format(types[name]) if name in types else None)
    model = build_model(config, weights, device, lambda: path, choose, batch_invariant)
    return _loaded(model, config, tokenizer)
