"""The paged-attention CUDA kernels (stage 5), compiled at run time by CuPy and launched on torch tensors.

One idea: the same paged KV pool the CPU reference reads through block tables is read on the GPU by
hand-written kernels (`cuda/*.cu`): decode attention with split-K partitions (flash-decoding;
version 3 on the tensor cores), prefill attention for variable-length query chunks (version 2
on the tensor cores; version 3 on Hopper's wgmma, the default on sm_90), and the two pool writes
(reshape_and_cache, copy_blocks).

Invariant (the CUDA half of the numerics contract): a sequence's output is bit-identical whatever
physical blocks hold its K/V and whatever else is in the batch; against the float64 oracle it is
within 1e-5 (fp32) or 1e-2 (fp16/bf16) norm-relative. Bit equality with the CPU oracle or across
GPU models is not promised: the sums are associated differently and expf differs by an ulp.

Importing this package needs neither a GPU nor cupy; cupy is imported when a kernel is launched.
"""

from pagedref.kernels.launch import copy_blocks, paged_attention_decode, paged_prefill, reshape_and_cache
from pagedref.kernels.splitk import (PARTITION_SIZE, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS, heads_per_cta,
                                     num_partitions)

__all__ = [
    "PARTITION_SIZE", "SUPPORTED_BLOCK_SIZES", "SUPPORTED_HEAD_DIMS", "copy_blocks", "gpu_available",
    "heads_per_cta", "num_partitions", "paged_attention_decode", "paged_prefill", "reshape_and_cache",
]


def gpu_available() -> bool:
    """True when torch sees a CUDA device and cupy is importable: the GPU tests can run."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, a broken install: no GPU for our purposes
        return False
