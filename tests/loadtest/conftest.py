"""A protocol stand-in: a small but real OpenAI-compatible streaming server.

It is NOT pagedserve. It exists so the load generator can be tested end to end
on CPU in milliseconds: real HTTP (uvicorn on 127.0.0.1, a free port), real SSE
framing, usage chunks, vLLM-style /tokenize and /detokenize over a whitespace
tokenizer, and Prometheus /metrics. It generates deterministic tokens
(" tok0", " tok1", ...) with a small delay, and can inject protocol faults.

The `standin` fixture starts servers in a thread and stops them through their
own uvicorn handle at teardown.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

FAULTS = ("missing_done", "invalid_json", "inconsistent_id", "http_500")


@dataclass
class StandInOptions:
    first_token_delay_s: float = 0.004
    token_delay_s: float = 0.001
    tokenize_endpoints: bool = True
    fault: str | None = None  # one of FAULTS, injected into every `fault_every`-th request
    fault_every: int = 0
    block_size: int = 4  # KV "blocks" the /metrics gauge counts, to check they are freed


class WhitespaceTokenizer:
    """Words are tokens; encode() prepends BOS (id 0) the way Llama's does."""

    BOS = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<s>": self.BOS}
        self.words = ["<s>"]
        self.lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self.lock:
            for word in text.split():
                if word not in self.vocab:
                    self.vocab[word] = len(self.words)
                    self.words.append(word)
            return [self.BOS] + [self.vocab[w] for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i != self.BOS)


@dataclass
class StandInState:
    options: StandInOptions
    tokenizer: WhitespaceTokenizer = field(default_factory=WhitespaceTokenizer)
    num_received: int = 0
    usage_log: list[dict] = field(default_factory=list)  # usage of every stream that ran to the end
    num_aborted: int = 0


def create_standin_app(options: StandInOptions) -> FastAPI:
    app = FastAPI()
    state = StandInState(options)
    app.state.standin = state
    registry = CollectorRegistry()  # per app: never the process-global registry
    ttft = Histogram("pagedserve:time_to_first_token_seconds", "TTFT", registry=registry)
    itl = Histogram("pagedserve:inter_token_latency_seconds", "ITL", registry=registry)
    kv_blocks = Gauge("pagedserve:kv_blocks_used", "KV blocks in use", registry=registry)
    running = Gauge("pagedserve:num_requests_running", "running requests", registry=registry)

    def prompt_tokens(body: dict, chat: bool) -> int:
        if chat:  # a pretend chat template: BOS, then 3 tokens of framing per message
            return 1 + sum(3 + len(str(m.get("content", "")).split()) for m in body["messages"])
        prompt = body["prompt"]
        return len(prompt) if isinstance(prompt, list) else len(state.tokenizer.encode(prompt))

    async def stream(body: dict, chat: bool, number: int, fault: str | None, arrival: float):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{number}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        num_prompt = prompt_tokens(body, chat)
        num_out = int(body.get("max_tokens") or 16)
        blocks = 0
        running.inc()
        try:
            if chat:
                yield _sse({"id": rid, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(options.first_token_delay_s)
            last = None
            for k in range(num_out):
                if k:
                    await asyncio.sleep(options.token_delay_s)
                now = time.perf_counter()
                if last is None:
                    ttft.observe(now - arrival)
                else:
                    itl.observe(now - last)
                last = now
                new_blocks = math.ceil((num_prompt + k + 1) / options.block_size)
                kv_blocks.inc(new_blocks - blocks)
                blocks = new_blocks
                text = f" tok{k}"
                choice = {"index": 0, "finish_reason": "length" if k == num_out - 1 else None}
                choice.update({"delta": {"content": text}} if chat else {"text": text})
                chunk_id = rid + "-x" if fault == "inconsistent_id" and k == 1 else rid
                yield _sse({"id": chunk_id, "object": obj, "choices": [choice]})
                if fault == "invalid_json" and k == 0:
                    yield "data: {not json\n\n"
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}
            yield _sse({"id": rid, "object": obj, "choices": [], "usage": usage})
            if fault != "missing_done":
                yield "data: [DONE]\n\n"
            state.usage_log.append(usage)
        except asyncio.CancelledError:  # the client went away: free its resources
            state.num_aborted += 1
            raise
        finally:
            kv_blocks.dec(blocks)
            running.dec()

    async def generate(request: Request, chat: bool):
        arrival = time.perf_counter()
        body = await request.json()
        state.num_received += 1
        number = state.num_received
        fault = None
        if options.fault and options.fault_every and number % options.fault_every == 0:
            fault = options.fault
        if fault == "http_500":
            return JSONResponse({"error": {"message": "injected fault"}}, status_code=500)
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the stand-in only streams"}}, status_code=400)
        return StreamingResponse(stream(body, chat, number, fault, arrival), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    if options.tokenize_endpoints:

        @app.post("/tokenize")
        async def tokenize(request: Request):
            tokens = state.tokenizer.encode((await request.json())["prompt"])
            return {"tokens": tokens, "count": len(tokens)}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            return {"prompt": state.tokenizer.decode((await request.json())["tokens"])}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    return app


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


class StandInServer:
    """uvicorn in a daemon thread, on a socket bound up front (no port race)."""

    def __init__(self, options: StandInOptions):
        self.app = create_standin_app(options)
        self.state: StandInState = self.app.state.standin
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted
        # sockets whose proto says TCP, and without it Nagle + delayed ACK add
        # ~40 ms to every response.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def start(self) -> StandInServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


@pytest.fixture
def standin():
    """Factory: `standin(token_delay_s=0.002, fault="missing_done", fault_every=4)` -> StandInServer."""
    servers: list[StandInServer] = []

    def start(**options) -> StandInServer:
        server = StandInServer(StandInOptions(**options)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
