"""`LLM` and `LLMEngine`: the serving API a vLLM user already knows, on the paged KV cache.

One idea: the engine is a loop of steps. `step()` = the scheduler picks this step's work (stages
6–7) → the model runner builds the step's attention metadata once and runs one forward pass →
the sampler picks one token per sequence that samples → each sequence grows, or finishes and frees
its blocks at once → outputs. `LLM.generate` adds every prompt and steps until all are done;
`LLMEngine` exposes the same loop piecewise (`add_request`, `step`, `abort_request`) for servers and
benchmarks that feed requests over time.

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
import itertools
import random
import time
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from pagedref.engine.block_manager import BlockManager, ContiguousBlockManager
from pagedref.engine.cuda_graph import CUDAGraphConfig
from pagedref.engine.model_runner import (GiB, MiB, ModelRunner, kv_block_bytes, num_blocks_from_budget,
                                          profile_num_gpu_blocks)
from pagedref.engine.sampling import BeamSearchParams, SampleResult, SamplingParams, make_generator
from pagedref.engine.scheduler import Scheduler, SchedulerConfig
from pagedref.engine.sequence import (CompletionOutput, RequestOutput, Sequence, SequenceGroup, SequenceStatus)
from pagedref.memory.block_table import cdiv

PromptType = str | dict[str, Any]


class LLMEngine:
    """The step loop over one model, one KV pool, one scheduler (vLLM's `LLMEngine` shape)."""

    def __init__(self, model, tokenizer, runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 seed: int = 0, record_logits: bool = False, max_logprobs: int = 20) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self.record_logits = record_logits
        self.max_logprobs = max_logprobs
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(seed)  # seeds of unseeded sequences: runs are reproducible too
        self.reset_stats()

    # --- requests -------------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt (text, or {"prompt_token_ids": [...]} / {"prompt": text}) -> (text, token ids), checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one character (or prompt_token_ids)")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"prompt_token_ids must be a list of ints, got {ids!r}")
            ids = list(ids)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            if not prompt["prompt"]:
                raise ValueError("the prompt is empty: give at least one character (or prompt_token_ids)")
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {prompt!r}")
        if not ids:
            raise ValueError("the prompt has no tokens (empty prompt_token_ids)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary of {self.vocab_size} tokens")
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs={self.max_logprobs} "
                             "(an LLM argument, 20 by default as in vLLM)")
        if params.n > 1 and isinstance(self.block_manager, ContiguousBlockManager):
            raise ValueError(f"n={params.n} needs shared blocks: kv_cache='contiguous' (the stage 1 baseline) has none")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Queue a request; it joins the running batch as soon as there is room for it."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt)
        self.check_params(params)
        group = SequenceGroup(request_id, text, ids, params)
        group.seqs.append(self._new_sequence(request_id, ids, params, index=0))
        self.requests[request_id] = group
        self.num_prompt_tokens += len(ids)
        self.scheduler.add(group.seqs[0])

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), request_id, list(token_ids), len(token_ids), params, index)
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
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for g in self.requests.values() if not g.is_finished)

    def get_num_requests_by_state(self) -> dict[str, int]:
        """Unfinished requests by where they are (a server's /metrics gauges, vLLM's): "running" (a sequence
        holds blocks in the device pool), "swapped" (in the CPU swap pool), "waiting" (queued, or preempted
        by recompute). Read-only."""
        counts = {"running": 0, "swapped": 0, "waiting": 0}
        for group in self.requests.values():
            states = {s.status for s in group.seqs}
            if SequenceStatus.RUNNING in states:
                counts["running"] += 1
            elif SequenceStatus.SWAPPED in states:
                counts["swapped"] += 1
            elif SequenceStatus.WAITING in states:
                counts["waiting"] += 1
        return counts

    # --- the step -------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, update. Returns the requests that advanced
        (finished ones for the last time: they are forgotten after); with final_only, only those that
        finished (vLLM's RequestOutputKind.FINAL_ONLY, what `LLM.generate` asks for: an output per
        running request per step is a streaming server's need, and costs microseconds per request)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any work (a bug: the pool should fit "
                                   "one sequence of max_model_len)")
            return []
        self._record_step(sched)
        logits, step = self.runner.execute(sched)
        for seq, n in sched.scheduled:
            group = self.requests.get(seq.request_id)
            if group and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = seq.num_computed_tokens  # the prefix cache's share of the prompt
            seq.num_computed_tokens += n
        rows, seqs = [], []
        for row, seq in enumerate(step.sample_seqs):
            rows.append(row)
            seqs.append(seq)
            group = self.requests.get(seq.request_id)
            if group and group.params.n > 1 and not group.forked:  # n samples share the prompt's blocks
                for child in self._fork_samples(group, seq):
                    rows.append(row)
                    seqs.append(child)
        results = self.runner.sample(logits, rows, seqs)
        touched: dict[str, SequenceGroup] = {}  # requests to report: all that advanced, or (final_only) finished
        for row, seq, result in zip(rows, seqs, results):
            finished = self._append_token(seq, result, logits, row)
            group = self.requests.get(seq.request_id)
            if group is None:
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = time.monotonic()
            if finished or not final_only:
                touched[group.request_id] = group
        outputs = []
        for rid, group in touched.items():
            if group.is_finished:
                group.metrics.finished_time = time.monotonic()
                del self.requests[rid]
            elif final_only:
                continue
            outputs.append(self._request_output(group))
        return outputs

    def _fork_samples(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """After the prompt's prefill: n - 1 more sequences, each sharing every block of the first."""
        children = []
        for index in range(1, group.params.n):
            child = self._new_sequence(group.request_id, parent.token_ids, group.params, index)
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
            if self.record_logits:
                child.logits = list(parent.logits)
            children.append(child)
        group.seqs.extend(children)
        group.forked = True
        return children

    def _append_token(self, seq: Sequence, result: SampleResult, logits: torch.Tensor, row: int) -> bool:
        """The sampled token joins the sequence; True if that finished it."""
        seq.token_ids.append(result.token_id)
        self.num_generated_tokens += 1
        if seq.logprobs is not None:
            for token_id, lp in result.top_logprobs.items():
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            seq.logprobs.append(result.top_logprobs)
            seq.cumulative_logprob += result.logprob
        if seq.logits is not None:
            seq.logits.append(logits[row].detach().cpu().clone())  # (indexed only here: a torch op per row)
        status = self._check_stop(seq)
        if status is not None:
            self.scheduler.finish(seq, status)
        return status is not None

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        """vLLM's rules: length (max_tokens, max_model_len), eos unless ignore_eos, stop token ids; then a
        stop string in the text stops it too (even on its last allowed token) and cuts the text."""
        p, token = seq.params, seq.token_ids[-1]
        status = None
        if seq.num_tokens >= self.max_model_len or (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens):
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif not p.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if p.stop:
            text = detokenize(self.tokenizer, seq, seq.num_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, stop = min(hits)
                seq.stop_reason = stop
                seq.text = text[:at + len(stop)] if p.include_stop_str_in_output else text[:at]
                return SequenceStatus.FINISHED_STOPPED
        return status

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index, token_ids=s.output_token_ids, cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs, finish_reason=s.status.finish_reason, stop_reason=s.stop_reason,
                logits=torch.stack(s.logits) if s.logits else None, _text=s.text,
                _decode=functools.partial(decode_output, self.tokenizer, s, len(s.token_ids), s.status),
            )
            for s in group.seqs
        ]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, group.is_finished,
                             group.metrics, group.num_cached_tokens)

    # --- statistics -----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_batched_tokens = 0
        self._preemptions_base = self.scheduler.num_preemptions
        self._swap_outs_base = self.scheduler.num_swap_outs
        self._replays_base = self._graph_replays()  # the runner's count runs on across generate calls
        self._tsf_sum = 0.0
        self._tsf_peak = 0.0
        self._tsf_steps = 0
        self.peak_num_running_seqs = 0  # sequences in flight (holding blocks) at once
        self.peak_num_batched_seqs = 0  # sequences in one step's batch
        self.peak_num_used_blocks = 0
        self.peak_blocks_saved_by_sharing = 0

    def _record_step(self, sched) -> None:
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

    def _graph_replays(self) -> tuple[int, int]:
        """(decode-graph replays, piecewise-graph replays) since the runner was built."""
        graphs, piecewise = self.runner.graphs, self.runner.piecewise
        return (graphs.num_replays if graphs is not None else 0, piecewise.num_replays if piecewise is not None else 0)

    def get_stats(self) -> dict[str, Any]:
        """The KV pool now (blocks total/used/free/cached/shared, token-state fraction) and, since the last
        reset (each `LLM.generate` starts one), the step statistics."""
        stats = dict(self.block_manager.stats())
        decode_replays, piecewise_replays = self._graph_replays()
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
            dtype=str(self.runner.dtype).removeprefix("torch."),
        )
        return stats


def detokenize(tokenizer, seq: Sequence, num_tokens: int) -> str:
    """The text the sequence's output tokens (up to num_tokens tokens in all) add to its prompt's text.
    Decoded after the prompt, as vLLM does, so a leading space ("▁he") is kept: " he"."""
    skip = seq.params.skip_special_tokens
    if seq.prompt_text is None:  # the prompt never changes: decode it once, not at every step's stop check
        seq.prompt_text = tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens], skip_special_tokens=skip)
    prompt = seq.prompt_text
    full = tokenizer.decode(seq.token_ids[:num_tokens], skip_special_tokens=skip)
    if full.startswith(prompt):
        return full[len(prompt):]
    return tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:num_tokens], skip_special_tokens=skip)


def decode_output(tokenizer, seq: Sequence, num_tokens: int, status: SequenceStatus) -> str:
    """The text of the output as it stood (num_tokens, status) when it was reported."""
    if status is SequenceStatus.FINISHED_STOPPED and not seq.params.include_stop_str_in_output:
        num_tokens -= 1  # as vLLM: the eos / stop token is in token_ids, not in the text
    return detokenize(tokenizer, seq, num_tokens)


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
    ) -> None:
        from pagedref.backends import get_backend
        from pagedref.distributed import TPGroup, check_tensor_parallel_size
        from pagedref.models import ModelConfig, load_model, load_tokenizer, resolve_dtype

        device = resolve_device(device)
        _check_positive("block_size", block_size)
        max_num_seqs = 256 if max_num_seqs is None else max_num_seqs
        _check_positive("max_num_seqs", max_num_seqs)
        if prefill_first and enable_chunked_prefill:
            raise ValueError("prefill_first=True is vLLM v0's policy without chunked prefill: "
                             "pass enable_chunked_prefill=False with it")
        if kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {kv_cache!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if num_kv_blocks is not None:
            _check_positive("num_kv_blocks", num_kv_blocks)
        if swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {swap_space}")
        _check_positive("max_seq_len_to_capture", max_seq_len_to_capture)
        _check_positive("max_capture_size", max_capture_size)
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {max_logprobs!r}")

        config = ModelConfig.from_pretrained(model)  # config.json, architecture: before anything heavy
        torch_dtype = resolve_dtype(("float32" if device == "cpu" else config.dtype) if dtype == "auto" else dtype)
        check_tensor_parallel_size(config, tensor_parallel_size)
        tp_size = tensor_parallel_size
        max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        _check_positive("max_model_len", max_model_len)
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is more than the model's max_position_embeddings="
                             f"{config.max_position_embeddings}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if device == "cpu" else 8192
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        _check_positive("max_num_batched_tokens", max_num_batched_tokens)
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len}: "
                             "without chunked prefill a whole prompt must fit in one step")
        tokenizer = load_tokenizer(model)
        workers = None
        if tp_size > 1:  # ranks 1..N-1: started here (or by torchrun), each loads its own shard
            from pagedref.distributed.worker import WorkerSpec, start_workers

            workers = start_workers(WorkerSpec(str(model), device, torch_dtype, device == "cpu"), tp_size)
        try:  # from here on, a failure must stop the workers it started
            weights = load_model(model, device=device, dtype=torch_dtype, batch_invariant=(device == "cpu"),
                                 tp=workers.tp if workers else TPGroup())
            backend = get_backend("reference" if device == "cpu" else "cuda")

            block_bytes = kv_block_bytes(config, block_size, torch_dtype, tp_size)  # one rank's share
            blocks_per_seq = cdiv(max_model_len, block_size)
            if num_kv_blocks is None:
                if device == "cpu":
                    where = f"cpu_kv_cache_bytes={cpu_kv_cache_bytes}"
                    num_kv_blocks = min(num_blocks_from_budget(cpu_kv_cache_bytes, block_bytes), max_num_seqs * blocks_per_seq)
                else:
                    where = f"gpu_memory_utilization={gpu_memory_utilization}"
                    profile = workers.profile_num_blocks if workers else profile_num_gpu_blocks  # TP: every GPU, the min
                    num_kv_blocks = profile(weights, backend, block_size, max_num_batched_tokens, max_num_seqs,
                                            max_model_len, gpu_memory_utilization, device, torch_dtype)
            else:
                where = f"num_kv_blocks={num_kv_blocks}"
            if num_kv_blocks < blocks_per_seq:
                raise ValueError(f"the KV pool ({where}: {num_kv_blocks} blocks of {block_size} tokens) cannot hold one "
                                 f"sequence of max_model_len={max_model_len} ({blocks_per_seq} blocks): give it more memory "
                                 "or lower max_model_len")
            num_cpu_blocks = 0
            if preemption_mode == "swap" and kv_cache == "paged":
                # At most the device pool: nothing new is admitted while a sequence is swapped out, so swapped
                # sequences stay few; when the CPU pool is full the scheduler preempts by recompute instead.
                num_cpu_blocks = min(num_blocks_from_budget(swap_space * GiB, block_bytes), num_kv_blocks)
            if kv_cache == "paged":
                block_manager = block_manager_cls(num_kv_blocks, block_size, max_model_len, enable_prefix_caching, num_cpu_blocks)
            else:
                block_manager = ContiguousBlockManager(num_kv_blocks, block_size, max_model_len)
            scheduler = scheduler_cls(SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                                      preemption_mode, prefill_first), block_manager)
            runner_args = (weights, backend, block_manager, num_kv_blocks, block_size, device, torch_dtype, num_cpu_blocks)
            if workers:  # tensor parallel: eager (every rank would have to capture and replay in step)
                runner = workers.driver_runner(*runner_args)
            else:
                graphs = None if enforce_eager or device != "cuda" else CUDAGraphConfig(
                    max_num_seqs, max_model_len, max_seq_len_to_capture, min(max_capture_size, max_num_batched_tokens))
                runner = ModelRunner(*runner_args, graphs=graphs)
            self.llm_engine = LLMEngine(weights, tokenizer, runner, scheduler, max_model_len, seed, record_logits,
                                        max_logprobs)
            self.num_kv_blocks = num_kv_blocks
            self.kv_cache = kv_cache
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        if workers is not None:
            weakref.finalize(self, workers.close)  # an LLM dropped without close() still stops its workers
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

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams):
        """Beam search (vLLM's `LLM.beam_search`): a list of BeamSearchOutput, beams best first."""
        from pagedref.engine.beam_search import beam_search

        engine = self._engine()
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(engine.block_manager, ContiguousBlockManager):
            raise ValueError("beam search needs shared blocks: kv_cache='contiguous' (the stage 1 baseline) has none")
        processed = [engine.process_prompt(p) for p in _as_list(prompts, "prompts")]
        engine.reset_stats()
        return beam_search(engine, processed, params)

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


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU and cupy (the kernels' runtime) works, else "cpu";
    "cpu" or "cuda[:N]" as given, once checked."""
    if device == "auto":
        from pagedref.kernels import gpu_available

        return "cuda" if gpu_available() else "cpu"
    if not isinstance(device, str) or not (device == "cpu" or device.split(":")[0] == "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU")
    return device


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
