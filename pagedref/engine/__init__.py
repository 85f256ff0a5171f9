"""The serving engine (stages 6–8): continuous batching, chunked prefill and speculative decoding on the
paged KV cache.

A step is three calls (the step contract, `scheduler.py`): `Scheduler.schedule()` forms the step's
batch within the token budget and preempts when blocks run out; `ModelRunner.execute()`
(model_runner.py) builds the step's attention metadata, runs the model and samples; `Scheduler.update()`
applies the sampled tokens (forks, stop rules, freeing). `LLM` / `LLMEngine` (llm.py) run the loop,
synchronously or with async scheduling; `EngineArgs` and the configs (config.py); `BlockManager`
(block_manager.py) maps sequences onto the memory layer (stages 2–4) and a CPU swap pool;
`SamplingParams` (sampling_params.py) and the sampler (sampling.py); `Sequence` and the outputs
(sequence.py); the stop rules (stop_checker.py); beam search on forks (beam_search.py); draft proposers
and the rejection sampler (spec_decode.py); CUDA graphs of decode steps and of a step's pieces (cuda_graph.py).
"""

from pagedref.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedref.engine.config import EngineArgs
from pagedref.engine.llm import LLM, LLMEngine
from pagedref.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedref.engine.sequence import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "RequestOutput", "CompletionOutput", "Logprob"]
