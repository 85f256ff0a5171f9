"""Attention backends: one interface, two implementations.

`reference` (CPU): reads K/V through the block tables into numpy and calls the oracle row by row, so
it is bit-identical to `pagedref.attention.attention`. `cuda`: the stage 5 kernels through CuPy.
Both take the step's `AttentionMetadata` (built once per step by the model runner) and write the new
K/V into their slots before reading.
"""

from pagedref.backends.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_backend"]


def get_backend(name: str):
    """`get_backend("reference")` or `get_backend("cuda")` → a backend object with `.forward(...)`."""
    if name == "reference":
        from pagedref.backends.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "cuda":
        from pagedref.backends.cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown attention backend {name!r}: choose 'reference' or 'cuda'")
