"""Rank 0 drives, the other ranks follow: the tensor-parallel workers, their loop, and what rank 0 sends them.

One idea: the scheduler and the block manager exist once, on rank 0: it schedules and updates (the
step contract of `pagedref.engine.scheduler`); the other ranks only execute. Each step rank 0 builds the
step's inputs (token ids, positions, and the AttentionMetadata: one block table, valid on every
rank, since every rank's KV pool has the same blocks, each holding that rank's own KV heads) and its
block operations (swap-outs, copy-on-write copies, swap-ins), broadcasts them as one `StepMessage`,
and then every rank does the same to its own shard: the block operations on its own pools, then
the forward pass, whose all-reduces keep the ranks in step. Only rank 0 computes logits and samples.
Besides steps, rank 0 sends a few commands (`WorkerPool.run`): build the KV pool, profile memory.
This package knows no engine and no model: the spec names the model runner class a worker builds
its shard with (`pagedref.engine.model_runner.ModelRunner`: `load_shard`, then the runner itself;
its `DriverRunner` is rank 0's side), so the engine and the models depend on `pagedref.distributed`
and never the other way round.

Two ways to start the workers: `WorkerPool.spawn` (rank 0 starts ranks 1..N-1 itself with
torch.multiprocessing, one GPU each on this host), or torchrun (it starts every rank; rank 0 runs
the program, the others call `serve` and leave when rank 0 closes).

Invariant: no worker outlives the engine. `WorkerPool.close` ends them (a "close" message when they
are healthy; otherwise terminate, then kill) and reaps them. When anything fails during a step or a
command, rank 0 stops every worker, reaps it, and raises: `TPWorkerError` naming the worker and its
traceback (or its exit signal) when a worker failed, rank 0's own error otherwise. A worker whose
rank 0 dies exits too: its next receive fails as rank 0's sockets close.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedref.backends.metadata import AttentionMetadata
from pagedref.distributed.parallel import DEFAULT_TIMEOUT_S, TPGroup, destroy_tp_group, init_tp_group, tp_backend

JOIN_TIMEOUT_S = 10.0  # a worker told to close gets this long before it is terminated, then killed


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed (raised, or died); every worker has been stopped."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard. Picklable: rank 0 hands it to each spawned worker."""

    model: str  # the Hugging Face model directory
    device: str  # "cpu" or "cuda" (each rank then uses its own GPU)
    dtype: torch.dtype
    batch_invariant: bool
    timeout_s: float = DEFAULT_TIMEOUT_S
    runner_cls: type | None = None  # what a worker builds its shard with (pickled by name): the engine's ModelRunner


@dataclass
class StepMessage:
    """One step, as every rank runs it: the model's inputs and the block operations to make first (CPU tensors)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)


class Worker:
    """Rank r > 0: its shard of the model and of the KV cache; runs what rank 0 sends."""

    def __init__(self, spec: WorkerSpec, tp: TPGroup) -> None:
        self.spec, self.tp = spec, tp
        self.model, self.backend = spec.runner_cls.load_shard(spec.model, spec.device, spec.dtype, spec.batch_invariant, tp)
        self.runner = None

    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int) -> None:
        self.runner = self.spec.runner_cls(self.model, self.backend, num_blocks, block_size, self.spec.device,
                                           self.spec.dtype, num_cpu_blocks, tp_size=self.tp.size)

    def profile_num_blocks(self, profile, *args) -> None:
        """Profile this GPU like rank 0 does (the forward pass is collective), then agree on the minimum."""
        self.tp.all_min(profile(self.model, self.backend, *args))

    def execute_model(self, msg: StepMessage) -> None:
        dev = self.runner.device
        self.runner.run_model(msg.input_ids.to(dev), msg.positions.to(dev), msg.meta.to(dev), msg, msg.meta)


def serve(spec: WorkerSpec, tp: TPGroup) -> None:
    """The worker loop: run rank 0's commands until it sends None (close)."""
    worker = Worker(spec, tp)
    while (command := tp.broadcast()) is not None:
        method, args = command
        getattr(worker, method)(*args)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher such as torchrun started this process (RANK, WORLD_SIZE set)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def start_workers(spec: WorkerSpec, size: int) -> "WorkerPool":
    """Rank 0's pool of `size` ranks: spawned from here, or joined when torchrun started them all.

    Under torchrun, on every rank but 0 this call is the whole program's remainder: the rank serves
    rank 0 until it closes, then the process ends (SystemExit(0)); the code after it runs on rank 0 only.
    """
    if spec.device not in ("cpu", "cuda"):
        raise ValueError(f"with tensor_parallel_size > 1, device must be 'cpu' or 'cuda' (rank r takes GPU r), "
                         f"got {spec.device!r}")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group (another tensor-parallel LLM that "
                           "was not closed?): close it first")
    launched = launched_rank()
    if launched is None:
        if spec.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, torch sees {torch.cuda.device_count()}")
        return WorkerPool.spawn(spec, size)
    rank, world_size = launched
    if world_size != size:
        raise ValueError(f"the launcher started {world_size} processes (WORLD_SIZE) but tensor_parallel_size={size}")
    if rank == 0:
        return WorkerPool.from_torchrun(spec, size)
    tp = init_tp_group(rank, size, spec.device, "env://", timeout_s=spec.timeout_s)
    try:
        serve(spec, tp)
    finally:
        destroy_tp_group(tp)
    raise SystemExit(0)


def worker_main(rank: int, size: int, port: int, spec: WorkerSpec, errors) -> None:
    """A spawned worker process: join rank 0's store, serve, and report any failure through `errors`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    tp = None
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
        store.add("joined", 1)
        tp = init_tp_group(rank, size, spec.device, store=store, timeout_s=spec.timeout_s)
        serve(spec, tp)
    except BaseException:
        errors.send(traceback.format_exc())
        raise SystemExit(1)
    finally:
        errors.close()
        if tp is not None:
            destroy_tp_group(tp)


class WorkerPool:
    """Rank 0's handle on the other ranks: send them commands and steps, watch them, stop them."""

    def __init__(self, tp: TPGroup, procs: list = (), error_conns: list = ()) -> None:
        self.tp = tp
        self.procs = list(procs)  # ranks 1..N-1 when spawned here; empty under torchrun
        self.error_conns = list(error_conns)
        self.failed: str | None = None  # why the pool broke; it then accepts nothing but close()
        self.closing = False

    # --- starting -------------------------------------------------------------------------------
    @classmethod
    def spawn(cls, spec: WorkerSpec, size: int) -> "WorkerPool":
        """Start ranks 1..size-1 on this host and join them as rank 0."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=spec.timeout_s),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(rank, size, store.port, spec, send),
                               name=f"pagedref-tp-rank{rank}", daemon=True)
            proc.start()
            send.close()  # the child holds the sending end; EOF here once it is gone
            procs.append(proc)
            conns.append(recv)
        pool = cls(TPGroup(), procs, conns)
        try:
            pool._await_workers(store, size, spec.timeout_s)
            pool.tp = init_tp_group(0, size, spec.device, store=store, timeout_s=spec.timeout_s)
        except BaseException as e:
            pool._fail(e)
        if tp_backend(spec.device) == "nccl":
            threading.Thread(target=pool._watch, name="pagedref-tp-watch", daemon=True).start()
        return pool

    @classmethod
    def from_torchrun(cls, spec: WorkerSpec, size: int) -> "WorkerPool":
        """Rank 0 of a torchrun launch (torchrun started the workers; they are in `serve`)."""
        return cls(init_tp_group(0, size, spec.device, "env://", timeout_s=spec.timeout_s))

    def _await_workers(self, store, size: int, timeout_s: float) -> None:
        # Wait for every worker to reach the store, watching them, so a worker that dies while starting
        # fails the engine now instead of after the rendezvous timeout.
        deadline = time.monotonic() + timeout_s
        while store.add("joined", 0) < size - 1:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel worker rank {rank} exited while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tensor-parallel workers did not start within {timeout_s} s")
            time.sleep(0.02)

    # --- talking to the workers -----------------------------------------------------------------
    def run(self, method: str, *args: Any) -> None:
        """Every worker calls Worker.<method>(*args); rank 0 does its own part itself, right after."""
        with self.guard():
            self.tp.broadcast((method, args))

    def send_step(self, msg: StepMessage) -> None:
        self.run("execute_model", msg)

    def profile_num_blocks(self, profile, model, backend, *args) -> int:
        """KV blocks that fit on every GPU: each rank profiles its own with `profile` (the forward pass is
        collective), the minimum wins."""
        self.run("profile_num_blocks", profile, *args)
        with self.guard():
            return self.tp.all_min(profile(model, backend, *args))

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around everything rank 0 does in step with the workers: on any error, stop them all and raise."""
        if self.failed:
            raise TPWorkerError(f"the tensor-parallel workers were stopped after an earlier failure: {self.failed}")
        try:
            yield
        except BaseException as e:
            if self.failed:  # already handled by an inner guard: the workers are stopped
                raise
            self._fail(e)

    def _fail(self, error: BaseException):
        """Stop and reap every worker, then raise: the worker's own error if one failed, else `error`."""
        worker_error = self._worker_errors()
        self.failed = worker_error or f"rank 0 failed: {error!r}"
        self._stop()
        if worker_error:
            raise TPWorkerError(worker_error) from error
        raise error

    def _worker_errors(self, grace_s: float = 1.0) -> str | None:
        """What went wrong in the workers, if anything: a traceback they sent, or how they exited."""
        deadline = time.monotonic() + grace_s  # a worker's error may still be on its way out
        reports = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.error_conns), start=1):
            proc.join(max(0.0, deadline - time.monotonic()))
            message = None
            if conn.poll():
                try:
                    message = conn.recv()
                except EOFError:
                    pass
            if message is None and proc.exitcode not in (None, 0):
                message = f"exited with {_exit_reason(proc.exitcode)}"
                if proc.exitcode > 0:  # an error before worker_main ran, which reports every error it sees
                    message += (" before it could start (its stderr says why; a script that starts "
                                "tensor-parallel workers must keep its main code under `if __name__ == '__main__':`, "
                                "since each spawned worker imports the main module)")
            if message:
                reports.append(f"tensor-parallel worker rank {rank} failed: {message}")
        return "\n".join(reports) or None

    def _watch(self) -> None:
        # NCCL does not notice a dead peer: an all-reduce waits for it until the timeout. So on CUDA,
        # watch the workers and abort the process group when one dies, which wakes rank 0 with an error.
        # (gloo needs no watch: the dead worker's sockets close, and rank 0's next collective fails.)
        wait([p.sentinel for p in self.procs])
        if not self.closing and self.failed is None:
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()

    # --- stopping -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell healthy workers to exit, stop the others; reap them all and leave the process group."""
        if self.closing:
            return
        self.closing = True
        if self.failed is None:
            try:
                self.tp.broadcast(None)
            except Exception:  # a worker is already gone: it gets stopped below
                pass
            for proc in self.procs:
                proc.join(JOIN_TIMEOUT_S)
        self._stop()

    def _stop(self) -> None:
        self.closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.error_conns:
            conn.close()
        destroy_tp_group(self.tp)
        self.tp = TPGroup()


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
