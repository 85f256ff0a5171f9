"""The engine (scheduler, block manager, model runner, sampler) fuzzed with a model-free stand-in.

`ChainModel` plays the model: the "K/V" of the token at position p is a rolling hash of the
sequence's tokens 0..p, computed from the token and the value at p - 1 *read back from the KV cache
through the block table*, exactly where a real model would read its context. Its "logits" are random
numbers seeded by that value. So a request's tokens depend on its own tokens only, and only if every
block it reads holds what it should: any K/V lost or mixed up by scheduling, chunking, prefix caching,
copy-on-write, swapping or preemption changes its outputs. Runs are cheap, so the tests below drive
random workloads through pools small enough to force preemption, and compare every request with the
same request run alone, checking the step invariants along the way.

Under `--impl PKG` it runs the learner's scheduler and block manager (stages 6-7, asked of
`pagedref.course.lesson()` as the stage tests ask them) inside the reference engine; each request's
run alone, the oracle, stays the reference's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedref.backends.reference import ReferenceBackend
from pagedref.course import lesson
from pagedref.engine import block_manager as reference_bm
from pagedref.engine import scheduler as reference_sched
from pagedref.engine.config import SchedulerConfig
from pagedref.engine.llm import LLMEngine
from pagedref.engine.model_runner import ModelRunner
from pagedref.engine.sampling import SamplingParams
from pagedref.engine.sequence import SequenceStatus
from pagedref.memory.block_table import cdiv

bm_mod = lesson("pagedref.engine.block_manager")  # the implementation under test (the reference, or --impl's)
sched_mod = lesson("pagedref.engine.scheduler")
pytestmark = pytest.mark.stage7  # the scheduler of stages 6 and 7: run it once both pass

VOCAB = 64
EOS = 3
MOD = 2_147_483_647  # values stay exact in float64


def chain(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % MOD


@dataclass(frozen=True)
class ChainConfig:
    vocab_size: int = VOCAB
    num_hidden_layers: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 1
    eos_token_ids: tuple = (EOS,)


class ChainModel:
    config = ChainConfig()

    def __call__(self, input_ids, positions, kv_caches, meta, backend):
        k_cache = kv_caches[0][0]
        flat = k_cache.view(-1)  # one float64 per slot
        bs = meta.block_size
        out = torch.empty(len(input_ids), dtype=torch.float64)
        starts, ctx = meta.query_start_loc.tolist(), meta.context_lens.tolist()
        ids, slots = input_ids.tolist(), meta.slot_mapping.tolist()
        for s in range(len(ctx)):
            q0, q1 = starts[s], starts[s + 1]
            first = ctx[s] - (q1 - q0)
            table = meta.block_tables[s].tolist()
            # The context before the chunk is read through the block table, like attention does.
            prev = 0 if first == 0 else int(flat[table[(first - 1) // bs] * bs + (first - 1) % bs])
            for j in range(q0, q1):
                prev = chain(prev, ids[j])
                flat[slots[j]] = prev
                out[j] = prev
        return out[:, None]

    def compute_logits(self, hidden, float32=True):  # (its logits are float32 either way)
        rows = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(h))) for h in hidden[:, 0].tolist()]
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class NumberTokenizer:
    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids)


class CheckingEngine(LLMEngine):
    """LLMEngine that checks, at every step, the scheduler's promises and every scheduled sequence's K/V."""

    def step(self):
        sched = self.scheduler.schedule()
        cfg, bm = self.scheduler.config, self.block_manager
        assert sched.num_batched_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(sched.scheduled) <= cfg.max_num_seqs, "max_num_seqs exceeded"
        ids = [s.seq.seq_id for s in sched.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        assert not {s.seq_id for s in sched.preempted} & set(ids), "a scheduled sequence was preempted"
        for s in sched.scheduled:
            seq, n = s.seq, s.num_new_tokens
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert len(bm.block_ids(seq)) == cdiv(s.num_computed_tokens + n, bm.block_size), "slots != tokens"
        queues = [list(self.scheduler.waiting), self.scheduler.running, list(self.scheduler.swapped)]
        everyone = [s.seq_id for q in queues for s in q]
        assert len(everyone) == len(set(everyone)), "a sequence is in two queues"
        bm.check_invariants()
        self.scheduler.schedule = lambda: sched  # run the real step on this very schedule
        try:
            outputs = super().step()
        finally:
            del self.scheduler.schedule
        flat = self.runner.kv_caches[0][0].view(-1)
        for seq in (s.seq for s in sched.scheduled):  # every computed token's K/V, read back through the block table
            if bm.has_blocks(seq):
                blocks, value = bm.block_ids(seq), 0
                for p in range(seq.num_computed_tokens):
                    value = chain(value, seq.token_ids[p])
                    got = flat[blocks[p // bm.block_size] * bm.block_size + p % bm.block_size]
                    assert int(got) == value, f"sequence {seq.seq_id}: wrong K/V at position {p}"
        return outputs


def make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                chunked=True, prefix_caching=True, preemption_mode="recompute", contiguous=False, seed=0,
                prefill_first=False, reference=False):
    """An engine over the implementation under test (reference=True: over pagedref's own, the oracle)."""
    bms, scheds = (reference_bm, reference_sched) if reference else (bm_mod, sched_mod)
    num_cpu_blocks = num_blocks if preemption_mode == "swap" else 0
    if contiguous:
        bm = bms.ContiguousBlockManager(num_blocks, block_size, max_model_len)
    else:
        bm = bms.BlockManager(num_blocks, block_size, max_model_len, prefix_caching, num_cpu_blocks)
    scheduler = scheds.Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked, preemption_mode, prefill_first), bm)
    model = ChainModel()
    runner = ModelRunner(model, ReferenceBackend(), num_blocks, block_size, "cpu", torch.float64, num_cpu_blocks)
    return CheckingEngine(model, NumberTokenizer(), runner, scheduler, max_model_len, seed=seed)


def run(engine, requests, arrivals=None, aborts=()):
    """Feed (request_id, prompt ids, params) at their arrival step; returns {request_id: RequestOutput}."""
    arrivals = arrivals or [0] * len(requests)
    done, step = {}, 0
    pending = sorted(zip(arrivals, range(len(requests))))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            rid, prompt, params = requests[pending.pop(0)[1]]
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for rid, at in aborts:
            if at == step:
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 10_000, "the engine does not make progress"
    assert engine.block_manager.all_free(), "blocks leaked"
    return done


def random_requests(rng: random.Random, count: int, max_prompt: int, max_tokens: int, allow_n: bool = True):
    shared = [rng.randrange(4, VOCAB) for _ in range(max_prompt)]  # a common prefix some prompts start with
    requests = []
    for i in range(count):
        length = rng.randint(1, max_prompt)
        prefix = rng.randint(0, length) if rng.random() < 0.5 else 0
        prompt = shared[:prefix] + [rng.randrange(4, VOCAB) for _ in range(length - prefix)]
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]) if allow_n else 1,
            temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, rng.randrange(100)]),
            max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(4, VOCAB)] if rng.random() < 0.2 else None,
        )
        requests.append((f"r{i}", prompt, params))
    return requests


def alone(requests, max_model_len=64):
    """Each request alone in a roomy engine over the reference (seeded requests only: unseeded ones draw
    engine seeds)."""
    out = {}
    for rid, prompt, params in requests:
        engine = make_engine(num_blocks=256, max_model_len=max_model_len, max_num_batched_tokens=1024, reference=True)
        out.update(run(engine, [(rid, prompt, params)]))
    return out


def tokens(outputs):
    return {rid: [(c.token_ids, c.finish_reason) for c in o.outputs] for rid, o in outputs.items()}


def seeded(requests):
    return [(rid, p, params) for rid, p, params in requests if params.seed is not None or params.is_greedy]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4, 8]), budget=st.sampled_from([1, 3, 8, 64]),
       policy=st.sampled_from(["chunked", "mixed", "prefill-first"]), prefix_caching=st.booleans(),
       mode=st.sampled_from(["recompute", "swap"]), max_num_seqs=st.sampled_from([1, 3, 16]))
# Always run, beside the random draws: decoding sequences outnumber a budget of 1 token, so a scheduler that
# lets decodes ignore the budget fails here every time (the 40 random draws once missed it in CI, 2026-12-02).
@example(seed=0, block_size=4, budget=1, policy="chunked", prefix_caching=False, mode="recompute", max_num_seqs=16)
def test_random_workloads_match_each_request_alone(seed, block_size, budget, policy, prefix_caching, mode, max_num_seqs):
    """Chunked prefill, or whole prompts mixed with decodes (vLLM v1), or in steps of their own (v0)."""
    rng = random.Random(seed)
    max_model_len = 32
    chunked = policy == "chunked"
    if not chunked:
        budget = max(budget, max_model_len)
    # A pool barely larger than one max-length sequence: preemption is the rule, not the exception.
    num_blocks = cdiv(max_model_len, block_size) + rng.randint(0, 3)
    requests = seeded(random_requests(rng, rng.randint(1, 8), max_prompt=20, max_tokens=12))
    arrivals = [rng.randint(0, 6) for _ in requests]
    engine = make_engine(num_blocks, block_size, max_model_len, max_num_seqs, budget, chunked, prefix_caching, mode,
                         prefill_first=policy == "prefill-first")
    got = run(engine, requests, arrivals)
    assert tokens(got) == tokens(alone(requests, max_model_len))


def test_preemption_happens_and_nothing_is_dropped():
    rng = random.Random(1)
    requests = seeded(random_requests(rng, 12, max_prompt=20, max_tokens=16, allow_n=False))
    expected = tokens(alone(requests))
    for mode in ("recompute", "swap"):
        engine = make_engine(num_blocks=20, block_size=4, max_num_batched_tokens=16, preemption_mode=mode)
        got = run(engine, requests)
        assert engine.scheduler.num_preemptions > 0, "the pool is too small not to preempt"
        if mode == "swap":
            assert engine.scheduler.num_swap_outs > 0
        assert tokens(got) == expected, f"preemption by {mode} changed a request's output"


def test_contiguous_baseline_serves_the_same_outputs():
    rng = random.Random(2)
    requests = seeded(random_requests(rng, 10, max_prompt=20, max_tokens=16, allow_n=False))
    engine = make_engine(num_blocks=48, block_size=4, max_model_len=64, contiguous=True)  # 3 reservations at most
    got = run(engine, requests)
    assert tokens(got) == tokens(alone(requests))
    assert engine.get_stats()["peak_num_running_seqs"] <= 3


def test_aborted_requests_free_their_blocks_at_once():
    rng = random.Random(3)
    requests = random_requests(rng, 6, max_prompt=20, max_tokens=30, allow_n=True)
    engine = make_engine(num_blocks=40, block_size=4, max_num_batched_tokens=8, preemption_mode="swap")
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_free_blocks < 40
    engine.abort_request([rid for rid, _, _ in requests])
    assert engine.block_manager.all_free(), "an aborted request must give back every block, device and swap"
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_parallel_samples_share_the_prompt_blocks():
    engine = make_engine(num_blocks=64, block_size=4)
    engine.add_request("a", {"prompt_token_ids": list(range(4, 18))}, SamplingParams(n=4, seed=1, max_tokens=5))
    engine.step()  # the prompt's prefill: then the fork into 4 sequences
    stats = engine.get_stats()
    assert stats["num_shared_blocks"] == 4, "the 14-token prompt's 4 blocks are shared by the 4 samples"
    engine.step()  # each sample writes its first token: the shared partial block is copied 3 times
    stats = engine.get_stats()
    assert stats["num_shared_blocks"] == 3 and stats["num_used_blocks"] == 3 + 4
    outputs = run(engine, [])  # to the end
    assert [len(c.token_ids) for c in outputs["a"].outputs] == [5, 5, 5, 5]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]), budget=st.sampled_from([2, 8, 64]),
       beam_width=st.integers(1, 4), length_penalty=st.sampled_from([0.0, 1.0]))
def test_beam_search_in_a_small_pool_equals_beam_search_in_a_roomy_one(seed, block_size, budget, beam_width, length_penalty):
    from pagedref.engine.beam_search import beam_search
    from pagedref.engine.sampling import BeamSearchParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 3))]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=rng.randint(1, 8), length_penalty=length_penalty)

    def search(engine):
        out = beam_search(engine, [(None, p) for p in prompts], params)
        assert engine.block_manager.all_free(), "beam search leaked blocks"
        return [[(b.tokens, b.cum_logprob, b.finish_reason) for b in o.sequences] for o in out]

    max_model_len = 24
    small = make_engine(cdiv(max_model_len, block_size), block_size, max_model_len, max_num_batched_tokens=budget)
    roomy = make_engine(256, block_size, max_model_len, max_num_batched_tokens=1024, reference=True)
    assert search(small) == search(roomy)
