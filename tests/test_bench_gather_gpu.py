"""bench gather's read kernel (cuda/kv_read.cu) reads exactly the bytes it claims: every pattern reads each K/V
byte of the batch once, a CTA the bytes its pattern names (so the roofline it measures is of the right stream),
whatever shared memory it reserves and whatever order the blocks are in."""

import pytest
import torch

from pagedref.kernels import build, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]


@pytest.mark.parametrize("pattern", list(build.KV_READ_PATTERNS))
@pytest.mark.parametrize("shared_kb", [0, 36])
def test_each_cta_reads_the_bytes_of_its_pattern(pattern, shared_kb):
    from pagedref.bench.gather import PARTITION_SIZE, expected_checksums, read_fn
    from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase

    case = DecodeCase(batch=3, context=2 * PARTITION_SIZE, seed=5)
    out = torch.zeros(3, 2, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    read_fn(case, pattern, shared_kb, case.block_tables, out)()
    torch.cuda.synchronize()
    want = torch.from_numpy(expected_checksums(case, pattern, case.block_tables))
    assert torch.equal(out.cpu(), want), f"{pattern}: the CTAs' checksums are not those of the bytes they must read"
