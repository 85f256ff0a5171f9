"""The model runner: owns the KV cache tensors and turns one scheduled step into sampled tokens.

One idea: `execute(scheduler_output)` is one call, a pure function of its input (and of the KV cache
it owns): everything an attention layer needs to find each token's K/V is built once per step, in
`prepare()`, as one `AttentionMetadata` shared by every layer, from what the scheduler handed over
(each sequence's token slice, block table and slot mapping, computed once by the block manager): the
new tokens of all scheduled sequences concatenated ([T] input ids and positions), their slot mapping,
and per sequence its query start offset, context length and block table. Then, in this order:
swap-outs (device → CPU), copy-on-write copies, swap-ins (CPU → device), the forward pass, logits
only for the rows that sample (the last token of a sequence whose known tokens are now all computed),
and the sampler. It never calls back into the scheduler or the block manager.
On CUDA (unless `enforce_eager`), a decode-only step replays one captured CUDA graph instead of
issuing the forward's launches one by one, and any other step of up to `max_capture_size` tokens
replays the graphs of the pieces between its attention calls (`pagedref.engine.cuda_graph`).

Async scheduling: nothing on the way from the step's host lists to the sampled tokens waits for the
GPU. The inputs go up from pinned memory without a sync, the cuda backend's value checks run on the
host copy of the metadata before it goes up, and the sampled tokens stay on the device: a decode whose
input was sampled by the step still in flight reads it there (`prev`), and the host copy of the
tokens arrives in the background (`ModelRunnerOutput.token_ids` waits for it). So the host can build
step N+1 while the GPU runs step N.

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

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedref.backends.metadata import AttentionMetadata
from pagedref.engine.cuda_graph import CUDAGraphConfig, DecodeGraphs, PiecewiseGraphs, num_scratch_blocks
from pagedref.engine.sampling import Sampler, row_logprobs
from pagedref.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedref.engine.spec_decode import RejectionSampler, SpecTokens
from pagedref.engine.sequence import Logprob, Sequence
from pagedref.memory.block_table import cdiv


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


def argmax_only(seqs: list[Sequence]) -> bool:
    """Whether the step reads nothing of its logits but each row's argmax: every sampling sequence greedy,
    with no logprobs asked and no logits recorded (then they may stay in the model's dtype)."""
    return all([s.params.is_greedy and s.params.logprobs is None and s.logits is None for s in seqs])


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # on the device
    sample_rows: list[int]  # row of the hidden states each sampling entry reads, in batch order
    logit_rows: list[int]  # per sampling sequence, its row of the step's logits (n samples share one)
    sample_seqs: list[Sequence]
    host_meta: AttentionMetadata | None = None  # the same on the CPU, for host-side checks (CUDA)
    prompt_rows: list[int] | None = None  # rows whose logits give prompt logprobs (sequences that ask for them)
    prompt_spans: list[tuple[Sequence, int, int]] | None = None  # (seq, first prompt position predicted, count)
    spec_rows: list[int] | None = None  # speculative decoding: every row of each speculating sequence (k + 1 each)
    spec_entries: list[ScheduledSequence] | None = None  # ... those sequences, in batch order


class ModelRunnerOutput:
    """One step's sampled tokens, one per sampling sequence in the order of `SchedulerOutput.sampling_seqs()`.
    The tokens are on the device at once (`token_tensor`, what the next step reads); `token_ids`,
    `logprobs` and `logits` are their host views, computed when first read (they wait for the device)."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor | None, rows: list[int], seqs: list[Sequence],
                 prompt_logits: torch.Tensor | None = None, prompt_spans: list[tuple[Sequence, int, int]] | None = None,
                 spec_tokens: torch.Tensor | None = None, spec_entries: list[ScheduledSequence] | None = None,
                 spec_offset: int = 0) -> None:
        """spec_tokens [sum(k + 1)]: the speculating entries' row tokens; their logits are rows spec_offset..
        of `logits` (after the sampling rows)."""
        self.token_tensor = tokens  # [S] int64, on the device
        self._rows, self._seqs = rows, seqs
        self._prompt_logits, self._prompt_spans = prompt_logits, prompt_spans  # [P, vocab]: rows in span order
        self._spec_tokens, self._spec_entries, self._spec_offset = spec_tokens, spec_entries or [], spec_offset
        # the step's logits [R, vocab] outlive it only where a sequence reads them (logprobs, recorded logits)
        self._asks_logprobs = any([seq.params.logprobs is not None for seq in seqs])
        self._records_logits = any([seq.logits is not None for seq in seqs])
        wanted = self._asks_logprobs or self._records_logits or any(
            e.seq.params.logprobs is not None or e.seq.logits is not None for e in self._spec_entries)
        self._logits = logits if wanted else None
        self._event = None
        if tokens.device.type == "cuda":  # the host copy goes in the background; token_ids waits for it
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    @functools.cached_property
    def token_ids(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    @functools.cached_property
    def logprobs(self) -> list[tuple[float, dict[int, Logprob]] | None] | None:
        """(logprob of the sampled token, {token: Logprob} of it and the k most likely), where the sequence asked."""
        if not self._asks_logprobs:
            return None
        return [None if seq.params.logprobs is None else row_logprobs(self._logits[row], token, seq.params.logprobs)
                for row, seq, token in zip(self._rows, self._seqs, self.token_ids)]

    @functools.cached_property
    def prompt_logprobs(self) -> list[tuple[Sequence, int, list[dict[int, Logprob]]]] | None:
        """Per sequence that asked: (seq, first prompt position, {token: Logprob} of each prompt token from
        there, its own and the k most likely, from the logits of the row before it)."""
        if not self._prompt_spans:
            return None
        out, row = [], 0
        for seq, first, count in self._prompt_spans:
            k = seq.params.prompt_logprobs
            tops = [row_logprobs(self._prompt_logits[row + i], seq.token_ids[first + i], k)[1] for i in range(count)]
            out.append((seq, first, tops))
            row += count
        return out

    @functools.cached_property
    def spec(self) -> list[SpecTokens] | None:
        """Per speculating entry, in batch order: its k + 1 rows' tokens (and logprobs, logits where asked)."""
        if not self._spec_entries:
            return None
        tokens = self._spec_tokens.tolist()  # (the synchronous loop: speculation never runs ahead of the device)
        out, row, first = [], 0, self._spec_offset
        for e in self._spec_entries:
            n, seq = e.num_draft_tokens + 1, e.seq
            ids = tokens[row:row + n]
            rows = range(first + row, first + row + n)
            logprobs = None if seq.params.logprobs is None else [
                row_logprobs(self._logits[r], t, seq.params.logprobs) for r, t in zip(rows, ids)]
            logits = None if seq.logits is None else [self._logits[r].detach().cpu().clone() for r in rows]
            out.append(SpecTokens(ids, logprobs, logits))
            row += n
        return out

    @functools.cached_property
    def logits(self) -> list[torch.Tensor | None] | None:
        """Each sampled token's logits row [vocab] float32 on the CPU, where the sequence records them."""
        if not self._records_logits:
            return None
        return [None if seq.logits is None else self._logits[row].detach().cpu().clone()
                for row, seq in zip(self._rows, self._seqs)]


def token_rows(scheduled: list[ScheduledSequence], starts: np.ndarray, query_lens: np.ndarray,
               qsl: np.ndarray) -> tuple[list[int], list[int], np.ndarray]:
    """The step's rows, every scheduled sequence's new tokens in turn -> (input ids, slots, positions [T]).
    Row r of sequence i is at position starts[i] + r - qsl[i]."""
    if int(qsl[-1]) == len(scheduled):  # one token each (decodes: most steps): no ranges to join
        return [s.token_ids[0] for s in scheduled], [s.slot_mapping[0] for s in scheduled], starts
    ids = list(itertools.chain.from_iterable([s.token_ids for s in scheduled]))
    slots = list(itertools.chain.from_iterable([s.slot_mapping for s in scheduled]))
    positions = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(starts - qsl[:-1], query_lens)
    return ids, slots, positions


def padded_block_tables(scheduled: list[ScheduledSequence]) -> np.ndarray:
    """[S, max_blocks] int32, each sequence's block ids, rows padded with -1: in one boolean-mask assignment."""
    tables = [s.block_ids for s in scheduled]
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    block_tables = np.full((len(tables), int(lens.max())), -1, dtype=np.int32)
    block_tables[np.arange(block_tables.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    return block_tables


def sampling_rows(scheduled: list[ScheduledSequence], qsl: np.ndarray) -> tuple[list[int], list[int], list[Sequence]]:
    """The rows that sample: the last row of each sequence whose known tokens are now all computed -> (those rows,
    each sampled sequence's index among them, the sampled sequences). n samples of one prompt share its row."""
    samplers = [s.sample_seqs for s in scheduled]
    sampling = [i for i, seqs in enumerate(samplers) if seqs]
    sample_rows = (qsl[1:][sampling] - 1).tolist()
    sample_seqs = list(itertools.chain.from_iterable(samplers))
    logit_rows = list(range(len(sampling))) if len(sample_seqs) == len(sampling) else [
        j for j, i in enumerate(sampling) for _ in samplers[i]]
    return sample_rows, logit_rows, sample_seqs


def chunk_rows(scheduled: list[ScheduledSequence], qsl: np.ndarray) -> tuple[list[int], list, list[int], list]:
    """The rows a decode does not have, from prefill chunks and speculative entries -> (prompt_logprobs rows and
    their (sequence, first predicted position, count) spans, the verified rows and their entries)."""
    prompt_rows, prompt_spans, spec_rows, spec_entries = [], [], [], []
    for i in [i for i, s in enumerate(scheduled) if s.num_new_tokens > 1 or not s.sample_seqs]:  # not decodes
        s = scheduled[i]
        n, start, first = s.num_new_tokens, s.num_computed_tokens, int(qsl[i])
        last = s.seq.num_prompt_tokens - 1  # the last prompt row predicts a generated token, not a prompt one
        if s.seq.params.prompt_logprobs is not None and start < last:  # rows start.. predict tokens start + 1..
            count = min(n, last - start)
            prompt_rows.extend(range(first, first + count))
            prompt_spans.append((s.seq, start + 1, count))
        if s.num_draft_tokens:  # speculative decoding: every one of its k + 1 rows is scored
            spec_rows.extend(range(first, first + n))
            spec_entries.append(s)
    return prompt_rows, prompt_spans, spec_rows, spec_entries


class ModelRunner:
    """One rank's KV pools and steps. Under tensor parallelism (tp_size > 1) the pools hold this rank's
    KV heads only, and `DriverRunner` sends each step to the other ranks (`pagedref.distributed.worker`)."""

    def __init__(self, model, backend, num_blocks: int, block_size: int, device, dtype: torch.dtype,
                 num_cpu_blocks: int = 0, tp_size: int = 1, graphs: CUDAGraphConfig | None = None) -> None:
        """graphs: capture CUDA graphs (`pagedref.engine.cuda_graph`) as configured; None: every step eager."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        # CUDA graphs pad their batches; the padding rows' K/V go to scratch blocks past the managed ones.
        scratch = num_scratch_blocks(graphs.max_num_seqs, block_size) if graphs is not None else 0
        self.kv_caches = allocate_kv_caches(model.config, num_blocks + scratch, block_size, dtype, device, tp_size=tp_size)
        pin = self.device.type == "cuda"
        self.cpu_caches = allocate_kv_caches(model.config, num_cpu_blocks, block_size, dtype, "cpu", pin, tp_size) \
            if num_cpu_blocks else []
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()  # speculative decoding's: the rows of speculating sequences
        self.graphs = self.piecewise = None
        if graphs is not None:
            self.graphs = DecodeGraphs(model, backend, self.kv_caches, block_size, graphs.max_num_seqs, graphs.max_model_len,
                                       graphs.max_seq_len_to_capture, first_scratch_block=num_blocks)
            self.piecewise = PiecewiseGraphs(model, backend, self.kv_caches, graphs.max_capture_size)
        # Set to a list to time each step's GPU work: execute() appends (start, end) CUDA events (bench profile).
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    @staticmethod
    def load_shard(model_dir: str, device: str, dtype: torch.dtype, batch_invariant: bool, tp):
        """(model, attention backend) of one tensor-parallel rank: what a worker runs its steps with."""
        from pagedref.backends import get_backend
        from pagedref.models import load_model

        model = load_model(model_dir, device=device, dtype=dtype, batch_invariant=batch_invariant, tp=tp)
        return model, get_backend("reference" if device == "cpu" else "cuda")

    # --- one step -------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, sched: SchedulerOutput, prev: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """Run the step and sample: the tokens of every sampling sequence. prev: the output of the step
        still in flight, whose tokens some of this step's decodes read (async scheduling)."""
        timed = self.step_events is not None and self.device.type == "cuda"
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        step = self.prepare(sched, prev)
        hidden = self.run_model(step.input_ids, step.positions, step.meta, sched, step.host_meta)  # [T, hidden]
        rows = step.sample_rows + step.spec_rows if step.spec_rows else step.sample_rows
        if rows:
            float32 = bool(step.spec_rows) or not argmax_only(step.sample_seqs)
            logits = self.model.compute_logits(hidden.index_select(0, self._upload(rows)), float32)  # [R (+ spec), vocab]
        else:
            logits = hidden.new_empty((0, 0))
        r = len(step.sample_rows)  # speculative decoding: the rows after the R sampling ones are verified, not sampled
        spec_tokens = self.rejection_sampler(logits[r:], step.spec_entries, self._upload) if step.spec_rows else None
        tokens = self.sampler.sample_tokens(logits[:r], step.logit_rows, step.sample_seqs, self._upload)
        prompt_logits = None
        if step.prompt_rows:  # prompt_logprobs: the logits of the prompt rows that predict a prompt token
            prompt_logits = self.model.compute_logits(hidden.index_select(0, self._upload(step.prompt_rows)))
        out = ModelRunnerOutput(tokens, logits, step.logit_rows, step.sample_seqs, prompt_logits, step.prompt_spans,
                                spec_tokens, step.spec_entries, len(step.sample_rows))
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.step_events.append((start, end))
        return out

    def prepare(self, sched: SchedulerOutput, prev: ModelRunnerOutput | None = None) -> StepInput:
        """The step's inputs and its AttentionMetadata, built once for every layer.

        Built in bulk from the scheduler's entries: one list comprehension per field, numpy for the
        arithmetic (query offsets, positions, context lengths, the padded block tables), then one tensor
        per field. With hundreds of sequences a step, a Python loop appending to a dozen lists per
        sequence, or small per-sequence numpy/torch ops (~1-3 us of call overhead each), costs more than
        the work. The rows only a prefill chunk or a speculative entry has (prompt logprobs, verified
        drafts) are looked for among those entries alone."""
        scheduled = sched.scheduled
        query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)  # [S]
        starts = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)  # [S] each one's first position
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int64)  # [S + 1] where each sequence's rows start
        np.cumsum(query_lens, out=qsl[1:])
        ids, slots, positions = token_rows(scheduled, starts, query_lens, qsl)
        context_lens = starts + query_lens  # [S]
        sample_rows, logit_rows, sample_seqs = sampling_rows(scheduled, qsl)
        prompt_rows, prompt_spans, spec_rows, spec_entries = [], [], [], []
        if len(ids) > len(sample_rows):  # (never in a step of decodes only)
            prompt_rows, prompt_spans, spec_rows, spec_entries = chunk_rows(scheduled, qsl)
        host = StepInput(
            input_ids=torch.from_numpy(np.array(ids, dtype=np.int64)), positions=torch.from_numpy(positions),
            meta=AttentionMetadata(
                slot_mapping=torch.from_numpy(np.array(slots, dtype=np.int64)),
                query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
                context_lens=torch.from_numpy(context_lens.astype(np.int32)),
                block_tables=torch.from_numpy(padded_block_tables(scheduled)),
                max_query_len=int(query_lens.max()), max_context_len=int(context_lens.max()), block_size=self.block_size),
            sample_rows=sample_rows, logit_rows=logit_rows, sample_seqs=sample_seqs, prompt_rows=prompt_rows,
            prompt_spans=prompt_spans, spec_rows=spec_rows, spec_entries=spec_entries)
        if self.device.type == "cpu":
            step = host
        else:
            step = replace(host, input_ids=self._upload(host.input_ids), positions=self._upload(host.positions),
                           meta=self._upload_meta(host.meta), host_meta=host.meta)
        if prev is not None:
            self._read_in_flight(step, scheduled, qsl, prev)
        return step

    def _read_in_flight(self, step: StepInput, scheduled: list[ScheduledSequence], qsl: np.ndarray,
                        prev: ModelRunnerOutput) -> None:
        """Async scheduling: a decode whose input token the step in flight is sampling reads it on the device,
        from `prev`'s sampled tokens into its row of step.input_ids (the host list held a placeholder)."""
        src = np.array([s.prev_sample_index for s in scheduled], dtype=np.int64)  # [S] -1: the token is known
        waiting = np.flatnonzero(src >= 0)
        if waiting.size:
            tokens = prev.token_tensor.index_select(0, self._upload(src[waiting].tolist()))
            step.input_ids.index_copy_(0, self._upload(qsl[waiting].tolist()), tokens)

    def _upload(self, x) -> torch.Tensor:
        """A host list or tensor on the device. On CUDA through pinned memory, without a sync (a plain
        copy from pageable memory waits for the GPU: the host would stop overlapping it)."""
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, dtype=np.int64))  # (4x torch.tensor's speed)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _upload_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        up = self._upload
        return AttentionMetadata(up(meta.slot_mapping), up(meta.query_start_loc), up(meta.context_lens),
                                 up(meta.block_tables), meta.max_query_len, meta.max_context_len, meta.block_size)

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
        return self._upload(list(src)), self._upload(list(dst))

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  blocks: SchedulerOutput, host_meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The step's block operations, then the forward pass: what every tensor-parallel rank runs.
        A backend whose value checks read the metadata on the host (`check_step`: the cuda one) checks
        the host copy once, here, and runs unchecked: no sync between the step's launches."""
        self.copy_blocks(blocks)
        check = getattr(self.backend, "check_step", None)
        if check is None:
            return self._forward(input_ids, positions, meta)
        check(host_meta if host_meta is not None else meta, self.kv_caches[0])
        with self.backend.unchecked():
            return self._forward(input_ids, positions, meta)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_replay(meta):
            return self.graphs.replay(input_ids, positions, meta)
        if self.piecewise is not None and self.piecewise.can_replay(meta):
            return self.piecewise.replay(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def check_healthy(self) -> None:
        """Raise if the runner cannot run steps any more (a tensor-parallel worker failed)."""

    def close(self) -> None:
        self.kv_caches, self.cpu_caches, self.graphs, self.piecewise = [], [], None, None


class DriverRunner(ModelRunner):
    """Rank 0's model runner under tensor parallelism: each step goes to the workers first (one
    `StepMessage`, its host tensors), then rank 0 runs its own shard of it. The workers only execute."""

    def __init__(self, *args, workers, **kwargs) -> None:
        super().__init__(*args, **kwargs, tp_size=workers.tp.size)
        self.workers = workers

    def run_model(self, input_ids, positions, meta, blocks, host_meta=None) -> torch.Tensor:
        from pagedref.distributed.worker import StepMessage

        if host_meta is None:  # CPU copies for the pickle (blocking: an unfinished non_blocking copy would be pickled)
            host_meta = AttentionMetadata(meta.slot_mapping.cpu(), meta.query_start_loc.cpu(), meta.context_lens.cpu(),
                                          meta.block_tables.cpu(), meta.max_query_len, meta.max_context_len, meta.block_size)
        msg = StepMessage(input_ids.cpu(), positions.cpu(), host_meta, blocks.blocks_to_swap_out,
                          blocks.blocks_to_copy, blocks.blocks_to_swap_in)
        with self.workers.guard():
            self.workers.send_step(msg)
            return super().run_model(input_ids, positions, meta, blocks, host_meta)

    def check_healthy(self) -> None:
        with self.workers.guard():  # raises once a worker has failed
            pass

    def close(self) -> None:
        super().close()
        self.workers.close()


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
