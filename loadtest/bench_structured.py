"""What structured output costs: grammar compile time, TTFT with a cold vs a cached grammar,
and throughput with every request under a JSON schema vs none, on one server, one after the other.

    python -m loadtest.bench_structured [--model PATH] [--concurrency 16] [--out result.json]

The schema run asks for an array of at least 50 objects, which the output never completes
within --output-len tokens: both runs generate exactly that many tokens per request
(ignore_eos), so the difference is the grammar's per-step cost alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtest.benchmark import run_benchmark
from loadtest.compare import cpu_description, free_port, stop_server, wait_healthy
from loadtest.config import BenchmarkConfig

ITEMS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
LONG = {"type": "array", "items": ITEMS, "minItems": 50}
# The shapes the tests use: flat, nested, enums, patterns, bounded numbers.
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat (3 fields)": ITEMS,
    "nested + pattern": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                },
                "required": ["id", "email"],
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "score"],
    },
    "array of objects": LONG,
    "20 properties": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(20)},
    },
}


def compile_times(model: str, repeats: int) -> dict:
    from engine.structured import GrammarCompiler, StructuredOutput
    from models.loader import load_model

    loaded = load_model(model, dtype="float32")
    compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids)
    start = time.perf_counter()
    compiler._tokenizer()
    compile_ms_p50: dict[str, float] = {}
    result = {"tokenizer_init_ms": 1000 * (time.perf_counter() - start), "compile_ms_p50": compile_ms_p50}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):  # a fresh description each time: never a cache hit
            spec = StructuredOutput.json_schema({**schema, "description": uuid.uuid4().hex})
            start = time.perf_counter()
            compiler.compile(spec)
            times.append(1000 * (time.perf_counter() - start))
        compile_ms_p50[name] = statistics.median(times)
    return result


def ttft_ms(url: str, schema: dict | None) -> float:
    body = {"model": "model", "prompt": "Describe three people as JSON.", "max_tokens": 1, "stream": True}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return 1000 * (time.perf_counter() - start)
    raise RuntimeError("no token came back")


def throughput(url: str, args: argparse.Namespace, tokenizer_dir: str, extra_body: dict | None) -> dict:
    """One run of the load (the same prompts every run, so both arms do the same work), its prompts
    computed afresh: a `cache_salt` of the run's own keeps the previous runs' prefix-cache blocks
    from serving them (without it every run after the first skipped prefill)."""
    extra_body = {**(extra_body or {}), "cache_salt": uuid.uuid4().hex}
    config = BenchmarkConfig(
        url=url,
        model="model",
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        warmup=4,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=True,
        tokenizer=tokenizer_dir,
        server_metrics=False,
        seed=1,
        extra_body=extra_body,
    )
    summary = asyncio.run(run_benchmark(config))["summary"]
    return {
        "output_tok_s": summary["output_token_throughput"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "completed": summary["completed"],
        "failed": summary["failed"],
    }


def main(argv: list[str] | None = None) -> int:
    from models.fetch import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF or checkpoint (default: the default model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="none/schema pairs, one after the other; medians reported")
    p.add_argument("--out", default=None, help="write every figure here as JSON")
    args = p.parse_args(argv)
    model = args.model or str(default_model_path())

    result = {"cpu": cpu_description(), "model": Path(model).name, **compile_times(model, repeats=5)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "server",
        "--model",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "model",
        "--max-num-seqs",
        str(max(args.concurrency, 16)),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, process)
        with tempfile.TemporaryDirectory() as tokenizer_dir:
            from models.loader import load_model

            load_model(model, dtype="float32").tokenizer.save_pretrained(tokenizer_dir)
            ttft_ms(url, None)  # warm up
            result["first_structured_request_ttft_ms"] = ttft_ms(url, {**ITEMS, "description": "first"})
            cold, cached, plain = [], [], []
            for _ in range(5):
                schema = {**ITEMS, "description": uuid.uuid4().hex}
                cold.append(ttft_ms(url, schema))
                cached.append(ttft_ms(url, schema))
                plain.append(ttft_ms(url, None))
            result["ttft_ms_p50"] = {
                "no schema": statistics.median(plain),
                "cold grammar": statistics.median(cold),
                "cached grammar": statistics.median(cached),
            }
            runs: dict[str, list[dict]] = {"none": [], "json_schema": []}
            schema_body = {
                "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": LONG}}
            }
            throughput(url, args, tokenizer_dir, None)  # unmeasured: the step tuner's first timings
            for _ in range(args.rounds):
                runs["none"].append(throughput(url, args, tokenizer_dir, None))
                runs["json_schema"].append(throughput(url, args, tokenizer_dir, schema_body))
                print(f"  none: {runs['none'][-1]}\n  json_schema: {runs['json_schema'][-1]}", flush=True)
        result["throughput"] = runs
    finally:
        stop_server(process)

    tok_s = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    itl = {k: statistics.median(r["itl_p50_ms"] for r in v) for k, v in runs.items()}
    lines = [
        f"CPU: {result['cpu']}",
        f"model: {result['model']}; c={args.concurrency}, prompts {args.input_len} "
        f"tokens, {args.output_len} generated (ignore_eos), {args.rounds} rounds, medians",
        "",
        "| figure | no schema | JSON schema | schema / none |",
        "|---|---|---|---|",
        f"| output tok/s | {tok_s['none']:.1f} | {tok_s['json_schema']:.1f} | {tok_s['json_schema'] / tok_s['none']:.2f} |",
        f"| ITL p50 ms | {itl['none']:.1f} | {itl['json_schema']:.1f} | {itl['json_schema'] / itl['none']:.2f} |",
        "",
        f"llguidance tokenizer view, built once: {result['tokenizer_init_ms']:.0f} ms",
        "| schema | compile ms (p50) |",
        "|---|---|",
    ]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in result["compile_ms_p50"].items()]
    t = result["ttft_ms_p50"]
    lines += [
        "",
        "| TTFT p50 (1 request alone) | ms |",
        "|---|---|",
        f"| no schema | {t['no schema']:.1f} |",
        f"| cold grammar | {t['cold grammar']:.1f} |",
        f"| cached grammar | {t['cached grammar']:.1f} |",
        f"| first structured request after start | {result['first_structured_request_ttft_ms']:.1f} |",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
