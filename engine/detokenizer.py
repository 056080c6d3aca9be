"""Incremental detokenization with stop strings: token ids in, text safe to stream out.

Decoding one token at a time does not work: a byte-level BPE token can hold half
of a UTF-8 character, and SentencePiece drops the leading space of whichever token
comes first in a decode. So, as vLLM and TGI do, we decode a short window of
recent tokens twice, with and without the new ones, and stream the difference:

    ids:        ... | t5  t6 | t7  t8 |
                      ^prefix  ^read   ^len(ids)
    prefix_text = decode(ids[prefix:read])   (already streamed)
    window_text = decode(ids[prefix:])       (starts with prefix_text)
    new text    = window_text[len(prefix_text):]

Both decodes start at the same token, so whatever the tokenizer does at the start
of a decode cancels out. While the window's text ends in U+FFFD (an incomplete
UTF-8 sequence, or byte-fallback tokens not yet forming a character) that tail is
held back; once it ends cleanly the window slides (prefix <- read <- len(ids)), so
each step decodes O(window) tokens, not the whole output. Concatenated pieces equal
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
for any tokenizer whose decode never rewrites text already decoded when tokens are
appended (byte-level BPE, SentencePiece/Metaspace); the clean-up step is off because
it does rewrite across token boundaries (" ." -> "."). One exception, for invalid
output only: a byte-fallback decoder (Llama-2 style <0xXX> tokens) turns a whole run
of byte tokens into one U+FFFD per byte once the run stops being valid UTF-8, even
characters of it we already streamed; valid output streams exactly.

Stop strings are matched on the decoded text, across token boundaries. Only the
longest suffix of the text that is a proper prefix of some stop string is held
back; everything before it streams at once. When several stop strings could
match, the one that is complete first in the text wins (on a tie, the longer one),
which is also what a client reading the stream character by character would see.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.request import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text. The engine calls `append` for every generated token
    and, when the request ends for a reason other than a stop string (EOS, stop token,
    max_tokens, abort), must call `flush()` to get the text still held back.

    The prompt is not decoded: the output alone decodes exactly as
    `tokenizer.decode(output_ids)` would (vLLM instead primes the window with the
    prompt's tail, which keeps a SentencePiece leading space on the first word but
    makes the stream differ from that decode). A token that ends the request through
    EOS or `stop_token_ids` should not be appended if its text is to stay out.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._decode_ids = _decoder(tokenizer, params.skip_special_tokens)
        # Tokens decode() would skip never enter the window, so a run of them cannot grow it.
        self._skipped_ids = _special_ids(tokenizer) if params.skip_special_tokens else frozenset()
        self.num_prompt_tokens = len(prompt_token_ids)
        self._stops = _StopMatcher(params.stop) if params.stop else None
        self.token_ids: list[int] = []  # the tokens decode() sees (skipped special tokens left out)
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters of the window past prefix_text already streamed: the text in front of
        # a trailing U+FFFD run is final even while that run is held back.
        self._num_streamed_past_read = 0
        self._pending = ""  # decoded text held back as a possible stop-string start
        self._parts: list[str] = []  # text released so far, joined on demand
        self.stop_matched: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All output text decoded so far: released plus held back, the stop string and
        anything after it excluded once matched. O(length): call it sparingly."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return (self._parts[0] if self._parts else "") + self._pending

    @property
    def held_back(self) -> str:
        """Decoded text not yet released because it could start a stop string."""
        return self._pending

    def append(self, token_id: int) -> tuple[str, str | None]:
        """Add one generated token; return (text safe to stream now, the stop string if one
        just matched). After a match or `flush()` the request is over and this returns ("", None)."""
        if self.finished:
            return "", None
        if token_id in self._skipped_ids:
            return "", None
        self.token_ids.append(token_id)
        return self._release(self._decode_new(final=False))

    def flush(self) -> str:
        """The request ended without a stop string: release everything still held back
        (a partial stop string, a trailing U+FFFD that will now never be completed)."""
        if self.finished:
            return ""
        text, _ = self._release(self._decode_new(final=True))
        if not self.finished:
            text += self._pending
            self._parts.append(self._pending)
            self._pending = ""
        self.finished = True
        return text

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens since the last call that is final (see the module map)."""
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(ids[self._prefix_offset :])
        start = len(prefix_text) + self._num_streamed_past_read
        stable = len(window_text) if final else len(window_text.rstrip(_REPLACEMENT_CHAR))
        if stable == len(window_text):
            # Ends on a whole character: nothing in the window can change any more. The
            # window only starts at the new tokens if they decode to something: after
            # tokens that decode to nothing (skipped special tokens), the next token would
            # otherwise be first in the decode and lose its leading space.
            if len(window_text) > len(prefix_text):
                self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._num_streamed_past_read = 0
        elif stable > start:
            self._num_streamed_past_read = stable - len(prefix_text)
        return window_text[start:stable]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids)

    def _release(self, new_text: str) -> tuple[str, str | None]:
        if not self._stops:
            self._parts.append(new_text)
            return new_text, None
        text = self._pending + new_text
        match = self._stops.feed(new_text)
        if match is not None:
            end, stop = match
            # The match began inside the held-back text at the earliest: what came before
            # it was released because it could not start a stop string.
            released, self._pending = text[: len(self._pending) + end - len(stop)], ""
            self.stop_matched, self.finished = stop, True
        else:
            num_held = self._stops.num_partial
            released, self._pending = text[: len(text) - num_held], text[len(text) - num_held :]
        self._parts.append(released)
        return released, match[1] if match is not None else None


def _decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` as a
    function of ids. Where the tokenizer is transformers' plain wrapper of a `tokenizers`
    tokenizer, that decode is the backend's own (with clean-up off it adds only argument
    handling, paid twice a token): call the backend directly."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode, as documented
        TokenizersBackend = None  # type: ignore[misc, assignment]
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    if (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and hasattr(backend, "decode")
    ):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    # decode() of a list of ids is a str (its stub also allows a list of them, for batches)
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,  # type: ignore[return-value]
        clean_up_tokenization_spaces=False,
    )


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops: the added tokens marked special
    (what a fast tokenizer's backend skips), else the tokenizer's special ids."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:
        return frozenset(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class _StopMatcher:
    """Stop strings matched one character at a time, each by its own Knuth-Morris-Pratt
    automaton: O(total stop length) memory, and O(number of stops) amortised time per
    character of text, however long the stop strings or the text.

    `state[i]` is the length of the longest suffix of the text fed so far that is a prefix
    of stop i; the text that must be held back is the longest of these (while none is
    complete). The first stop to complete wins; of those completing on the same
    character, the longest.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.failure = [_failure_function(s) for s in self.stops]
        self.state = [0] * len(self.stops)

    @property
    def num_partial(self) -> int:
        return max(self.state)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`: (index in `text` just past the stop string that completed
        first, that stop string), or None."""
        stops, failure, state = self.stops, self.failure, self.state
        for pos, char in enumerate(text):
            matched = None
            for i, stop in enumerate(stops):
                k = state[i]
                while k and stop[k] != char:
                    k = failure[i][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    if matched is None or len(stop) > len(matched):
                        matched = stop
                    k = failure[i][k - 1]
                state[i] = k
            if matched is not None:
                return pos + 1, matched
        return None


def _failure_function(pattern: str) -> list[int]:
    """failure[j]: the length of the longest proper prefix of pattern[:j + 1] that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for j in range(1, len(pattern)):
        while k and pattern[j] != pattern[k]:
            k = failure[k - 1]
        if pattern[j] == pattern[k]:
            k += 1
        failure[j] = k
    return failure
