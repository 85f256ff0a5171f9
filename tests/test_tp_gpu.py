"""Tensor parallelism on 2 GPUs (NCCL, the CUDA kernels): TP=2 gives TP=1's greedy tokens in float32.

Run on a machine with 2 GPUs (kind nvidia-h200-x2): `pytest tests/test_tp_gpu.py`. Skipped cleanly
elsewhere. Rank 0 is the test process on cuda:0; it spawns rank 1 on cuda:1. NVLink SHARP stays
off (NCCL_NVLS_ENABLE=0, set for every rank unless the environment already says otherwise).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers import model_path
from pagedref import LLM, SamplingParams
from pagedref.kernels import gpu_available
from test_tp_engine import PROMPTS, no_hang  # noqa: F401  (the autouse fixture: no hang, no process left)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or not gpu_available(), reason="needs 2 CUDA GPUs and cupy"),
]

TEST_TIMEOUT_S = 300  # CUDA start-up and the kernels' first compilation included
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(name: str, tp: int, **kw):
    llm = LLM(model_path(name), device="cuda", dtype="float32", max_model_len=64, record_logits=True,
              tensor_parallel_size=tp, **kw)
    try:
        return [(c.token_ids, c.logits) for o in llm.generate(PROMPTS, GREEDY) for c in o.outputs]
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-mistral-hd32", "stories260K"])
def test_tp2_greedy_tokens_equal_tp1_on_two_gpus(name):
    kw = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)  # chunked prefill too
    tp1, tp2 = run(name, 1, **kw), run(name, 2, **kw)
    for (ids, logits), (tp_ids, tp_logits) in zip(tp1, tp2):
        assert tp_ids == ids
        assert torch.isfinite(tp_logits).all()
        assert (tp_logits - logits).abs().max().item() <= 1e-3  # float32, reassociated sums


def test_kv_pool_sized_by_profiling_every_gpu():
    # No num_kv_blocks: each rank profiles its own GPU, and all take the smallest count.
    llm = LLM(model_path("tiny-llama3-hd64"), device="cuda", dtype="float32", max_model_len=64,
              gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        assert llm.num_kv_blocks > 0
        [out] = llm.generate(PROMPTS[1], GREEDY)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.close()


def test_a_killed_worker_fails_the_engine_on_nccl_too():
    # The next step's broadcast (gloo) fails at once; a worker that dies inside a forward pass, where
    # NCCL would wait for it until the timeout, is caught by the pool's watch thread (it aborts NCCL).
    from pagedref.distributed.worker import TPWorkerError

    llm = LLM(model_path("tiny-llama3-hd64"), device="cuda", dtype="float32", max_model_len=64,
              num_kv_blocks=16, tensor_parallel_size=2)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[0], GREEDY)
    engine.step()
    worker = engine.runner.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(TPWorkerError, match="worker rank 1 failed: exited with signal SIGKILL"):
        for _ in range(GREEDY.max_tokens):
            engine.step()
    llm.close()
