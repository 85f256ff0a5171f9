"""bench gather's read kernel (cuda/kv_read.cu) reads exactly the bytes it claims: every pattern reads each K/V
byte of the batch once, a CTA the bytes its pattern names (so the roofline it measures is of the right stream),
whatever shared memory it reserves."""

import numpy as np
import pytest
import torch

from pagedref.kernels import build, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]


def expected_checksums(k_cache, v_cache, block_tables, pattern: str, partition_size: int) -> np.ndarray:
    """The oracle: each CTA's xor of the 32-bit words its pattern reads, [num_seqs, partitions, num_kv_heads]."""
    k = k_cache.view(torch.int32).cpu().numpy()  # [blocks, 16, heads, 64 words]
    v = v_cache.view(torch.int32).cpu().numpy()
    tables = block_tables.cpu().numpy()
    steps, heads = partition_size // 16, k.shape[2]
    out = np.zeros((tables.shape[0], tables.shape[1] // steps, heads), dtype=np.int32)
    for s, p, h in np.ndindex(*out.shape):
        blocks = tables[s, p * steps:(p + 1) * steps]
        if pattern == "whole blocks":  # blocks h, h + heads, ... of the partition, every head
            words = np.concatenate([k[blocks[h::heads]].ravel(), v[blocks[h::heads]].ravel()])
        else:  # kv head h of every block of the partition
            words = np.concatenate([k[blocks, :, h].ravel(), v[blocks, :, h].ravel()])
        out[s, p, h] = np.bitwise_xor.reduce(words)
    return out


@pytest.mark.parametrize("pattern", list(build.KV_READ_PATTERNS))
@pytest.mark.parametrize("shared_kb", [0, 36])
def test_each_cta_reads_the_bytes_of_its_pattern(pattern, shared_kb):
    from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase
    from pagedref.kernels.kv_read import PARTITION_SIZE, kv_read

    case = DecodeCase(batch=3, context=2 * PARTITION_SIZE, seed=5)
    out = torch.zeros(3, 2, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    kv_read(case.k_cache, case.v_cache, case.block_tables, out, pattern, shared_kb)
    torch.cuda.synchronize()
    want = torch.from_numpy(expected_checksums(case.k_cache, case.v_cache, case.block_tables, pattern, PARTITION_SIZE))
    assert torch.equal(out.cpu(), want), f"{pattern}: the CTAs' checksums are not those of the bytes they must read"
