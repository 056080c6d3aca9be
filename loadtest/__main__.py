"""python -m loadtest: command line -> BenchmarkConfig -> run(s) -> table, JSON, plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from loadtest.benchmark import run_benchmark, run_sweep
from loadtest.config import BenchmarkConfig
from loadtest.multi_turn import run_multi_turn
from loadtest.report import format_sweep_table, format_table, format_turn_table, plot, require_matplotlib, write_json

EXAMPLES = """examples:
  # closed loop, 16 in flight, 512-token prompts, exactly 128 output tokens
  python -m loadtest --url http://127.0.0.1:8000 --model M --concurrency 16 \\
      --input-len 512 --output-len 128 --ignore-eos --warmup 8 --json out.json

  # concurrency sweep with plots
  python -m loadtest --url http://127.0.0.1:8000 --model M --concurrency 1,4,16,64 --plot sweep.png

  # open loop: Poisson arrivals at 8 req/s for at most 60 s, goodput under SLOs
  python -m loadtest --url http://127.0.0.1:8000 --model M --request-rate 8 --duration 60 \\
      --slo-ttft 500 --slo-tpot 50

  # multi-turn chats: 8 conversations of 4 turns over one 1000-token system prompt, TTFT by turn;
  # then the same requests again after the server is restarted by a command
  python -m loadtest --url http://127.0.0.1:8000 --model M --endpoint chat --workload multi-turn \\
      --conversations 8 --turns 4 --system-prompt-tokens 1000 --input-len 64 --output-len 32 \\
      --restart-cmd "systemctl restart pagedserve"

  # prefix caching: 4 shared 256-token prefixes (hit rate 1 - 4/200), a tenth of streams cut
  python -m loadtest --url http://127.0.0.1:8000 --model M --concurrency 8 --num-requests 200 \\
      --input-len 512 --prefix-len 256 --num-prefixes 4 --disconnect-fraction 0.1
"""


_Number = TypeVar("_Number", int, float)


def _number_list(kind: Callable[[str], _Number]) -> Callable[[str], list[_Number]]:
    """'4' -> [4]; '1,4,16' -> [1, 4, 16] (a sweep)."""

    def parse(text: str) -> list[_Number]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list, got {text!r}") from e

    return parse


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Measure TTFT, inter-token latency and throughput of an OpenAI-compatible server.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name sent in each request (required unless --models is given)")
    p.add_argument(
        "--models",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help="model names the requests take in turn (round-robin), e.g. a base model and its LoRA adapters: "
        "base,sql,chat; the run is named by --model if given, else by these",
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")

    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency", type=_number_list(int), help="max requests in flight; a list sweeps, e.g. 1,4,16,64"
    )
    load.add_argument(
        "--request-rate",
        type=_number_list(float),
        help="open-loop arrivals per second (default inf: all at once); a list sweeps",
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1.0 = Poisson, <1 burstier"
    )
    load.add_argument("--num-requests", type=int, default=1000)
    load.add_argument("--duration", type=float, help="stop sending new requests after this many seconds")
    load.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for its next bytes before it fails as a timeout",
    )

    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=int, default=1024, help="prompt tokens, counted with the server's tokenizer")
    work.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    work.add_argument("--prefix-len", type=int, default=0, help="tokens of shared prefix at the start of each prompt")
    work.add_argument(
        "--num-prefixes", type=int, default=1, help="distinct shared prefixes (hit rate = 1 - this/num-requests)"
    )
    work.add_argument("--dataset", help='JSONL of {"prompt": ...} or {"messages": [...]}, optional "output_len"')
    work.add_argument("--tokenizer", help="HF tokenizer name or path, used if the server has no /tokenize")
    work.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens (vLLM/SGLang)")
    work.add_argument(
        "--extra-body",
        type=json_object,
        default=None,
        metavar="JSON",
        help='fields merged into every request, e.g. \'{"response_format": {"type": "json_object"}}\'',
    )
    work.add_argument(
        "--workload",
        choices=["single-turn", "multi-turn"],
        default="single-turn",
        help="multi-turn: conversations over a shared system prompt, each turn sent after the previous "
        "reply arrived (--input-len is then each user message's tokens); the report adds TTFT by turn",
    )
    work.add_argument(
        "--conversations", type=int, default=8, help="multi-turn: conversations (in flight: --concurrency)"
    )
    work.add_argument("--turns", type=int, default=4, help="multi-turn: user messages a conversation")
    work.add_argument("--system-prompt-tokens", type=int, default=1000, help="multi-turn: the shared system prompt")
    work.add_argument(
        "--replay",
        action="store_true",
        help="multi-turn: then send the same requests again (the first pass's replies as history)",
    )
    work.add_argument(
        "--restart-cmd",
        metavar="CMD",
        help="multi-turn: a shell command run between the pass and its replay (e.g. one that restarts the "
        "server); it must exit 0, then the server is waited for on /health (--restart-timeout)",
    )
    work.add_argument("--restart-timeout", type=float, default=600.0, help="seconds to wait for /health after it")
    work.add_argument("--disconnect-fraction", type=float, default=0.0, help="close this fraction of streams mid-way")

    out = p.add_argument_group("results")
    out.add_argument("--slo-ttft", type=float, help="TTFT SLO in ms, for goodput")
    out.add_argument("--slo-tpot", type=float, help="TPOT SLO in ms, for goodput")
    out.add_argument("--json", help="write the full result here: summary, server metrics and per-request timings")
    out.add_argument("--plot", help="write latency distributions (or a sweep's curves) to this PNG")
    out.add_argument("--idle-timeout", type=float, default=10.0, help="seconds to wait for server gauges to settle")
    out.add_argument("--no-server-metrics", action="store_true", help="do not read the server's /metrics")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, RuntimeError, OSError) as e:  # bad flags, unreachable server, missing file
        parser.exit(2, f"loadtest: error: {e}\n")


def _run(args: argparse.Namespace) -> int:
    concurrency = args.concurrency or [None]
    rates = args.request_rate or [math.inf]
    if len(concurrency) > 1 and len(rates) > 1:
        raise ValueError("sweep one of --concurrency or --request-rate, not both")
    if args.plot:
        require_matplotlib()  # fail before the run, not after it

    if not args.model and not args.models:
        raise ValueError("give --model, or --models to spread the requests over several names")
    config = BenchmarkConfig(
        url=args.url,
        model=args.model or ",".join(args.models),
        models=tuple(args.models or ()),
        endpoint=args.endpoint,
        concurrency=concurrency[0],
        request_rate=rates[0],
        burstiness=args.burstiness,
        num_requests=args.num_requests,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        dataset=args.dataset,
        tokenizer=args.tokenizer,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        disconnect_fraction=args.disconnect_fraction,
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        server_metrics=not args.no_server_metrics,
        idle_timeout=args.idle_timeout,
        progress=not args.quiet,
        workload=args.workload,
        conversations=args.conversations,
        turns=args.turns,
        system_prompt_tokens=args.system_prompt_tokens,
        replay=args.replay,
        restart_cmd=args.restart_cmd,
        restart_timeout=args.restart_timeout,
    )
    if config.workload == "multi-turn":
        if len(concurrency) > 1 or len(rates) > 1:
            raise ValueError("--workload multi-turn runs one load point: no --concurrency or --request-rate sweep")
        result = asyncio.run(run_multi_turn(config))
        print(format_table(result))
        print(format_turn_table(result))
        if result["replay"] is not None:
            print(f"replay{' after --restart-cmd' if config.restart_cmd else ''}:")
            print(format_table(result["replay"]))
        if args.json:
            write_json(result, args.json)
        if args.plot:
            plot(result, args.plot)
        return 0 if result["summary"]["completed"] else 1
    if len(concurrency) > 1 or len(rates) > 1:
        field, values = ("concurrency", concurrency) if len(concurrency) > 1 else ("request_rate", rates)
        result = asyncio.run(run_sweep(config, field, values))
        for value, run in zip(values, result["runs"], strict=True):
            print(f"\n{field} = {value}")
            print(format_table(run))
        print()
        print(format_sweep_table(result))
        completed = sum(run["summary"]["completed"] for run in result["runs"])
    else:
        result = asyncio.run(run_benchmark(config))
        print(format_table(result))
        completed = result["summary"]["completed"]

    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    return 0 if completed else 1  # nothing completed: let scripts notice


if __name__ == "__main__":
    sys.exit(main())
