"""run_multi_turn(config) -> dict: conversations that grow turn by turn over one shared system
prompt, each turn sent once the reply to the previous one has arrived, and TTFT by turn index.

A server with a prefix cache computes a turn's history once: turn 1 pays for the system prompt
(once for every conversation, if the cache holds it), turn k > 1 for its new user message only.
`replay` sends the same requests again, each turn's history the first pass's replies, so its
prompts are the first pass's token for token; `restart_cmd` runs between the passes (a shell
command that restarts the server, which is then waited for on /health): the replay's TTFT against
the first pass's says what of the cache outlived the restart.

    result = asyncio.run(run_multi_turn(BenchmarkConfig(url=url, model="m", workload="multi-turn")))
    result["turns"][0]["ttft_ms"]["p50"], result["replay"]["turns"][0]["ttft_ms"]["p50"]
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx

from loadtest.benchmark import _aux_client, _bench_client, record_to_dict
from loadtest.client import Outcome, RequestRecord, build_payload, send_request
from loadtest.config import BenchmarkConfig
from loadtest.metrics import latency_stats, summarize
from loadtest.tokenizer import resolve_tokenizer
from loadtest.workload import Conversation, RequestSpec, conversation_prompt, multi_turn_workload


async def run_multi_turn(config: BenchmarkConfig) -> dict:
    """The first pass (and the replay, with `config.replay` or `config.restart_cmd`). The result has
    run_benchmark's keys for the first pass (`summary`, `requests`: each with its `conversation` and
    `turn`), `turns` (one entry a turn index) and `replay` (the same three, or None)."""
    async with _aux_client(config) as aux:
        tokenizer = await resolve_tokenizer(aux, config.base_url, config.tokenizer)
        if tokenizer is None:
            raise RuntimeError("multi-turn conversations are text: the server has no /tokenize, so pass --tokenizer")
        conversations = await multi_turn_workload(
            tokenizer,
            config.conversations,
            config.turns,
            config.system_prompt_tokens,
            config.input_len,
            config.output_len,
            config.seed,
        )
        first = await _pass(config, conversations, None)
        second = None
        if config.replay or config.restart_cmd:
            if config.restart_cmd:
                await restart_server(aux, config)
            second = await _pass(config, conversations, first["replies"])
    workload = {
        "num_conversations": len(conversations),
        "turns": config.turns,
        "system_prompt_tokens": config.system_prompt_tokens,
        "user_message_tokens": config.input_len,
        "tokenizer": tokenizer.name,
    }
    return {
        "config": config.to_dict(),
        "workload": workload,
        "summary": first["summary"],
        "server": None,
        "requests": first["requests"],
        "turns": first["turns"],
        "replay": None if second is None else {k: second[k] for k in ("summary", "requests", "turns")},
    }


async def restart_server(aux: httpx.AsyncClient, config: BenchmarkConfig) -> None:
    """Run config.restart_cmd (it must exit 0), then wait until the server answers /health with 200."""
    assert config.restart_cmd is not None
    proc = await asyncio.create_subprocess_shell(config.restart_cmd)
    if await proc.wait() != 0:
        raise RuntimeError(f"--restart-cmd exited with {proc.returncode}: {config.restart_cmd}")
    deadline = time.monotonic() + config.restart_timeout
    while True:
        try:
            if (await aux.get(f"{config.base_url}/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {config.restart_timeout:g} s of the restart")
        await asyncio.sleep(0.2)


async def _pass(config: BenchmarkConfig, conversations: list[Conversation], replies: list[list[str]] | None) -> dict:
    """Every conversation, at most config.concurrency at a time; a conversation whose turn fails stops
    there. `replies`: the histories to send (a replay), else each turn's own reply becomes history."""
    slots = asyncio.Semaphore(config.concurrency or len(conversations))
    records: list[tuple[int, int, RequestRecord]] = []
    got: list[list[str]] = [[] for _ in conversations]

    async def converse(client: httpx.AsyncClient, conversation: Conversation) -> None:
        async with slots:
            for turn in range(config.turns):
                history = replies[conversation.index][:turn] if replies is not None else got[conversation.index]
                if len(history) < turn:  # the first pass stopped this conversation here
                    return
                spec = RequestSpec(
                    conversation.index * config.turns + turn,
                    conversation_prompt(conversation, history, config.endpoint),
                    -1,
                    conversation.output_len,
                )
                payload = build_payload(
                    spec, config.model_for(conversation.index), config.endpoint, config.ignore_eos, config.extra_body
                )
                record = await send_request(client, config.api_url, payload, spec, config.endpoint)
                records.append((conversation.index, turn, record))
                if record.outcome is not Outcome.COMPLETED:
                    return
                got[conversation.index].append(record.text)

    async with _bench_client(replace(config, concurrency=config.concurrency or len(conversations))) as client:
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, c) for c in conversations))
        duration = time.perf_counter() - start
    records.sort(key=lambda x: x[2].index)
    turns = []
    for turn in range(config.turns):
        done = [r for _, t, r in records if t == turn and r.outcome is Outcome.COMPLETED]
        prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
        turns.append(
            {
                "turn": turn + 1,
                "completed": len(done),
                "failed": sum(1 for _, t, r in records if t == turn and r.outcome is Outcome.FAILED),
                "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
                "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
            }
        )
    plain = [r for _, _, r in records]
    return {
        "summary": summarize(plain, duration, config.slo_ttft_ms, config.slo_tpot_ms),
        "requests": [{**record_to_dict(r), "conversation": c, "turn": t + 1} for c, t, r in records],
        "turns": turns,
        "replies": got,
    }
