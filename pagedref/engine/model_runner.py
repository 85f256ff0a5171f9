"""The model runner: owns the KV cache tensors and turns one scheduled step into one forward pass.

One idea: everything an attention layer needs to find each token's K/V is built once per step, in
`prepare()`, as one `AttentionMetadata` shared by every layer: the new tokens of all scheduled
sequences concatenated ([T] input ids and positions), their slot mapping, and per sequence its query
start offset, context length and block table. Then, in this order: swap-outs (device → CPU),
copy-on-write copies, swap-ins (CPU → device), the forward pass, and logits only for the rows that
sample (the last token of a sequence whose prompt is now fully computed, or its decode token).
On CUDA (unless `enforce_eager`), a decode-only step replays one captured CUDA graph instead of
issuing the forward's launches one by one, and any other step of up to `max_capture_size` tokens
replays the graphs of the pieces between its attention calls (`pagedref.engine.cuda_graph`).

KV pool sizing (`num_kv_blocks`):
- explicit `num_kv_blocks`: exactly that many blocks;
- CUDA (vLLM's method): load the weights, run one profiling forward pass of max_num_batched_tokens
  tokens, read the peak memory torch allocated, and give the KV cache what is left of
  gpu_memory_utilization × total memory after that peak and after memory others hold on the device;
- CPU: a byte budget (`cpu_kv_cache_bytes`), capped at what max_num_seqs sequences of max_model_len
  could ever use.
A pool that cannot hold one sequence of max_model_len is refused.

How the CPU path is batch invariant (the numerics contract): the model applies every per-token
operation to each token row on its own (`pagedref.models.llama.map_rows`), the reference backend
attends each query row with the numpy oracle over exactly the keys it may see, `compute_logits` runs
per row, and the sampler draws each row with its sequence's own generator. So a request's logits
depend only on its own tokens: not on the batch, the chunking, the blocks' placement, the prefix
cache or preemption. Cached and recomputed K/V are bit-identical for the same reason.

Invariant: the K/V of token p of sequence s are written to slot block_ids[p // block_size] *
block_size + p % block_size of its block table before any query row reads them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from pagedref.backends.metadata import AttentionMetadata
from pagedref.engine.cuda_graph import CUDAGraphConfig, DecodeGraphs, PiecewiseGraphs, num_scratch_blocks
from pagedref.engine.sampling import SampleResult, Sampler
from pagedref.engine.scheduler import SchedulerOutput
from pagedref.engine.sequence import Sequence
from pagedref.memory.block_table import cdiv

MiB = 1 << 20
GiB = 1 << 30


def kv_block_bytes(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block in every layer: K and V, [block_size, num_kv_heads, head_dim] each
    (on one rank of tp_size: its num_kv_heads / tp_size heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * (config.num_key_value_heads // tp_size) * config.head_dim * elem


def allocate_kv_caches(config, num_blocks: int, block_size: int, dtype: torch.dtype, device, pin: bool = False,
                       tp_size: int = 1):
    """One (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads / tp_size, head_dim]. On the
    CPU they start as NaN: a slot read before it was written would poison the logits, so tests would see it."""
    shape = (num_blocks, block_size, config.num_key_value_heads // tp_size, config.head_dim)
    caches = []
    for _ in range(config.num_hidden_layers):
        if torch.device(device).type == "cpu":
            k, v = (torch.full(shape, float("nan"), dtype=dtype, pin_memory=pin) for _ in range(2))
        else:
            k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
        caches.append((k, v))
    return caches


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the hidden states each sampling sequence reads
    sample_seqs: list[Sequence]


class ModelRunner:
    """One rank's KV pools and steps. Under tensor parallelism (tp_size > 1) the pools hold this rank's
    KV heads only, and `pagedref.distributed.worker` drives the other ranks through `run_model`."""

    def __init__(self, model, backend, block_manager, num_blocks: int, block_size: int, device, dtype: torch.dtype,
                 num_cpu_blocks: int = 0, tp_size: int = 1, graphs: CUDAGraphConfig | None = None) -> None:
        """graphs: capture CUDA graphs (`pagedref.engine.cuda_graph`) as configured; None: every step eager."""
        self.model = model
        self.backend = backend
        self.block_manager = block_manager
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype  # of the weights' activations and the KV pool
        # CUDA graphs pad their batches; the padding rows' K/V go to scratch blocks past the managed ones.
        scratch = num_scratch_blocks(graphs.max_num_seqs, block_size) if graphs is not None else 0
        self.kv_caches = allocate_kv_caches(model.config, num_blocks + scratch, block_size, dtype, device, tp_size=tp_size)
        pin = self.device.type == "cuda"
        self.cpu_caches = allocate_kv_caches(model.config, num_cpu_blocks, block_size, dtype, "cpu", pin, tp_size) \
            if num_cpu_blocks else []
        self.sampler = Sampler()
        self.graphs = self.piecewise = None
        if graphs is not None:
            self.graphs = DecodeGraphs(model, backend, self.kv_caches, block_size, graphs.max_num_seqs, graphs.max_model_len,
                                       graphs.max_seq_len_to_capture, first_scratch_block=num_blocks)
            self.piecewise = PiecewiseGraphs(model, backend, self.kv_caches, graphs.max_capture_size)

    # --- one step -------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInput:
        """The step's inputs and its AttentionMetadata, built once for every layer.

        Built in plain Python lists, then one tensor per field: with hundreds of sequences a step,
        small per-sequence numpy/torch ops (each ~1-3 us of call overhead) cost more than the work."""
        bs = self.block_size
        ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        sample_rows, sample_seqs = [], []
        num_rows = 0
        for seq, n in sched.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            blocks = self.block_manager.block_ids(seq)
            if n == 1:  # a decode, most rows of most steps: one token, one slot, no slices or ranges
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(slot_range(blocks, start, end, bs))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(blocks)
            num_rows += n
            if end == seq.num_tokens:  # everything known is computed: this row samples
                sample_rows.append(num_rows - 1)
                sample_seqs.append(seq)
        # [num_seqs, max_blocks] int32, rows padded with -1: every table's ids in one go, in row order
        # (one boolean-mask assignment instead of a numpy call per sequence)
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        block_tables = np.full((len(tables), int(lens.max())), -1, dtype=np.int32)
        block_tables[np.arange(block_tables.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
        )
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta, sample_rows=sample_rows, sample_seqs=sample_seqs,
        )

    def copy_blocks(self, sched: SchedulerOutput) -> None:
        """Swap out, copy-on-write, swap in: in this order, all before the forward writes anything.
        (A block freed by a swap-out may be this step's copy destination; a copy-on-write source may
        have been freed and handed to a swap-in.)"""
        if sched.blocks_to_swap_out:
            src, dst = self._index(sched.blocks_to_swap_out)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                ck[dst.cpu()] = k[src].cpu()
                cv[dst.cpu()] = v[src].cpu()
        if sched.blocks_to_copy:
            pairs = sched.blocks_to_copy
            # A source freed later in the step (its other holder preempted) can come back as a later
            # copy's destination: then copy in list order, since a GPU kernel copies all pairs at once.
            conflict = {d for _, d in pairs} & {s for s, _ in pairs}
            for batch in ([[p] for p in pairs] if conflict else [pairs]):
                src, dst = self._index(batch)
                self.backend.copy_blocks(self.kv_caches, src, dst)
        if sched.blocks_to_swap_in:
            src, dst = self._index(sched.blocks_to_swap_in)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                k[dst] = ck[src.cpu()].to(self.device, non_blocking=True)
                v[dst] = cv[src.cpu()].to(self.device, non_blocking=True)

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = zip(*pairs)
        return (torch.tensor(src, dtype=torch.int64, device=self.device),
                torch.tensor(dst, dtype=torch.int64, device=self.device))

    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, StepInput]:
        """Run the step. Returns the logits [num sampling sequences, vocab] (float32) and the step input."""
        step = self.prepare(sched)
        hidden = self.run_model(step.input_ids, step.positions, step.meta, sched)  # [T, hidden]
        rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows]) if step.sample_rows else hidden.new_empty((0, 0))
        return logits, step

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  blocks: SchedulerOutput) -> torch.Tensor:
        """The step's block operations, then the forward pass: what every tensor-parallel rank runs."""
        self.copy_blocks(blocks)
        if self.graphs is not None and self.graphs.can_replay(meta):
            return self.graphs.replay(input_ids, positions, meta)
        if self.piecewise is not None and self.piecewise.can_replay(meta):
            return self.piecewise.replay(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[SampleResult]:
        return self.sampler(logits, rows, seqs)

    def close(self) -> None:
        self.kv_caches, self.cpu_caches, self.graphs, self.piecewise = [], [], None, None


def slot_range(block_ids: list[int], start: int, end: int, block_size: int) -> Iterator[int]:
    """The slots of positions start..end-1 (block_ids[p // block_size] * block_size + p % block_size),
    one range per block touched: a chunk of 256 tokens is 16 ranges, not 256 divisions."""
    for b in range(start // block_size, cdiv(end, block_size)):
        base = block_ids[b] * block_size - b * block_size  # slot of position p in block b = base + p
        yield from range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))


# --- KV pool sizing ----------------------------------------------------------------------------------
def num_blocks_from_budget(kv_bytes: int, block_bytes: int) -> int:
    return max(0, int(kv_bytes) // block_bytes)


@torch.no_grad()
def profile_num_gpu_blocks(model, backend, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                           max_model_len: int, gpu_memory_utilization: float, device, dtype: torch.dtype) -> int:
    """vLLM's profiling: how many KV blocks fit in gpu_memory_utilization × the device's memory once the
    weights and the activations of the largest step (max_num_batched_tokens tokens) are accounted for."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # The largest step: max_num_batched_tokens prompt tokens in sequences of at most max_model_len,
    # in a throwaway pool just big enough for them.
    lens, left = [], max_num_batched_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    blocks_per = [cdiv(n, block_size) for n in lens]
    tp_size = model.tp.size  # a rank's share of the model and of its KV heads
    caches = allocate_kv_caches(model.config, sum(blocks_per), block_size, dtype, device, tp_size=tp_size)
    tables = torch.full((len(lens), max(blocks_per)), -1, dtype=torch.int32)
    first, slots = 0, []
    for i, (n, nb) in enumerate(zip(lens, blocks_per)):
        tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += nb
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(lens), max_context_len=max(lens), block_size=block_size,
    ).to(device)
    total_tokens = sum(lens)
    input_ids = torch.zeros(total_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    hidden = model(input_ids, positions, caches, meta, backend)
    model.compute_logits(hidden[: min(max_num_seqs, total_tokens)])  # the largest sampling batch
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    profile_cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
    del caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # CUDA context, CuPy's pool, other processes
    kv_bytes = total * gpu_memory_utilization - (peak - profile_cache_bytes) - others
    return num_blocks_from_budget(kv_bytes, kv_block_bytes(model.config, block_size, dtype, tp_size))
