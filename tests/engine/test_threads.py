"""Intra-op threads: the tuner follows whichever count runs steps faster; a fixed count holds."""
import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine.threads import ThreadTuner


def run(tuner, seconds_per_token, num_steps, num_tokens=64):
    """Step the tuner against a machine where a step with n threads takes seconds_per_token[n] per token."""
    chosen = []
    for _ in range(num_steps):
        n = tuner.choose(num_tokens)
        tuner.record(num_tokens, n, seconds_per_token[n] * num_tokens)
        chosen.append(n)
    return chosen


def test_tuner_tries_each_count_then_keeps_the_faster_and_rechecks_rarely():
    tuner = ThreadTuner((2, 1), recheck_every=10)
    chosen = run(tuner, {2: 1.0, 1: 3.0}, 200)
    assert chosen[:2] == [2, 1]  # every candidate timed once, most threads first
    assert chosen.count(1) <= 2 + 200 // 30  # re-checks of a 3x slower count: every 3 x 10 steps
    assert chosen[-1] == 2


def test_tuner_moves_when_the_machine_changes_and_steps_of_other_sizes_are_apart():
    tuner = ThreadTuner((2, 1), recheck_every=10)
    assert run(tuner, {2: 1.0, 1: 1.5}, 50)[-1] == 2  # quiet: every core helps
    busy = run(tuner, {2: 10.0, 1: 1.5}, 50)  # neighbours arrive: a 2-thread team stalls
    assert busy[-1] == 1 and busy.count(2) <= 3 + 50 // 40  # two slow steps move the median; re-checks capped at 4 x 10
    quiet = run(tuner, {2: 1.0, 1: 1.5}, 100)  # they leave: found at the next re-check, within 10 / 1.5 x 10 steps
    assert quiet[-30:].count(1) <= 2  # back on 2, with a re-check of 1 every 1.5 x 10 steps
    assert run(tuner, {2: 1.0, 1: 9.0}, 3, num_tokens=2048)[:2] == [2, 1]  # a new step size is timed anew


def test_tuner_refuses_nonsense():
    with pytest.raises(ValueError):
        ThreadTuner(())
    with pytest.raises(ValueError):
        ThreadTuner((0, 1))
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_configured_thread_count_holds_during_steps_and_the_callers_comes_back(loaded):
    caller = torch.get_num_threads()
    seen = []
    hook = loaded.model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    try:
        core = EngineCore(loaded, EngineConfig(block_size=8, num_kv_blocks=32, num_threads=caller + 1))
        core.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while core.has_unfinished:
            core.step()
    finally:
        hook.remove()
    assert seen == [caller + 1] * 3
    assert torch.get_num_threads() == caller
