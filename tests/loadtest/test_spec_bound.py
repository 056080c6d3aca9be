"""loadtest.spec_bound: the oracle's steps, the n-gram replay and the bound they give, counted
exactly; and the command end to end on a tiny GGUF, where greedy outputs are the argmax and the
engine with drafts gives the same tokens as without."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from loadtest import spec_bound
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path


def test_oracle_steps_accept_up_to_the_first_miss_and_take_one_token_more():
    hits = [True, True, False, True, True, True, True, False]
    # 0: drafts 0-2, hits 0 and 1, 2 drawn; 3: drafts 3-5 all hit, 6 drawn (the bonus); 7: nothing left to draft
    assert spec_bound.oracle_steps(hits, 3) == [4, 4, 1]
    assert spec_bound.oracle_steps(hits, 0) == [1] * len(hits)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(0, 6))
def test_oracle_steps_yield_every_token_once(hits, k):
    rows = spec_bound.oracle_steps(hits, k)
    # Replay: each step yields its accepted run and one token; all steps together yield len(hits).
    i = 0
    for r in rows:
        run = 0
        while run < r - 1 and hits[i + run]:
            run += 1
        i += run + 1
    assert i == len(hits)
    if all(hits):
        assert len(rows) == -(-len(hits) // (k + 1))
    if not any(hits):
        assert len(rows) == len(hits)


def test_ngram_replay_copies_a_prompt_in_few_steps_and_counts_every_token():
    prompt = list(range(100, 140))
    output = prompt[10:30]  # the answer quotes the prompt
    rows, accepted = spec_bound.ngram_steps(prompt, output, 4)
    assert len(rows) + accepted == len(output) - 1  # each step: its accepted drafts and one token
    assert len(rows) <= 5 and accepted >= 14
    rows, accepted = spec_bound.ngram_steps(prompt, list(range(500, 520)), 4)  # nothing to copy
    assert rows == [1] * 19 and accepted == 0


def test_the_bound_is_one_without_drafts_and_the_prefill_share_caps_it():
    requests = [
        {
            "prompt": [1] * 10,
            "output": list(range(9)),
            "prefill_s": 1.0,
            "decode_s": 8 * 0.1,
            "max_p": [1.0] * 9,
            "hits": [True] * 9,
        }
    ]
    costs = {r: 0.1 for r in range(1, 5)}  # rows cost nothing: the bound is the steps saved
    b = spec_bound.bounds(requests, costs, 3)
    assert b["oracle"][0]["ratio"] == pytest.approx(1.0)
    assert b["oracle"][3]["tokens_per_step"] == pytest.approx(4.0)  # 8 decoded tokens in 2 steps
    assert b["oracle"][3]["ratio"] == pytest.approx(1.8 / 1.2)
    assert b["ceiling"] == pytest.approx(1.8)
    assert b["prefill_share"] == pytest.approx(1.0 / 1.8)


@pytest.mark.slow
def test_the_command_reports_each_workload_and_greedy_outputs_are_the_argmax(tmp_path, capsys):
    model = write_gguf(
        tmp_path / "tiny-q4_0.gguf", "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path())
    )
    out = tmp_path / "bound.json"
    spec_bound.main(
        [
            "--model",
            str(model),
            "--threads",
            "1",
            "--requests",
            "2",
            "--max-tokens",
            "12",
            "--k",
            "3",
            "--workloads",
            "quote",
            "chat",
            "--rounds",
            "2",
            "--engine-rounds",
            "2",
            "--out",
            str(out),
        ]
    )
    assert "| quote | 0 |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert sorted(result["results"]) == ["chat t=0", "chat t=0.8", "quote t=0", "quote t=0.8"]
    for name, b in result["results"].items():
        assert set(b["oracle"]) == {"0", "1", "2", "3"} and b["oracle"]["0"]["ratio"] == pytest.approx(1.0)
        assert 0 < b["prefill_share"] < 1 and b["ceiling"] > 1
        # the engine with drafts gave every request the tokens it gave without, in both rounds
        assert b["measured"]["same_tokens"] and len(b["measured"]["rounds"]) == 2 and b["measured"]["ratio"] > 0
        assert b["measured"]["control"] > 0
        if name.endswith("t=0"):  # greedy: every token the argmax of the same logits, teacher-forced
            assert b["argmax_share"] == 1.0 and b["mean_max_p"] == 1.0
    assert sorted(map(int, result["row_costs"])) == [1, 2, 3, 4]


def test_the_engine_run_flags_outputs_that_differ_with_drafts():
    class Fake:
        def __init__(self, shift):
            self.shift = shift

        def generate(self, prompts, params):
            return [type("Result", (), {"token_ids": [t + self.shift for t in range(5)]})()]

    requests = [{"prompt": [1, 2], "params": None, "output": list(range(5))}]
    run = spec_bound.measured(Fake(0), Fake(0), requests, 3, control=Fake(0))
    assert run["same_tokens"] and len(run["rounds"]) == 3 and run["control"] > 0
    assert "off again" in spec_bound.engine(run) and "DIFFER" not in spec_bound.engine(run)
    run = spec_bound.measured(Fake(0), Fake(1), requests, 2)
    assert not run["same_tokens"] and len(run["rounds"]) == 2 and "control" not in run
    assert "TOKENS DIFFER" in spec_bound.engine(run)
