"""loadtest.offline times our engine on random prompts: every timed run must prefill its prompts,
as transformers' generate_batch (which has no prefix cache) does, or the ratio flatters us."""

from __future__ import annotations

import json

import pytest

from loadtest import offline
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline") / "tiny-q4_0.gguf"
    return write_gguf(path, "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path()))


@pytest.mark.slow
def test_repeats_and_the_warm_up_prefill_prompts_of_their_own(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "figures.json"
    # 40-token prompts fill two 16-token blocks each: a repeat of them would be found in the prefix cache
    assert (
        offline.main(
            [
                "--model",
                str(tiny_gguf),
                "--skip-hf",
                "--num-prompts",
                "3",
                "--input-len",
                "40",
                "--output-len",
                "2",
                "--repeats",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    figures = json.loads(out.read_text())
    assert figures["pagedserve_cached_prompt_tokens"] == 0
    assert figures["pagedserve_tokens_per_s"] > 0
    assert "pagedserve" in capsys.readouterr().out
