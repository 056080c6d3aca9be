"""loadtest.speculative runs each pair of servers (without and with speculation) side by side, a row
on one and then on the other, and its table holds every row for every server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loadtest import speculative
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path


def test_every_server_gets_a_port_of_its_own_and_the_same_threads():
    args = SimpleNamespace(model="m.gguf", llama_server="/bin/llama-server", threads=2, k=3, concurrency=16)
    servers = speculative.commands(args)
    assert list(servers) == [
        "pagedserve",
        "pagedserve --speculative ngram",
        "llama-server",
        "llama-server --spec-type ngram-simple",
    ]
    ports = [command[command.index("--port") + 1] for command in servers.values()]
    assert all(port.isdigit() for port in ports) and len(set(ports)) == 4
    for command in servers.values():
        threads = command[command.index("--num-threads" if "--num-threads" in command else "-t") + 1]
        assert threads == "2"
    assert servers["pagedserve --speculative ngram"][-4:] == ["--speculative", "ngram", "--num-speculative-tokens", "3"]


@pytest.mark.slow
def test_a_pair_runs_side_by_side_and_reports_every_row(tmp_path, capsys):
    model = write_gguf(
        tmp_path / "tiny-q4_0.gguf", "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path())
    )
    out = tmp_path / "spec.json"
    speculative.main(
        [
            "--model",
            str(model),
            "--threads",
            "1",
            "--requests",
            "1",
            "--max-tokens",
            "8",
            "--temperatures",
            "0",
            "0.8",
            "--concurrency",
            "2",
            "--workloads",
            "quote",
            "chat",
            "--rounds",
            "2",
            "--mixed-rounds",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())["results"]
    rows = ["quote t=0.0 c=1", "quote t=0.8 c=1", "chat t=0.0 c=1", "chat t=0.8 c=1", "mixed t=0.8 c=2"]
    for name in ("pagedserve", "pagedserve --speculative ngram"):
        assert list(result[name]) == rows
        assert all(result[name][row]["tokens"] > 0 and result[name][row]["tok_s"] > 0 for row in rows)
    # Seeded and greedy requests: the same tokens with and without drafts.
    for row in rows[:-1]:
        assert result["pagedserve"][row]["tokens"] == result["pagedserve --speculative ngram"][row]["tokens"]
        for name in ("pagedserve", "pagedserve --speculative ngram"):  # twice on each, the figure their median
            runs = result[name][row]["tok_s_runs"]
            assert len(runs) == 2 and result[name][row]["tok_s"] == pytest.approx(sum(runs) / 2)
    for name in (
        "pagedserve",
        "pagedserve --speculative ngram",
    ):  # the mixed run its own count of rounds, on fresh pairs
        mixed = result[name][rows[-1]]
        assert len(mixed["tok_s_runs"]) == 2 and mixed["tok_s"] == pytest.approx(sum(mixed["tok_s_runs"]) / 2)
        assert mixed["draft_tokens"] == 0 or name.endswith("ngram")
    # Every run computes its prompts afresh (a cache_salt of its own): nothing from the prefix cache,
    # though every round sends the same prompts.
    for name in ("pagedserve", "pagedserve --speculative ngram"):
        assert all(result[name][row]["cached_prompt_tokens"] == 0 for row in rows), result[name]
    assert "Prompt tokens served from a prefix cache, all rows: pagedserve " in printed
    # The rounds of a row, and the rows, alternate which server goes first.
    runs = [line for line in printed.splitlines() if line.startswith("  pagedserve") and " c=1:" in line]
    firsts = [runs[i].split(":")[0].strip() for i in range(0, len(runs), 2)]
    on, off = "pagedserve --speculative ngram", "pagedserve"
    assert firsts == [off, on, on, off] * 2
    assert "| quote t=0.0 c=1 |" in printed
    assert printed.count("pagedserve --speculative ngram: /") == 1 + 2  # the pair's start, then one a mixed round


@pytest.mark.slow
def test_no_mixed_rounds_reports_the_c1_rows_alone(tmp_path, capsys):
    model = write_gguf(
        tmp_path / "tiny-q4_0.gguf", "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path())
    )
    speculative.main(
        [
            "--model",
            str(model),
            "--threads",
            "1",
            "--requests",
            "1",
            "--max-tokens",
            "4",
            "--temperatures",
            "0",
            "--workloads",
            "quote",
            "--rounds",
            "1",
            "--mixed-rounds",
            "0",
        ]
    )
    printed = capsys.readouterr().out
    assert "| quote t=0.0 c=1 |" in printed and "mixed" not in printed.split("| run |")[1]


def test_rounds_are_bounded():
    for bad in (["--rounds", "0"], ["--mixed-rounds", "-1"]):
        with pytest.raises(SystemExit):
            speculative.main(["--model", "smollm2-135m", *bad])
