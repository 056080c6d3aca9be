"""Workloads: exact prompt lengths, shared-prefix structure, datasets, arrivals."""

import asyncio
import itertools
import json
import math
import statistics
from collections import Counter

import pytest

from loadtest.benchmark import disconnect_plan
from loadtest.workload import TOKEN_ID_RANGE, arrival_times, dataset_workload, synthetic_workload


class PieceTokenizer:
    """A fake tokenizer that does not round-trip, like real BPE: encode() adds
    BOS (id 0) and splits words longer than 5 characters into two pieces, so
    decoding random ids and encoding again changes the count."""

    name = "fake"

    def __init__(self):
        self.pieces = ["<s>"]
        self.ids = {"<s>": 0}

    def _id(self, piece):
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    async def encode(self, text):
        ids = [0]
        for word in text.split():
            if len(word) > 5:
                ids += [self._id(word[:5]), self._id("##" + word[5:])]
            else:
                ids.append(self._id(word))
        return ids

    async def decode(self, ids):
        text = ""
        for i in ids:
            piece = self.pieces[i]
            if i == 0:
                continue
            text += piece[2:] if piece.startswith("##") else (" " if text else "") + piece
        return text


def build(tokenizer, **kw):
    args = dict(num_requests=24, input_len=40, output_len=8, seed=0)
    args.update(kw)
    return asyncio.run(synthetic_workload(tokenizer, **args))


def encode(tokenizer, text):
    return asyncio.run(tokenizer.encode(text))


def test_random_prompts_have_exact_token_lengths_despite_merges():
    tok = PieceTokenizer()
    workload = build(tok)
    assert workload.num_inexact == 0
    for spec in workload.requests:
        assert len(encode(tok, spec.prompt)) == spec.prompt_len == 40
        assert spec.output_len == 8
    assert len({spec.prompt for spec in workload.requests}) == 24


def test_same_seed_same_prompts_other_salt_other_prompts():
    first, again = build(PieceTokenizer()), build(PieceTokenizer())
    warmup = build(PieceTokenizer(), salt="warmup")
    assert [s.prompt for s in first.requests] == [s.prompt for s in again.requests]
    assert not {s.prompt for s in first.requests} & {s.prompt for s in warmup.requests}


def test_shared_prefix_workload_has_the_promised_hit_structure():
    tok = PieceTokenizer()
    workload = build(tok, prefix_len=16, num_prefixes=4)
    specs = workload.requests
    assert Counter(s.prefix_index for s in specs) == {0: 6, 1: 6, 2: 6, 3: 6}  # dealt out evenly
    assert workload.expected_prefix_hit_rate == pytest.approx(1 - 4 / 24)
    assert workload.num_inexact == 0
    tokens = [encode(tok, s.prompt) for s in specs]
    assert all(len(t) == 40 for t in tokens)
    for a in range(len(specs)):
        for b in range(a + 1, len(specs)):
            shared = 0
            while tokens[a][shared] == tokens[b][shared]:
                shared += 1
            if specs[a].prefix_index == specs[b].prefix_index:
                assert shared >= 1 + 16  # BOS + the whole prefix, token for token
            else:
                assert shared < 1 + 16


def test_token_id_prompts_without_a_tokenizer():
    workload = build(None, prefix_len=10, num_prefixes=2)
    assert workload.tokenizer == "token-ids"
    low, high = TOKEN_ID_RANGE
    for spec in workload.requests:
        assert len(spec.prompt) == 40 and all(low <= t < high for t in spec.prompt)
    by_prefix = {}
    for spec in workload.requests:
        by_prefix.setdefault(spec.prefix_index, set()).add(tuple(spec.prompt[:10]))
    assert sorted(len(p) for p in by_prefix.values()) == [1, 1] and len(by_prefix) == 2


def gaps(times):
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_schedule_is_seeded_and_has_the_requested_rate():
    times = arrival_times(4000, request_rate=50.0, burstiness=1.0, seed=7)
    assert times == arrival_times(4000, 50.0, 1.0, seed=7)
    assert times != arrival_times(4000, 50.0, 1.0, seed=8)
    assert times[0] == 0.0 and times == sorted(times)
    g = gaps(times)
    assert statistics.mean(g) == pytest.approx(1 / 50.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.08)


@pytest.mark.parametrize("shape", [0.25, 4.0])
def test_burstiness_changes_spread_not_rate(shape):
    g = gaps(arrival_times(4000, 10.0, shape, seed=1))
    assert statistics.mean(g) == pytest.approx(0.1, rel=0.1)
    # Gamma(k) gaps: coefficient of variation 1/sqrt(k).
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1 / math.sqrt(shape), rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_dataset_lines_prompts_messages_and_output_len(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "one two three"},
        {"messages": [{"role": "user", "content": "hi"}], "output_len": 5},
        {"prompt": "four five"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    workload = asyncio.run(dataset_workload(str(path), 7, 32, seed=0, endpoint="chat", tokenizer=PieceTokenizer()))
    specs = workload.requests
    assert len(specs) == 7  # reused in order when asking for more than the file has
    assert [s.prompt for s in specs[3:6]] == [s.prompt for s in specs[:3]]
    by_kind = {isinstance(s.prompt, str): s for s in specs}
    assert by_kind[False].output_len == 5 and by_kind[False].prompt_len == -1
    assert by_kind[True].output_len == 32 and by_kind[True].prompt_len > 0


def test_dataset_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        asyncio.run(dataset_workload(str(bad), 2, 8, 0, "completions", None))
    chat_only = tmp_path / "chat.jsonl"
    chat_only.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match="--endpoint chat"):
        asyncio.run(dataset_workload(str(chat_only), 1, 8, 0, "completions", None))
    token_ids = tmp_path / "ids.jsonl"
    token_ids.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match="text"):
        asyncio.run(dataset_workload(str(token_ids), 1, 8, 0, "chat", None))
    assert asyncio.run(dataset_workload(str(token_ids), 1, 8, 0, "completions", None)).requests[0].prompt_len == 3


def test_disconnect_plan_picks_exactly_the_fraction_mid_stream():
    specs = build(None, num_requests=40, output_len=10).requests
    plan = disconnect_plan(specs, 0.25, seed=3)
    assert len(plan) == 10
    assert all(1 <= after <= 9 for after in plan.values())
    assert plan == disconnect_plan(specs, 0.25, seed=3)
    assert disconnect_plan(specs, 0.0, seed=3) == {}


def test_bench_grammars_times_llguidance_on_the_default_tokenizer(capsys):
    from loadtest.bench_grammars import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 49152" in out and "REJECTED" not in out
    assert out.count("compile") >= 3 and "llguidance: tokenizer view" in out
