"""The engine on CUDA (the stage 5 kernels): pool sizing by profiling, preemption, sharing, the baseline.

The numerics checks against llama2.c and transformers run on CUDA in test_engine_models.py (its
`cuda` parameters). On the GPU the numerics are not batch invariant (batched matrix products), so
here outputs are compared as greedy tokens, on models whose top-2 logit gaps dwarf float32 rounding.
Run on the device: `pytest tests -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from helpers import read_reference, model_path
from pagedref import LLM, SamplingParams
from pagedref.engine import BeamSearchParams
from pagedref.kernels import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]

MODEL = "tiny-llama3-hd64"
CASES = read_reference(MODEL, "hf_reference.json")["cases"]
PROMPTS = [{"prompt_token_ids": c["prompt_ids"]} for c in CASES]
GREEDY = SamplingParams(temperature=0.0, max_tokens=len(CASES[0]["greedy_ids"]), ignore_eos=True)


def test_the_pool_is_sized_from_gpu_memory_utilization_after_profiling(gpu_to_itself):
    # blocks = (utilization x total - the step's peak - memory held by others) / block bytes: 0.3 more of the
    # device is 0.3 x total more bytes of blocks, whatever the weights, the peak and other processes hold.
    free_before, total = torch.cuda.mem_get_info()
    sizes = []
    for utilization in (0.3, 0.6):
        llm = LLM(model_path(MODEL), device="cuda", gpu_memory_utilization=utilization, max_model_len=512)
        sizes.append(llm.num_kv_blocks)
        caches = llm.llm_engine.runner.kv_caches  # [num_blocks, block_size, num_kv_heads, head_dim] each
        block_bytes = sum(k.nbytes + v.nbytes for k, v in caches) // len(caches[0][0])
        del caches  # no reference of the test's may keep the pool alive past close()
        outs = llm.generate(PROMPTS[:1], GREEDY)
        assert outs[0].outputs[0].token_ids == CASES[0]["greedy_ids"]
        llm.close()
    grown = (sizes[1] - sizes[0]) * block_bytes
    assert abs(grown - 0.3 * total) < 0.02 * total, (
        f"0.3 more of the device must be 0.3 of it more in blocks: {sizes} blocks of {block_bytes} bytes, "
        f"{grown / total:.3f} of {total} bytes")
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after > free_before - 0.02 * total, "close() must give the KV cache back"


def test_the_seed_style_call_that_names_no_device_runs_on_cuda():
    # vLLM's defaults: device "auto" takes the GPU, dtype "auto" the checkpoint's dtype (float32 here).
    llm = LLM(model=str(model_path(MODEL)), tensor_parallel_size=1, gpu_memory_utilization=0.5,
              enable_chunked_prefill=True, max_num_batched_tokens=2048, max_model_len=512)
    stats = llm.get_stats()
    assert (stats["device"], stats["dtype"]) == ("cuda", "float32"), stats
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == CASES[0]["greedy_ids"]
    llm.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_tiny_pool_keeps_every_request_right(mode):
    # 512 / 16 = 32 blocks hold one sequence of max_model_len; 4 requests of up to 364 tokens need ~45.
    llm = LLM(model_path(MODEL), device="cuda", max_model_len=512, num_kv_blocks=34, preemption_mode=mode,
              max_num_batched_tokens=128)
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and (mode == "recompute" or stats["num_swap_outs"] > 0)
    for out, case in zip(outs, CASES):
        assert out.outputs[0].token_ids == case["greedy_ids"]
    assert llm.llm_engine.block_manager.all_free()
    llm.close()


def test_parallel_sampling_beam_search_and_the_contiguous_baseline():
    llm = LLM(model_path("stories260K"), device="cuda", num_kv_blocks=256)
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=20))[0]
    assert [len(c.token_ids) for c in out.outputs] == [20, 20, 20]
    again = llm.generate("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=20))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs], "seeded: reproducible"
    beams = llm.beam_search(["Lily and Tom"], BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    scores = [b.cum_logprob / len(b.tokens) for b in beams]
    assert len(beams) == 3 and scores == sorted(scores, reverse=True)
    assert llm.llm_engine.block_manager.all_free()
    case = read_reference("stories260K", "llama2c_reference.json")["cases"][1]
    contiguous = LLM(model_path("stories260K"), device="cuda", num_kv_blocks=256, kv_cache="contiguous")
    got = contiguous.generate(case["prompt"], SamplingParams(temperature=0, max_tokens=50))[0].outputs[0].token_ids
    assert got == case["greedy_ids"][:50]


@pytest.mark.skipif(not gpu_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")
def test_on_the_hopper_gemm_a_requests_logits_do_not_depend_on_its_batch(monkeypatch):
    # With every projection on kernels.gemm (a tile fixed by the weight, never by the row count), each
    # per-token operation of the step is the same kernel on the same row in any batch, and the attention
    # kernels are batch-invariant by their contract: so alone or beside three others, in any step's graph,
    # a request's logits are the same bits. (With cuBLAS, whose kernel depends on the row count, they are not.)
    from collections import Counter

    from pagedref.kernels import gemm
    from pagedref.models.llama import WEIGHT_GEMM_OPS

    calls = Counter()
    for name in ("linear", "silu_mul_linear", "linear_add_rms_norm"):
        def counted(*args, _real=getattr(gemm, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(gemm, name, counted)
    llm = LLM(model_path(MODEL), device="cuda", dtype="bfloat16", max_model_len=512, num_kv_blocks=256,
              weight_gemm=WEIGHT_GEMM_OPS, record_logits=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    assert all(calls[name] > 0 for name in ("linear", "silu_mul_linear", "linear_add_rms_norm")), \
        f"the projections must run on kernels.gemm (down with the next norm in a decode step): {calls}"
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate([prompt], params)[0].outputs[0]
        assert alone.token_ids == batched.outputs[0].token_ids
        assert torch.equal(alone.logits, batched.outputs[0].logits), "a request's logits changed with its batch"
    assert llm.get_stats()["num_cuda_graph_replays"] > 0
    llm.close()

