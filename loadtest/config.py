"""BenchmarkConfig: everything one benchmark run needs, validated once.

Built by `loadtest.__main__` from the command line, or directly by tests and
scripts that call `run_benchmark(config)` in-process.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

ENDPOINTS = ("completions", "chat")
WORKLOADS = ("single-turn", "multi-turn")


@dataclass(frozen=True)
class BenchmarkConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"
    # Names the requests take in turn, request i the (i mod n)-th (a base model and its LoRA
    # adapters, say); empty: every request names `model`.
    models: tuple[str, ...] = ()

    # Load shape. `concurrency` caps requests in flight (closed loop);
    # `request_rate` paces arrivals (open loop, req/s, inf = all at once);
    # both together give paced arrivals with a cap, as vLLM's --max-concurrency.
    concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0  # gamma shape of inter-arrival gaps; 1.0 = Poisson
    num_requests: int = 1000
    duration: float | None = None  # stop sending new requests after this many seconds
    warmup: int = 0
    seed: int = 0

    # Workload: random prompts of exact token lengths, optionally sharing
    # `num_prefixes` prefixes of `prefix_len` tokens; or a JSONL dataset.
    input_len: int = 1024
    output_len: int = 128
    prefix_len: int = 0
    num_prefixes: int = 1
    dataset: str | None = None
    tokenizer: str | None = None  # local fallback when the server has no /tokenize
    ignore_eos: bool = False
    extra_body: dict | None = None  # merged into every request body (e.g. response_format)

    disconnect_fraction: float = 0.0  # chaos: close this fraction of streams mid-way

    # multi-turn: `conversations` conversations of `turns` user messages of `input_len` tokens, after
    # one shared system prompt of `system_prompt_tokens`; each turn is sent once the previous reply
    # has arrived. `replay`: then the same requests again (the first pass's replies as history),
    # after `restart_cmd` (a shell command that restarts the server) if given.
    workload: str = "single-turn"
    conversations: int = 8
    turns: int = 4
    system_prompt_tokens: int = 1000
    replay: bool = False
    restart_cmd: str | None = None
    restart_timeout: float = 600.0  # seconds for the server to answer /health after restart_cmd

    # Goodput SLOs, milliseconds.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    api_key: str | None = None
    request_timeout: float = 600.0  # seconds a request may wait for its next bytes (a stall, not a total)
    server_metrics: bool = True  # scrape /metrics before and after, if the server has it
    idle_timeout: float = 10.0  # seconds to wait for the server's gauges to settle
    progress: bool = False

    def model_for(self, index: int) -> str:
        """The model name request `index` sends."""
        return self.models[index % len(self.models)] if self.models else self.model

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0 <= self.prefix_len < self.input_len:
            raise ValueError(
                f"--prefix-len must be in [0, --input-len); got {self.prefix_len} "
                f"with --input-len {self.input_len} (prompts need a random suffix to differ)"
            )
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes must be >= 1, got {self.num_prefixes}")
        if self.dataset is not None and self.prefix_len > 0:
            raise ValueError("--prefix-len makes synthetic prompts; it cannot be combined with --dataset")
        if not 0.0 <= self.disconnect_fraction <= 1.0:
            raise ValueError(f"--disconnect-fraction must be in [0, 1], got {self.disconnect_fraction}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name[:-3].replace('_', '-')} must be > 0, got {value}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "multi-turn":
            if self.conversations < 1 or self.turns < 1 or self.system_prompt_tokens < 0:
                raise ValueError("--conversations and --turns must be >= 1, --system-prompt-tokens >= 0")
            if self.dataset is not None or self.prefix_len > 0 or self.disconnect_fraction > 0:
                raise ValueError(
                    "--workload multi-turn builds its own prompts: no --dataset, --prefix-len, --disconnect-fraction"
                )
        elif self.replay or self.restart_cmd:
            raise ValueError("--replay and --restart-cmd replay conversations: they need --workload multi-turn")
        if not self.restart_timeout > 0:
            raise ValueError(f"--restart-timeout must be > 0, got {self.restart_timeout}")
        if not self.request_timeout > 0 or self.idle_timeout < 0:
            raise ValueError("--request-timeout must be > 0 and --idle-timeout >= 0")

    @property
    def base_url(self) -> str:
        """Server root without a trailing slash or /v1: /tokenize and /metrics live there."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def api_url(self) -> str:
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return self.base_url + path

    def to_dict(self) -> dict:
        """For reports: never echo the API key into a JSON file."""
        data = asdict(self)
        data["api_key"] = "***" if self.api_key else None
        if math.isinf(self.request_rate):
            data["request_rate"] = "inf"  # JSON has no infinity
        return data
