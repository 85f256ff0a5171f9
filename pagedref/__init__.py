"""pagedref: PagedAttention serving, explained — a reference implementation and a course.

`from pagedref import LLM, SamplingParams` is the serving API (vLLM's names); the layers underneath
are one idea per module: attention (the oracle) → memory (contiguous baseline, block allocator,
block table, sharing) → kernels (CUDA through CuPy) → engine (continuous batching, chunked prefill).
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Imported lazily so that `import pagedref.memory...` (the early stages) needs no torch.
    if name in ("LLM",):
        from pagedref.engine.llm import LLM

        return LLM
    if name in ("SamplingParams",):
        from pagedref.engine.sampling import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from pagedref.engine.sampling import BeamSearchParams

        return BeamSearchParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedref.engine import sequence

        return getattr(sequence, name)
    raise AttributeError(f"module 'pagedref' has no attribute {name!r}")
