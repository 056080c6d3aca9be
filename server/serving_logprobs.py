"""Token logprobs in OpenAI's two formats (legacy completions, chat), with each token's real bytes.

A byte-level BPE token can hold part of a UTF-8 character: decoded alone it is
"\\ufffd", but its bytes are exact. Chat logprobs carry those bytes (OpenAI's
`bytes` field exists for this), recovered from the token's vocabulary string:
GPT-2 byte-to-unicode mapping for byte-level BPE, <0xNN> for SentencePiece byte
fallback, else the UTF-8 of the decoded text.
"""

from __future__ import annotations

import builtins
import re
from typing import TYPE_CHECKING, Any

from engine.request import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


class LogprobFormatter:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._unicode_to_byte = _gpt2_unicode_to_byte()
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])  # type: ignore[assignment]  # one sequence: a str
        return self._text[token_id]

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = self._token_bytes(token_id)
        return self._bytes[token_id]

    def _token_bytes(self, token_id: int) -> builtins.bytes:  # the method above shadows the type
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            if self._byte_level and all(ch in self._unicode_to_byte for ch in piece):
                return bytes(self._unicode_to_byte[ch] for ch in piece)
        return self.text(token_id).encode("utf-8")

    def completion(
        self,
        logprobs: list[TokenLogprob],
        offset: int,
        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None,
    ) -> dict[str, list]:
        """Legacy completions format; top_logprobs holds the top k and the sampled token (up to k + 1).
        With echo, `prompt` (its token ids and prompt logprobs) comes first: the first prompt token
        has null for its logprob and its top_logprobs, as OpenAI gives it."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        entries: list[tuple[int, TokenLogprob | None]] = [(lp.token_id, lp) for lp in logprobs]
        if prompt is not None:
            entries = list(zip(*prompt)) + entries
        for token_id, lp in entries:
            token = self.text(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if lp is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(lp.logprob)
            # Keyed by text, so distinct tokens can collide (two partial UTF-8 bytes both read
            # "\ufffd"): keep the likelier one, as the list is best first.
            alternatives: dict[str, float] = {}
            for top_id, top_logprob in lp.top:
                alternatives.setdefault(self.text(top_id), top_logprob)
            alternatives.setdefault(token, lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat(self, logprobs: list[TokenLogprob], num_top: int) -> dict[str, list]:
        """Chat format: every sampled token with its bytes and exactly `num_top` alternatives."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:num_top]]}
                for lp in logprobs
            ]
        }

    def prompt(self, logprobs: list[TokenLogprob | None]) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs: null for the first token, then per position the prompt token and
        the top k, token id -> {logprob, rank, decoded_token}."""

        def entry(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}

        rendered: list[dict[str, dict] | None] = []
        for lp in logprobs:
            if lp is None:
                rendered.append(None)
                continue
            position = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}  # the prompt's token first
            for rank, (token_id, logprob) in enumerate(lp.top, start=1):
                position.setdefault(str(token_id), entry(logprob, rank, token_id))
            rendered.append(position)
        return rendered
