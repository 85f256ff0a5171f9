"""Engine configuration: `EngineArgs` (every `LLM` keyword, vLLM's names) → one validated `EngineConfig`.

One idea: an engine's settings are checked in one place, once, before anything heavy happens (no
weights loaded, no process started, no memory taken), and each bad value is refused with an error
naming it. `EngineArgs.create_engine_config()` resolves what "auto" and None mean (the device, the
dtype, max_model_len from the checkpoint, the token budget and batch size for the device) and
returns the configs the engine's parts are built from, grouped as vLLM groups them: the model's
(`EngineConfig` itself), the KV cache's (`CacheConfig`), the scheduler's (`SchedulerConfig`), the
parallel layout (`ParallelConfig`), CUDA graphs (`CompilationConfig`) and speculative decoding
(`SpeculativeConfig`, with what it cannot be combined with refused by name).

Invariant: a config that exists is valid; the same arguments always give the same config on the
same machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedref.engine.sampling_params import check_int

MiB = 1 << 20
GiB = 1 << 30

# vLLM (v1, the LLM class) raises its batch defaults on GPUs with large memory (H100/H200-class, >= 70 GiB):
# max_num_seqs 1024 and max_num_batched_tokens 16384 instead of 256 and 8192. A big GPU's KV pool holds far
# more than 256 running sequences of a chat workload (bench serve at the 8B shape on an H200 peaked at 256
# sequences with 12.5% of the pool used: the cap, not memory, bounded the batch), and a decode step's
# matmuls read the weights once for every row, so more rows per step is nearly free throughput until the
# step turns compute-bound. A bigger token budget lets the prompts of those sequences in faster. Proposed
# here from vLLM's measurements; issue 16 has the lead measure them on the H200 (`bench serve`).
LARGE_GPU_MEMORY_GIB = 70
LARGE_GPU_DEFAULTS = dict(max_num_seqs=1024, max_num_batched_tokens=16384)
GPU_DEFAULTS = dict(max_num_seqs=256, max_num_batched_tokens=8192)
CPU_DEFAULTS = dict(max_num_seqs=256, max_num_batched_tokens=2048)
# Decode steps of more sequences than this replay the piecewise graphs instead of one whole-step graph.
# 1024, the large-GPU max_num_seqs: in bench serve's 8B run at 1024 sequences, the steps of 513-1000
# decodes are 237 of 1683 and carry 57% of the output tokens; replayed in pieces, each paid 32 eager
# attention launches and the pieces' buffer copies. Capturing the ladder's 32 sizes past 512 costs a few
# seconds at start-up and little memory (all graphs share one pool, sized by the largest).
MAX_DECODE_GRAPH_BATCH = 1024
# weight_gemm="pagedref": the projections put on the project's Hopper GEMM (pagedref.kernels.gemm), those
# measured at or past cuBLAS at a 256-row decode step (bench gemm, H200; docs/benchmarks.md).
PAGEDREF_GEMM_OPS = ("gate_up", "down")


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


def device_defaults(device: str) -> dict[str, int]:
    """max_num_seqs and max_num_batched_tokens when not given: vLLM's defaults for the device."""
    if device == "cpu":
        return CPU_DEFAULTS
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return LARGE_GPU_DEFAULTS if memory >= LARGE_GPU_MEMORY_GIB * GiB else GPU_DEFAULTS


@dataclass
class SchedulerConfig:
    """What `Scheduler.schedule()` may put in one step, and how (vLLM's SchedulerConfig)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    prefill_first: bool = False  # vLLM v0's policy without chunking: a step admits prompts or decodes, never both
    async_scheduling: bool = False  # schedule step N+1 while step N runs (the engine's loop; pagedref.engine.llm)

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.prefill_first and self.enable_chunked_prefill:
            raise ValueError("prefill_first=True is vLLM v0's policy without chunked prefill: pass "
                             "enable_chunked_prefill=False with it (chunked prefill schedules decodes first)")


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: block size, how many blocks (or how to size it), prefix caching, swap space, layout."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (CUDA) or cpu_kv_cache_bytes (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 * MiB
    swap_space: float = 4.0  # GiB of CPU memory for preemption by swap
    enable_prefix_caching: bool = True
    kv_cache: str = "paged"  # or "contiguous" (stage 1's reservations: the serving benchmark's baseline)


SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`; `pagedref.engine.spec_decode`): each step a
    decoding sequence brings k draft tokens, and the target scores the k + 1 positions in one pass.

    - `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m, "prompt_lookup_min": 1}`:
      prompt lookup, the continuation of the latest earlier match of the sequence's last tokens in its own
      text (vLLM's rule for the lengths: neither given, both 5; one given, the other equals it);
    - `{"model": DRAFT_DIR, "num_speculative_tokens": k}` (method "draft_model"): a smaller model with the
      target's vocabulary, its own paged KV pool and block tables."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model's directory (method "draft_model")

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """vLLM's dict: every key checked, the method resolved ("model" alone means a draft model)."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict (vLLM's keys), got {config!r}")
        unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} (known: {', '.join(SPECULATIVE_KEYS)})")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method must be 'ngram' or 'draft_model' (or give a draft 'model'), "
                             f"got {config.get('method')!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required (the k draft tokens per step)")
        check_int("speculative_config num_speculative_tokens", config["num_speculative_tokens"], 1)
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if method == "ngram":
            if config.get("model") is not None:
                raise ValueError("speculative_config: method 'ngram' takes no draft 'model'")
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            check_int("speculative_config prompt_lookup_min", lo, 1)
            check_int("speculative_config prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi}")
        else:
            if not config.get("model"):
                raise ValueError("speculative_config: method 'draft_model' needs the draft's 'model' directory")
            if lo is not None or hi is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max belong to method 'ngram'")
        return cls(method, config["num_speculative_tokens"], hi, lo,
                   None if method == "ngram" else str(config["model"]))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class CompilationConfig:
    """CUDA graphs (`pagedref.engine.cuda_graph`): captured unless enforce_eager, on one CUDA GPU only."""

    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    max_capture_size: int = 2048


@dataclass
class EngineConfig:
    """Everything an engine is built from, validated (vLLM's VllmConfig): the model's own settings here."""

    model: str | Path
    hf_config: Any  # pagedref.models.ModelConfig: the checkpoint's config.json
    device: str  # "cpu" or "cuda[:N]" ("auto" resolved)
    dtype: torch.dtype  # "auto" resolved
    max_model_len: int
    seed: int
    max_logprobs: int
    record_logits: bool
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    compilation: CompilationConfig
    scheduler_cls: type | None  # None: pagedref's Scheduler / BlockManager (the course grades a learner's with them)
    block_manager_cls: type | None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    weight_gemm: tuple[str, ...] = ()  # projections on pagedref.kernels.gemm (models.llama.WEIGHT_GEMM_OPS)

    @property
    def uses_cuda_graphs(self) -> bool:
        return (not self.compilation.enforce_eager and self.device != "cpu"
                and self.parallel.tensor_parallel_size == 1)


@dataclass
class EngineArgs:
    """Every `LLM` keyword, with its default (vLLM's EngineArgs). See `LLM` for what each one means."""

    model: str | Path
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    preemption_mode: str = "recompute"
    kv_cache: str = "paged"
    swap_space: float = 4.0
    cpu_kv_cache_bytes: int = 256 * MiB
    seed: int = 0
    record_logits: bool = False
    scheduler_cls: type | None = None
    block_manager_cls: type | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    max_capture_size: int = 2048
    prefill_first: bool = False
    max_logprobs: int = 20
    async_scheduling: bool | None = None  # None: on with CUDA and one GPU (vLLM's --async-scheduling)
    speculative_config: dict[str, Any] | None = None  # vLLM's keys: see SpeculativeConfig
    weight_gemm: str | tuple[str, ...] = "torch"  # "torch" (cuBLAS), "pagedref" (PAGEDREF_GEMM_OPS), or the ops

    def create_engine_config(self) -> EngineConfig:
        """Check every argument (cheap ones first, then those that need the checkpoint's config.json) and
        resolve the automatic ones. Loads nothing but config.json."""
        from pagedref.distributed import check_tensor_parallel_size
        from pagedref.models import ModelConfig, resolve_dtype

        device = resolve_device(self.device)
        check_int("block_size", self.block_size, 1)
        defaults = device_defaults(device)
        if self.kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {self.kv_cache!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        check_int("max_seq_len_to_capture", self.max_seq_len_to_capture, 1)
        check_int("max_capture_size", self.max_capture_size, 1)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")

        weight_gemm = resolve_weight_gemm(self.weight_gemm, device, self.tensor_parallel_size)

        hf_config = ModelConfig.from_pretrained(self.model)  # config.json, architecture: before anything heavy
        dtype = resolve_dtype(("float32" if device == "cpu" else hf_config.dtype) if self.dtype == "auto" else self.dtype)
        check_tensor_parallel_size(hf_config, self.tensor_parallel_size)
        tp_size = self.tensor_parallel_size
        max_model_len = hf_config.max_position_embeddings if self.max_model_len is None else self.max_model_len
        check_int("max_model_len", max_model_len, 1)
        if max_model_len > hf_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is more than the model's max_position_embeddings="
                             f"{hf_config.max_position_embeddings}")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = defaults["max_num_batched_tokens"]
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        max_num_seqs = defaults["max_num_seqs"] if self.max_num_seqs is None else self.max_num_seqs
        # the scheduler's own checks (limits, preemption_mode, prefill_first), in one place: its config
        scheduler = SchedulerConfig(max_num_seqs, budget, self.enable_chunked_prefill, self.preemption_mode,
                                    self.prefill_first)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} < max_model_len={max_model_len}: "
                             "without chunked prefill a whole prompt must fit in one step")
        speculative = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        if speculative is not None:
            check_speculative(speculative, hf_config, max_model_len, tp_size, self.kv_cache, self.async_scheduling)
        async_scheduling = self.async_scheduling
        if async_scheduling is None:  # vLLM's --async-scheduling: what hides the host's time behind the GPU's
            async_scheduling = device != "cpu" and tp_size == 1 and speculative is None
        elif async_scheduling and tp_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size=1: the workers would need each step's "
                             "sampled tokens on their own GPUs (tensor parallelism schedules synchronously)")
        scheduler.async_scheduling = bool(async_scheduling)
        return EngineConfig(
            model=self.model, hf_config=hf_config, device=device, dtype=dtype, max_model_len=max_model_len,
            seed=self.seed, max_logprobs=self.max_logprobs, record_logits=self.record_logits,
            cache=CacheConfig(self.block_size, self.num_kv_blocks, self.gpu_memory_utilization, self.cpu_kv_cache_bytes,
                              self.swap_space, self.enable_prefix_caching, self.kv_cache),
            scheduler=scheduler,
            parallel=ParallelConfig(tp_size),
            compilation=CompilationConfig(self.enforce_eager, self.max_seq_len_to_capture, self.max_capture_size),
            scheduler_cls=self.scheduler_cls, block_manager_cls=self.block_manager_cls, speculative=speculative,
            weight_gemm=weight_gemm,
        )


def resolve_weight_gemm(weight_gemm: str | tuple[str, ...] | list[str], device: str, tp_size: int) -> tuple[str, ...]:
    """"torch" -> () (cuBLAS for every projection), "pagedref" -> PAGEDREF_GEMM_OPS, or a list of op names
    (models.llama.WEIGHT_GEMM_OPS), checked: the Hopper GEMM needs one sm_90 CUDA GPU."""
    from pagedref.models.llama import WEIGHT_GEMM_OPS

    if weight_gemm == "torch":
        return ()
    ops = PAGEDREF_GEMM_OPS if weight_gemm == "pagedref" else weight_gemm
    if isinstance(ops, str) or not all(isinstance(op, str) for op in ops):
        raise ValueError(f"weight_gemm must be 'torch', 'pagedref' or a list of {', '.join(WEIGHT_GEMM_OPS)}, "
                         f"got {weight_gemm!r}")
    unknown = sorted(set(ops) - set(WEIGHT_GEMM_OPS))
    if unknown:
        raise ValueError(f"weight_gemm: unknown op(s) {unknown} (known: {', '.join(WEIGHT_GEMM_OPS)})")
    if ops and device == "cpu":
        raise ValueError("weight_gemm: the Hopper GEMM (pagedref.kernels.gemm) runs on an sm_90 CUDA GPU; "
                         "on the CPU every projection is torch's (use weight_gemm='torch')")
    capability = torch.cuda.get_device_capability(torch.device(device)) if ops else None
    if ops and capability != (9, 0):
        raise ValueError(f"weight_gemm: the Hopper GEMM needs compute capability 9.0 (sm_90), {device} has {capability}")
    if ops and tp_size > 1:
        raise ValueError("weight_gemm: the Hopper GEMM path takes tensor_parallel_size=1 (the workers load "
                         "their own shards with cuBLAS)")
    return tuple(sorted(set(ops), key=WEIGHT_GEMM_OPS.index))


def check_speculative(spec: SpeculativeConfig, hf_config, max_model_len: int, tp_size: int, kv_cache: str,
                      async_scheduling: bool | None) -> None:
    """What speculative decoding cannot be combined with (yet), refused by name; a draft model must share
    the target's vocabulary and reach max_model_len. Reads the draft's config.json only."""
    from pagedref.models import ModelConfig

    if async_scheduling:
        raise ValueError("speculative_config with async_scheduling=True: a step's drafts follow the tokens the step "
                         "before accepted, so speculative steps are scheduled synchronously (leave async_scheduling unset)")
    if tp_size > 1:
        raise ValueError("speculative_config needs tensor_parallel_size=1 (the draft and the rollback run on one rank)")
    if kv_cache != "paged":
        raise ValueError(f"speculative_config needs kv_cache='paged', got {kv_cache!r}: rejected tokens give their blocks back")
    if spec.method == "draft_model":
        draft = ModelConfig.from_pretrained(spec.model)
        if draft.vocab_size != hf_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size={draft.vocab_size} differs from the "
                             f"target's {hf_config.vocab_size}: the draft must propose the target's token ids")
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model's max_position_embeddings="
                             f"{draft.max_position_embeddings} is less than max_model_len={max_model_len}")
