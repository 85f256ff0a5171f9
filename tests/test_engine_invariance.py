"""Batch invariance of the CPU engine, bit for bit (issue 4's numerics contract).

Each request's logits (every row that chose a token, `LLM(record_logits=True)`) must be bit-identical
whether it runs alone or in continuous batching: chunked prefill with budgets 1, 7 and 64, without
chunking, the prefix cache cold and warm, requests arriving while others run, and after preemption by
recompute and by swap in a KV pool small enough that preemption happens. Seeded sampling requests
(n = 1 and n = 2) must draw the same tokens too. No block may leak after any of it.
"""

from __future__ import annotations

import pytest
import torch

from helpers import read_reference, model_path
from pagedref import LLM, SamplingParams

MAX_MODEL_LEN = 64
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside"
# llama2.c's empty prompt is its BOS token alone: an empty text is refused (as vLLM does), its ids are not.
PROMPTS = [c["prompt"] or {"prompt_token_ids": c["prompt_ids"]}
           for c in read_reference("stories260K", "llama2c_reference.json")["cases"]] + [
    STORY + " in the park.",  # these two share 2 full blocks with each other: prefix-cache hits in one batch
    STORY + " with her dog.",
]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]
PARAMS[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
PARAMS[5] = SamplingParams(n=2, temperature=1.0, top_k=20, seed=3, max_tokens=24, ignore_eos=True)


def make_llm(**kw) -> LLM:
    return LLM(model_path("stories260K"), device="cpu", max_model_len=MAX_MODEL_LEN, record_logits=True, **kw)


def completions(outputs):
    return [[(c.token_ids, c.logits) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def alone():
    """Every request on its own, prefix cache off, whole prompts: the reference."""
    llm = make_llm(num_kv_blocks=64, enable_prefix_caching=False)
    return [completions(llm.generate(p, sp))[0] for p, sp in zip(PROMPTS, PARAMS)]


def assert_same_as_alone(outputs, alone, what: str) -> None:
    for prompt, got, want in zip(PROMPTS, completions(outputs), alone):
        assert len(got) == len(want)
        for (ids, logits), (want_ids, want_logits) in zip(got, want):
            assert ids == want_ids, f"{what}: tokens of {prompt!r} differ from its run alone"
            assert torch.equal(logits, want_logits), f"{what}: logits of {prompt!r} are not bit-identical to its run alone"


def assert_no_leak(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.all_free(), "after generate every block must be free (cached ones too: on the free list)"


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_budgets_cold_then_warm_prefix_cache(alone, budget):
    llm = make_llm(num_kv_blocks=64, max_num_batched_tokens=budget)
    cold = llm.generate(PROMPTS, PARAMS)
    assert_same_as_alone(cold, alone, f"budget {budget}, cold cache")
    assert_no_leak(llm)
    assert llm.get_stats()["peak_num_running_seqs"] > 1, "the requests must have run together"
    warm = llm.generate(PROMPTS, PARAMS)
    assert_same_as_alone(warm, alone, f"budget {budget}, warm cache")
    assert sum(o.num_cached_tokens for o in warm) > 0 and llm.get_stats()["prefix_cache_hit_rate"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("prefill_first", [False, True], ids=["mixed", "prefill-first"])
def test_without_chunked_prefill(alone, prefill_first):
    llm = make_llm(num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN,
                   prefill_first=prefill_first)
    assert_same_as_alone(llm.generate(PROMPTS, PARAMS), alone, f"unchunked, prefill_first={prefill_first}")
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_after_preemption_in_a_tiny_pool(alone, mode):
    # 5 blocks of 16: one sequence of max_model_len (4 blocks) and one block more.
    llm = make_llm(num_kv_blocks=5, preemption_mode=mode, max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, PARAMS)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0, "the pool is meant to force preemption"
    if mode == "swap":
        assert stats["num_swap_outs"] > 0, "preemption_mode='swap' must swap blocks out"
    assert_same_as_alone(outputs, alone, f"preemption by {mode}")
    assert_no_leak(llm)


def test_requests_arriving_while_others_run(alone):
    llm = make_llm(num_kv_blocks=16, max_num_batched_tokens=16)
    engine = llm.llm_engine
    done, step, pending = {}, 0, list(enumerate(zip(PROMPTS, PARAMS)))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # one new request every third step
            i, (prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    assert_same_as_alone([done[str(i)] for i in range(len(PROMPTS))], alone, "staggered arrivals")
    assert_no_leak(llm)
