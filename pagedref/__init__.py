"""pagedref: PagedAttention serving, explained — a reference implementation and a course.

`from pagedref import LLM, SamplingParams` is the serving API (vLLM's names); the layers underneath
are one idea per module: attention (the oracle) → memory (contiguous baseline, block allocator,
block table, sharing) → kernels (CUDA through CuPy) → engine (continuous batching, chunked prefill).
"""

from pathlib import Path

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineArgs", "RequestOutput", "CompletionOutput", "DEFAULT_MODEL"]

# The small Llama that ships inside the package (trained by `python -m pagedref.train_default` on this
# project's own lessons): `LLM(model=pagedref.DEFAULT_MODEL)`, and what `python -m pagedref.generate` runs.
DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default-model"


def __getattr__(name: str):
    # Imported lazily so that `import pagedref.memory...` (the early stages) needs no torch.
    if name in ("LLM",):
        from pagedref.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from pagedref.engine import sampling_params

        return getattr(sampling_params, name)
    if name == "EngineArgs":
        from pagedref.engine.config import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedref.engine import sequence

        return getattr(sequence, name)
    raise AttributeError(f"module 'pagedref' has no attribute {name!r}")
