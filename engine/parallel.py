"""Tensor-parallel ranks of one engine: rank 0 schedules, samples and sends each step; the
other ranks run the same forward pass on their part of every layer.

    rank 0 (the engine's process)              ranks 1..N-1 (workers)
    scheduler -> StepInputs --broadcast------> StepInputs
    model(StepInputs)  <-- all-reduces -->     model(StepInputs)      models/layers/parallel.py
    logits (gathered) -> sampler               (their vocab slice, sent to rank 0)

Two torch.distributed groups over the same ranks (gloo on CPU; NCCL would carry the model's
collectives on CUDA): `model`, whose collectives run inside a step and time out after
`collective_timeout` (a rank that stopped answering), and `control`, where workers wait for
the next step as long as the server idles. Single node: rank 0 spawns the workers. Several
nodes: each node's process starts its own ranks (`--nnodes --node-rank --master-addr
--master-port`, or torchrun's environment, one process per rank).

LoRA adapters loaded or unloaded while serving reach the workers the same way, between two steps:
rank 0 sends a LoRACommand after checking the adapter itself; each worker reads it from the same
path and attaches its part, and answers (gathered on the control group). A worker that cannot is
an adapter refused, dropped again by the ranks that took it, not an engine lost.

Failure: a step whose collectives fail (a rank died: its sockets close) raises
EngineDeadError, which ends the engine (streams get an error, /health turns 503) rather
than one batch: the ranks can no longer agree. A monitor thread reports a worker that exits
while the engine idles. A worker exits when rank 0's process does (parent watchdog), and on
the stop message that `shutdown` sends before it joins them.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from engine.step import EngineDeadError, StepInputs
from models.layers.parallel import DistCommunicator, ShmCommunicator, TensorParallel

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from models.loader import LoadedModel

logger = logging.getLogger(__name__)

# Workers wait for the next step on the control group for as long as the server idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# float32 numbers per rank and slot of the shared-memory collectives (4 MiB; 2 slots a rank).
SHM_CAPACITY = 1 << 20


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1  # several: each node runs `python -m server ... --node-rank R` (or torchrun)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None (single node): a free port
    init_timeout: float = 300.0  # seconds for every rank to join (and load its part of the model)
    # The model's collectives: "shm" (CPU ranks of one node; models/layers/parallel.py),
    # "dist" (torch.distributed: gloo, NCCL), "auto": shm where it can, else dist.
    collectives: str = "auto"
    spawn_local_ranks: bool = True  # False: torchrun started every rank
    collective_timeout: float = 30.0  # seconds a step's collective waits for a silent rank

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
        if self.nnodes < 1 or n % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size {n}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-addr and --master-port (rank 0's node)")
        if not (self.init_timeout > 0 and self.collective_timeout > 0):
            raise ValueError("init_timeout and collective_timeout must be positive")
        if self.collectives not in ("auto", "shm", "dist"):
            raise ValueError(f"collectives must be auto, shm or dist, got {self.collectives!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @classmethod
    def from_torchrun(cls, tensor_parallel_size: int, **kwargs: Any) -> tuple[ParallelConfig, int] | None:
        """(config, this process's rank) when torchrun started it (RANK, WORLD_SIZE, MASTER_*), else None."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        if world != tensor_parallel_size:
            raise ValueError(f"torchrun started {world} ranks; --tensor-parallel-size is {tensor_parallel_size}")
        config = cls(
            tensor_parallel_size,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            spawn_local_ranks=False,
            **kwargs,
        )
        return config, int(env["RANK"])


def threads_per_rank(ranks_on_this_node: int) -> int:
    """CPU threads for each rank, so that the node's ranks share its cores rather than oversubscribe."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // ranks_on_this_node)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LoRACommand:
    """Rank 0 to the workers, between steps: attach the adapter at `path` in `slot` ("load"), or
    drop what `slot` holds ("remove")."""

    op: str  # "load" | "remove"
    name: str
    slot: int
    path: str = ""
    max_rank: int = 0


def run_lora_command(model: Any, command: LoRACommand, dtype: torch.dtype) -> str | None:
    """A worker: carry `command` out on its part of the model; None, or why it could not."""
    from models.layers.lora import prepare_lora_adapter, read_peft_adapter, remove_lora_adapter

    try:
        if command.op == "load":
            adapter = read_peft_adapter(command.name, command.path, command.max_rank)
            prepare_lora_adapter(model, adapter, dtype).install(command.slot)
        else:
            remove_lora_adapter(model, command.slot)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it as the adapter's refusal
        return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return None


@dataclass
class WorkerSpec:
    """What a worker needs to load its part of the model and run steps (picklable)."""

    load_kwargs: dict[str, Any]  # models.loader.load_model's
    engine_config: EngineConfig
    parallel: ParallelConfig
    num_threads: int
    parent_pid: int = field(default_factory=os.getpid)


class RankGroup:
    """This process's place among the ranks: its TensorParallel (for building the model) and
    the control channel. Rank 0 also holds the workers it started."""

    def __init__(self, rank: int, config: ParallelConfig, device: str = "cpu"):
        """`device`: the model's; CUDA ranks run the model's collectives on NCCL."""
        self.rank, self.config = rank, config
        timeout = datetime.timedelta(seconds=config.init_timeout)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{config.master_addr}:{config.master_port}",
            rank=rank,
            world_size=config.tensor_parallel_size,
            timeout=timeout,
        )
        ranks = list(range(config.tensor_parallel_size))
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        self.model_group = dist.new_group(
            ranks, timeout=datetime.timedelta(seconds=config.collective_timeout), backend=backend
        )
        self.control_group = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
        self.tp = TensorParallel(rank, config.tensor_parallel_size, self._communicator(backend))
        self.processes: Sequence[multiprocessing.process.BaseProcess] = []
        self._listeners: list[Callable[[str], object]] = []
        self._stopping = False
        self._closed = False

    def _communicator(self, backend: str) -> DistCommunicator | ShmCommunicator:
        config = self.config
        shm = backend == "gloo" and config.nnodes == 1 and ShmCommunicator.supported()
        if config.collectives == "dist" or (config.collectives == "auto" and not shm):
            return DistCommunicator(self.model_group)
        if not shm:
            raise ValueError("shared-memory collectives need CPU ranks on one x86 Linux machine")
        # Rank 0 creates the file; once every rank has mapped it, it is unlinked: nothing is
        # left in /dev/shm however the ranks end.
        size, timeout = config.tensor_parallel_size, config.collective_timeout
        comm: ShmCommunicator | None = None
        box = [""]  # the file's name: rank 0's, broadcast
        if self.rank == 0:  # made, at its full size, before any other rank hears its name
            box[0] = f"/dev/shm/pagedserve-tp-{os.getpid()}-{os.urandom(4).hex()}"
            comm = ShmCommunicator(0, size, box[0], SHM_CAPACITY, create=True, timeout=timeout)
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        if comm is None:
            comm = ShmCommunicator(self.rank, size, box[0], SHM_CAPACITY, create=False, timeout=timeout)
        dist.barrier(group=self.control_group)
        if self.rank == 0:
            os.unlink(box[0])
        return comm

    # ------------------------------------------------------------ rank 0
    def send(self, inputs: StepInputs | LoRACommand | None) -> None:
        """Rank 0: the next step's inputs (or a LoRACommand) to every rank (None: stop)."""
        try:
            dist.broadcast_object_list([inputs], src=0, group=self.control_group)
        except Exception as e:  # a worker is gone
            raise EngineDeadError(f"tensor-parallel step could not be sent: {e}") from e

    def command(self, command: LoRACommand) -> list[str | None]:
        """Rank 0: `command` to every worker, then their answers, rank 1 first (None: done)."""
        self.send(command)
        answers: list[str | None] = [None] * self.config.tensor_parallel_size
        try:
            dist.gather_object(None, answers, dst=0, group=self.control_group)
        except Exception as e:  # a worker is gone
            raise EngineDeadError(f"tensor-parallel workers did not answer: {e}") from e
        return answers[1:]

    def load_lora(self, name: str, path: str, slot: int, max_rank: int) -> None:
        """Rank 0: every worker attaches its part of the adapter at `path` in `slot`, or none does
        (ValueError naming the first rank that could not, and why)."""
        answers = self.command(LoRACommand("load", name, slot, path, max_rank))
        failed = [(rank, why) for rank, why in enumerate(answers, start=1) if why is not None]
        if failed:
            self.remove_lora(name, slot)  # the ranks that took it drop it
            rank, why = failed[0]
            raise ValueError(f"tensor-parallel rank {rank} could not load LoRA adapter {name!r}: {why}")

    def remove_lora(self, name: str, slot: int) -> None:
        """Rank 0: every worker drops the adapter in `slot`."""
        self.command(LoRACommand("remove", name, slot))

    def on_failure(self, listener: Callable[[str], object]) -> None:
        """Call `listener(message)` (from a monitor thread) when a worker this rank started exits unasked."""
        self._listeners.append(listener)

    def watch(self) -> None:
        if self.processes:
            threading.Thread(target=self._monitor, name="pagedserve-tp-monitor", daemon=True).start()

    def _monitor(self) -> None:
        sentinels: dict[object, multiprocessing.process.BaseProcess] = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self._stopping:
            return
        process = sentinels[ready[0]]
        process.join(1)
        message = f"tensor-parallel worker {process.name} exited (code {process.exitcode})"
        logger.error("%s: the engine cannot run steps without it", message)
        if isinstance(self.tp.comm, ShmCommunicator):  # a step waiting on it fails now
            self.tp.comm.abort(message)
        for listener in self._listeners:
            listener(message)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Rank 0: stop every worker (the stop message, then a kill for any left) and leave the group."""
        if self._closed:
            return
        self._closed = self._stopping = True
        if self.rank == 0 and all(p.is_alive() for p in self.processes):
            try:
                self.send(None)
            except EngineDeadError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; killing it", p.name)
                p.kill()
                p.join(5)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group: nothing left to tear down cleanly
            logger.debug("destroy_process_group failed", exc_info=True)

    # ------------------------------------------------------------ workers
    def receive(self) -> StepInputs | LoRACommand | None:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def reply(self, answer: str | None) -> None:
        """A worker's answer to rank 0's last command (RankGroup.command)."""
        dist.gather_object(answer, None, dst=0, group=self.control_group)


def start_ranks(spec: WorkerSpec, rank: int = 0) -> RankGroup:
    """Start this node's other ranks (spawned processes running `worker_main`) and join the
    group as `rank` (rank 0: the engine; single node: master_port chosen here)."""
    config = spec.parallel
    if config.master_port is None:
        config = spec.parallel = ParallelConfig(**{**config.__dict__, "master_port": free_port()})
    context = multiprocessing.get_context("spawn")
    first = config.node_rank * config.ranks_per_node
    processes = []
    for worker_rank in range(first, first + config.ranks_per_node):
        if worker_rank == rank or not config.spawn_local_ranks:
            continue
        p = context.Process(target=worker_main, args=(worker_rank, spec), name=f"rank-{worker_rank}", daemon=False)
        p.start()
        processes.append(p)
    try:
        group = _join_watching(processes, lambda: RankGroup(rank, config, spec.load_kwargs.get("device", "cpu")))
    except BaseException:
        for p in processes:
            p.kill()
            p.join(5)
        raise
    group.processes = processes
    group.watch()
    return group


def _join_watching(processes: list, join: Callable[[], RankGroup]) -> RankGroup:
    """join() (the rendezvous: it waits for every rank up to init_timeout) in a thread, while
    this one watches the ranks it started: one that exits first fails the start at once."""
    result: dict = {}

    def run() -> None:
        try:
            result["group"] = join()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="pagedserve-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        dead = [p for p in processes if p.exitcode is not None]
        if dead and thread.is_alive():
            raise RuntimeError(
                f"tensor-parallel rank {dead[0].name} exited during start-up (code {dead[0].exitcode}); its "
                'log says why. A script that starts ranks needs the `if __name__ == "__main__":` guard '
                "(they are spawned processes, which import it again)"
            )
    if "error" in result:
        raise result["error"]
    return result["group"]


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """A worker rank: load this rank's part of the model, then run every step rank 0 sends."""
    _exit_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    try:
        group = RankGroup(rank, spec.parallel, spec.load_kwargs.get("device", "cpu"))
        serve_steps(group, spec)
    except Exception as e:  # noqa: BLE001 - rank 0 fails on the same model and says why, once
        logger.error("rank %d: %s: %s", rank, type(e).__name__, e)
        os._exit(1)


def serve_steps(group: RankGroup, spec: WorkerSpec) -> None:
    """The worker loop (a spawned rank, or the process of a node other than rank 0's)."""
    from engine.heap import freeze_heap
    from engine.model_runner import ModelRunner
    from models.loader import load_model

    load_kwargs = dict(spec.load_kwargs)
    if torch.device(load_kwargs.get("device", "cpu")).type == "cuda":  # one GPU per rank of the node
        load_kwargs["device"] = f"cuda:{group.rank % group.config.ranks_per_node}"
        torch.cuda.set_device(load_kwargs["device"])
    loaded = load_model(**load_kwargs, tensor_parallel=group.tp)
    runner = ModelRunner(loaded, spec.engine_config)
    freeze_heap()  # this process holds its model for its whole life (engine/heap.py)
    try:
        while (inputs := group.receive()) is not None:
            if isinstance(inputs, LoRACommand):
                group.reply(run_lora_command(runner.model, inputs, runner.lora_dtype))
            else:
                runner.forward_logits(inputs)
    except Exception as e:  # rank 0 is gone or failed: nothing to serve
        logger.error("rank %d: stopping: %s: %s", group.rank, type(e).__name__, e)
        os._exit(1)
    group.shutdown()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the process that started it: a thread polls for the parent
    (not PR_SET_PDEATHSIG, which fires when the parent's *thread* that spawned it ends)."""
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


def load_parallel(
    load_kwargs: dict[str, Any], engine_config: EngineConfig, parallel: ParallelConfig, rank: int = 0
) -> tuple[LoadedModel, EngineConfig, RankGroup]:
    """Rank 0 of a tensor-parallel engine: start this node's other ranks, then load rank 0's
    part of the model. Returns (LoadedModel, engine config with this rank's threads, RankGroup);
    the caller hands the group to EngineCore / AsyncEngine, whose close / shutdown stops it."""
    from dataclasses import replace

    from models.loader import load_model

    threads = engine_config.num_threads or threads_per_rank(parallel.ranks_per_node)
    engine_config = replace(engine_config, num_threads=threads)
    spec = WorkerSpec(load_kwargs=load_kwargs, engine_config=engine_config, parallel=parallel, num_threads=threads)
    torch.set_num_threads(threads)
    group = start_ranks(spec, rank)
    try:
        loaded = load_model(**load_kwargs, tensor_parallel=group.tp)
    except BaseException:
        group.shutdown()
        raise
    return loaded, engine_config, group


def run_node(load_kwargs: dict[str, Any], engine_config: EngineConfig, parallel: ParallelConfig, rank: int) -> None:
    """A node other than rank 0's (or a torchrun rank other than 0): start this node's other
    ranks, then serve steps as `rank` until rank 0 stops them."""
    from dataclasses import replace

    threads = engine_config.num_threads or threads_per_rank(parallel.ranks_per_node)
    spec = WorkerSpec(
        load_kwargs=load_kwargs,
        engine_config=replace(engine_config, num_threads=threads),
        parallel=parallel,
        num_threads=threads,
    )
    torch.set_num_threads(threads)
    group = start_ranks(spec, rank)
    try:
        serve_steps(group, spec)
    finally:
        group.shutdown()
