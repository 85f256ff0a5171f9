"""The tensor-parallel group: which rank this process is, how many there are, and the two collectives TP needs.

One idea: tensor parallelism (Megatron-LM, as vLLM uses it) needs exactly two kinds of communication.
Activations: an all-reduce (sum) of each row-parallel layer's partial outputs, on the device's own
backend (NCCL between GPUs, gloo between CPU processes). Control: rank 0, which alone runs the
scheduler and the block manager, broadcasts each step's metadata (pickled Python objects, always over
a gloo group on the CPU, so a step's bookkeeping never occupies the GPUs' links).

Invariant: `TPGroup()` is the single-process group (rank 0 of 1): its all-reduce returns its input
untouched, so a model built with it computes exactly what it computed before TP existed.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0  # an all-reduce that waits longer than this on a peer raises instead of hanging
# Workers wait for rank 0's next step for as long as the engine lives (a server may idle for hours); a
# dead rank 0 still wakes them at once: its sockets close.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # all-reduce of activations: NCCL on CUDA, gloo on the CPU
    cpu_group: Any = None  # step metadata and commands from rank 0: gloo, with no timeout

    @property
    def is_driver(self) -> bool:
        """Rank 0 drives: it schedules, samples and sends every step to the others."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the same bits."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (pickled: keep it to CPU tensors and plain Python)."""
        if self.size == 1:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each GPU has room for)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def check_tensor_parallel_size(config, tp_size: int) -> None:
    """Refuse a tensor_parallel_size that cannot split the model into equal whole shards, naming the count.

    Every rank holds num_attention_heads / tp query heads, num_key_value_heads / tp KV heads (and their
    share of the KV cache) and intermediate_size / tp MLP columns. vLLM would replicate KV heads when
    there are fewer than ranks; pagedref refuses instead (one rule, no duplicated cache).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise TypeError(f"tensor_parallel_size must be an int, got {tp_size!r}")
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp_size:
            raise ValueError(
                f"{name}={value} is not divisible by tensor_parallel_size={tp_size}: every rank must hold "
                f"an equal share of the {name.removeprefix('num_').replace('_', ' ')}"
            )


def tp_backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tp_group(rank: int, size: int, device: str, init_method: str | None = "env://", store: Any = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the process group of `size` ranks as `rank` (rendezvous at `init_method`, or through an
    existing `store`) and return this process's TPGroup.

    On CUDA each rank owns one GPU: cuda:LOCAL_RANK under torchrun, cuda:rank when the engine spawned
    the workers itself (one host). NVLink SHARP (NVLS) stays off unless the environment says otherwise.
    """
    backend = tp_backend(device)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        init_method = None
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)


def destroy_tp_group(tp: TPGroup) -> None:
    """Leave the process group (every group of this process), so a later one can be made."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
