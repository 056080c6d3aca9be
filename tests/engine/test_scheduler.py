"""The scheduler with a fake model, the block audit after every step. No torch.

The fake model is paged like the real one: it writes each computed token into a
slot-addressed store through the block table, and "samples" a token from the
tokens it reads back through the block table. A wrong block table, a stale
prefix-cache block or a bad recompute after preemption changes the output.
"""

import pytest

from engine.config import EngineConfig, max_blocks_per_request, max_tokens_per_request
from engine.request import QueueFullError, Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler

VOCAB = 1000
EOS = 0


class FakePagedModel:
    """windows: the KV cache groups (engine/block_manager.py). Each group's layer writes the token
    through its own table into one slot store (block ids are one pool); a sliding group's token reads
    only the keys in its window, so a block dropped too early, or shared by two groups, shows."""

    def __init__(self, block_size, windows=(None,)):
        self.block_size = block_size
        self.windows = windows
        self.slots = {}  # slot -> token id written there
        self.num_computed_tokens = 0

    def execute(self, output):
        sampled = {}
        bs = self.block_size
        for s in output.scheduled:
            assert len(s.block_tables) == len(self.windows)
            for table in s.block_tables:
                for i, token_id in enumerate(s.token_ids):
                    pos = s.start_position + i
                    self.slots[table[pos // bs] * bs + pos % bs] = token_id
            self.num_computed_tokens += len(s.token_ids)
            if s.samples:  # the last row, and a draft's rows: keep tokens up to the first miss
                end = s.start_position + len(s.token_ids)
                run = []
                for j, row_end in enumerate(range(end - len(s.draft_token_ids), end + 1)):
                    contexts = []
                    for table, window in zip(s.block_tables, self.windows):
                        first = 0 if window is None else max(0, row_end - window)
                        contexts.append({p: self.slots[table[p // bs] * bs + p % bs] for p in range(first, row_end)})
                    run.append(next_token(contexts))
                    if j == len(s.draft_token_ids) or run[-1] != s.draft_token_ids[j]:
                        break
                sampled[s.request_id] = run
        return sampled


def next_token(contexts):
    """contexts: per group, position -> token id of the keys it sees."""
    return 1 + sum((k + 1) * (p + 1) * t for k, context in enumerate(contexts) for p, t in context.items()) % (
        VOCAB - 1
    )


def reference_output(prompt, max_tokens, windows=(None,)):
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        n = len(tokens)
        out.append(next_token([{p: tokens[p] for p in range(0 if w is None else max(0, n - w), n)} for w in windows]))
        tokens.append(out[-1])
    return out


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, windows=(None,), **kw):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **kw)
    capacity = None  # as EngineCore: a pool with sliding groups holds longer requests than its tokens
    if any(w is not None for w in windows):
        capacity = max_tokens_per_request(windows, block_size, num_blocks, config.max_num_batched_tokens, max_model_len)
    return Scheduler(config, num_blocks, config.limits(max_model_len, num_blocks, VOCAB, capacity), windows=windows)


def add(scheduler, rid, prompt, max_tokens=8, **params):
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))
    scheduler.add_request(request)
    return request


def run(scheduler, model, max_steps=10_000, on_step=None):
    """Step until done; audit the pool after every step. Returns the list of SchedulerOutputs."""
    outputs = []
    while scheduler.has_unfinished:
        assert len(outputs) < max_steps, "no progress"
        out = scheduler.schedule()
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        assert len(out.scheduled) <= scheduler.config.max_num_seqs
        scheduler.update(out, model.execute(out))
        assert scheduler.block_manager.audit() == []
        outputs.append(out)
        if on_step:
            on_step(len(outputs), out)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return outputs


def test_outputs_match_reference_under_varied_load():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=6)
    model = FakePagedModel(4)
    reqs = [add(s, f"r{i}", range(i * 7, i * 7 + 3 + 5 * (i % 5)), max_tokens=2 + i % 9) for i in range(20)]
    run(s, model)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens)
        assert r.status is RequestStatus.FINISHED_LENGTH


def test_decodes_are_served_every_step_while_a_long_prompt_is_chunked():
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=512)
    model = FakePagedModel(4)
    decoders = [add(s, f"d{i}", range(10 * i + 1, 10 * i + 4), max_tokens=30) for i in range(4)]
    s.update(first := s.schedule(), model.execute(first))  # all four prompts in one step
    assert all(r.num_output_tokens == 1 for r in decoders)
    long = add(s, "long", range(300, 400), max_tokens=3)
    counts = []

    def check(step, out):
        ids = {x.request_id for x in out.scheduled}
        if long.num_output_tokens == 0 and long.status is not RequestStatus.FINISHED_LENGTH:
            counts.append(sum(f"d{i}" in ids for i in range(4)))

    run(s, model, on_step=check)
    # 100 prompt tokens at 12 per step: ~9 steps of prefill, each with all 4 decodes.
    assert len(counts) >= 8 and all(c == 4 for c in counts)
    assert long.output_token_ids == reference_output(range(300, 400), 3)
    for r in decoders:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 30)


def test_small_pool_preempts_and_recomputes_with_identical_outputs():
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=64, max_num_seqs=8)
    model = FakePagedModel(4)
    reqs = [add(s, f"r{i}", range(i * 11, i * 11 + 6), max_tokens=14) for i in range(8)]
    run(s, model)
    assert s.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == s.num_preemptions
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 14)


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=4)
    model = FakePagedModel(4)
    a, b, c = (add(s, n, range(k, k + 8), max_tokens=10) for n, k in (("a", 0), ("b", 50), ("c", 100)))
    out = s.schedule()  # 2 blocks each: 6 of 6
    assert [x.request_id for x in out.scheduled] == ["a", "b", "c"]
    s.update(out, model.execute(out))
    out = s.schedule()  # each needs a third block for position 8
    assert out.preempted[0] == "c" and c.status is RequestStatus.PREEMPTED
    assert s.waiting[0] is c and c.num_computed_tokens == 0
    s.update(out, model.execute(out))
    run(s, model)
    assert c.output_token_ids == reference_output(range(100, 108), 10)


def test_prefix_hit_computes_only_uncached_tokens():
    s = make_scheduler(num_blocks=64, block_size=4)
    model = FakePagedModel(4)
    shared = list(range(500, 512))  # 3 blocks
    first = add(s, "first", shared + [1, 2], max_tokens=5)
    run(s, model)
    before = model.num_computed_tokens
    second = add(s, "second", shared + [7, 8, 9], max_tokens=5)
    run(s, model)
    assert second.num_cached_tokens == 12
    # 3 uncached prompt tokens, then 4 decodes (the 5th token is never computed).
    assert model.num_computed_tokens - before == 3 + 4
    assert second.output_token_ids == reference_output(shared + [7, 8, 9], 5)
    assert s.block_manager.num_prefix_hits == 12
    assert first.output_token_ids == reference_output(shared + [1, 2], 5)


def test_samples_of_one_prompt_submitted_together_share_the_prompt_blocks():
    s = make_scheduler(num_blocks=64, block_size=4)
    model = FakePagedModel(4)
    prompt = list(range(600, 618))  # 4 full blocks + 2 tokens
    reqs = [add(s, f"x-{i}", prompt, max_tokens=3) for i in range(3)]
    outs = run(s, model)
    assert [r.num_cached_tokens for r in reqs] == [0, 16, 16]
    # Prompt computed once, then 2 tokens for each of the other two; 2 decodes each.
    assert model.num_computed_tokens == 18 + 2 * 2 + 3 * 2
    assert len(outs) <= 4
    for r in reqs:
        assert r.output_token_ids == reference_output(prompt, 3)


def test_stop_conditions():
    s = make_scheduler()
    model = FakePagedModel(4)
    prompt = list(range(40, 45))
    ref = reference_output(prompt, 10)
    eos_after_3 = Request("eos", prompt, SamplingParams(max_tokens=10), eos_token_ids=(ref[2],))
    s.add_request(eos_after_3)
    ignore = Request("ignore", prompt, SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=(ref[2],))
    s.add_request(ignore)
    min_tok = Request("min", prompt, SamplingParams(max_tokens=10, min_tokens=5), eos_token_ids=(ref[2],))
    s.add_request(min_tok)
    stop_id = add(s, "stop_id", prompt, max_tokens=10, stop_token_ids=(ref[1],))
    run(s, model)
    assert eos_after_3.output_token_ids == ref[:3] and eos_after_3.status is RequestStatus.FINISHED_STOPPED
    assert eos_after_3.stop_reason is None
    assert ignore.output_token_ids == ref and ignore.status is RequestStatus.FINISHED_LENGTH
    assert min_tok.output_token_ids == ref  # the eos at token 3 came before min_tokens
    assert stop_id.output_token_ids == ref[:2] and stop_id.stop_reason == ref[1]


def test_admission_rejects_requests_that_can_never_fit():
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=40)
    with pytest.raises(ValueError, match="context length"):
        add(s, "long", range(30), max_tokens=11)
    with pytest.raises(ValueError, match="whole cache"):
        add(s, "big", range(30), max_tokens=5)  # 35 tokens > 8 blocks x 4
    with pytest.raises(ValueError, match="empty"):
        add(s, "empty", [], max_tokens=5)
    add(s, "ok", range(20), max_tokens=12)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "ok", range(3))
    assert not s.block_manager.audit()


def test_queue_limit_counts_every_request_in_flight():
    s = make_scheduler(max_num_seqs=1, max_waiting=1)
    add(s, "a", range(3))
    add(s, "b", range(3))
    with pytest.raises(QueueFullError):
        add(s, "c", range(3))
    s.abort_request("a")
    add(s, "c", range(3))


def test_abort_in_every_phase_frees_blocks():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
    model = FakePagedModel(4)
    decoding = add(s, "decoding", range(3), max_tokens=50)
    prefilling = add(s, "prefilling", range(100, 140), max_tokens=5)
    waiting = add(s, "waiting", range(200, 210), max_tokens=5)
    for _ in range(3):
        out = s.schedule()
        s.update(out, model.execute(out))
        assert s.block_manager.audit() == []
    assert decoding.num_output_tokens >= 2 and 0 < prefilling.num_computed_tokens < 40
    assert waiting.status is RequestStatus.WAITING
    for r in (decoding, prefilling, waiting):
        assert s.abort_request(r.request_id) is r and r.status is RequestStatus.FINISHED_ABORTED
        assert s.block_manager.audit() == []
    assert s.abort_request("decoding") is None
    assert not s.has_unfinished and s.block_manager.num_free_blocks == 32


def test_fcfs_admission_order():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=10, max_num_seqs=2)
    model = FakePagedModel(4)
    reqs = [add(s, f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3) for i in range(6)]
    first_token_step = {}

    def record(step, out):
        for r in reqs:
            if r.num_output_tokens and r.request_id not in first_token_step:
                first_token_step[r.request_id] = step

    run(s, model, on_step=record)
    steps = [first_token_step[r.request_id] for r in reqs]
    assert steps == sorted(steps)


def test_prompt_logprob_rows_per_step_are_bounded_and_cover_the_prompt():
    """Each prompt row's logits hold a whole vocabulary: a step computes at most
    MAX_PROMPT_LOGPROB_ROWS of them, and over the steps every prompt position gets one row."""
    from engine.scheduler import MAX_PROMPT_LOGPROB_ROWS

    config = EngineConfig(block_size=16, num_kv_blocks=256, max_num_batched_tokens=2048)
    scheduler = Scheduler(config, 256, config.limits(4096, 256, VOCAB))
    model = FakePagedModel(16)
    sizes = {"a": 700, "b": 300, "c": 40}
    for rid, n in sizes.items():
        scheduler.add_request(
            Request(rid, [1 + i % (VOCAB - 1) for i in range(n)], SamplingParams(max_tokens=2, prompt_logprobs=1))
        )
    scheduler.add_request(Request("plain", list(range(1, 500)), SamplingParams(max_tokens=2)))
    positions = {rid: [] for rid in sizes}
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        rows = 0
        for s in output.scheduled:
            rows += len(s.prompt_logprob_rows)
            positions.get(s.request_id, []).extend(s.start_position + j + 1 for j in s.prompt_logprob_rows)
        assert rows <= MAX_PROMPT_LOGPROB_ROWS
        scheduler.update(output, model.execute(output))
        assert scheduler.audit() == []
    assert positions == {rid: list(range(1, n)) for rid, n in sizes.items()}


WINDOWED = [(None, 6), (6,), (6, 6, None), (9, None)]


@pytest.mark.parametrize("windows", WINDOWED)
def test_sliding_groups_under_load_preemption_and_prefix_hits(windows):
    """Prompts of several windows, chunked, in a pool that preempts, half of them sharing prefixes:
    every output is the reference's, the pool audits clean at every step, and a sliding group never
    holds more than its window and a chunk a running request."""
    # Room for the longest request (70 tokens) and two blocks more: six at once preempt.
    num_blocks = 1 + max_blocks_per_request(windows, 4, 70, 10) + 2
    s = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=10, max_num_seqs=6, windows=windows)
    model = FakePagedModel(4, windows)
    shared = list(range(500, 530))
    reqs = [
        add(s, f"r{i}", (shared if i % 2 else []) + list(range(i * 37, i * 37 + 5 + 7 * (i % 4))), max_tokens=6 + i % 7)
        for i in range(14)
    ]
    bm = s.block_manager
    most = [0] * len(windows)

    def check(step, out):
        for g, w in enumerate(windows):
            held = bm.num_held_blocks(g)
            most[g] = max(most[g], held)
            if w is not None:
                assert held <= len(s.running) * (-(-(w - 1 + 10) // 4) + 1)

    run(s, model, on_step=check)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens, windows)
    assert s.num_preemptions > 0 and bm.num_prefix_hits > 0
    if None in windows:
        assert max(m for m, w in zip(most, windows) if w is None) > max(m for m, w in zip(most, windows) if w)
