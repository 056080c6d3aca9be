"""How much faster can speculation make one stream, at most, on this CPU: the bound that exact
verification and the prompt's prefill leave, next to what the n-gram drafts reach.

    python -m loadtest.spec_bound                                  # SmolLM2-135M, t=0 and 0.8
    python -m loadtest.spec_bound --model smollm2-360m:q4_0 --workloads code-edit quote

Verification is exact (engine/speculative.py): row j's token is drawn from the request's own
generator as decoding without drafts would draw it, and a draft token counts only where it is
that token. A drafter that does not see the request's random draws is right at a position with
chance p(draft) <= max p, the model's most likely token, so the best such drafter proposes the
model's own argmax: the "oracle" here (what a perfect draft model, EAGLE head or MTP layer could
reach, if it cost nothing). With the outputs fixed (seeded, and the same with drafts or without),
its accepted runs are counted exactly: at each step, the argmax tokens up to the first position
where the sampled token is not the argmax.

For each workload of `loadtest.speculative` (the same requests, seeds and max_tokens) and
temperature, in one process:
  1. every request decoded without drafts in the engine: its prefill and per-token decode time;
  2. prompt + output through the model in one prefill: each position's logits, so max p
     (softmax(logits / t)) and whether the sampled token was the argmax;
  3. one request's decode step of r = 1 .. k + 1 rows (forward and logits) timed, rounds
     alternating r, medians: what r rows add to a step;
  4. the oracle's steps for each k (drafting k argmax tokens a step), and the n-gram proposer
     (engine/speculative.py's NgramIndex, fixed k) replayed over the same tokens;
  5. what the engine itself does: the same requests through it without drafts, with
     `--speculative ngram` (its policy, up to --engine-k drafts) and through a second engine
     without drafts (two engines of one setting differ by a few percent), the order rotating by
     round; the median of the rounds' on / off, the second engine's / the first's, and whether
     every output was the same.
The bound on output tok/s with drafts / without, per k:

    (prefill + decode without) / (prefill + sum over steps of (decode step + what its extra rows add))

where the drafter costs nothing and a step's extra rows add only their forward and logits, so it
is an upper bound for that drafter. "Ceiling" is decoding in no time at all: the prefill alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loadtest.bench_step import BLOCK_SIZE, Batch
from loadtest.compare import cpu_description, resolve_model
from loadtest.perplexity import next_token_logits
from loadtest.speculative import workloads

if TYPE_CHECKING:
    from engine.llm import LLM
    from models.loader import LoadedModel


def oracle_steps(hits: list[bool], k: int) -> list[int]:
    """The rows of each decode step when every step drafts the next k argmax tokens: hits[i] is
    whether output token i (after the first, which the prefill gives) was the argmax. A step
    from position i accepts the drafts up to the first miss and yields that token too.

        hits  T T F T T T T F         k = 3: steps at 0 (T T F: 3 tokens), 3 (T T T: 3 drafts
        rows  4     4     4 ...              accepted and a fourth token), 7 ..."""
    rows, i, n = [], 0, len(hits)
    while i < n:
        drafts = min(k, n - 1 - i)
        run = 0
        while run < drafts and hits[i + run]:
            run += 1
        rows.append(1 + drafts)
        i += run + 1
    return rows


def ngram_steps(
    prompt: list[int], output: list[int], k: int, ngram_min: int = 1, ngram_max: int = 4
) -> tuple[list[int], int]:
    """(rows of each decode step, draft tokens accepted) with the n-gram proposer drafting up to k
    tokens a step over prompt + output, as the engine's NgramIndex does (no policy: k wherever a
    match is found; the engine's policy drafts fewer where they pay less, so it can do better)."""
    from engine.speculative import NgramIndex

    index = NgramIndex(ngram_min, ngram_max)
    tokens = list(prompt) + list(output[:1])
    rows, accepted, i, n = [], 0, 1, len(output)
    while i < n:
        draft = index.propose(tokens, min(k, n - 1 - i)) if k else []
        run = 0
        while run < len(draft) and draft[run] == output[i + run]:
            run += 1
        rows.append(1 + len(draft))
        accepted += run
        tokens += output[i : i + run + 1]
        i += run + 1
    return rows, accepted


@torch.inference_mode()
def row_costs(loaded: LoadedModel, max_rows: int, context: int, rounds: int) -> dict[int, float]:
    """rows -> median seconds of one request's forward and logits with that many rows after
    `context` tokens, the row counts alternated in each round (this machine's speed drifts)."""
    model = loaded.model
    num_blocks = -(-(context + max_rows) // BLOCK_SIZE) + 1
    kv_caches = model.kv_cache_spec(loaded.config.dtype).allocate(num_blocks, BLOCK_SIZE, "cpu")
    batches = {r: Batch([r], [context + r], num_blocks, "cpu", seed=r) for r in range(1, max_rows + 1)}
    metas = {r: b.build() for r, b in batches.items()}

    def step(r: int) -> float:
        start = time.perf_counter()
        hidden = model(batches[r].input_ids, batches[r].positions, kv_caches, metas[r])
        model.compute_logits(hidden)
        return time.perf_counter() - start

    for r in batches:  # warm each shape once
        step(r)
    times: dict[int, list[float]] = {r: [] for r in batches}
    for i in range(rounds):
        for r in list(batches) if i % 2 == 0 else list(batches)[::-1]:
            times[r].append(step(r))
    return {r: statistics.median(t) for r, t in times.items()}


def analyse(loaded: LoadedModel, llm: LLM, bodies: list[dict], temperature: float, max_tokens: int) -> list[dict]:
    """Per request: its tokens, times, max p and hits (steps 1 and 2 of the docstring)."""
    from engine.request import SamplingParams

    tokenizer = llm.tokenizer
    requests = []
    for j, body in enumerate(bodies):
        # As the server renders a chat request (server/serving_chat.py's encode_chat): the template
        # writes any BOS it wants, so no special tokens are added again.
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=1000 + j if temperature > 0 else None
        )
        result = llm.generate([prompt_ids], params)[0]
        output = result.token_ids
        logits = next_token_logits(loaded, prompt_ids + output[:-1])[len(prompt_ids) - 1 :]
        if temperature > 0:
            max_p = torch.softmax(logits.float() / temperature, dim=-1).amax(dim=-1)
        else:
            max_p = torch.ones(len(output))
        argmax = logits.argmax(dim=-1).tolist()
        requests.append(
            {
                "prompt": prompt_ids,
                "params": params,
                "output": output,
                "prefill_s": result.prefill_time,
                "decode_s": result.decode_time,
                "max_p": max_p.tolist(),
                "hits": [t == a for t, a in zip(output, argmax)],
            }
        )
    return requests


def measured(off: LLM, on: LLM, requests: list[dict], rounds: int, control: LLM | None = None) -> dict:
    """The engine's own on / off: the requests one at a time (c=1) through an engine without drafts
    and one with them (`--speculative ngram`'s policy), the order rotating by round; output tok/s of
    each, the median of the rounds' ratios, and whether both gave every request the tokens the first
    decode did (they must: verification is exact). `control`, a second engine without drafts, runs
    in the rotation too: two engines of the same settings in one process differ by a few percent,
    and its ratio shows how much."""
    engines = [("off", off), ("on", on)] + ([("control", control)] if control is not None else [])
    ratios: dict[str, list[float]] = {name: [] for name, _ in engines if name != "off"}
    same = True
    for i in range(rounds):
        tok_s = {}
        for name, llm in engines[i % len(engines) :] + engines[: i % len(engines)]:
            start, tokens = time.perf_counter(), 0
            for r in requests:
                out = llm.generate([r["prompt"]], r["params"])[0].token_ids
                same = same and out == r["output"]
                tokens += len(out)
            tok_s[name] = tokens / (time.perf_counter() - start)
        for name in ratios:
            ratios[name].append(tok_s[name] / tok_s["off"])
    result = {"ratio": statistics.median(ratios["on"]), "rounds": ratios["on"], "same_tokens": same}
    if control is not None:
        result["control"] = statistics.median(ratios["control"])
    return result


def bounds(requests: list[dict], costs: dict[int, float], max_k: int) -> dict:
    """Step 4: the oracle's and the n-gram's steps for each k, and the bound on tok/s on / off."""
    prefill = sum(r["prefill_s"] for r in requests)
    decode = sum(r["decode_s"] for r in requests)
    steps_off = sum(len(r["output"]) - 1 for r in requests)
    per_step = decode / max(1, steps_off)  # the engine's decode step without drafts, all it does
    extra = {rows: max(0.0, costs[rows] - costs[1]) for rows in costs}  # what rows beyond the first add

    def on_time(step_rows: list[int]) -> float:
        return prefill + sum(per_step + extra[rows] for rows in step_rows)

    oracle, ngram = {}, {}
    for k in range(max_k + 1):  # k = 0: no drafts, the time without them (1.0x)
        rows = [s for r in requests for s in oracle_steps(r["hits"][1:], k)]
        oracle[k] = {
            "tokens_per_step": steps_off / len(rows) if rows else 1.0,
            "ratio": (prefill + decode) / on_time(rows),
        }
        replay = [ngram_steps(r["prompt"], r["output"], k) for r in requests]
        rows = [s for steps, _ in replay for s in steps]
        ngram[k] = {
            "tokens_per_step": steps_off / len(rows) if rows else 1.0,
            "ratio": (prefill + decode) / on_time(rows),
            "accepted": sum(a for _, a in replay),
            "drafted": sum(s - 1 for s in rows),
        }
    positions = [p for r in requests for p in r["max_p"][1:]]
    hits = [h for r in requests for h in r["hits"][1:]]
    return {
        "requests": len(requests),
        "prompt_tokens": statistics.mean(len(r["prompt"]) for r in requests),
        "output_tokens": sum(len(r["output"]) for r in requests),
        "prefill_share": prefill / (prefill + decode),
        "decode_step_ms": per_step * 1e3,
        "mean_max_p": statistics.mean(positions) if positions else 1.0,
        "argmax_share": sum(hits) / len(hits) if hits else 1.0,
        "ceiling": (prefill + decode) / prefill,
        "oracle": oracle,
        "ngram": ngram,
    }


def engine(m: dict | None) -> str:
    if m is None:
        return "-"
    rounds = ", ".join(f"{r:.2f}" for r in m["rounds"])
    control = f"; off again {m['control']:.2f}x" if "control" in m else ""
    return f"{m['ratio']:.2f}x ({rounds}{control})" + ("" if m["same_tokens"] else " TOKENS DIFFER")


def report(results: dict, costs: dict[int, float], args: argparse.Namespace) -> str:
    best = lambda table: max(table.items(), key=lambda kv: kv[1]["ratio"])  # noqa: E731
    lines = [
        f"CPU: {cpu_description()}; threads {torch.get_num_threads()}; model {args.model.name}; "
        f"{args.requests} requests per workload, max_tokens {args.max_tokens}",
        "One request's step with r rows (forward + logits, medians) / 1 row: "
        + ", ".join(f"{r}: {costs[r] / costs[1]:.2f}" for r in sorted(costs)),
        "| workload | temp | prompt tok | prefill share | mean max p | argmax share | oracle: best k, tok/step, "
        "bound on/off | n-gram replay: best k, tok/step, on/off | engine on/off (rounds; a second engine without "
        "drafts / the first) | ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, temperature), b in results.items():
        ok, o = best(b["oracle"])
        nk, n = best(b["ngram"])
        lines.append(
            f"| {workload} | {temperature:g} | {b['prompt_tokens']:.0f} | {b['prefill_share']:.0%} | "
            f"{b['mean_max_p']:.2f} | {b['argmax_share']:.0%} | k={ok}: {o['tokens_per_step']:.2f}, "
            f"**{o['ratio']:.2f}x** | k={nk}: {n['tokens_per_step']:.2f}, {n['ratio']:.2f}x | "
            f"{engine(b.get('measured'))} | {b['ceiling']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.spec_bound", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="a GGUF file, or SHAPE:TYPE (loadtest.make_gguf); default SmolLM2-135M"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--requests", type=int, default=4, help="requests per workload and temperature")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=8, help="drafts a step: each k up to this is tried, the best reported")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["code-edit", "quote", "chat"],
        help="a subset of code-edit quote summary chat (json's grammar is not replayed here)",
    )
    p.add_argument("--rounds", type=int, default=15, help="rounds of the row-count timing")
    p.add_argument(
        "--engine-rounds", type=int, default=3, help="rounds of the engine's own on / off, the order rotating (0: none)"
    )
    p.add_argument("--engine-k", type=int, default=5, help="the engine's drafts a step at most (the server's default)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if (
        not 1 <= args.k <= 16
        or not 1 <= args.engine_k <= 16
        or args.requests < 1
        or args.max_tokens < 2
        or args.rounds < 1
        or args.engine_rounds < 0
    ):
        p.error(
            "need 1 <= --k, --engine-k <= 16, --requests >= 1, --max-tokens >= 2, --rounds >= 1, --engine-rounds >= 0"
        )
    loads = workloads(args.requests)
    unknown = [w for w in args.workloads if w not in loads or w == "json"]
    if unknown:
        p.error(f"unknown or unsupported workloads: {', '.join(unknown)}")
    from engine.llm import LLM
    from engine.speculative import SpeculativeConfig
    from models.loader import load_model

    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    loaded = load_model(str(args.model), dtype="auto", max_model_len=2048)
    llm = LLM.from_loaded(loaded, enable_prefix_caching=False, max_model_len=2048)
    spec = LLM.from_loaded(
        loaded,
        enable_prefix_caching=False,
        max_model_len=2048,
        speculative=SpeculativeConfig(num_speculative_tokens=args.engine_k),
    )
    control = LLM.from_loaded(loaded, enable_prefix_caching=False, max_model_len=2048)
    for warm in (llm, spec, control):
        warm.generate([[1, 2, 3]], None)  # warm the path
    results, runs = {}, {}
    for workload in args.workloads:
        for temperature in args.temperatures:
            requests = analyse(loaded, llm, loads[workload], temperature, args.max_tokens)
            results[(workload, temperature)] = requests
            if args.engine_rounds:
                runs[(workload, temperature)] = measured(llm, spec, requests, args.engine_rounds, control)
            print(
                f"  {workload} t={temperature:g}: {sum(len(r['output']) for r in requests)} tokens"
                + (f", engine on/off {engine(runs[(workload, temperature)])}" if args.engine_rounds else ""),
                flush=True,
            )
    context = int(statistics.mean(len(r["prompt"]) + len(r["output"]) // 2 for rs in results.values() for r in rs))
    costs = row_costs(loaded, args.k + 1, context, args.rounds)
    summaries = {
        key: {**bounds(requests, costs, args.k), "measured": runs.get(key)} for key, requests in results.items()
    }
    table = report(summaries, costs, args)
    print(table)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "cpu": cpu_description(),
                    "row_costs": costs,
                    "table": table,
                    "results": {f"{w} t={t:g}": b for (w, t), b in summaries.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
