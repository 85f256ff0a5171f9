"""The launcher of `cuda/kv_read.cu`: a kernel that only reads the paged K/V pool (`bench gather`'s roofline).

One idea: decode attention streams K/V, so the speed at which the GPU reads the pool in the decode kernel's own
access pattern, with its occupancy and grid and nothing computed, is its ceiling; `kv_read` is that read, in v3's
per-lane pattern ("v3 lanes"), in whole 256-byte rows, or in whole blocks (every KV head), with shared memory
reserved per CTA and never touched (what a kernel's shared memory costs the stream).

Invariant: a launch reads each K/V byte of its sequences once, partition by partition (a CTA per KV head and
1024-token partition), and xors each CTA's checksum of the 32-bit words it read into out[seq, partition, kv_head]
(tests/test_bench_gather_gpu.py checks them against the bytes each pattern names). Scope: v3's measured layout,
16-bit K/V at head_dim 128 in 16-token blocks, 8 KV heads for whole blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedref.kernels import build, launch, validate
from pagedref.kernels.splitk import MMA_MIN_CTAS_PER_SM, MMA_PARTITION_SIZE

PARTITION_SIZE = MMA_PARTITION_SIZE  # tokens a CTA reads: v3's partition (build.kv_read_config passes it)
SM_SHARED_KB = 228  # an sm_90 SM's most shared memory (of its 256 KB of L1 and shared memory together)
DRIVER_RESERVED_KB = 1  # shared memory the driver reserves for each CTA
CTAS_PER_SM = MMA_MIN_CTAS_PER_SM[128]  # v3's occupancy at head_dim 128 (kv_read.cu's __launch_bounds__ too)
MAX_SHARED_KB = SM_SHARED_KB // CTAS_PER_SM - DRIVER_RESERVED_KB  # 56: what 4 CTAs an SM can each reserve


def carveout(shared_kb: int) -> int:
    """The percentage of an SM's shared-memory capacity that 4 CTAs of `shared_kb` KB need (each also takes the
    1 KB the driver reserves): the read's carve-out, as the decode kernel gets it. Left to the driver, this
    kernel of few registers would be given shared memory for the ~16 CTAs an SM its registers allow, and so a
    smaller L1 than decode's: at 12 KB a CTA it read ~2% slower than with this preference
    (docs/results/carveout-2026-12-05.json)."""
    return -(-100 * CTAS_PER_SM * (shared_kb + DRIVER_RESERVED_KB) // SM_SHARED_KB)


def kv_read(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor,
            pattern: str = "v3 lanes", shared_kb: int = 0, partition_size: int = PARTITION_SIZE) -> None:
    """Read every K/V byte of the sequences of `block_tables` [num_seqs, blocks] (each sequence blocks * 16
    tokens, a multiple of partition_size) from k/v_cache [num_blocks, 16, num_kv_heads, 128] as `pattern` does,
    a CTA per KV head and partition_size tokens (a multiple of 16; v3's partition by default, a whole short context
    for `bench gather --launch-constant`), each reserving `shared_kb` KB of shared memory; out [num_seqs,
    partitions, num_kv_heads] int32 gets each CTA's checksum xor'ed into it."""
    if pattern not in build.KV_READ_PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}: choose from {list(build.KV_READ_PATTERNS)}")
    unit = 128 if pattern == "whole blocks" else 16  # tokens: a 16-token step; whole blocks, 8 steps (a block a head)
    if partition_size <= 0 or partition_size % unit:
        raise ValueError(f"partition_size must be a positive multiple of {unit} for {pattern!r}, got {partition_size}")
    if not 0 <= shared_kb <= MAX_SHARED_KB:
        raise ValueError(f"shared_kb takes 0 to {MAX_SHARED_KB} KB, got {shared_kb}")
    validate.check_cache(k_cache, v_cache)
    validate.check_tensor(block_tables, "block_tables", "[num_seqs, blocks]", 2, (torch.int32,), k_cache.device)
    num_seqs, blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if (block_size, head_dim, k_cache.element_size()) != (16, 128, 2):
        raise ValueError(f"kv_read reads 16-bit K/V of 16-token blocks at head_dim 128, got {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}")
    if pattern == "whole blocks" and num_kv_heads != 8:
        raise ValueError(f"whole blocks are read a quarter-block a step: 8 KV heads, got {num_kv_heads}")
    if blocks * block_size % partition_size:
        raise ValueError(f"block_tables must hold whole {partition_size}-token partitions, got {blocks} blocks")
    parts = blocks * block_size // partition_size
    validate.check_tensor(out, "out", "[num_seqs, partitions, num_kv_heads]", 3, (torch.int32,), k_cache.device)
    if out.shape != (num_seqs, parts, num_kv_heads):
        raise ValueError(f"out must be [{num_seqs}, {parts}, {num_kv_heads}], got {tuple(out.shape)}")
    validate.require_cuda(k_cache, "k_cache")
    args = (launch._ptr(k_cache), launch._ptr(v_cache), launch._ptr(block_tables), np.int32(blocks), launch._ptr(out))
    launch._launch(build.kv_read_config(pattern, partition_size), "kv_read", k_cache.device,
                   (num_kv_heads, parts, num_seqs), args, shared_mem=shared_kb << 10, carveout=carveout(shared_kb))
