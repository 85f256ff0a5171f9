"""bench kernel's decode problem at a context that is not a whole number of blocks: the pool holds a partial last
block, and pagedref, SDPA's contiguous copy and FlashInfer's plan all read exactly the context's tokens."""

import pytest
import torch

from pagedref.kernels import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]


def test_a_context_with_a_partial_last_block_is_timed_on_its_own_tokens():
    from pagedref.bench.kernel import BLOCK_SIZE, DecodeCase, bench_decode

    case = DecodeCase(batch=3, context=200, seed=1)
    nb, last = case.pages()
    assert case.block_tables.shape == (3, 13) and nb == 13 and last.tolist() == [200 - 12 * BLOCK_SIZE] * 3
    k, v = case.contiguous_kv()
    assert k.shape == v.shape == (3, case.k_cache.shape[2], 200, case.k_cache.shape[3])
    assert torch.equal(k[1, :, 199], case.k_cache[case.block_tables[1, 12].long(), 199 % BLOCK_SIZE])
    res = bench_decode(3, 200, reps=2, candidates=[])
    assert res["rel_err_vs_sdpa"] < 1e-2, res
