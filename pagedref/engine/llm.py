"""`LLM` and `LLMEngine`: the serving API a vLLM user already knows, on the paged KV cache.

One idea: the engine is a loop of steps, and a step is three calls and nothing else (the step
contract, `pagedref.engine.scheduler`): `Scheduler.schedule()` picks this step's work (stages 6–7)
and returns a `SchedulerOutput`; `ModelRunner.execute(output)` runs one forward pass and samples;
`Scheduler.update(output, sampled)` appends the tokens, forks, checks the stop rules and frees. The
engine turns the requests that advanced into `RequestOutput`s. `LLM.generate` adds every prompt and
steps until all are done; `LLMEngine` exposes the same loop piecewise (`add_request`, `step`,
`abort_request`) for servers and benchmarks that feed requests over time.

Async scheduling (vLLM v1's, `async_scheduling=True`, the default with CUDA and one GPU): the host
schedules and prepares step N+1 while the GPU runs step N. A `step()` call schedules and launches
N+1 (its decodes read the tokens step N samples on the device, as placeholders: the scheduler
counts them before they exist), and only then waits for N's tokens and updates with them; so a call
returns the outputs of the step launched by the call before it, and the last call drains. What the
host cannot know about step N when it schedules N+1 is handled by construction: a sequence whose
N-token forks it (the first samples of n > 1) or is a beam's candidate is not scheduled in N+1; one
known to end on that token (max_tokens, max_model_len) neither; one that turns out to stop on it
(eos, stop token, stop string) is finished by update N, its work in N+1 dropped and its blocks
freed at once (the GPU finishes N+1 before any later step can reuse them). Each sequence's tokens
depend only on its own tokens, so the outputs are the synchronous loop's, bit for bit on the CPU
(which runs the same code path; tests compare the two).

n > 1: the prompt is prefilled once; when it samples its first tokens the sequence is forked into n
sequences sharing every block (the shared, partly filled last block is copied on the first write).

Batch invariance (`device="cpu"`): a request's logits are bit-identical alone or batched, chunked or
not, with the prefix cache cold or warm, preempted (recompute or swap) or not. See
`pagedref.engine.model_runner` for how; `LLM(record_logits=True)` records, in each
`CompletionOutput.logits`, the [num_tokens, vocab] float32 logits that chose each token, so tests can
compare them bit for bit.

Invariant: every input is checked before any work is scheduled; when no request is left, every KV
block is free (or free and still findable in the prefix cache).
"""

from __future__ import annotations

import functools
import gc
import itertools
import random
import time
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from pagedref.engine.beam_search import BeamSearchOutput, BeamState, beam_search, round_params
from pagedref.engine.block_manager import BlockManager, ContiguousBlockManager
from pagedref.engine.config import MAX_DECODE_GRAPH_BATCH, EngineArgs, EngineConfig, GiB, MiB
from pagedref.engine.cuda_graph import CUDAGraphConfig
from pagedref.engine.model_runner import (DriverRunner, ModelRunner, ModelRunnerOutput, kv_block_bytes,
                                          num_blocks_from_budget, profile_num_gpu_blocks)
from pagedref.engine.sampling import make_generator
from pagedref.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedref.engine.scheduler import Scheduler, SchedulerOutput
from pagedref.engine.sequence import (CompletionOutput, RequestOutput, Sequence, SequenceGroup, SequenceStatus,
                                      next_seq_id)
from pagedref.engine.stop_checker import StopChecker, decode_output
from pagedref.memory.block_table import cdiv

PromptType = str | dict[str, Any]


# The cyclic collector's first threshold (CPython's default: 700 allocations). A step allocates a few
# objects per sequence (its ScheduledSequence, token slice, slot mapping...), so at 1024 sequences the
# default ran ~12 young collections a step and a full one every few steps; at 10,000, `bench step`'s host
# time at 1024 sequences fell by a quarter (256: a few percent). Nothing else changes: reference counting
# frees almost everything at once, and what only the collector frees (cycles) waits a little longer.
GC_THRESHOLD = 10_000


def freeze_gc_heap() -> None:
    """Move every object alive now (the modules, the model, the KV pool's bookkeeping) out of the cyclic
    garbage collector's reach, as vLLM does once its engine is built (`gc.collect()`, then `gc.freeze()`),
    and collect young objects every GC_THRESHOLD allocations rather than every 700. The collector's oldest
    generation is otherwise scanned whole, 0.1 s and more with torch loaded, once every few hundred
    thousand allocations: at a thousand sequences a step, one step in ~20 paid it, 5 ms a step on average.
    Collected first, so no garbage is frozen; what the requests allocate later is still collected (it is
    scanned alone), and a frozen object is still freed when its last reference goes. (Process-wide, as
    vLLM's freeze is: the engine is what the process runs.)"""
    gc.collect()
    gc.freeze()
    threshold, *older = gc.get_threshold()
    gc.set_threshold(max(threshold, GC_THRESHOLD), *older)


class LLMEngine:
    """The step loop over one model, one KV pool, one scheduler (vLLM's `LLMEngine` shape)."""

    def __init__(self, model, tokenizer, runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 seed: int = 0, record_logits: bool = False, max_logprobs: int = 20) -> None:
        """Async scheduling follows the scheduler's config (`SchedulerConfig.async_scheduling`)."""
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        # the engine's stop rules, which the scheduler's update applies
        scheduler.stop_checker = StopChecker(max_model_len, self.eos_token_ids, tokenizer)
        self.record_logits = record_logits
        self.max_logprobs = max_logprobs
        self.dtype = runner.kv_caches[0][0].dtype if runner.kv_caches else None
        self.requests: dict[str, SequenceGroup] = {}
        self._rng = random.Random(seed)  # seeds of unseeded sequences: runs are reproducible too
        self._in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None  # async: launched, not updated
        self._failure: BaseException | None = None  # a step that raised leaves the scheduler's state behind
        self.reset_stats()
        freeze_gc_heap()

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.config.async_scheduling

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Build the engine an `LLM(...)` call describes: check every argument, load the tokenizer and the
        weights (tensor parallel: start the workers, each loads its shard), size the KV pool, build the
        block manager, the scheduler and the model runner (CUDA graphs captured)."""
        from pagedref.backends import get_backend
        from pagedref.distributed import TPGroup
        from pagedref.models import load_model, load_tokenizer

        config = args.create_engine_config()
        cache, sched_config, tp_size = config.cache, config.scheduler, config.parallel.tensor_parallel_size
        device, dtype = config.device, config.dtype
        tokenizer = load_tokenizer(config.model)
        workers = None
        if tp_size > 1:  # ranks 1..N-1: started here (or by torchrun), each loads its own shard
            from pagedref.distributed.worker import WorkerSpec, start_workers

            workers = start_workers(WorkerSpec(str(config.model), device, dtype, device == "cpu", runner_cls=ModelRunner),
                                    tp_size)
        try:  # from here on, a failure must stop the workers it started
            weights = load_model(config.model, device=device, dtype=dtype, batch_invariant=(device == "cpu"),
                                 tp=workers.tp if workers else TPGroup())
            weights.set_weight_gemm(config.weight_gemm)  # before any graph is captured
            backend = get_backend("reference" if device == "cpu" else "cuda")
            spec = config.speculative
            draft = None
            if spec is not None and spec.method == "draft_model":  # loaded first: a GPU's profiling counts its weights
                draft = load_model(spec.model, device=device, dtype=dtype, batch_invariant=(device == "cpu"))
            draft_block_bytes = 0 if draft is None else kv_block_bytes(draft.config, cache.block_size, dtype)
            num_kv_blocks, num_cpu_blocks = _num_blocks(config, weights, backend, workers, draft_block_bytes)
            if cache.kv_cache == "paged":
                block_manager = (config.block_manager_cls or BlockManager)(
                    num_kv_blocks, cache.block_size, config.max_model_len, cache.enable_prefix_caching, num_cpu_blocks)
            else:
                block_manager = ContiguousBlockManager(num_kv_blocks, cache.block_size, config.max_model_len)
            scheduler = (config.scheduler_cls or Scheduler)(sched_config, block_manager)
            runner_args = (weights, backend, num_kv_blocks, cache.block_size, device, dtype, num_cpu_blocks)
            graphs = None
            if workers:  # tensor parallel: eager (every rank would have to capture and replay in step)
                workers.run("init_kv_cache", num_kv_blocks, cache.block_size, num_cpu_blocks)
                runner = DriverRunner(*runner_args, workers=workers)
            else:
                comp = config.compilation
                graphs = CUDAGraphConfig(min(sched_config.max_num_seqs, MAX_DECODE_GRAPH_BATCH), config.max_model_len,
                                         comp.max_seq_len_to_capture,
                                         min(comp.max_capture_size, sched_config.max_num_batched_tokens)
                                         ) if config.uses_cuda_graphs else None
                runner = ModelRunner(*runner_args, graphs=graphs)
            if spec is not None:  # speculative decoding (stage 8): the scheduler asks the proposer for drafts
                scheduler.proposer = _proposer(spec, draft, backend, num_kv_blocks, cache.block_size, device, dtype,
                                               config.max_model_len, graphs)
            engine = cls(weights, tokenizer, runner, scheduler, config.max_model_len, config.seed, config.record_logits,
                         config.max_logprobs)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        engine.config, engine.num_kv_blocks = config, num_kv_blocks
        return engine

    # --- requests -------------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt (text, or {"prompt_token_ids": [...]} / {"prompt": text}) -> (text, token ids), checked."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"prompt_token_ids must be a list of ints, got {ids!r}")
            ids = list(ids)
        else:  # text, given as it is or as {"prompt": text}
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            if not isinstance(text, str):
                raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {prompt!r}")
            if not text:
                raise ValueError("the prompt is empty: give at least one character (or prompt_token_ids)")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt has no tokens (empty prompt_token_ids)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary of {self.vocab_size} tokens")
        return text, ids

    def check_params(self, params: SamplingParams | BeamSearchParams) -> None:
        if isinstance(params, BeamSearchParams):
            if isinstance(self.block_manager, ContiguousBlockManager):
                raise ValueError("beam search needs shared blocks: kv_cache='contiguous' (the stage 1 baseline) has none")
            if 2 * params.beam_width > self.max_logprobs:
                raise ValueError(f"beam_width={params.beam_width} ranks 2 x beam_width logprobs, more than "
                                 f"max_logprobs={self.max_logprobs}")
            return
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}={k} is more than max_logprobs={self.max_logprobs} "
                                 "(an LLM argument, 20 by default as in vLLM)")
        if params.n > 1 and isinstance(self.block_manager, ContiguousBlockManager):
            raise ValueError(f"n={params.n} needs shared blocks: kv_cache='contiguous' (the stage 1 baseline) has none")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None = None) -> None:
        """Queue a request; it joins the running batch as soon as there is room for it. With
        BeamSearchParams it is a beam search (`LLM.beam_search`): its output's completions are the best beams."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt)
        self.check_params(params)
        group = SequenceGroup(request_id, text, ids, params)
        if isinstance(params, BeamSearchParams):
            group.seqs = [self._new_sequence(group, round_params(params), 0)]
            group.beam = BeamState(params, list(group.seqs))
        else:  # all n now (their seeds drawn in index order); the n - 1 others fork off the first after its prefill
            group.seqs = [self._new_sequence(group, params, i) for i in range(params.n)]
            if params.prompt_logprobs is not None:  # filled by update as the prompt's chunks are computed
                group.prompt_logprobs = [None] * len(ids)
        self.requests[request_id] = group
        self.num_prompt_tokens += len(ids)
        self.scheduler.add(group.seqs[0])

    def _new_sequence(self, group: SequenceGroup, params: SamplingParams, index: int) -> Sequence:
        ids = group.prompt_token_ids
        seq = Sequence(next_seq_id(), group.request_id, list(ids), len(ids), params, index, group=group)
        if not params.is_greedy:  # the sequence's own random stream: seed + index, else one from the engine
            seed = params.seed + index if params.seed is not None else self._rng.getrandbits(63)
            seq.generator = make_generator(seed, self.runner.device)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        if self.record_logits:
            seq.logits = []
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now; their blocks are freed at once. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.requests.pop(rid, None)
            for seq in group.seqs if group else []:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for g in self.requests.values() if not g.is_finished)

    def get_num_requests_by_state(self) -> dict[str, int]:
        """Unfinished requests by where they are: {"running": holding KV blocks, "waiting": new or preempted
        by recompute, "swapped": preempted by swap} (the server's /metrics)."""
        return self.scheduler.num_requests()

    # --- the step -------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One iteration: schedule, execute (forward and sample), update. Returns the requests that
        advanced (finished ones for the last time: they are forgotten after); with final_only, only those
        that finished (vLLM's RequestOutputKind.FINAL_ONLY, what `LLM.generate` asks for: an output per
        running request per step is a streaming server's need, and costs microseconds per request).
        With async scheduling, the outputs are those of the step launched by the previous call."""
        if self._failure is not None:
            self.runner.check_healthy()  # tensor parallel: names the worker that failed
            raise RuntimeError(f"an earlier step failed ({self._failure!r}): the engine's state is lost, make a new one")
        try:
            return self._step_async(final_only) if self.async_scheduling else self._step(final_only)
        except BaseException as e:
            self._failure = e
            raise

    def _step(self, final_only: bool) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._check_progress()
            return []
        self._record_step(sched)
        sampled = self.runner.execute(sched)
        return self._outputs(self.scheduler.update(sched, sampled), final_only)

    def _step_async(self, final_only: bool) -> list[RequestOutput]:
        """Schedule and launch step N+1, then wait for step N's tokens and update with them."""
        sched = self.scheduler.schedule()  # N's sampled tokens are placeholders here
        launched = None
        if not sched.is_empty:
            self._record_step(sched)
            launched = self.runner.execute(sched, prev=self._in_flight[1] if self._in_flight else None)
        elif self._in_flight is None:
            self._check_progress()
            return []
        outputs = []
        if self._in_flight is not None:
            prev_sched, prev_sampled = self._in_flight
            outputs = self._outputs(self.scheduler.update(prev_sched, prev_sampled), final_only)  # waits for N's tokens
        self._in_flight = (sched, launched) if launched is not None else None
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            # N stopped every sequence N+1 computes for (eos, stop strings): N+1 is all dropped work. Drain it
            # now, so an engine with nothing left to do is idle (has_unfinished_requests() is False).
            self.scheduler.update(sched, launched)
            self._in_flight = None
        return outputs

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any work (a bug: the pool should fit "
                               "one sequence of max_model_len)")

    def _outputs(self, groups: list[SequenceGroup], final_only: bool) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for group in groups:
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            finished = group.is_finished
            if finished:
                group.metrics.finished_time = now
                self.requests.pop(group.request_id, None)
            elif final_only:
                continue
            outputs.append(self._request_output(group, finished))
        return outputs

    def _request_output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        if group.beam is not None:
            outputs = [] if not group.beam.done else [
                CompletionOutput(index=i, token_ids=b.tokens[len(group.prompt_token_ids):], cumulative_logprob=b.cum_logprob,
                                 logprobs=b.logprobs, finish_reason=b.finish_reason, stop_reason=b.stop_reason)
                for i, b in enumerate(group.beam.results)]
        else:
            outputs = [
                CompletionOutput(
                    index=s.index, token_ids=s.output_token_ids, cumulative_logprob=s.cumulative_logprob,
                    logprobs=s.logprobs, finish_reason=s.status.finish_reason, stop_reason=s.stop_reason,
                    logits=torch.stack(s.logits) if s.logits else None, _text=s.text,
                    _decode=functools.partial(decode_output, self.tokenizer, s, len(s.token_ids), s.status),
                )
                for s in group.seqs
            ]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             group.metrics, group.num_cached_tokens or 0,
                             list(group.prompt_logprobs) if group.prompt_logprobs is not None else None)

    # --- statistics -----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_batched_tokens = 0
        self._generated_base = self.scheduler.num_generated_tokens
        self._preemptions_base = self.scheduler.num_preemptions
        self._swap_outs_base = self.scheduler.num_swap_outs
        self._replays_base = self._graph_replays()  # the runner's count runs on across generate calls
        self._spec_base = self._spec_counts()
        self._tsf_sum = 0.0
        self._tsf_peak = 0.0
        self._tsf_steps = 0
        self.peak_num_running_seqs = 0  # sequences in flight (holding blocks) at once
        self.peak_num_batched_seqs = 0  # sequences in one step's batch
        self.peak_num_used_blocks = 0
        self.peak_blocks_saved_by_sharing = 0

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens - self._generated_base

    def _record_step(self, sched: SchedulerOutput) -> None:
        self.num_steps += 1
        self.num_batched_tokens += sched.num_batched_tokens
        self.peak_num_running_seqs = max(self.peak_num_running_seqs, len(self.scheduler.running))
        self.peak_num_batched_seqs = max(self.peak_num_batched_seqs, len(sched.scheduled))
        tsf, used, saved = self.block_manager.live_usage()
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, used)
        self.peak_blocks_saved_by_sharing = max(self.peak_blocks_saved_by_sharing, saved)
        if used:
            self._tsf_sum += tsf
            self._tsf_steps += 1
            self._tsf_peak = max(self._tsf_peak, tsf)

    def _spec_counts(self) -> tuple[int, int, int]:
        """(verified speculative steps, draft tokens, accepted draft tokens) since the scheduler was built
        (a scheduler without speculative decoding, a learner's, counts none)."""
        s = self.scheduler
        return tuple(getattr(s, name, 0) for name in ("num_spec_drafts", "num_draft_tokens", "num_accepted_tokens"))

    def _graph_replays(self) -> tuple[int, int]:
        """(decode-graph replays, piecewise-graph replays) since the runner was built."""
        graphs, piecewise = self.runner.graphs, self.runner.piecewise
        return (graphs.num_replays if graphs is not None else 0, piecewise.num_replays if piecewise is not None else 0)

    def get_stats(self) -> dict[str, Any]:
        """The KV pool now (blocks total/used/free/cached/shared, token-state fraction) and, since the last
        reset (each `LLM.generate` starts one), the step statistics. Speculative decoding's (vLLM's names):
        spec_num_drafts (a sequence's speculative steps), spec_num_draft_tokens, spec_num_accepted_tokens,
        spec_acceptance_rate (accepted / draft tokens) and spec_mean_accepted_length (tokens emitted per
        speculative step, the target's own included: 1 + accepted / drafts); zeros without speculation."""
        stats = dict(self.block_manager.stats())
        decode_replays, piecewise_replays = self._graph_replays()
        drafts, draft_tokens, accepted = (now - base for now, base in zip(self._spec_counts(), self._spec_base))
        stats.update(
            num_steps=self.num_steps,
            num_preemptions=self.scheduler.num_preemptions - self._preemptions_base,
            num_swap_outs=self.scheduler.num_swap_outs - self._swap_outs_base,
            peak_num_running_seqs=self.peak_num_running_seqs,
            peak_num_batched_seqs=self.peak_num_batched_seqs,
            peak_num_used_blocks=self.peak_num_used_blocks,
            peak_blocks_saved_by_sharing=self.peak_blocks_saved_by_sharing,
            token_state_fraction_peak=self._tsf_peak,
            token_state_fraction_mean=self._tsf_sum / self._tsf_steps if self._tsf_steps else 0.0,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_batched_tokens=self.num_batched_tokens,
            num_cuda_graph_replays=decode_replays - self._replays_base[0],  # decode steps, one graph each
            num_piecewise_graph_replays=piecewise_replays - self._replays_base[1],  # other steps, in pieces
            block_size=self.block_manager.block_size,
            device=self.runner.device.type,  # where the engine runs ("auto" resolved)
            dtype=str(self.dtype).removeprefix("torch."),
            async_scheduling=self.async_scheduling,
            spec_num_drafts=drafts,
            spec_num_draft_tokens=draft_tokens,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
            spec_mean_accepted_length=1 + accepted / drafts if drafts else 0.0,
        )
        return stats


def _proposer(spec, draft, backend, num_blocks: int, block_size: int, device: str, dtype: torch.dtype,
              max_model_len: int, graphs: CUDAGraphConfig | None):
    """The speculative_config's proposer: prompt lookup, or a draft model on its own pool of num_blocks blocks
    (the target's count: its table never holds more blocks than the target's does), replaying CUDA graphs
    as the target does (its k - 1 decode rounds a step are decode-only batches: one launch each)."""
    from pagedref.engine.spec_decode import DraftModelProposer, NgramProposer

    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    runner = ModelRunner(draft, backend, num_blocks, block_size, device, dtype, graphs=graphs)
    return DraftModelProposer(runner, num_blocks, spec.num_speculative_tokens, max_model_len)


def _num_blocks(config: EngineConfig, weights, backend, workers, draft_block_bytes: int = 0) -> tuple[int, int]:
    """(device KV blocks, CPU swap blocks): exactly num_kv_blocks, or sized from the memory budget (which a
    draft model's pool of as many blocks shares, draft_block_bytes each)."""
    cache, sched = config.cache, config.scheduler
    tp_size = config.parallel.tensor_parallel_size
    block_bytes = kv_block_bytes(config.hf_config, cache.block_size, config.dtype, tp_size)  # one rank's share
    blocks_per_seq = cdiv(config.max_model_len, cache.block_size)
    num_kv_blocks = cache.num_kv_blocks
    if num_kv_blocks is None:
        if config.device == "cpu":
            where = f"cpu_kv_cache_bytes={cache.cpu_kv_cache_bytes}"
            # (a draft model's pool of as many blocks shares the budget; the cap is what the target can use)
            num_kv_blocks = min(num_blocks_from_budget(cache.cpu_kv_cache_bytes, block_bytes + draft_block_bytes),
                                sched.max_num_seqs * blocks_per_seq)
        else:
            where = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
            args = (cache.block_size, sched.max_num_batched_tokens, sched.max_num_seqs, config.max_model_len,
                    cache.gpu_memory_utilization, config.device, config.dtype)
            if workers:  # TP: every GPU profiles its own, the minimum wins
                num_kv_blocks = workers.profile_num_blocks(profile_num_gpu_blocks, weights, backend, *args)
            else:
                num_kv_blocks = profile_num_gpu_blocks(weights, backend, *args)
            num_kv_blocks = num_kv_blocks * block_bytes // (block_bytes + draft_block_bytes)  # the draft's pool: its share
    else:
        where = f"num_kv_blocks={num_kv_blocks}"
    if num_kv_blocks < blocks_per_seq:
        raise ValueError(f"the KV pool ({where}: {num_kv_blocks} blocks of {cache.block_size} tokens) cannot hold one "
                         f"sequence of max_model_len={config.max_model_len} ({blocks_per_seq} blocks): give it more memory "
                         "or lower max_model_len")
    num_cpu_blocks = 0
    if sched.preemption_mode == "swap" and cache.kv_cache == "paged":
        # At most the device pool: nothing new is admitted while a sequence is swapped out, so swapped
        # sequences stay few; when the CPU pool is full the scheduler preempts by recompute instead.
        num_cpu_blocks = min(num_blocks_from_budget(cache.swap_space * GiB, block_bytes), num_kv_blocks)
    return num_kv_blocks, num_cpu_blocks


class LLM:
    """Offline inference: `LLM(model=PATH).generate(prompts, SamplingParams(...))` (vLLM's `LLM`).

    device "auto" (the default, as vLLM's) runs on CUDA when torch sees a GPU and CuPy works, else on
    the CPU; "cpu" runs the reference backend with batch-invariant numerics; "cuda" the stage 5 kernels.
    dtype "auto" is the checkpoint's dtype on CUDA and float32 on the CPU (where the numerics contract
    is stated). `get_stats()` says which device and dtype the engine runs on. `max_logprobs` (20, as
    vLLM's) caps the logprobs a request may ask for.
    kv_cache "paged" (the default) or "contiguous" (stage 1's max-length reservations, the baseline
    of the serving benchmark). preemption_mode "recompute" (default) or "swap" (into `swap_space`
    GiB of CPU memory). The KV pool is exactly `num_kv_blocks` blocks when given; otherwise sized
    from gpu_memory_utilization (CUDA, by profiling) or `cpu_kv_cache_bytes` (CPU). The contiguous
    baseline has no prefix caching, no n > 1 and no beam search: it cannot share blocks.

    `async_scheduling` (None: on with CUDA and one GPU, as vLLM's `--async-scheduling`) schedules each
    step while the GPU still runs the one before (`LLMEngine`); outputs are the same bits either way.

    `weight_gemm` puts projections on the project's Hopper GEMM (sm_90, `pagedref.kernels.gemm`) instead
    of cuBLAS: "torch" (the default) none, "pagedref" those measured at or past cuBLAS
    (`config.PAGEDREF_GEMM_OPS`), or a list of `models.llama.WEIGHT_GEMM_OPS` (for benchmarks).

    `tensor_parallel_size=N` splits the model and its KV cache over N processes (one GPU each on CUDA,
    gloo processes on the CPU); this process is rank 0 and starts the others (`pagedref.distributed`),
    or joins them under torchrun. `close()` stops them.

    On CUDA with one GPU, steps replay captured CUDA graphs, as vLLM's do by default
    (`pagedref.engine.cuda_graph`): a decode step one graph per padded batch size up to max_num_seqs,
    for contexts up to `max_seq_len_to_capture` tokens; any other step of up to `max_capture_size`
    tokens the graphs of the pieces between its attention calls. `enforce_eager=True` issues every
    step's launches one by one instead. The CPU, and tensor parallelism (for now), always run eagerly.

    Without chunked prefill a whole prompt shares its step with the running decodes (vLLM v1);
    `prefill_first=True` gives prompts steps of their own instead, before any decode (vLLM v0).

    `record_logits=True` keeps each token's logits in `CompletionOutput.logits` (for tests).
    `scheduler_cls` / `block_manager_cls` (vLLM's SchedulerConfig has `scheduler_cls` too) build the
    engine around other implementations of stage 6's classes: the course grades a learner's with them.
    """

    def __init__(
        self,
        model: str | Path,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        preemption_mode: str = "recompute",
        kv_cache: str = "paged",
        swap_space: float = 4.0,
        cpu_kv_cache_bytes: int = 256 * MiB,
        seed: int = 0,
        record_logits: bool = False,
        scheduler_cls: type = Scheduler,
        block_manager_cls: type = BlockManager,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        max_seq_len_to_capture: int = 8192,
        max_capture_size: int = 2048,
        prefill_first: bool = False,
        max_logprobs: int = 20,
        async_scheduling: bool | None = None,
        speculative_config: dict[str, Any] | None = None,
        weight_gemm: str | tuple[str, ...] = "torch",
    ) -> None:
        args = EngineArgs(**{name: value for name, value in locals().items() if name != "self"})
        self.llm_engine = LLMEngine.from_engine_args(args)
        self.num_kv_blocks = self.llm_engine.num_kv_blocks
        self.kv_cache = args.kv_cache
        runner = self.llm_engine.runner
        if isinstance(runner, DriverRunner):  # an LLM dropped without close() still stops its workers
            weakref.finalize(self, runner.workers.close)
        self._request_ids = itertools.count()

    # --- vLLM's offline API ---------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of the prompts. Everything is checked first."""
        engine = self._engine()
        prompts = _as_list(prompts, "prompts")
        params = self._params_list(sampling_params, len(prompts))
        processed = [engine.process_prompt(p) for p in prompts]
        for p in params:
            engine.check_params(p)
        engine.reset_stats()
        ids = []
        for (text, token_ids), p in zip(processed, params):
            rid = f"gen-{next(self._request_ids)}"
            engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids}, p)
            ids.append(rid)
        wanted, done = set(ids), {}
        bar = _progress(len(ids), use_tqdm)
        while wanted - done.keys():
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(wanted - done.keys())} were aborted before they finished")
            for out in engine.step(final_only=True):
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): a list of BeamSearchOutput, beams best first."""
        engine = self._engine()
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine.check_params(params)
        processed = [engine.process_prompt(p) for p in _as_list(prompts, "prompts")]
        engine.reset_stats()
        return beam_search(engine, processed, params, request_prefix=f"beam-{next(self._request_ids)}")

    def get_stats(self) -> dict[str, Any]:
        return self._engine().get_stats()

    def close(self) -> None:
        """Free the KV cache and the model (the GPU memory, on CUDA)."""
        if self.llm_engine is not None:
            self.llm_engine.runner.close()
            self.llm_engine = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM was closed")
        return self.llm_engine

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts (one, or one per prompt)")
        return sampling_params


def _as_list(prompts, name: str) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"{name} is empty: give at least one prompt")
    return prompts


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts")
