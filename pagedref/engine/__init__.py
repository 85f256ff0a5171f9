"""The serving engine (stages 6–7): continuous batching and chunked prefill on the paged KV cache.

`LLM` / `LLMEngine` (llm.py) run the step loop; `Scheduler` (scheduler.py) forms each step's batch
within the token budget and preempts when blocks run out; `BlockManager` (block_manager.py) maps
sequences onto the memory layer (stages 2–4) and a CPU swap pool; `ModelRunner` (model_runner.py)
builds the step's attention metadata and runs the model; the sampler and `SamplingParams`
(sampling.py); `Sequence` and the outputs (sequence.py); beam search on forks (beam_search.py).
"""

from pagedref.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedref.engine.llm import LLM, LLMEngine
from pagedref.engine.sampling import BeamSearchParams, SamplingParams
from pagedref.engine.sequence import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "RequestOutput", "CompletionOutput", "Logprob"]
