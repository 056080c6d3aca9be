"""Incremental detokenization against real tokenizers' full decode, and stop strings.

Tokenizers are built here without the hub: a byte-level BPE trained on a small
multilingual corpus (tokens split UTF-8 characters, merges cross character
boundaries), a Llama-2-style SentencePiece BPE with byte fallback (decode strips
the first leading space; unknown characters become <0xXX> tokens), and, when the
model fetcher and GGUF reader are there, SmolLM2's own tokenizer.
"""

import functools
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "中文字符和日本語のテキスト、한국어 문장도 있습니다。",
    "Emoji: 👍👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 😀😀 and café, naïve, e\u0301, a\u0308\u0323.",
    "def f(x):\n    return x * 2  # code\tand tabs",
]
ATOMS = [
    "a",
    "b",
    "the",
    " ",
    "  ",
    "\n",
    ".",
    ",",
    "!",
    "Hello",
    " world",
    "x",
    "7",
    "中",
    "文",
    "字符",
    "日本語",
    "한국어",
    "é",
    "e\u0301",
    "a\u0308\u0323",
    "\u0301",
    "👍",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "🇫🇷",
    "😀",
    "\u200d",
    "Ω",
    "ß",
    "▁",
]
TEXT = st.lists(
    st.one_of(st.sampled_from(ATOMS), st.characters(codec="utf-8", exclude_categories=["Cs"])),
    max_size=25,
).map("".join)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENIZERS = ["byte_level_bpe", "sentencepiece_byte_fallback", "smollm2_gguf"]


@functools.lru_cache
def byte_level_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


@functools.lru_cache
def sentencepiece_byte_fallback():
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHTW.,!", "▁t", "he", "▁the", "▁w"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@functools.lru_cache
def smollm2_gguf():
    try:
        from models.fetch import default_model_path
        from models.gguf import load_tokenizer
    except ImportError as err:
        pytest.skip(f"SmolLM2 case needs models.fetch and models.gguf: {err}")
    return load_tokenizer(default_model_path())


def is_byte(tok, token_id):
    token = tok.convert_ids_to_tokens(token_id)
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def get_tokenizer(name):
    return globals()[name]()


def stream(tokenizer, ids, params):
    """Feed ids one by one; return the emitted pieces, per-step snapshots and the stop matched."""
    det = IncrementalDetokenizer(tokenizer, [0, 1], params)
    pieces, snapshots = [], []
    for n, token_id in enumerate(ids, 1):
        piece, stop = det.append(token_id)
        pieces.append(piece)
        snapshots.append((n, "".join(pieces), det.held_back))
        if stop is not None:
            assert det.stop_matched == stop and det.finished
            assert det.flush() == "" and det.append(token_id) == ("", None)
            return pieces, snapshots, stop, det
    pieces.append(det.flush())  # may still match a stop string ending in a held-back U+FFFD
    return pieces, snapshots, det.stop_matched, det


def first_stop(text, stops):
    """Reference: scan end positions; the first stop string to complete wins (longest on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
    return None


@pytest.mark.parametrize("name", TOKENIZERS)
@FAST
@given(text=TEXT, skip_special=st.booleans(), data=st.data())
def test_pieces_concatenate_to_the_full_decode(name, text, skip_special, data):
    tok = get_tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    # Special tokens anywhere (but inside a character): skipped or kept, they must not disturb the stream.
    for _ in range(data.draw(st.integers(0, 2))):
        boundaries = [
            i
            for i in range(len(ids) + 1)
            if not (0 < i < len(ids) and is_byte(tok, ids[i - 1]) and is_byte(tok, ids[i]))
        ]
        ids.insert(data.draw(st.sampled_from(boundaries)), tok.eos_token_id)
    params = SamplingParams(skip_special_tokens=skip_special)
    full = tok.decode(ids, skip_special_tokens=skip_special)
    pieces, _, _, det = stream(tok, ids, params)
    assert "".join(pieces) == full == det.text
    if "\ufffd" not in full:
        assert not any("\ufffd" in piece for piece in pieces)  # no character was split


# Not with byte fallback: its decoder turns a whole run of <0xXX> tokens into one U+FFFD per
# byte as soon as the run is invalid UTF-8, rewriting characters already streamed.
@pytest.mark.parametrize("name", ["byte_level_bpe", "smollm2_gguf"])
@FAST
@given(data=st.data())
def test_arbitrary_token_sequences_concatenate_to_the_full_decode(name, data):
    """Ids no text encodes to: stray UTF-8 continuation bytes, truncated characters."""
    tok = get_tokenizer(name)
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=30))
    pieces, _, _, det = stream(tok, ids, SamplingParams())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == det.text


@pytest.mark.parametrize("name", TOKENIZERS)
@FAST
@given(text=TEXT.filter(bool), data=st.data())
def test_stop_strings_cut_the_text_and_hold_back_only_their_prefixes(name, text, data):
    tok = get_tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    if not full:
        return
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):  # substrings, so they occur, often across tokens
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 6))])
    stops += data.draw(st.lists(st.sampled_from(["zz", "END", "👍👍", "中中中"]), max_size=1))
    params = SamplingParams(stop=tuple(stops))
    pieces, snapshots, stop, det = stream(tok, ids, params)

    start, expected_stop = first_stop(full, stops)
    assert stop == expected_stop
    assert "".join(pieces) == full[:start] == det.text
    prefixes = {s[:i] for s in stops for i in range(1, len(s))}
    for n, released, held in snapshots[:-1]:  # every step before the match
        # Nothing is delayed but a trailing partial character and a possible stop-string start.
        assert full.startswith(released + held)
        if name != "sentencepiece_byte_fallback":  # see test_arbitrary_token_sequences...
            assert released + held == tok.decode(ids[:n], skip_special_tokens=True).rstrip("\ufffd")
        assert len(held) <= max(map(len, stops)) - 1
        longest = max(
            (i for i in range(1, len(held) + len(released) + 1) if (released + held)[-i:] in prefixes), default=0
        )
        assert len(held) == longest


def test_stop_string_across_tokens_is_cut_and_reported():
    tok = byte_level_bpe()
    ids = tok.encode("Hello world. The end", add_special_tokens=False)
    pieces, _, stop, det = stream(tok, ids, SamplingParams(stop=("o w", "The")))
    assert stop == "o w" and "".join(pieces) == "Hell" and det.text == "Hell"


def test_flush_releases_a_held_back_partial_stop_string():
    tok = byte_level_bpe()
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=("xyz!",)))
    emitted = "".join(det.append(t)[0] for t in tok.encode("ab xy", add_special_tokens=False))
    assert emitted == "ab " and det.held_back == "xy" and det.text == "ab xy"
    assert det.flush() == "xy" and det.text == "ab xy" and det.stop_matched is None


def test_split_character_is_held_until_complete():
    tok = byte_level_bpe()
    # One byte-level token per UTF-8 byte of a 4-byte emoji.
    byte_ids = [tok.convert_tokens_to_ids(c) for c in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("😀")[0][0]]
    assert len(byte_ids) == 4
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert [det.append(t)[0] for t in byte_ids] == ["", "", "", "😀"]


def test_sentencepiece_leading_space_matches_full_decode():
    tok = sentencepiece_byte_fallback()
    ids = tok.encode("the wheat the 中", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [5, 6], SamplingParams())
    pieces = [det.append(t)[0] for t in ids] + [det.flush()]
    assert "".join(pieces) == tok.decode(ids) == "the wheat the 中"


def test_skipped_special_token_does_not_eat_the_next_leading_space():
    tok = sentencepiece_byte_fallback()
    ids = tok.convert_tokens_to_ids(["▁", "a", "</s>", "▁", "b", "</s>", "</s>", "▁w"])
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    pieces = [det.append(t)[0] for t in ids] + [det.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "a b w"


class CharTokenizer:
    """Token id i decodes to chr(i): one character per token, nothing special."""

    added_tokens_decoder: dict = {}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def test_stop_matching_is_linear_in_the_stop_strings_and_the_text():
    """A long stop string that keeps almost matching ("aaa...a" against "aaa...ab") costs
    memory linear in its length (every prefix of it, as a set, was quadratic: 32 MB here)
    and time linear in the text."""
    stop_len, num_tokens = 8000, 20000
    stop = "a" * (stop_len - 1) + "b"
    tracemalloc.start()
    try:
        start = time.perf_counter()
        det = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=(stop, "zz")))
        released = "".join(det.append(ord("a" if i % stop_len else "c"))[0] for i in range(1, num_tokens))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak
    assert time.perf_counter() - start < 10.0  # ~0.1 s
    held = det.held_back
    assert held == "a" * ((num_tokens - 1) % stop_len) and released + held == det.text
    det = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=(stop,)))
    assert "".join(det.append(ord("a"))[0] for _ in range(num_tokens)) == "a" * (num_tokens - stop_len + 1)
    assert det.append(ord("b")) == ("", stop)


def test_stop_matching_overlapping_candidates():
    det = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=("abab", "bac", "c")))
    out = [det.append(ord(c)) for c in "ababac"]
    assert out[:3] == [("", None)] * 3 and out[3] == ("", "abab")
    det = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=("abcd", "bc")))
    assert [det.append(ord(c)) for c in "xabc"] == [("x", None), ("", None), ("", None), ("a", "bc")]
    det = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=("aab",)))
    assert "".join(det.append(ord(c))[0] for c in "aaaa") == "aa" and det.held_back == "aa"
    assert det.append(ord("b")) == ("", "aab") and det.text == "aa"
