"""vLLM's admission watermark (`pagedref.engine.block_manager.WATERMARK`, 1% of the pool).

Admitting a request into the last free blocks only preempts somebody a few steps later, when the
running sequences need their next blocks, and preemption by recompute throws that work away. So a
new request is admitted only if a watermark of free blocks remains afterwards; growth of the running
sequences (`can_append`) may use every block, and an idle pool admits whatever fits.
"""

from __future__ import annotations

from pagedref.engine.block_manager import WATERMARK, BlockManager
from pagedref.engine.sampling import SamplingParams
from pagedref.engine.sequence import Sequence

BS = 16


def _seq(seq_id: int, num_blocks: int) -> Sequence:
    tokens = [3 + (seq_id * 7 + i) % 50 for i in range(num_blocks * BS)]
    return Sequence(seq_id, f"r{seq_id}", tokens, len(tokens), SamplingParams())


def test_admission_leaves_the_watermark_free_for_the_running():
    bm = BlockManager(400, BS, 8192, enable_prefix_caching=False)
    assert WATERMARK == 0.01 and bm.watermark_blocks == 4, "vLLM's int(0.01 * num_blocks)"
    running = _seq(0, 390)
    bm.allocate(running, len(running.token_ids))  # 10 blocks left
    assert bm.can_allocate(_seq(1, 6), 6 * BS), "6 blocks leave 4 free: the watermark holds"
    assert not bm.can_allocate(_seq(2, 7), 7 * BS), "7 blocks fit, but would leave only 3 free"
    assert bm.can_append(running, 10 * BS), "the running sequence itself may grow into every block"


def test_an_idle_pool_admits_whatever_fits():
    bm = BlockManager(400, BS, 400 * BS, enable_prefix_caching=False)
    assert bm.can_allocate(_seq(0, 400), 400 * BS), "the watermark must never keep a request out for good"


def test_small_pools_have_no_watermark():
    assert BlockManager(99, BS, 1024).watermark_blocks == 0
    assert BlockManager(400, BS, 1024, watermark=0.0).watermark_blocks == 0
