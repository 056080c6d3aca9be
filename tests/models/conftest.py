"""Tiny random checkpoints written by transformers' own `save_pretrained`, reusable by any test.

    from tests.models.conftest import make_hf_model, save_checkpoint, tiny_tokenizer, paged_forward

`make_hf_model("llama", num_key_value_heads=1)` gives a seeded float32 HF model;
`save_checkpoint(hf_model, dir)` writes it with a byte-level BPE tokenizer and a
ChatML chat template.  Fixtures: `tiny_llama_dir` (session-wide Llama GQA checkpoint)
and `make_checkpoint` (factory into tmp_path).
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import pytest
import torch

from models.layers.attention import AttentionMetadata

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Paged attention serves many requests from one pool of key/value blocks.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "The capital of France is Paris. Once upon a time, there was a tiny model.",
]
_ARCHS = {  # short name -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_tokenizer():
    """Byte-level BPE (300 tokens: 3 specials, 256 bytes, merges): any text round-trips. A copy
    each call: a test that edits its tokenizer (a chat template, special tokens) must not change
    the checkpoints that later tests save."""
    return copy.deepcopy(_trained_tokenizer())


@functools.lru_cache(maxsize=1)
def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A float32 transformers model with random weights large enough that attention is not uniform."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in _ARCHS[arch])
    kwargs = {**TINY, "vocab_size": len(tiny_tokenizer()), **overrides}
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    # HF initializes norms to 1 and biases to 0, which would hide a swapped or
    # unloaded norm/bias; use larger weights so q.k varies across positions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def save_checkpoint(hf_model, path: Path, max_shard_size: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(path, **kwargs)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint(arch, **config overrides) -> (checkpoint dir, hf model)."""
    counter = iter(range(1000))

    def make(arch: str = "llama", max_shard_size: str | None = None, **overrides):
        hf_model = make_hf_model(arch, **overrides)
        return save_checkpoint(hf_model, tmp_path / f"{arch}-{next(counter)}", max_shard_size), hf_model

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A Llama GQA checkpoint (2 layers, hidden 64, vocab 300) with tokenizer and chat template."""
    return save_checkpoint(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"))


def shuffled_block_tables(seq_lens: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Non-contiguous, interleaved block tables for sequences of these lengths; (tables, num_blocks)."""
    needed = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(needed) + 3  # a few never-used blocks
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, it = [], iter(ids)
    for n in needed:
        tables.append([next(it) for _ in range(n)])
    return tables, num_blocks


def paged_forward(model, kv_caches, chunks, block_tables, block_size) -> list[torch.Tensor]:
    """One engine step.  chunks[i] = (seq index, start position, new token ids).

    Returns the float32 logits (len(new ids), vocab) of each chunk.
    """
    query_lens = [len(ids) for _, _, ids in chunks]
    seq_lens = [start + len(ids) for _, start, ids in chunks]
    meta = AttentionMetadata.build(query_lens, seq_lens, [block_tables[i] for i, _, _ in chunks], block_size)
    input_ids = torch.tensor([t for _, _, ids in chunks for t in ids], dtype=torch.int64)
    positions = torch.tensor([p for _, s, ids in chunks for p in range(s, s + len(ids))], dtype=torch.int64)
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
    return list(logits.split(query_lens))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> float:
    """Max abs diff below tol, both relative to the reference's max abs and absolute; returns the relative one."""
    abs_diff = (ours.float() - ref.float()).abs().max().item()
    rel = abs_diff / ref.abs().max().item()
    assert rel < tol and abs_diff < tol, f"relative diff {rel:.2e}, absolute diff {abs_diff:.2e}"
    return rel


class ModelCase:
    """A tiny random HF model (`arch` with config `overrides`) saved and loaded by us in float32, random
    prompts of `prompt_lens` tokens and transformers' logits for each: the fixture of the model tests."""

    def __init__(self, name: str, arch: str, overrides: dict, prompt_lens: list[int], tmp_path_factory):
        from models.loader import load_model

        self.hf_model = make_hf_model(arch, **overrides)
        self.dir = save_checkpoint(self.hf_model, tmp_path_factory.mktemp(name))
        self.loaded = load_model(str(self.dir), dtype="float32")
        gen = random.Random(len(name))
        vocab = self.loaded.config.vocab_size
        self.prompts = [[gen.randrange(vocab) for _ in range(n)] for n in prompt_lens]
        with torch.no_grad():
            self.ref = [self.hf_model(input_ids=torch.tensor([p])).logits[0] for p in self.prompts]

    def new_cache(self, seq_lens, block_size, seed=0):
        tables, num_blocks = shuffled_block_tables(seq_lens, block_size, seed)
        spec = self.loaded.model.kv_cache_spec(torch.float32)
        return spec.allocate(num_blocks, block_size, "cpu"), tables


def model_cases(cases: dict[str, tuple[str, dict]], prompt_lens: list[int], tmp_path_factory):
    """name -> ModelCase, each built on first use."""
    built: dict[str, ModelCase] = {}

    def get(name: str) -> ModelCase:
        if name not in built:
            arch, overrides = cases[name]
            built[name] = ModelCase(name, arch, overrides, prompt_lens, tmp_path_factory)
        return built[name]

    return get
