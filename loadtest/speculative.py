"""Speculative decoding on and off, side by side: one stream's output tokens per second.

    python -m loadtest.speculative                                  # SmolLM2-135M, ours on and off
    python -m loadtest.speculative --model smollm2-360m:q4_0 --llama-server PATH

Workloads, made offline: `code-edit` (functions of engine/block_manager.py, "rename this
variable and give the whole function back"), `quote` (repeat a paragraph of
loadtest/data/perplexity.txt), `summary` (summarise one, quoting it), `chat` (open questions)
and `json` (a JSON schema to fill). Each runs at temperature 0 and at 0.8 with a seed per request, so
both configurations of a server produce the same tokens (ours: exactly; llama.cpp: its own
answer). Every run computes its prompts afresh (ours: a `cache_salt` per request, row and round;
llama-server: `cache_prompt: false`; the same prompts again had come from the prefix cache, prefill
gone); the report counts the prompt tokens a server still served from its cache. Servers run in
pairs on the same cores: pagedserve without drafts and with
`--speculative ngram` side by side, then where given llama-server without and with `--spec-type
ngram-simple`; each row runs on one server of the pair and at once on the other (alternating
which goes first), so drift of the machine's speed falls on both alike, `--rounds` times (default
3; the median counts). Requests go one at a
time (c=1: output tok/s = completion tokens / wall time), then a mixed run at `--concurrency`
streams (default 16), `--mixed-rounds` times, each round on a pair started afresh (two servers of
one command differ by a few percent for their whole life). The acceptance rate is read from /metrics
(vLLM's `spec_decode` counters). Prints a table with the CPU named; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare import check_executable, cpu_description, free_port, resolve_model, side_by_side

DATA = Path(__file__).parent / "data"
SOURCE = Path(__file__).parent.parent / "engine" / "block_manager.py"
QUESTIONS = [
    "Write a short poem about the sea at night.",
    "What are three good habits for learning a new language?",
    "Explain in a few sentences why the sky is blue.",
    "Suggest a name and a short story idea for a friendly robot.",
]
RENAMES = [("request", "req"), ("block_id", "block"), ("table", "block_table"), ("num_tokens", "count")]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
}


def functions(path: Path, count: int) -> list[tuple[str, str]]:
    """(source, a variable it uses) of the first `count` methods of `path` that use one of RENAMES."""
    text = path.read_text()
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and len(found) < count:
            segment = ast.get_source_segment(text, node)
            assert segment is not None  # the node was parsed from `text`
            source = textwrap.dedent(" " * node.col_offset + segment)
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
            old = next((o for o, _ in RENAMES if o in names), None)
            if old is not None and 8 <= source.count("\n") <= 30:
                found.append((source, old))
    return found


def workloads(num: int) -> dict[str, list[dict]]:
    """Workload name -> request bodies (chat), `num` each."""
    paragraphs = [p.strip() for p in (DATA / "perplexity.txt").read_text().split("\n\n") if p.strip()]
    rename = dict(RENAMES)

    def chat(text: str, **extra: object) -> dict:
        return {"messages": [{"role": "user", "content": text}], **extra}

    return {
        "code-edit": [
            chat(
                f"Here is a Python function:\n\n```python\n{src}\n```\n\nRename the variable `{old}` to "
                f"`{rename[old]}` everywhere in it. Reply with the whole function in a code block, "
                f"nothing else."
            )
            for src, old in functions(SOURCE, num)
        ],
        "quote": [
            chat(f"Repeat the following passage exactly, word for word:\n\n{paragraphs[i % len(paragraphs)]}")
            for i in range(num)
        ],
        "summary": [
            chat(
                f"Summarise this passage in two sentences, quoting its key phrases:\n\n"
                f"{paragraphs[i % len(paragraphs)]}"
            )
            for i in range(num)
        ],
        "chat": [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(num)],
        "json": [
            chat(
                f"Describe a fictional person number {i + 1} as JSON with name, age, city and hobbies.",
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
            )
            for i in range(num)
        ],
    }


def spec_counters(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from /metrics: vLLM's names (both servers that expose them)."""
    drafts = accepted = 0.0
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return drafts, accepted
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_draft_tokens_total"):
            drafts = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            accepted = float(line.rsplit(" ", 1)[1])
    return drafts, accepted


def uncached(bodies: list[dict], run: str, server: str) -> list[dict]:
    """The bodies as `server` computes them afresh: ours each with a `cache_salt` of its own (vLLM's
    field: no prefix-cache hit across salts), llama-server with `cache_prompt: false` (its own). The
    same prompts in every round and at both temperatures came from the prefix cache after their first
    run (ours, and llama-server's slot cache), so prefill vanished from most figures and tok/s read
    decode alone. The prompts themselves stay as the workload wrote them."""
    if server.startswith("llama-server"):
        return [{**body, "cache_prompt": False} for body in bodies]
    return [{**body, "cache_salt": f"loadtest-{run}-{i}"} for i, body in enumerate(bodies)]


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, int]:
    """(completion tokens, prompt tokens the server says came from its cache)."""
    response = await client.post(f"{url}/v1/chat/completions", json={"model": "model", **body})
    response.raise_for_status()
    usage = response.json()["usage"]
    return usage["completion_tokens"], int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def run_serial(url: str, bodies: list[dict]) -> tuple[int, float, int]:
    """(completion tokens, seconds, cached prompt tokens) of `bodies` one after the other."""
    async with httpx.AsyncClient(timeout=600) as client:
        warm = {**bodies[0], "max_tokens": 8}
        if "cache_salt" in warm:
            warm["cache_salt"] += "-warm-up"
        await one(client, url, warm)  # warm the path, not measured (its prompt cached apart)
        start, tokens, cached = time.perf_counter(), 0, 0
        for body in bodies:
            done, hit = await one(client, url, body)
            tokens, cached = tokens + done, cached + hit
        return tokens, time.perf_counter() - start, cached


async def run_concurrent(url: str, bodies: list[dict], concurrency: int) -> tuple[int, float, int]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        queue = list(bodies)
        tokens = cached = 0

        async def worker() -> None:
            nonlocal tokens, cached
            while queue:
                done, hit = await one(client, url, queue.pop())
                tokens += done  # (not `tokens += await ...`: that reads tokens before the await)
                cached += hit

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens, time.perf_counter() - start, cached


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server's command line, each on a port of its own (a pair runs side by side)."""
    ours = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(args.model),
        "--port",
        "{port}",
        "--served-model-name",
        "model",
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(max(16, args.concurrency)),
        *(["--num-threads", str(args.threads)] if args.threads else []),
    ]
    spec = ["--speculative", "ngram", "--num-speculative-tokens", str(args.k)]
    out = {"pagedserve": ours, "pagedserve --speculative ngram": ours + spec}
    if args.llama_server:
        theirs = [
            str(args.llama_server),
            "-m",
            str(args.model),
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "-c",
            str(4096 * max(16, args.concurrency)),
            "-np",
            str(max(16, args.concurrency)),
            "-t",
            str(args.threads or os.cpu_count()),
            "-a",
            "model",
            "--log-disable",
            "--metrics",
        ]
        out["llama-server"] = theirs
        out["llama-server --spec-type ngram-simple"] = theirs + [
            "--spec-type",
            "ngram-simple",
            "--spec-draft-n-max",
            str(args.k),
        ]
    return {name: [str(free_port()) if part == "{port}" else part for part in command] for name, command in out.items()}


def counted_run(
    url: str, run: Coroutine[Any, Any, tuple[int, float, int]], label: str, figures: list[float], counts: list[float]
) -> int:
    """Await `run` (a run_serial or run_concurrent against `url`): its output tok/s appended to
    `figures`, its draft tokens, accepted tokens and cached prompt tokens added to `counts`, a line
    printed; returns its completion tokens."""
    before = spec_counters(url)
    tokens, seconds, cached = asyncio.run(run)
    after = spec_counters(url)
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    figures.append(tokens / seconds)
    counts[0] += drafted
    counts[1] += accepted
    counts[2] += cached
    print(
        f"  {label}: {tokens / seconds:.1f} tok/s ({tokens} tokens, {cached} prompt tokens cached)"
        + (f", {accepted / drafted:.0%} of {drafted:.0f} drafts accepted" if drafted else ""),
        flush=True,
    )
    return tokens


def row_result(figures: list[float], counts: list[float], tokens: int) -> dict:
    """A row's figure on one server: the median of its rounds, with what counted_run summed."""
    drafted, accepted, cached = counts
    return {
        "tok_s": statistics.median(figures),
        "tok_s_runs": figures,
        "tokens": tokens,
        "cached_prompt_tokens": cached,
        "acceptance": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
    }


def measure(servers: dict[str, list[str]], args: argparse.Namespace, loads: dict[str, list[dict]]) -> dict[str, dict]:
    """Run each row on one server of a pair (with and without speculation, side by side) and at once
    on the other, alternating which goes first, so that the two figures of a row are minutes closer
    than whole runs one after the other (this machine's speed drifts by 10-30% over minutes: such
    drift read as 0.8x "costs" of speculation that made no draft); `args.rounds` times, each row's
    figure the median. One round of the 360M shape's t=0.8 rows, where no draft was made, read
    0.94-1.26x."""
    results: dict[str, dict] = {name: {} for name in servers}
    with side_by_side(servers) as (urls, _):
        order = list(servers)
        rows = [(workload, temperature) for workload in loads for temperature in args.temperatures]
        for i, (workload, temperature) in enumerate(rows):
            sized = [
                {
                    **b,
                    "max_tokens": args.max_tokens,
                    "temperature": temperature,
                    **({"seed": 1000 + j} if temperature > 0 else {}),
                }
                for j, b in enumerate(loads[workload])
            ]
            runs: dict[str, list[float]] = {name: [] for name in servers}
            counted = {name: [0.0, 0.0, 0] for name in servers}
            for r in range(args.rounds):
                for name in order if (i + r) % 2 == 0 else order[::-1]:
                    tokens = counted_run(
                        urls[name],
                        run_serial(urls[name], uncached(sized, f"{i}.{r}", name)),
                        f"{name}: {workload} t={temperature} c=1",
                        runs[name],
                        counted[name],
                    )
            for name in servers:
                results[name][f"{workload} t={temperature} c=1"] = row_result(runs[name], counted[name], tokens)
    # The mixed run on a fresh pair each round: two servers of the same command differ by a few
    # percent for their whole life (both without drafts, alternated over rounds: up to 9%), which
    # one pair for every round reads as a cost or a gain of speculation. Here no draft is made above 4 running requests, so that was most of the figure.
    if args.mixed_rounds == 0:  # c=1 rows only
        return results
    mixed = [
        {**b, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": i}
        for i, b in enumerate(sum((loads[w] for w in loads), []) * 2)
    ]
    runs = {name: [] for name in servers}
    counted = {name: [0.0, 0.0, 0] for name in servers}
    order = list(servers)
    for r in range(args.mixed_rounds):
        with side_by_side(servers) as (urls, _):
            for name in order if (len(rows) + r) % 2 == 0 else order[::-1]:
                warm = {**mixed[0], "max_tokens": 8}
                asyncio.run(run_concurrent(urls[name], uncached([warm], f"mixed.{r}.warm-up", name), 1))
                bodies = uncached(mixed, f"mixed.{r}", name)
                tokens = counted_run(
                    urls[name],
                    run_concurrent(urls[name], bodies, args.concurrency),
                    f"{name}: mixed c={args.concurrency}",
                    runs[name],
                    counted[name],
                )
    for name in servers:
        results[name][f"mixed t=0.8 c={args.concurrency}"] = row_result(runs[name], counted[name], tokens)
    return results


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    names = list(results)
    rows = list(next(iter(results.values())))
    lines = [
        f"CPU: {cpu_description()}; threads {args.threads or os.cpu_count()}; model {args.model.name}; "
        f"k={args.k}; {args.requests} requests per workload, max_tokens {args.max_tokens}; output tok/s",
        "| run | " + " | ".join(names) + " | ours on/off | ours on / llama.cpp on |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for row in rows:
        cells = []
        for name in names:
            r = results[name][row]
            cells.append(f"{r['tok_s']:.1f}" + (f" ({r['acceptance']:.0%})" if r["acceptance"] is not None else ""))
        ours = results["pagedserve --speculative ngram"][row]["tok_s"] / results["pagedserve"][row]["tok_s"]
        theirs = results.get("llama-server --spec-type ngram-simple")
        versus = (
            f"{results['pagedserve --speculative ngram'][row]['tok_s'] / theirs[row]['tok_s']:.2f}x" if theirs else "-"
        )
        lines.append(f"| {row} | " + " | ".join(cells) + f" | **{ours:.2f}x** | {versus} |")
    cached = [f"{name} {sum(r.get('cached_prompt_tokens', 0) for r in results[name].values())}" for name in names]
    lines.append(
        f"Prompt tokens served from a prefix cache, all rows: {', '.join(cached)} (every run computes its "
        "prompts afresh: a `cache_salt` per request, llama-server `cache_prompt: false`)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.speculative", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="a GGUF file, or SHAPE:TYPE (loadtest.make_gguf); default SmolLM2-135M"
    )
    p.add_argument("--llama-server", default=None, help="llama-server binary (loadtest/llama_server.sh)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--k", type=int, default=5, help="drafts per step at most, both servers")
    p.add_argument("--requests", type=int, default=4, help="requests per workload and temperature")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each row this many times on each server, alternating which goes first; the median counts",
    )
    p.add_argument(
        "--mixed-rounds",
        type=int,
        default=None,
        help="rounds of the mixed run, each on a pair started afresh (default: --rounds, at least 5; 0: none). Above "
        "--speculative-max-batch-size running requests no draft is made, so its two figures differ by "
        "the machine's drift and the pair's own difference: one server's runs can spread by a third in "
        "one sitting, more than any cost of drafts",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--workloads", nargs="+", default=None, help="a subset of code-edit quote summary chat json")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1 or (args.mixed_rounds is not None and args.mixed_rounds < 0):
        p.error("--rounds must be at least 1 and --mixed-rounds at least 0 (0: no mixed run)")
    args.model = resolve_model(args.model)
    if args.mixed_rounds is None:
        args.mixed_rounds = max(args.rounds, 5)
    if args.llama_server is not None:
        args.llama_server = check_executable(args.llama_server)
    loads = workloads(args.requests)
    if args.workloads:
        loads = {name: loads[name] for name in args.workloads}
    results = {}
    servers = commands(args)
    for pair in (
        ("pagedserve", "pagedserve --speculative ngram"),
        ("llama-server", "llama-server --spec-type ngram-simple"),
    ):
        if pair[0] in servers:
            results.update(measure({name: servers[name] for name in pair}, args, loads))
    table = report(results, args)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_description(), "results": results, "table": table}, indent=1))


if __name__ == "__main__":
    main()
