"""What to send and when: prompts of exact token lengths, shared-prefix
prompts, JSONL datasets, and the arrival schedule.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass

from loadtest.tokenizer import Tokenizer

# Ordinary words tokenize to one or two tokens in every common vocabulary, so
# random sequences of their tokens decode to text that encodes back to about
# the same length (random ids over the whole vocabulary often do not).
_CORPUS = """
the of and to in is was for on that with as by at from his her they this be are or
had not have but one which were all their when there can an your has been who more
its out would time will about if up into other what some than them these so two may
first could then only new like over such our after also any people most made many
through where much before years good great way well use man just world state even
back must because here still life between both three under never day same another
know while last might us found house part number small since against long place
water city year home high old river north south east west light night music story
garden market winter summer stone paper glass silver window table mountain forest
island valley bridge station letter orange purple yellow basket engine rocket planet
signal record mirror pocket ladder candle wallet pencil blanket coffee butter cotton
""".split()

# Token-id prompts (no tokenizer at all) draw ids from here: above the special
# tokens of common vocabularies and below the size of the smallest ones.
TOKEN_ID_RANGE = (1000, 10000)

_MAX_FIT_ROUNDS = 10
_TOKENIZE_CONCURRENCY = 16


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str | list[int] | list[dict]  # text, token ids (completions) or chat messages
    prompt_len: int  # tokens as the tokenizer counts the prompt; -1 when unknown
    output_len: int
    prefix_index: int | None = None  # which shared prefix it starts with


@dataclass(frozen=True)
class Workload:
    requests: list[RequestSpec]
    tokenizer: str  # which tokenizer counted the prompts: "server", "local:NAME", "token-ids", "none"
    num_inexact: int = 0  # synthetic prompts whose length could not be hit exactly
    expected_prefix_hit_rate: float | None = None  # request-level, ignoring concurrency races

    def info(self) -> dict:
        lens = [r.prompt_len for r in self.requests if r.prompt_len >= 0]
        return {
            "num_requests": len(self.requests),
            "tokenizer": self.tokenizer,
            "num_inexact_prompts": self.num_inexact,
            "mean_prompt_len": sum(lens) / len(lens) if lens else None,
            "expected_prefix_hit_rate": self.expected_prefix_hit_rate,
        }


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start, the first at 0.

    Gaps are gamma distributed with mean 1/rate and shape `burstiness`, as in
    vLLM's benchmark_serving: shape 1 is a Poisson process, below 1 requests
    bunch into bursts, above 1 they arrive more evenly.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"{seed}:arrivals")
    scale = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


@dataclass(frozen=True)
class TokenPool:
    """Ids of ordinary word pieces to draw prompts from, and what encode()
    adds around every text: special tokens such as BOS (leading) or EOS (trailing)."""

    ids: list[int]
    special: frozenset[int]
    num_special: int
    num_trailing_special: int


async def token_pool(tokenizer: Tokenizer) -> TokenPool:
    special_tokens = await tokenizer.encode("")
    special = frozenset(special_tokens)
    corpus_tokens = await tokenizer.encode(" ".join(_CORPUS))
    ids = sorted(set(corpus_tokens) - special)
    if not ids:
        raise RuntimeError(f"tokenizer {tokenizer.name} returned no ordinary tokens for plain text")
    num_trailing = 0
    while num_trailing < len(corpus_tokens) and corpus_tokens[-1 - num_trailing] in special:
        num_trailing += 1
    return TokenPool(ids, special, len(special_tokens), num_trailing)


async def fit_prompt(
    tokenizer: Tokenizer,
    pool: TokenPool,
    target_len: int,
    rng: random.Random,
    prefix_ids: tuple[int, ...] = (),
    prefix_tokens: tuple[int, ...] = (),
) -> tuple[str, int]:
    """Text that encodes to exactly `target_len` tokens, if the tokenizer allows.

    Decoding random ids and encoding the text back does not round-trip: pieces
    merge across word boundaries and encode() adds special tokens (BOS). So
    the random suffix grows or shrinks by the difference until counts match.
    `prefix_ids` stay fixed at the front; the prompt's encoding must start with
    `prefix_tokens` (their encoding, less trailing specials) so that a server's
    prefix cache really sees a shared prefix. Returns (text, token count); the
    count differs from target_len only if no fit was found in a few rounds.
    """
    suffix = [rng.choice(pool.ids) for _ in range(max(0, target_len - pool.num_special - len(prefix_ids)))]
    best: tuple[str, int] | None = None
    for _ in range(_MAX_FIT_ROUNDS):
        text = await tokenizer.decode(list(prefix_ids) + suffix)
        tokens = await tokenizer.encode(text)
        if tuple(tokens[: len(prefix_tokens)]) != prefix_tokens:
            suffix = [rng.choice(pool.ids) for _ in suffix]  # the boundary merged: try other words
            continue
        if best is None or abs(len(tokens) - target_len) < abs(best[1] - target_len):
            best = (text, len(tokens))
        delta = target_len - len(tokens)
        if delta == 0 or (delta < 0 and not suffix):
            break
        if delta > 0:
            suffix += [rng.choice(pool.ids) for _ in range(delta)]
        else:
            suffix = suffix[:delta]
    if best is None:
        raise RuntimeError("could not build a prompt that keeps its shared prefix intact")
    return best


async def synthetic_workload(
    tokenizer: Tokenizer | None,
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
    prefix_len: int = 0,
    num_prefixes: int = 1,
    salt: str = "",
) -> Workload:
    """Random prompts of `input_len` tokens; with `prefix_len`, each starts with
    one of `num_prefixes` shared random prefixes.

    Prefixes are dealt out evenly in a seeded random order, so every prefix's
    first request misses the server's prefix cache and the rest can hit:
    the expected request-level hit rate is 1 - num_prefixes / num_requests.
    `salt` gives warmup or sweep points prompts of their own.
    """
    rng = random.Random(f"{seed}:{salt}:workload")
    assignment: list[int | None] = [None] * num_requests
    hit_rate = None
    if prefix_len > 0:
        assignment = [i % num_prefixes for i in range(num_requests)]
        rng.shuffle(assignment)
        hit_rate = 1.0 - min(num_prefixes, num_requests) / num_requests

    if tokenizer is None:
        # Token-id prompts: exact by construction, though the server may add a BOS.
        low, high = TOKEN_ID_RANGE
        id_prefixes = [[rng.randrange(low, high) for _ in range(prefix_len)] for _ in range(num_prefixes)]
        specs = []
        for i, p in enumerate(assignment):
            ids = (id_prefixes[p] if p is not None else []) + [
                rng.randrange(low, high) for _ in range(input_len - (prefix_len if p is not None else 0))
            ]
            specs.append(RequestSpec(i, ids, input_len, output_len, p))
        return Workload(specs, "token-ids", 0, hit_rate)

    pool = await token_pool(tokenizer)
    # Each prefix as (its ids to decode, the token sequence prompts must start with).
    prefixes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for p in range(num_prefixes if prefix_len > 0 else 0):
        prefix_rng = random.Random(f"{seed}:{salt}:prefix:{p}")
        text, _ = await fit_prompt(tokenizer, pool, prefix_len + pool.num_special, prefix_rng)
        tokens = await tokenizer.encode(text)
        content = tuple(t for t in tokens if t not in pool.special)
        prefixes.append((content, tuple(tokens[: len(tokens) - pool.num_trailing_special])))

    semaphore = asyncio.Semaphore(_TOKENIZE_CONCURRENCY)  # a server tokenizer is one HTTP call each

    async def build(i: int, p: int | None) -> RequestSpec:
        # One generator per prompt keeps the workload identical however the
        # concurrent tokenizer calls interleave.
        prompt_rng = random.Random(f"{seed}:{salt}:prompt:{i}")
        prefix_ids, prefix_tokens = prefixes[p] if p is not None else ((), ())
        async with semaphore:
            text, n = await fit_prompt(tokenizer, pool, input_len, prompt_rng, prefix_ids, prefix_tokens)
        return RequestSpec(i, text, n, output_len, p)

    specs = list(await asyncio.gather(*(build(i, p) for i, p in enumerate(assignment))))
    num_inexact = sum(s.prompt_len != input_len for s in specs)
    return Workload(specs, tokenizer.name, num_inexact, hit_rate)


async def dataset_workload(
    path: str, num_requests: int, output_len: int, seed: int, endpoint: str, tokenizer: Tokenizer | None
) -> Workload:
    """Requests from a JSONL file: {"prompt": str} or {"messages": [...]}, with an
    optional "output_len". Lines are shuffled (seeded) and reused in order
    when num_requests exceeds the file.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ValueError(f'{path}:{lineno}: each line needs "prompt" or "messages"')
            if "messages" in row and endpoint == "completions":
                raise ValueError(f'{path}:{lineno}: "messages" needs --endpoint chat')
            if endpoint == "chat" and "messages" not in row and not isinstance(row["prompt"], str):
                raise ValueError(f'{path}:{lineno}: a chat request needs a text "prompt" or "messages"')
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests in the dataset")
    random.Random(f"{seed}:dataset").shuffle(rows)

    specs = []
    for i in range(num_requests):
        row = rows[i % len(rows)]
        prompt = row["messages"] if "messages" in row else row["prompt"]
        prompt_len = -1  # chat templates add tokens only the server knows; usage reports them
        if isinstance(prompt, str) and tokenizer is not None:
            prompt_len = len(await tokenizer.encode(prompt))
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_len = len(prompt)
        specs.append(RequestSpec(i, prompt, prompt_len, int(row.get("output_len", output_len))))
    return Workload(specs, tokenizer.name if tokenizer else "none")


@dataclass(frozen=True)
class Conversation:
    """One multi-turn chat: the system prompt every conversation shares, then its user messages, each
    sent once the reply to the one before has arrived (the replies become the history)."""

    index: int
    system: str
    users: list[str]
    output_len: int


async def multi_turn_workload(
    tokenizer: Tokenizer, num_conversations: int, turns: int, system_len: int, user_len: int, output_len: int, seed: int
) -> list[Conversation]:
    """`num_conversations` conversations of `turns` user messages of `user_len` tokens each, after one
    shared system prompt of `system_len` tokens (none at 0): the long prefix every request repeats."""
    pool = await token_pool(tokenizer)
    system = ""
    if system_len > 0:
        system, _ = await fit_prompt(tokenizer, pool, system_len + pool.num_special, random.Random(f"{seed}:system"))
    semaphore = asyncio.Semaphore(_TOKENIZE_CONCURRENCY)

    async def user(c: int, t: int) -> str:
        async with semaphore:
            text, _ = await fit_prompt(tokenizer, pool, user_len + pool.num_special, random.Random(f"{seed}:{c}:{t}"))
        return text

    messages = await asyncio.gather(*(user(c, t) for c in range(num_conversations) for t in range(turns)))
    return [
        Conversation(c, system, list(messages[c * turns : (c + 1) * turns]), output_len)
        for c in range(num_conversations)
    ]


def conversation_prompt(conversation: Conversation, replies: list[str], endpoint: str) -> str | list[dict]:
    """The request of turn len(replies): the system prompt, every earlier user message and its reply,
    then this turn's user message; chat messages, or one text in a plain User/Assistant framing."""
    turn = len(replies)
    if endpoint == "chat":
        messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
        for user, reply in zip(conversation.users[:turn], replies):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return messages + [{"role": "user", "content": conversation.users[turn]}]
    text = conversation.system + "\n\n" if conversation.system else ""
    for user, reply in zip(conversation.users[:turn], replies):
        text += f"User: {user}\nAssistant:{reply}\n\n"
    return text + f"User: {conversation.users[turn]}\nAssistant:"
