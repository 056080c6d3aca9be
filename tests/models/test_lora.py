"""LoRA adapters (models/layers/lora.py) against transformers + peft on the same PEFT directories.

Adapters are made offline by peft with `init_lora_weights=False`, so that they change the output;
our greedy tokens and their logprobs must be peft's, for one adapter alone and for several adapters
and the base model mixed in one engine batch.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from engine.block_manager import hash_block
from engine.llm import LLM
from engine.request import SamplingParams
from models.layers.lora_weights import LoRABatch
from tests.models.conftest import make_hf_model, save_checkpoint

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 9, 100, 33], [7, 7, 250, 3], [12, 80, 80, 81, 90, 4, 66, 23, 1], [200, 13]]
NUM_TOKENS = 6
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(arch: str, path, seed: int, targets=ALL_TARGETS, r: int = 4, alpha: int = 8, **options):
    """A PEFT LoRA directory over make_hf_model(arch)'s weights, with random A and B."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **options)
    model = peft.get_peft_model(make_hf_model(arch), config)
    with torch.no_grad():  # large enough that greedy tokens change, not only logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


@functools.lru_cache(maxsize=8)
def reference_model(arch: str, adapter: str | None):
    model = make_hf_model(arch)
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def reference(arch: str, adapter: str | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers (+ peft on `adapter`): greedy tokens and their logprobs, full forward each step."""
    model = reference_model(arch, adapter)
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def greedy(lora_name: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0, lora_name=lora_name)


def check(result, expected: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = expected
    assert result.token_ids == tokens
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def served(request, tmp_path_factory):
    """A checkpoint and four adapters of one architecture: all targets; rsLoRA on a subset; q/v only;
    gate/up only."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    checkpoint = save_checkpoint(make_hf_model(arch), root / "base")
    adapters = {
        "all": make_adapter(arch, root / "all", seed=1),
        "rs": make_adapter(
            arch,
            root / "rs",
            seed=2,
            targets=["k_proj", "o_proj", "up_proj", "down_proj"],
            r=8,
            alpha=4,
            use_rslora=True,
        ),
        "qv": make_adapter(arch, root / "qv", seed=3, targets=["q_proj", "v_proj"], r=2, alpha=16),
        "gu": make_adapter(arch, root / "gu", seed=6, targets=["gate_proj", "up_proj"], r=4, alpha=8),
    }
    return arch, str(checkpoint), adapters


def test_one_adapter_matches_peft(served):
    arch, checkpoint, adapters = served
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=64, lora_modules=(("all", adapters["all"]),))
    expected = reference(arch, adapters["all"], PROMPTS[0])
    assert expected[0] != reference(arch, None, PROMPTS[0])[0]  # the adapter changes the greedy tokens
    check(llm.generate(PROMPTS[0], greedy("all"))[0], expected)


def test_adapters_and_base_mixed_in_one_batch_match_peft(served):
    """Every prompt under each adapter and the base model, all in one continuous batch: each row
    gets its own adapter (and the prefix cache shares no block across adapters)."""
    arch, checkpoint, adapters = served
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=256, block_size=4, lora_modules=tuple(adapters.items()))
    names = [None, *adapters]
    jobs = [(prompt, name) for prompt in PROMPTS for name in names]  # an adapter's rows apart: gathered
    results = llm.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
    for (prompt, name), result in zip(jobs, results):
        check(result, reference(arch, None if name is None else adapters[name], prompt))


def test_an_unknown_adapter_name_is_refused(served):
    _, checkpoint, adapters = served
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=32, lora_modules=(("qv", adapters["qv"]),))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate(PROMPTS[0], greedy("nope"))


def test_a_step_groups_rows_by_adapter():
    batch = LoRABatch.build([3, 1, 2, 1], [1, 0, 2, 1], torch.device("cpu"))
    (slot_a, rows_a), (slot_b, rows_b) = batch.groups
    assert (slot_a, rows_a.tolist()) == (1, [0, 1, 2, 6])  # apart: an index to gather by
    assert (slot_b, rows_b) == (2, slice(4, 6))  # contiguous: a slice
    assert LoRABatch.build([2, 3], [0, 0], torch.device("cpu")) is None  # no adapter: the base path


def test_prefix_hashes_include_the_adapter_and_leave_base_hashes_alone():
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens, lora_name=None) == hash_block(None, tokens)
    assert hash_block(None, tokens, lora_name="a") != hash_block(None, tokens)
    assert hash_block(None, tokens, lora_name="a") != hash_block(None, tokens, lora_name="b")
    assert hash_block(None, tokens, salt="a") != hash_block(None, tokens, lora_name="a")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bad")
    return root, str(save_checkpoint(make_hf_model("llama"), root / "base"))


def _edit_config(path: str, **changes) -> str:
    config_file = f"{path}/adapter_config.json"
    config = json.loads(open(config_file).read())
    config.update(changes)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such directory"),
        ("rank", "rank 8 is above --max-lora-rank 4"),
        ("target", "target module\\(s\\) 'lm_head' are not supported"),
        ("modules_to_save", "modules_to_save=\\['lm_head'\\] is not supported"),
        ("dora", "use_dora=True is not supported"),
        ("rank_pattern", "rank_pattern 'q_proj' \\(matching model.layers.0.self_attn.q_proj\\) is not supported"),
        ("regex", "alpha_pattern '\\(' is not a regular expression"),
        ("shape", "do not fit the layer"),
    ],
)
def test_a_bad_adapter_is_refused_by_name(llama, case, message):
    root, checkpoint = llama
    path = str(root / case)
    if case == "rank":
        make_adapter("llama", path, seed=4, r=8)
    elif case == "target":
        _edit_config(make_adapter("llama", path, seed=4), target_modules=["q_proj", "lm_head"])
    elif case == "modules_to_save":
        _edit_config(make_adapter("llama", path, seed=4), modules_to_save=["lm_head"])
    elif case == "dora":
        _edit_config(make_adapter("llama", path, seed=4), use_dora=True)
    elif case == "rank_pattern":
        _edit_config(make_adapter("llama", path, seed=4), rank_pattern={"q_proj": 2, "nowhere_proj": 2})
    elif case == "regex":
        _edit_config(make_adapter("llama", path, seed=4), alpha_pattern={"(": 2})
    elif case == "shape":  # an adapter trained on another model's shapes
        make_adapter("llama", path, seed=4, targets=["q_proj"])
        from safetensors.torch import load_file, save_file

        tensors = load_file(f"{path}/adapter_model.safetensors")
        save_file(
            {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in tensors.items()},
            f"{path}/adapter_model.safetensors",
        )
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, dtype="float32", num_kv_blocks=32, max_lora_rank=4, lora_modules=(("bad", path),))


def test_patterns_that_match_no_layer_of_the_adapter_are_accepted(llama):
    """peft writes rank/alpha patterns for layers it then does not adapt (DeepSeek's fused experts)."""
    root, checkpoint = llama
    path = _edit_config(
        make_adapter("llama", str(root / "patterns"), seed=4, targets=["q_proj"]),
        rank_pattern={".*\\.gate_up_proj": 8},
        alpha_pattern={"v_proj": 16},
    )
    LLM(checkpoint, dtype="float32", num_kv_blocks=32, lora_modules=(("ok", path),))


@pytest.mark.parametrize("data", [b"", b"GGUF\x03\x00\x00\x00" + bytes(range(40)), bytes(range(200))])
def test_a_damaged_gguf_adapter_is_a_value_error(tmp_path, data):
    from models.layers.lora import read_peft_adapter

    path = tmp_path / "adapter.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="LoRA adapter 'x' .*not a readable GGUF file"):
        read_peft_adapter("x", path, 16)
