"""Step settings: the tuner follows whichever thread count runs steps faster; a fixed count
holds; single-token reduced-precision steps run on torch's own kernels, always, and that
choice reaches the model with the step, not through torch's process-wide oneDNN switch."""

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine import threads
from engine.threads import StepSetting, StepTuner, applied, candidate_settings
from models.layers.step_kernels import StepKernels

TWO, ONE = StepSetting(2), StepSetting(1)


def run(tuner, ms_per_token, num_steps, num_tokens=64):
    """Step the tuner against a machine where a step with setting s takes ms_per_token[s] per token."""
    chosen = []
    for _ in range(num_steps):
        s = tuner.choose(num_tokens)
        tuner.record(num_tokens, s, ms_per_token[s] * num_tokens / 1e3)
        chosen.append(s)
    return chosen


def test_tuner_tries_each_setting_then_keeps_the_faster_and_rechecks_rarely():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    chosen = run(tuner, {TWO: 1.0, ONE: 3.0}, 200)
    assert chosen[:4] == [
        TWO,
        ONE,
        TWO,
        TWO,
    ]  # every candidate timed once, in the order given; the best's window filled
    assert chosen.count(ONE) <= 2 + 200 // 30  # re-checks of a 3x slower setting: every 3 x 10 steps
    assert chosen[-1] == TWO


def test_tuner_totals_count_each_thread_counts_steps_tokens_and_seconds():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    chosen = run(tuner, {TWO: 1.0, ONE: 3.0}, 40, num_tokens=16)
    totals = tuner.totals()
    assert set(totals) == {1, 2}
    for num_threads, setting, ms in ((2, TWO, 1.0), (1, ONE, 3.0)):
        steps = chosen.count(setting)
        assert totals[num_threads].steps == steps and totals[num_threads].tokens == 16 * steps
        assert totals[num_threads].seconds == pytest.approx(steps * 16 * ms / 1e3)


def test_tuner_moves_when_the_machine_changes_and_steps_of_other_sizes_are_apart():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    assert run(tuner, {TWO: 1.0, ONE: 1.5}, 50)[-1] == TWO  # quiet: every core helps
    busy = run(tuner, {TWO: 10.0, ONE: 1.5}, 50)  # neighbours arrive: a 2-thread team stalls
    # two slow steps move the median; re-checks capped at 4 x 10 steps
    assert busy.count(TWO) <= 3 + 50 // 40 and busy[-10:].count(ONE) >= 9
    quiet = run(tuner, {TWO: 1.0, ONE: 1.5}, 100)  # they leave: found at the next re-check, within 10 / 1.5 x 10 steps
    assert quiet[-30:].count(ONE) <= 2  # back on 2, with a re-check of 1 every 1.5 x 10 steps
    assert run(tuner, {TWO: 1.0, ONE: 9.0}, 3, num_tokens=128)[:2] == [TWO, ONE]  # a new step size is timed anew


def test_a_costly_step_size_tries_fewer_threads_only_where_smaller_steps_run_best_on_them():
    # 2048-token steps of 2 s: never a second one on 1 thread to time it (it would take ~4 s)
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    assert run(tuner, {TWO: 1.0, ONE: 1.9}, 60, num_tokens=2048) == [TWO] * 60
    assert run(tuner, {TWO: 1.0, ONE: 1.9}, 3, num_tokens=16)[:2] == [TWO, ONE]  # 16 ms steps: timed
    # the cores get busy: the small steps move to 1 thread, and then the costly size tries it too
    busy = {TWO: 5.0, ONE: 1.0}
    assert run(tuner, busy, 20, num_tokens=16)[-5:] == [ONE] * 5
    assert ONE in run(tuner, busy, 3, num_tokens=2048)
    assert run(tuner, busy, 20, num_tokens=2048)[-5:] == [ONE] * 5
    # a step size whose best takes at most explore_seconds is timed as before
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10, explore_seconds=5.0)
    assert run(tuner, {TWO: 1.0, ONE: 1.9}, 3, num_tokens=2048)[:2] == [TWO, ONE]


def test_a_slow_first_step_or_a_few_percent_do_not_move_steps_off_every_core():
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    chosen = []
    for i in range(200):  # the first 2-thread step pays first-use costs (10x); then 2 threads are 5% faster,
        s = tuner.choose(1)  # with +-3% noise
        seconds = {TWO: 1.0, ONE: 1.05}[s] * (1 + 0.03 * ((i * 7) % 3 - 1)) * (10.0 if i == 0 else 1.0) / 1e3
        tuner.record(1, s, seconds)
        chosen.append(s)
    assert chosen.count(ONE) <= 3 + 200 // 10 and chosen[-20:].count(TWO) >= 18
    # a busy machine from the first step (2 threads 5x slower): on 1 thread within a few steps
    # (steps of 80 ms: a costlier size waits for a cheaper one's verdict, see the next test)
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    busy = run(tuner, {TWO: 5.0, ONE: 1.0}, 30, num_tokens=16)
    assert busy[:6] == [TWO, ONE, TWO, TWO, ONE, ONE] and busy[6:].count(TWO) <= 1
    # within the margin either way: the first candidate (most threads) stays
    tuner = StepTuner(lambda n: (TWO, ONE), recheck_every=10)
    assert run(tuner, {TWO: 1.0, ONE: 0.95}, 100)[-20:].count(TWO) >= 18
    assert run(tuner, {TWO: 1.0, ONE: 0.8}, 100)[-20:].count(ONE) >= 18  # 20% faster: it moves


def test_single_token_reduced_precision_steps_run_on_torchs_kernels_and_only_threads_are_tuned(monkeypatch):
    # As on a CPU where oneDNN takes bf16 matmuls (AVX-512 / AMX); where it takes none,
    # switching it off would change no kernel, and the steps keep the default.
    monkeypatch.setattr(threads, "onednn_takes", lambda dtype: dtype == torch.bfloat16)
    bf16 = candidate_settings(2, None, torch.bfloat16)
    torchs = StepKernels(onednn=False)
    # Never a choice between kernels: it would change bf16 rounding from one step to the next.
    assert bf16(1) == (StepSetting(2, torchs), StepSetting(1, torchs))
    assert bf16(2) == bf16(64) == (TWO, ONE)
    assert candidate_settings(2, None, torch.float32)(1) == (TWO, ONE)  # fp32 matmuls do not go to oneDNN
    assert candidate_settings(4, 3, torch.bfloat16)(1) == (StepSetting(3, torchs),)  # a fixed count is the only count
    assert candidate_settings(1, None, torch.float32)(64) == (ONE,)
    monkeypatch.setattr(threads, "onednn_takes", lambda dtype: False)
    assert candidate_settings(2, None, torch.bfloat16)(1) == (TWO, ONE)


def test_applied_sets_and_restores_the_thread_count_and_leaves_onednn_alone():
    caller, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    with applied(StepSetting(caller + 1, StepKernels(onednn=False))):
        assert torch.get_num_threads() == caller + 1
        assert torch.backends.mkldnn.enabled == onednn  # the kernels travel with the step instead
    assert torch.get_num_threads() == caller
    with pytest.raises(RuntimeError), applied(StepSetting(caller + 1)):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == caller and torch.backends.mkldnn.enabled == onednn


def test_tuner_refuses_nonsense():
    with pytest.raises(ValueError):
        StepTuner(lambda n: ()).choose(1)
    with pytest.raises(ValueError):
        StepTuner(lambda n: (StepSetting(0),)).choose(1)
    with pytest.raises(ValueError):
        StepTuner(lambda n: (ONE,), recheck_every=0)
    with pytest.raises(ValueError, match="margin"):
        StepTuner(lambda n: (ONE,), margin=1.0)
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


def test_a_one_token_step_carries_torchs_kernels_to_the_model_and_leaves_onednn_on(loaded, monkeypatch):
    monkeypatch.setattr(threads, "onednn_takes", lambda dtype: True)  # as for bf16 on an AVX-512 / AMX CPU
    seen = []  # (where, num_tokens or rows, the step's kernels, torch's switch at that moment)
    hook = loaded.model.register_forward_pre_hook(
        lambda module, args: seen.append(("forward", args[0].numel(), args[3].kernels, torch.backends.mkldnn.enabled))
    )
    compute_logits = loaded.model.compute_logits

    def spy(hidden, kernels):
        seen.append(("logits", hidden.shape[0], kernels, torch.backends.mkldnn.enabled))
        return compute_logits(hidden, kernels)

    monkeypatch.setattr(loaded.model, "compute_logits", spy)
    try:
        core = EngineCore(loaded, EngineConfig(block_size=8, num_kv_blocks=32))
        core.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while core.has_unfinished:
            core.step()
    finally:
        hook.remove()
    torchs = StepKernels(onednn=False)
    assert (
        seen
        == [("forward", 3, StepKernels(), True), ("logits", 1, StepKernels(), True)]
        + [("forward", 1, torchs, True), ("logits", 1, torchs, True)] * 2
    )


def test_the_thread_count_is_tuned_only_where_results_do_not_depend_on_it(loaded, tiny_llama):
    from models.layers import cpu_kernels
    from models.loader import load_model

    torch.set_num_threads(2)  # the runner's cores (the fixture puts the count back)
    # Dense float32 layers run on torch's GEMM, where a row's rounding can follow the thread count.
    assert not loaded.model.row_invariant()
    dense = EngineCore(loaded, EngineConfig(block_size=8, num_kv_blocks=32)).runner.step_tuner
    assert dense.candidates(1) == dense.candidates(64) == (TWO,)
    assert candidate_settings(2, 1, torch.float32, row_invariant=False)(64) == (ONE,)  # a configured count holds
    if cpu_kernels.available():  # quantized layers: our kernel, split over outputs, never over a sum
        quantized = load_model(tiny_llama[0], dtype="float32", quantization="int8")
        assert quantized.model.row_invariant()
        tuner = EngineCore(quantized, EngineConfig(block_size=8, num_kv_blocks=32)).runner.step_tuner
        assert tuner.candidates(64) == (TWO, ONE)
