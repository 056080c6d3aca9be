"""Tokenizers for building prompts of exact token lengths.

The server's own tokenizer (vLLM-style `POST /tokenize` and `/detokenize`) is
preferred: it counts exactly what the server will count, special tokens
included. A local Hugging Face tokenizer (`--tokenizer`) is the fallback.
Both are async so that asking the server never blocks an event loop that
might be serving it (tests run the stand-in server in-process).
"""

from __future__ import annotations

from typing import Protocol

import httpx


class Tokenizer(Protocol):
    name: str

    async def encode(self, text: str) -> list[int]:
        """Token ids as the server counts a completions prompt (special tokens included)."""
        ...

    async def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    def __init__(self, client: httpx.AsyncClient, base_url: str):
        self._client = client
        self._base_url = base_url
        self.name = "server"

    async def encode(self, text: str) -> list[int]:
        response = await self._client.post(self._base_url + "/tokenize", json={"prompt": text})
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]

    async def decode(self, ids: list[int]) -> str:
        response = await self._client.post(self._base_url + "/detokenize", json={"tokens": list(ids)})
        response.raise_for_status()
        return str(response.json()["prompt"])


class LocalTokenizer:
    def __init__(self, name_or_path: str):
        try:
            from transformers import AutoTokenizer  # slow import, only when asked for
        except ImportError as e:  # pragma: no cover - transformers is a core dependency
            raise RuntimeError("--tokenizer needs the `transformers` package") from e
        self._tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        self.name = f"local:{name_or_path}"

    async def encode(self, text: str) -> list[int]:
        # add_special_tokens=True (the default) matches how servers tokenize a
        # completions prompt, so a BOS token counts towards --input-len.
        return list(self._tokenizer.encode(text))

    async def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)  # type: ignore[return-value]  # one sequence: a str


async def probe_server_tokenizer(client: httpx.AsyncClient, base_url: str) -> ServerTokenizer | None:
    """The server tokenizer if both endpoints answer and round-trip plain text."""
    tokenizer = ServerTokenizer(client, base_url)
    try:
        ids = await tokenizer.encode("hello world")
        text = await tokenizer.decode(ids)
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None
    return tokenizer if "world" in text else None


async def resolve_tokenizer(client: httpx.AsyncClient, base_url: str, local_name: str | None) -> Tokenizer | None:
    """Server tokenizer, else the local one named by --tokenizer, else None."""
    server = await probe_server_tokenizer(client, base_url)
    if server is not None:
        return server
    if local_name:
        return LocalTokenizer(local_name)
    return None
