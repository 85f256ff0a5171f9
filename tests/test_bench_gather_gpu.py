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


@pytest.mark.parametrize("pattern", ["v3 lanes", "whole rows"])
def test_a_cta_per_short_context_reads_the_bytes_of_its_pattern(pattern):
    # --launch-constant's read: a CTA per KV head and whole 208-token context (13 steps, its warps ending unevenly)
    from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase
    from pagedref.kernels.kv_read import kv_read

    case = DecodeCase(batch=5, context=208, seed=6)
    out = torch.zeros(5, 1, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    kv_read(case.k_cache, case.v_cache, case.block_tables, out, pattern, 0, partition_size=208)
    torch.cuda.synchronize()
    want = torch.from_numpy(expected_checksums(case.k_cache, case.v_cache, case.block_tables, pattern, 208))
    assert torch.equal(out.cpu(), want), f"{pattern}: a 208-token CTA's checksum is not that of its bytes"


def test_a_cta_per_superpartition_reads_the_bytes_of_its_pattern():
    # `bench gather --partition 4096`: a CTA per KV head and 4096 tokens, the default decode's grid for a few long
    # sequences (a CTA per folded superpartition)
    from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase
    from pagedref.kernels.kv_read import kv_read

    case = DecodeCase(batch=2, context=8192, seed=7)
    out = torch.zeros(2, 2, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    kv_read(case.k_cache, case.v_cache, case.block_tables, out, "v3 lanes", 12, partition_size=4096)
    torch.cuda.synchronize()
    want = torch.from_numpy(expected_checksums(case.k_cache, case.v_cache, case.block_tables, "v3 lanes", 4096))
    assert torch.equal(out.cpu(), want), "a 4096-token CTA's checksum is not that of its bytes"


def test_the_launch_constant_is_fitted_from_decode_and_the_read_side_by_side():
    from pagedref.bench.gather import launch_constant

    # 64 and 512 sequences: 8x the bytes take clearly longer, so the fitted rate is positive (a handful of sequences
    # would be all constant, and the fit's slope noise).
    (row,) = launch_constant([208], [64, 512], reps=3)
    assert [p["batch"] for p in row["points"]] == [64, 512] and row["context"] == 208
    for kind in ("decode", "read"):
        first, last = row["points"]
        assert 0 < first[f"{kind}_us"] < last[f"{kind}_us"], row
        assert row[kind]["GBps"] > 0 and row[kind]["constant_us"] < first[f"{kind}_us"], row

