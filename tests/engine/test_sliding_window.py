"""Sliding-window layers in the paged cache, end to end: the engine serves prompts several windows
long with chunked prefill, preemption and prefix hits, gives transformers' greedy tokens, keeps the
pool consistent at every step, and a sliding layer's blocks stay bounded by its window while the
global layers' grow with the context."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig, max_blocks_per_request
from engine.core import EngineCore
from engine.request import SamplingParams
from models.loader import load_model
from tests.engine.test_engine import run_core
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_gemma import CASES, WINDOW

BLOCK_SIZE, CHUNK, NEW_TOKENS = 4, 12, 12
# Pools too small for four requests' whole contexts at once in the global layers (the sliding ones
# alone fit): requests are preempted and recomputed.
NUM_BLOCKS = {"gemma2": 40, "gemma3": 56, "mistral": 14}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            arch, overrides = CASES[name]
            hf_model = make_hf_model(arch, **overrides)
            built[name] = hf_model, save_checkpoint(hf_model, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def hf_greedy(hf_model, prompt):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral"])
def test_sliding_layers_hold_their_window_through_preemption_and_prefix_hits(checkpoints, attention_path, name):
    hf_model, path = checkpoints(name)
    loaded = load_model(str(path), dtype="float32")
    core = EngineCore(
        loaded,
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS[name],
            max_num_seqs=4,
            max_num_batched_tokens=CHUNK,
            audit_interval_steps=1,
        ),
    )
    windows = core.runner.kv_layout.windows
    assert WINDOW in windows and (None in windows) == (name != "mistral")
    rng = random.Random(7)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(41)] for _ in range(3)]  # five windows each
    prompts.append(prompts[0][:29] + [rng.randrange(vocab) for _ in range(12)])  # shares 7 blocks with the first
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    bm = core.scheduler.block_manager
    sliding = [g for g, w in enumerate(windows) if w is not None]
    full = [g for g, w in enumerate(windows) if w is None]
    # A request holds at most this many blocks in one sliding group: the window before a chunk and the chunk.
    bound = max_blocks_per_request((WINDOW,), BLOCK_SIZE, 10**6, CHUNK)
    most = {g: 0 for g in range(len(windows))}

    def on_step(_):
        assert core.audit() == []
        for g in most:
            held = bm.num_held_blocks(g)
            most[g] = max(most[g], held)
            if g in sliding:
                assert held <= bound * len(core.scheduler.running)

    expected = [hf_greedy(hf_model, p) for p in prompts]
    for round_ in range(2):  # the second round's prompts are prefix hits
        hits_before = core.stats().prefix_cache_hits
        results = run_core(core, [(f"r{round_}-{i}", p, params) for i, p in enumerate(prompts)], on_step)
        assert [results[f"r{round_}-{i}"]["token_ids"] for i in range(len(prompts))] == expected
        assert bm.num_used_blocks == 0 and core.audit() == []
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > hits_before
    if full:  # the global layers held whole contexts, more than any sliding group
        assert max(most[g] for g in full) > max(most[g] for g in sliding)
    print(
        f"\n{name}: most blocks held by a group at once: {most} (windows {windows}); "
        f"{stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-hit tokens"
    )


def test_layout_groups_layers_alike_in_groups_of_one_size():
    from models.layers.attention import KVCacheLayout, KVCacheSpec

    # Gemma 3 1B: five sliding layers, then a global one, 26 layers.
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    layout = KVCacheLayout.of(windows)
    assert layout.num_slots == 4 and layout.windows == (512,) * 6 + (None,)
    assert layout.layer_groups[5] == 6 and layout.layer_slots[5] == 0 and layout.layer_slots[23] == 3
    pairs = list(zip(layout.layer_groups, layout.layer_slots))
    assert len(set(pairs)) == 26  # no two layers share a group's tensor
    spec = KVCacheSpec(26, (2, 1, 8), torch.float32, windows)
    assert spec.layout(512).windows == (None,)  # a window as long as the context is no window
    caches = spec.allocate(3, 4, "cpu", layout)
    assert len(caches) == 26 and len({id(c) for c in caches}) == 4 and caches[0] is caches[4] is caches[5]
    assert len(spec.allocate(3, 4, "cpu")) == 26  # without a layout, a tensor a layer
