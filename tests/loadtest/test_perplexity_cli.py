"""python -m loadtest.perplexity on a tiny GGUF: several text files read as one, and --kv-reference
scoring the text again with the cache in another dtype (both perplexities, their ratio, the mean
KL divergence), as docs/benchmarks.md's int8 KV figures are taken."""

from __future__ import annotations

import math
import re

import pytest

from loadtest import perplexity
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("perplexity") / "tiny-q4_0.gguf"
    return write_gguf(path, "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path()))


def test_two_texts_and_an_int8_cache_against_float32(tiny_gguf, tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("The river rose slowly through the night.\n")
    second.write_text("def f(x):\n    return x + 1\n")
    argv = ["--model", str(tiny_gguf), "--kv-cache-dtype", "int8", "--kv-reference", "float32"]
    perplexity.main([*argv, "--text", str(first), str(second)])
    out = capsys.readouterr().out
    ours, tokens = re.search(r"--kv-cache-dtype int8: perplexity ([\d.]+) over (\d+) tokens", out).groups()
    ref, ratio, kl = re.search(
        r"--kv-cache-dtype float32: perplexity ([\d.]+); int8 / float32 ([\d.]+), mean KL divergence ([\d.]+)", out
    ).groups()
    assert float(ratio) == pytest.approx(float(ours) / float(ref), abs=2e-4)
    assert 0 <= float(kl) < 0.05 and math.isfinite(float(ref))
    perplexity.main(["--model", str(tiny_gguf), "--text", str(first)])
    alone = re.search(r"over (\d+) tokens", capsys.readouterr().out).group(1)
    assert int(alone) < int(tokens)  # the second file was scored too
