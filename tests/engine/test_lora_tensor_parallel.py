"""LoRA adapters over two tensor-parallel ranks (rank 1 a spawned process, gloo): each rank holds
its part of every adapter (column-parallel layers B's rows, row-parallel ones A's columns), and
adapter and base requests in one batch give transformers + peft's greedy tokens, as with one rank.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_lora import PROMPTS, check, greedy, make_adapter, reference

pytest.importorskip("peft")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_adapters_and_base_mixed_match_peft(arch, tmp_path):
    checkpoint = str(save_checkpoint(make_hf_model(arch), tmp_path / "base"))
    adapters = {
        "all": make_adapter(arch, tmp_path / "all", seed=1),
        "rs": make_adapter(
            arch,
            tmp_path / "rs",
            seed=2,
            targets=["k_proj", "o_proj", "up_proj", "down_proj"],
            r=8,
            alpha=4,
            use_rslora=True,
        ),
    }
    names = [None, *adapters]
    jobs = [(prompt, name) for prompt in PROMPTS[:3] for name in names]
    with LLM(
        checkpoint,
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=128,
        block_size=4,
        lora_modules=tuple(adapters.items()),
    ) as llm:
        results = llm.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
    for (prompt, name), result in zip(jobs, results):
        check(result, reference(arch, None if name is None else adapters[name], prompt))


def test_tp2_adapters_loaded_and_unloaded_while_serving_reach_every_rank(tmp_path):
    """Runtime loads go to the workers over the control channel, between steps: each rank attaches its
    part, or (a worker that cannot read the adapter) none does and the engine serves on; an unload
    frees the slot on every rank, so the next adapter in it is that adapter alone."""
    import shutil

    arch = "llama"
    checkpoint = str(save_checkpoint(make_hf_model(arch), tmp_path / "base"))
    first = make_adapter(arch, tmp_path / "first", seed=1)
    second = make_adapter(arch, tmp_path / "second", seed=2, targets=["k_proj", "o_proj", "up_proj", "down_proj"])
    doomed = shutil.copytree(first, tmp_path / "doomed")
    with LLM(checkpoint, dtype="float32", tensor_parallel_size=2, num_kv_blocks=128, block_size=4, max_loras=2) as llm:
        engine = llm.engine
        engine.load_lora_adapter(engine.runner.prepare_lora("first", first))
        jobs = [(prompt, name) for prompt in PROMPTS[:2] for name in (None, "first")]
        results = llm.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
        for (prompt, name), result in zip(jobs, results):
            check(result, reference(arch, first if name else None, prompt))

        prepared = engine.runner.prepare_lora("doomed", str(doomed))  # rank 0 read it; the workers cannot
        shutil.rmtree(doomed)
        with pytest.raises(ValueError, match="tensor-parallel rank 1 could not load LoRA adapter 'doomed'.*no such"):
            engine.load_lora_adapter(prepared)
        assert set(engine.runner.lora_slots) == {"first"}

        engine.unload_lora_adapter("first")
        engine.load_lora_adapter(engine.runner.prepare_lora("second", second))
        assert engine.runner.lora_slots == {"second": 1}  # the slot "first" (and "doomed") held, on every rank
        jobs = [(prompt, name) for prompt in PROMPTS[:2] for name in (None, "second")]
        results = llm.generate([p for p, _ in jobs], [greedy(name) for _, name in jobs])
        for (prompt, name), result in zip(jobs, results):
            check(result, reference(arch, second if name else None, prompt))


def test_tp2_moe_expert_adapters_match_peft(tmp_path):
    """Qwen2-MoE's routed experts (each split along its intermediate size) and its shared expert hold
    their part of an adapter on every rank, as the dense layers do."""
    from tests.models.test_lora_coverage import check as check_close
    from tests.models.test_lora_coverage import greedy as greedy_n
    from tests.models.test_lora_coverage import make_adapter as make_adapter_over
    from tests.models.test_lora_coverage import reference as reference_of
    from tests.models.test_lora_coverage import with_adapter
    from tests.models.test_lora_moe import FUSED, TARGETS, qwen_moe

    checkpoint = str(save_checkpoint(qwen_moe("qwen2_moe"), tmp_path / "base"))
    adapter = make_adapter_over(
        qwen_moe("qwen2_moe"), tmp_path / "experts", seed=1, targets=TARGETS["qwen2_moe"], target_parameters=FUSED
    )
    with LLM(
        checkpoint,
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=64,
        block_size=4,
        lora_modules=(("experts", adapter),),
    ) as llm:
        results = llm.generate(PROMPTS[:2] * 2, [greedy_n("experts")] * 2 + [greedy_n(None)] * 2)
    peft_model, base = with_adapter(qwen_moe("qwen2_moe"), adapter), qwen_moe("qwen2_moe")
    for prompt, result in zip(PROMPTS[:2], results[:2]):
        check_close(result, reference_of(peft_model, prompt))
    for prompt, result in zip(PROMPTS[:2], results[2:]):
        check_close(result, reference_of(base, prompt))
