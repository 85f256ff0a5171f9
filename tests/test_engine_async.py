"""Async scheduling (issue 16, part 2) on the CPU: the same code path as on CUDA, bit for bit the synchronous loop.

With `async_scheduling=True` the engine schedules and launches step N+1 before it reads step N's tokens
(the decodes of N+1 read them on the device, as placeholders). The CPU runs each step to the end inside
`execute`, so nothing overlaps here, but every line of the async loop runs: placeholders, decodes whose
input is the previous step's sample, finishing a sequence whose step N+1 is already scheduled (eos, a
stop token, a stop string), n > 1 forks and beam rounds that wait for their update, preemption (recompute
and swap) of sequences whose token is in flight, prefix caching. Every request's tokens, logits,
logprobs, text and finish reason must equal the synchronous loop's, and the engine must really have run
placeholder decodes.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import model_path
from pagedref import LLM, BeamSearchParams, SamplingParams
from pagedref.backends.reference import ReferenceBackend
from pagedref.engine.block_manager import BlockManager
from pagedref.engine.llm import LLMEngine
from pagedref.engine.model_runner import ModelRunner
from pagedref.engine.scheduler import Scheduler, SchedulerConfig
from test_engine_fuzz import ChainModel, NumberTokenizer, random_requests, run, seeded, tokens

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because", "One day",
           STORY + " in the park.", STORY + " with her dog."]  # the last two share full blocks: prefix-cache hits
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=25, stop=["park"]),  # a stop string, found late
    SamplingParams(n=3, temperature=1.0, top_k=20, seed=5, max_tokens=15),  # forks after the prefill
    SamplingParams(temperature=0.0, max_tokens=None, logprobs=3),  # to eos or max_model_len, with logprobs
    SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=30, stop_token_ids=[261]),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
]


def counting(llm: LLM) -> dict[str, int]:
    """Counts the decodes whose input was the previous step's sample (read on the device)."""
    runner, counts = llm.llm_engine.runner, {"placeholder_decodes": 0}
    execute = runner.execute

    def counted(sched, prev=None):
        counts["placeholder_decodes"] += sum(s.prev_sample_index >= 0 for s in sched.scheduled)
        return execute(sched, prev)

    runner.execute = counted
    return counts


def generate(async_scheduling: bool, **kw):
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=128, record_logits=True,
              async_scheduling=async_scheduling, **kw)
    counts = counting(llm)
    outputs = llm.generate(PROMPTS, PARAMS)
    stats = llm.get_stats()
    beams = llm.beam_search(["Lily and Tom", "Once upon"], BeamSearchParams(beam_width=3, max_tokens=6))
    llm.llm_engine.block_manager.check_invariants()
    assert llm.llm_engine.block_manager.all_free(), "every block is free again"
    assert not llm.llm_engine.scheduler.in_flight, "no step is left in flight"
    completions = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs, c.logits)
                    for c in o.outputs] for o in outputs]
    return completions, [[(b.tokens, b.cum_logprob, b.finish_reason) for b in o.sequences] for o in beams], stats, counts


def assert_same(sync, asyn) -> None:
    for prompt, s, a in zip(PROMPTS, sync, asyn):
        assert len(s) == len(a)
        for (*s_rest, s_logits), (*a_rest, a_logits) in zip(s, a):
            assert s_rest == a_rest, f"{prompt!r}: the async loop's tokens, text or logprobs differ from the sync loop's"
            assert torch.equal(s_logits, a_logits), f"{prompt!r}: the async loop's logits are not the sync loop's bits"


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=64),
    dict(num_kv_blocks=9, max_num_batched_tokens=16),  # chunked prefill and preemption by recompute
    dict(num_kv_blocks=9, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=128),
], ids=["roomy", "recompute", "swap", "unchunked"])
def test_the_async_loop_gives_the_sync_loops_bits(kw):
    sync, sync_beams, sync_stats, _ = generate(False, **kw)
    asyn, asyn_beams, asyn_stats, counts = generate(True, **kw)
    assert_same(sync, asyn)
    assert asyn_beams == sync_beams, "beam search through the async loop ranks the same beams"
    assert counts["placeholder_decodes"] > 0, "the async loop must decode tokens its previous step was still sampling"
    assert asyn_stats["async_scheduling"] and not sync_stats["async_scheduling"]
    if kw["num_kv_blocks"] == 9:
        assert asyn_stats["num_preemptions"] > 0, "the pool is meant to force preemption in the async loop too"
    if kw.get("preemption_mode") == "swap":
        assert asyn_stats["num_swap_outs"] > 0


def test_a_step_returns_the_outputs_of_the_step_launched_before_it():
    llm = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == [], "the first call only launches the prefill"
    got = [len(o.outputs[0].token_ids) for o in engine.step()]
    assert got == [1], "the second call returns the prefill's token (and has launched the first decode)"
    seen = []
    while engine.has_unfinished_requests():
        seen += [(len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    assert seen == [(2, False), (3, True)], "the last call drains the step in flight"
    assert engine.block_manager.all_free()


def test_a_sequence_stopped_late_frees_its_blocks_and_its_next_step_is_dropped():
    # eos is not known when the next step is scheduled: the sequence decodes once more, and update drops it
    llm = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, async_scheduling=True, record_logits=True)
    sync = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, record_logits=True)
    prompt = 'One day, a big bear said "Hello!"'  # ends its story (eos, token 1) after 172 tokens
    params = SamplingParams(temperature=0.0, max_tokens=None)
    [want], [got] = sync.generate(prompt, params), llm.generate(prompt, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].finish_reason == "stop"
    assert torch.equal(got.outputs[0].logits, want.outputs[0].logits)
    assert llm.get_stats()["num_steps"] == sync.get_stats()["num_steps"] + 1, "one decode step after eos, dropped"
    assert llm.llm_engine.block_manager.all_free()
    assert not llm.llm_engine.has_unfinished_requests(), "the dropped step is drained: the engine is idle"


def test_abort_while_a_step_is_in_flight():
    llm = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    for rid in "ab":
        engine.add_request(rid, "Lily and Tom", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")  # its sequence is in the step in flight: update drops its sample
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(done) == ["b"] and len(done["b"].outputs[0].token_ids) == 20
    assert engine.block_manager.all_free()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]), budget=st.sampled_from([1, 3, 8, 64]),
       mode=st.sampled_from(["recompute", "swap"]), prefix_caching=st.booleans())
def test_random_workloads_async_equal_sync(seed, block_size, budget, mode, prefix_caching):
    """The model-free fuzz engine (test_engine_fuzz), async against sync, in pools small enough to preempt."""
    rng = random.Random(seed)
    requests = seeded(random_requests(rng, rng.randint(1, 8), max_prompt=20, max_tokens=12))
    arrivals = [rng.randint(0, 6) for _ in requests]
    num_blocks = -(-32 // block_size) + rng.randint(0, 3)
    outs = []
    for async_scheduling in (False, True):
        engine = chain_engine(num_blocks, block_size, 32, budget, async_scheduling, mode, prefix_caching)
        engine.scheduler.config.max_num_seqs = 3
        outs.append(tokens(run(engine, requests, arrivals)))
        engine.block_manager.check_invariants()
    assert outs[1] == outs[0]


def chain_engine(num_blocks: int, block_size: int, max_model_len: int, budget: int, async_scheduling: bool,
                 mode: str = "recompute", prefix_caching: bool = True) -> LLMEngine:
    num_cpu_blocks = num_blocks if mode == "swap" else 0
    bm = BlockManager(num_blocks, block_size, max_model_len, prefix_caching, num_cpu_blocks)
    scheduler = Scheduler(SchedulerConfig(8, budget, True, mode, async_scheduling=async_scheduling), bm)
    runner = ModelRunner(ChainModel(), ReferenceBackend(), num_blocks, block_size, "cpu", torch.float64, num_cpu_blocks)
    return LLMEngine(ChainModel(), NumberTokenizer(), runner, scheduler, max_model_len)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]), budget=st.sampled_from([2, 8, 64]),
       beam_width=st.integers(1, 4))
def test_beam_search_async_in_a_small_pool_equals_sync_in_a_roomy_one(seed, block_size, budget, beam_width):
    from pagedref.engine.beam_search import beam_search

    rng = random.Random(seed)
    prompts = [(None, [rng.randrange(4, 64) for _ in range(rng.randint(1, 12))]) for _ in range(rng.randint(1, 3))]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=rng.randint(1, 8))

    def search(engine):
        out = beam_search(engine, prompts, params)
        assert engine.block_manager.all_free(), "beam search leaked blocks"
        return [[(b.tokens, b.cum_logprob, b.finish_reason) for b in o.sequences] for o in out]

    small = chain_engine(-(-24 // block_size), block_size, 24, budget, async_scheduling=True)
    roomy = chain_engine(256, block_size, 24, 1024, async_scheduling=False)
    assert search(small) == search(roomy)
