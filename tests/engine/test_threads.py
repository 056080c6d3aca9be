"""Step settings: the tuner follows whichever thread count runs steps faster; a fixed count
holds; oneDNN is switched off around single-token reduced-precision steps, always."""
import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine.threads import StepSetting, StepTuner, applied, candidate_settings

TWO, ONE = StepSetting(2), StepSetting(1)


def run(tuner, seconds_per_token, num_steps, num_tokens=64):
    """Step the tuner against a machine where a step with setting s takes seconds_per_token[s] per token."""
    chosen = []
    for _ in range(num_steps):
        s = tuner.choose(num_tokens)
        tuner.record(num_tokens, s, seconds_per_token[s] * num_tokens)
        chosen.append(s)
    return chosen


def test_tuner_tries_each_setting_then_keeps_the_faster_and_rechecks_rarely():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    chosen = run(tuner, {TWO: 1.0, ONE: 3.0}, 200)
    assert chosen[:2] == [TWO, ONE]  # every candidate timed once, in the order given
    assert chosen.count(ONE) <= 2 + 200 // 30  # re-checks of a 3x slower setting: every 3 x 10 steps
    assert chosen[-1] == TWO


def test_tuner_moves_when_the_machine_changes_and_steps_of_other_sizes_are_apart():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    assert run(tuner, {TWO: 1.0, ONE: 1.5}, 50)[-1] == TWO  # quiet: every core helps
    busy = run(tuner, {TWO: 10.0, ONE: 1.5}, 50)  # neighbours arrive: a 2-thread team stalls
    assert busy[-1] == ONE and busy.count(TWO) <= 3 + 50 // 40  # two slow steps move the median; re-checks capped at 4 x 10
    quiet = run(tuner, {TWO: 1.0, ONE: 1.5}, 100)  # they leave: found at the next re-check, within 10 / 1.5 x 10 steps
    assert quiet[-30:].count(ONE) <= 2  # back on 2, with a re-check of 1 every 1.5 x 10 steps
    assert run(tuner, {TWO: 1.0, ONE: 9.0}, 3, num_tokens=2048)[:2] == [TWO, ONE]  # a new step size is timed anew


def test_single_token_reduced_precision_steps_run_with_onednn_off_and_only_threads_are_tuned():
    bf16 = candidate_settings(2, None, torch.bfloat16)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    # Never a choice between kernels: it would change bf16 rounding from one step to the next.
    assert bf16(1) == (StepSetting(2, False), StepSetting(1, False))
    assert bf16(2) == bf16(64) == (TWO, ONE)
    assert candidate_settings(2, None, torch.float32)(1) == (TWO, ONE)  # fp32 matmuls do not go to oneDNN
    assert candidate_settings(4, 3, torch.bfloat16)(1) == (StepSetting(3, False),)  # a fixed count is the only count
    assert candidate_settings(1, None, torch.float32)(64) == (ONE,)


def test_applied_sets_and_restores_both():
    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    with applied(StepSetting(threads + 1, not onednn)):
        assert torch.get_num_threads() == threads + 1
        assert torch.backends.mkldnn.enabled == (not onednn)
    assert torch.get_num_threads() == threads and torch.backends.mkldnn.enabled == onednn
    with pytest.raises(RuntimeError), applied(StepSetting(threads + 1, not onednn)):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == threads and torch.backends.mkldnn.enabled == onednn


def test_tuner_refuses_nonsense():
    with pytest.raises(ValueError):
        StepTuner(lambda n: ()).choose(1)
    with pytest.raises(ValueError):
        StepTuner(lambda n: (StepSetting(0),)).choose(1)
    with pytest.raises(ValueError):
        StepTuner(lambda n: (ONE,), recheck_every=0)
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
