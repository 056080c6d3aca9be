"""AsyncEngine: EngineCore in its own thread, per-request asyncio queues in front.

    event loop                              engine thread
    generate() --("add", ...)--> inbox --> core.add_request
    abort()    --("abort", id)-> inbox --> core.abort_request
    async for out in queue  <-- call_soon_threadsafe(_put_all) <-- core.step()   one call per loop per step

The engine thread owns the core and the map of request id -> sink (loop, queue); the
loop side only puts commands in the inbox, so no state is shared but the inbox
and the stats snapshot (replaced whole after every step). The asyncio loop never
waits on a forward pass.

However the engine thread ends (the stop command, or an exception anywhere in its
loop), it closes the inbox, refuses every "add" still in it and ends every open
stream, with an "error" output unless it was a clean stop: no generate() waits on
a thread that is gone, and is_running (what /health reads) turns False.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from engine.config import EngineConfig
from engine.core import EngineCore, tokenize_prompt
from engine.step import EngineDeadError
from engine.request import RequestOutput, SamplingParams
from engine.stats import EngineStats
from engine.structured import GrammarError, StructuredOutput

if TYPE_CHECKING:
    from engine.parallel import RankGroup
    from models.loader import LoadedModel

logger = logging.getLogger(__name__)

_STOP = ("stop",)
# A grammar still compiling after this is refused; llguidance's own limits bound the work.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class _Sink:
    """One generate() call's stream: outputs are routed to it, never by request id alone.

    Its queue holds at most max_pending_outputs unread items; the engine thread keeps
    what comes after merged into one held output until the reader catches up:

        num_sent (engine thread) - num_read (event loop) = unread items in the queue
    """

    __slots__ = ("request_id", "loop", "stream", "num_sent", "num_read", "held", "stalled_since")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, stream: asyncio.Queue):
        self.request_id, self.loop, self.stream = request_id, loop, stream
        self.num_sent = 0  # written by the engine thread only
        self.num_read = 0  # written by the event loop only
        self.held: RequestOutput | None = None  # engine thread only
        self.stalled_since: float | None = None  # when the queue filled up


class AsyncEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        start: bool = True,
        ranks: RankGroup | None = None,
    ):
        """`ranks`: rank 0's engine.parallel.RankGroup (tensor parallel); shutdown stops them."""
        self.core = EngineCore(loaded, config, ranks=ranks)
        self.config = self.core.config
        self.limits = self.core.limits  # what a request must fit: front ends check it before generate()
        self.tokenizer = loaded.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # request id -> its current submission; engine thread only
        self._held: dict[_Sink, None] = {}  # sinks with a held-back output, in order; engine thread only
        self._num_stalled_aborts = 0
        self._open: set[str] = set()  # ids with a live generate(); event loop side only
        self._stats = self.core.stats()
        self._thread: threading.Thread | None = None
        # Grammars compile here: never on the event loop, never on the engine thread.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        # Taken to put a command or to close the inbox: once closed, no command can
        # land where nobody will read it.
        self._inbox_lock = threading.Lock()
        self._closed = False
        if ranks is not None:  # a worker that dies while we idle: the engine stops at once
            ranks.on_failure(lambda message: self._submit(("dead", message)))
        if start:
            self.start()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is left (streams get their final "abort" output) and join the thread."""
        if self._thread is None:
            return
        self._submit(_STOP)
        self._thread.join(timeout)
        self._thread = None
        self._grammar_pool.shutdown(wait=False)
        self.core.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def _submit(self, command: tuple) -> bool:
        """Put a command in the inbox; False once the engine thread has closed it."""
        with self._inbox_lock:
            if self._closed:
                return False
            self._inbox.put(command)
            return True

    def stats(self) -> EngineStats:
        return self._stats

    # ----------------------------------------------------------------- API
    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has `finished` set.

        Raises ValueError before any output for a request that can never fit
        (self.limits) or whose id is already streaming, QueueFullError when the queue
        is full. Leaving the iteration early (break, cancellation) aborts the request.
        """
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        if params.structured is not None and self.core.grammars.cached(params.structured) is None:
            await self.compile_grammar(params.structured)
        prompt_token_ids = tokenize_prompt(self.tokenizer, prompt)
        if request_id in self._open:
            raise ValueError(f"request id {request_id!r} is already in use")
        sink = _Sink(request_id, asyncio.get_running_loop(), asyncio.Queue())
        self._open.add(request_id)
        finished = False
        try:
            if not self._submit(("add", request_id, prompt_token_ids, params, sink)):
                finished = True
                raise RuntimeError("the engine is not running")
            while True:
                item = await sink.stream.get()
                sink.num_read += 1
                if isinstance(item, BaseException):  # refused by the engine thread
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._open.discard(request_id)
            if not finished:
                self._submit(("abort", request_id))

    async def compile_grammar(self, spec: StructuredOutput, timeout: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        """Compile (or find cached) the grammar of a structured output in the grammar thread;
        GrammarError (a ValueError) if it is invalid or takes longer than `timeout` seconds."""
        future = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.core.grammars.compile, spec)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise GrammarError(f"the {spec.kind} took longer than {timeout:g} s to compile; simplify it") from None

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter while serving: read and checked in a worker thread (ValueError naming
        what is wrong; LoRANameTakenError for a name in use), installed by the engine thread
        between two steps, so no step sees half an adapter and no running request changes."""
        prepared = await asyncio.to_thread(self.core.runner.prepare_lora, name, path)
        await self._call(self.core.load_lora_adapter, prepared)

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter between two steps (EngineCore.unload_lora_adapter's refusals)."""
        await self._call(self.core.unload_lora_adapter, name)

    async def _call(self, fn: Callable[..., object], *args: object) -> None:
        """fn(*args) on the engine thread between steps; its exception is raised here."""
        future = asyncio.get_running_loop().create_future()
        if not self._submit(("call", None, fn, args, future)):
            raise RuntimeError("the engine is not running")
        await future

    async def abort(self, request_id: str) -> None:
        """End a request; its stream (if still read) gets a final output with finish_reason "abort"."""
        self._submit(("abort", request_id))

    # -------------------------------------------------------- engine thread
    def _run(self) -> None:
        error = None
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - ended below: every stream hears of it
            logger.exception("the engine thread failed; ending every open stream")
            error = f"the engine stopped: {type(e).__name__}: {e}"
        finally:
            self._close(error)

    def _close(self, error: str | None) -> None:
        """Close the inbox, refuse the adds left in it, end the streams still open.

        Uses neither the core nor _deliver: either may be what just failed."""
        with self._inbox_lock:
            self._closed = True
        left = []
        while True:
            try:
                left.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._refuse(left)
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            self._send(sink.loop, sink.stream, _error_output(request_id, error or "the engine stopped"))

    def _refuse(self, commands: list[tuple]) -> None:
        for command in commands:
            if command[0] == "add":
                sink = command[4]
                self._send(sink.loop, sink.stream, RuntimeError("the engine is shutting down"))
            elif command[0] == "call":
                future = command[4]
                try:
                    future.get_loop().call_soon_threadsafe(
                        _settle, future, future.set_exception, RuntimeError("the engine is shutting down")
                    )
                except RuntimeError:  # the loop is closed
                    pass

    def _loop(self) -> None:
        while True:
            commands = [self._inbox.get()] if not self.core.has_unfinished else []
            try:
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            # Each output is routed when it is made: an abort and a new add of the same id
            # in one drain must not hand the old request's final output to the new stream.
            routed: list[tuple[_Sink, RequestOutput]] = []
            for i, command in enumerate(commands):
                if command is _STOP:
                    self._refuse(commands[i + 1 :])  # then _close refuses what is still in the inbox
                    routed += self._route(self.core.abort_all())
                    self._publish(routed)
                    return
                try:
                    routed += self._route(self._handle(command))
                except EngineDeadError:
                    raise
                except Exception:  # noqa: BLE001 - one bad command must not end the thread
                    logger.exception("engine command %s failed", command[:2])
            if self.core.has_unfinished:
                try:
                    outputs = self.core.step()
                except EngineDeadError:
                    raise  # _run ends every stream with its message; is_running turns False
                except Exception as e:  # noqa: BLE001 - the core contains failures; this is a last resort
                    logger.exception("engine step raised; ending every request")
                    outputs = self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")
                routed += self._route(outputs)
            self._publish(routed)

    def _publish(self, routed: list[tuple[_Sink, RequestOutput]]) -> None:
        send = self._flow(routed)  # may abort a stalled stream: before the snapshot
        # Stats first: whoever has seen an output then never reads an older snapshot.
        self._stats = replace(self.core.stats(), num_stalled_aborts=self._num_stalled_aborts)
        self._deliver(send)

    def _handle(self, command: tuple) -> list[RequestOutput]:
        kind, request_id = command[0], command[1]
        if kind == "add":
            _, _, prompt_token_ids, params, sink = command
            try:
                self.core.add_request(request_id, prompt_token_ids, params)
            except Exception as e:  # noqa: BLE001 - handed to the caller of generate()
                self._send(sink.loop, sink.stream, e)
                return []
            self._sinks[request_id] = sink
        elif kind == "abort":
            output = self.core.abort_request(request_id)
            if output is not None:
                return [output]
        elif kind == "call":
            _, _, fn, args, future = command
            outcome: tuple[Callable[..., object], object]
            try:
                outcome = (future.set_result, fn(*args))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                outcome = (future.set_exception, e)
            try:
                future.get_loop().call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the caller's loop is closed
                pass
        elif kind == "dead":  # from the tensor-parallel monitor: request_id is its message
            raise EngineDeadError(request_id)
        return []

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[_Sink, RequestOutput]]:
        """Pair each output with the submission it belongs to now; a final output ends it."""
        routed = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            routed.append((sink, output))
        return routed

    def _deliver(self, routed: list[tuple[_Sink, RequestOutput]]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per output: each call
        # takes the loop's lock and writes its wake-up pipe, a cost the event loop thread
        # would otherwise pay once per running request every step.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, RequestOutput]]] = {}
        for sink, output in routed:
            batches.setdefault(sink.loop, []).append((sink, output))
        for loop, batch in batches.items():
            if self._send_all(loop, [(sink.stream, output) for sink, output in batch]):
                continue
            for sink, output in batch:  # the consumer's loop is gone: nobody will read these requests
                if not output.finished and self._sinks.get(sink.request_id) is sink:
                    del self._sinks[sink.request_id]
                    self.core.abort_request(sink.request_id)

    def _flow(self, routed: list[tuple[_Sink, RequestOutput]]) -> list[tuple[_Sink, RequestOutput]]:
        """What to send now: held-back outputs whose reader caught up, then this step's, each
        only while its stream has room (a final output always goes). A stream full for
        stalled_stream_timeout is aborted: its blocks go back to the pool."""
        limit, now = self.config.max_pending_outputs, time.monotonic()
        for sink, output in routed:
            self._hold(sink, output, now)
        send = []
        for sink in list(self._held):
            assert sink.held is not None and sink.stalled_since is not None  # what _hold set
            if sink.held.finished or sink.num_sent - sink.num_read < limit:
                pass  # sent below
            elif now - sink.stalled_since < self.config.stalled_stream_timeout:
                continue
            elif self._sinks.get(sink.request_id) is sink and (aborted := self.core.abort_request(sink.request_id)):
                logger.warning(
                    "request %s: its reader left %d outputs unread for %g s; aborted",
                    sink.request_id,
                    limit,
                    self.config.stalled_stream_timeout,
                )
                self._num_stalled_aborts += 1
                del self._sinks[sink.request_id]
                self._hold(sink, aborted, now)
            else:
                continue
            send.append((sink, sink.held))
            sink.num_sent += 1
            sink.held = sink.stalled_since = None
            del self._held[sink]
        return send

    def _hold(self, sink: _Sink, output: RequestOutput, now: float) -> None:
        if sink.held is None:
            sink.held, sink.stalled_since = output, now
            self._held[sink] = None
        else:
            sink.held = _merge(sink.held, output)

    @staticmethod
    def _send(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item: object) -> bool:
        return AsyncEngine._send_all(loop, [(stream, item)])

    @staticmethod
    def _send_all(loop: asyncio.AbstractEventLoop, batch: list[tuple[asyncio.Queue, object]]) -> bool:
        try:
            loop.call_soon_threadsafe(_put_all, batch)
            return True
        except RuntimeError:  # the loop is closed
            return False


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (text and tokens are increments)."""
    logprobs = (
        None if first.logprobs is None and then.logprobs is None else (first.logprobs or []) + (then.logprobs or [])
    )
    return replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
    )


def _error_output(request_id: str, error: str) -> RequestOutput:
    """A final output for a stream the engine can no longer serve (its core may be broken)."""
    return RequestOutput(
        request_id=request_id,
        text="",
        token_ids=[],
        logprobs=None,
        finished=True,
        finish_reason="error",
        num_prompt_tokens=0,
        num_output_tokens=0,
        num_cached_tokens=0,
        error=error,
    )


def _settle(future: asyncio.Future, method: Callable[[Any], object], value: object) -> None:
    """Runs on the event loop: complete a _call's future unless its caller already left."""
    if not future.done():
        method(value)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    """Runs on the event loop: hand each item to its stream."""
    for stream, item in batch:
        stream.put_nowait(item)
