"""--lora-dtype: adapters held in bfloat16 or float16 (EngineConfig.lora_dtype), against transformers
+ peft on the same adapter with its weights rounded to that dtype first. Our products read the
16-bit weights and sum in float32, as peft's float32 products of the rounded weights do: the same
numbers, so the bound stays test_lora.py's. On the CPU kernels (rows alone) a row's logprobs are
the same bits alone and in a batch of other adapters' and the base model's rows."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from models.layers import cpu_kernels
from models.layers.linear import Linear
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_lora import PROMPTS, check, greedy, make_adapter, reference

ARCH = "llama"


def rounded(path: str, dest, dtype: torch.dtype) -> str:
    """A copy of the PEFT directory at `path` with every weight rounded to `dtype` (held as float32)."""
    from safetensors.torch import load_file, save_file

    if not dest.exists():
        shutil.copytree(path, dest)
        tensors = load_file(f"{path}/adapter_model.safetensors")
        save_file({k: v.to(dtype).float() for k, v in tensors.items()}, f"{dest}/adapter_model.safetensors")
    return str(dest)


def held_dtypes(llm: LLM) -> set[torch.dtype]:
    """The dtypes of every A_cat and B_cat^T the model's layers hold."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.lora is not None]
    return {t.dtype for m in layers for w in m.lora.slots.values() for t in (w.a, w.bt)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A checkpoint and two adapters: every projection; q and v only, another rank and alpha."""
    root = tmp_path_factory.mktemp("lora-dtype")
    checkpoint = save_checkpoint(make_hf_model(ARCH), root / "base")
    adapters = {
        "all": make_adapter(ARCH, root / "all", seed=1),
        "qv": make_adapter(ARCH, root / "qv", seed=3, targets=["q_proj", "v_proj"], r=2, alpha=16),
    }
    return root, str(checkpoint), adapters


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["torch", "cpu-kernels"])
def test_16_bit_adapters_alone_and_mixed_match_peft_on_rounded_weights(served, lora_dtype, batch_invariant):
    root, checkpoint, adapters = served
    if batch_invariant and not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    dtype = getattr(torch, lora_dtype)
    llm = LLM(
        checkpoint,
        dtype="float32",
        batch_invariant=batch_invariant,
        num_kv_blocks=256,
        block_size=4,
        lora_modules=tuple(adapters.items()),
        lora_dtype=lora_dtype,
    )
    assert held_dtypes(llm) == {dtype}
    twins = {name: rounded(path, root / f"{name}-{lora_dtype}", dtype) for name, path in adapters.items()}

    alone = llm.generate(PROMPTS[0], greedy("all"))[0]
    check(alone, reference(ARCH, twins["all"], PROMPTS[0]))
    names = [None, *adapters]
    jobs = [(prompt, name) for prompt in PROMPTS for name in names]
    results = llm.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
    for (prompt, name), result in zip(jobs, results, strict=True):
        check(result, reference(ARCH, None if name is None else twins[name], prompt))
    if batch_invariant:  # each row summed on its own: the same bits beside any other rows
        mixed = results[jobs.index((PROMPTS[0], "all"))]
        assert [lp.logprob for lp in mixed.logprobs] == [lp.logprob for lp in alone.logprobs]


def test_the_rounding_is_what_the_bound_sees(served):
    """The float32 adapter's logprobs are not the rounded twin's within the bound: a 16-bit adapter
    compared to the unrounded one would need a looser bound, and would hide a wrong dtype."""
    root, _, adapters = served
    twin = rounded(adapters["all"], root / "all-bfloat16", torch.bfloat16)
    exact, rounded_lp = reference(ARCH, adapters["all"], PROMPTS[0])[1], reference(ARCH, twin, PROMPTS[0])[1]
    assert max(abs(a - b) for a, b in zip(exact, rounded_lp, strict=True)) > 1e-4


def test_an_adapter_loaded_while_serving_takes_the_lora_dtype(served):
    """/v1/load_lora_adapter's path (ModelRunner.prepare_lora, EngineCore.load_lora_adapter)."""
    root, checkpoint, adapters = served
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=64, max_loras=1, lora_dtype="bfloat16")
    llm.engine.load_lora_adapter(llm.engine.runner.prepare_lora("all", adapters["all"]))
    assert held_dtypes(llm) == {torch.bfloat16}
    twin = rounded(adapters["all"], root / "all-bfloat16", torch.bfloat16)
    check(llm.generate(PROMPTS[1], greedy("all"))[0], reference(ARCH, twin, PROMPTS[1]))


def test_auto_keeps_the_models_dtype_and_a_bad_dtype_is_refused(served):
    _, checkpoint, adapters = served
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=32, lora_modules=(("qv", adapters["qv"]),))
    assert llm.engine.runner.lora_dtype == torch.float32
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, bfloat16, float16, got 'int8'"):
        EngineConfig(lora_dtype="int8")
