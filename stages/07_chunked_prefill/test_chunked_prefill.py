"""Stage 7 — the token budget: chunked prefill mixed with decodes, one lesson step per test, in order.

Steps 1–7 drive your scheduler by hand (no model; `advance()` plays the model runner and hands its
tokens to your `update`) over the reference block manager. Step 8 builds one mixed step's attention
metadata with the (given) model runner from your scheduler's output; step 9 runs the reference engine
around your scheduler on a real model, at three budgets. Step 10 is vLLM v0's policy; step 11 schedules
a step before the previous one's tokens are known (async scheduling). Messages name sequences by their
ids (a: 1, b: 2, ...).

Run: pytest stages -m stage7 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedref import DEFAULT_MODEL, LLM
from pagedref.course import lesson, raises
from pagedref.engine.block_manager import BlockManager
from pagedref.engine.config import EngineArgs
from pagedref.engine.model_runner import ModelRunner
from pagedref.engine.sampling import SamplerOutput, SamplingParams
from pagedref.engine.sequence import Sequence, SequenceGroup, SequenceStatus

# Your scheduler: stage 6 built it, this stage adds the token budget. The rest is given.
sched_mod = lesson("pagedref.engine.scheduler")
NEW_TOKEN = 7


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 100) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(prompt), len(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens))


def make_scheduler(budget: int, chunked: bool = True, num_blocks: int = 32, block_size: int = 4, caching: bool = False):
    bm = BlockManager(num_blocks, block_size, max_model_len=64, enable_prefix_caching=caching)
    return sched_mod.Scheduler(sched_mod.SchedulerConfig(8, budget, chunked, "recompute"), bm)


def advance(s, out) -> list[int]:
    """The runner's part (every sequence that samples gets NEW_TOKEN), then your update. Returns who sampled."""
    sampling = out.sampling_seqs()
    s.update(out, SamplerOutput([NEW_TOKEN] * len(sampling)))
    return [seq.seq_id for seq in sampling]


def ids_of(seqs) -> list[int]:
    return [seq.seq_id for seq in seqs]


def batch(out) -> list[tuple[int, int]]:
    """The step's batch as (sequence id, tokens computed) pairs, in batch order."""
    return [(entry.seq.seq_id, entry.num_new_tokens) for entry in out.scheduled]


def test_step1_a_long_prompt_is_split_into_chunks_of_the_budget():
    s = make_scheduler(budget=16)
    a = make_seq(1, list(range(40)))
    s.add(a)
    chunks, sampled = [], []
    for _ in range(3):
        out = s.schedule()
        assert out.num_batched_tokens <= 16, "stage 7: a step never computes more than max_num_batched_tokens tokens"
        chunks.append(batch(out))
        sampled.append(advance(s, out))
    assert chunks == [[(1, 16)], [(1, 16)], [(1, 8)]], "stage 7: 40 prompt tokens in a budget of 16: chunks 16, 16, 8"
    assert sampled == [[], [], [1]], "stage 7: only the chunk that completes the prompt samples a token"
    assert a.num_computed_tokens == 40 and a.output_token_ids == [NEW_TOKEN], "stage 7: the prompt is computed once"


def test_step2_decodes_count_against_the_budget_too():
    s = make_scheduler(budget=2)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10)
    group = SequenceGroup("r1", None, [1, 2], params)  # n=3: 3 sequences decode after the prompt (stage 6)
    group.seqs = [Sequence(1 + i, "r1", [1, 2], 2, params, i, group=group) for i in range(3)]
    s.add(group.seqs[0])
    out = s.schedule()
    assert ids_of(out.sampling_seqs()) == [1, 2, 3], "stage 7: the 2-token prompt fits the budget: its last row samples 3"
    s.update(out, SamplerOutput([7, 8, 9]))
    assert [seq.output_token_ids for seq in group.seqs] == [[7], [8], [9]], "stage 7: one token each, in order"
    s.add(make_seq(4, [5, 6]))
    out = s.schedule()
    assert out.num_batched_tokens == 2 and batch(out) == [(1, 1), (2, 1)], \
        "stage 7: 3 decoders, budget 2: a decode costs 1 token of the budget too, so only 2 decode in this step"
    assert group.seqs[2].num_uncomputed_tokens == 1 and s.num_requests()["running"] == 1 and s.has_unfinished(), \
        "stage 7: the third keeps its token to compute for a later step (it stays running), and the new request " \
        "waits: no budget is left for it"


def test_step3_decodes_go_first_and_a_prefill_chunk_gets_what_is_left():
    s = make_scheduler(budget=8)
    a, b = make_seq(1, [1, 2, 3]), make_seq(2, list(range(20)))
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    out = s.schedule()
    assert batch(out) == [(1, 1), (2, 7)] and [e.context_len for e in out.scheduled] == [4, 7], \
        "stage 7: decodes go first: a's decode (1 token), then 7 of b's 20 prompt tokens: one forward pass mixes both"
    advance(s, out)
    out = s.schedule()
    assert batch(out) == [(1, 1), (2, 7)], \
        "stage 7: decodes go first: a keeps decoding every step while b's prompt streams in, in what is left"


def test_step4_a_partly_prefilled_prompt_continues_before_new_requests_start():
    s = make_scheduler(budget=8)
    a, b = make_seq(1, list(range(12))), make_seq(2, [5, 6])
    s.add(a)
    advance(s, s.schedule())  # a: 8 of 12
    s.add(b)
    out = s.schedule()
    assert batch(out) == [(1, 4), (2, 2)], "stage 7: a's last 4 prompt tokens first, then b fits in what is left"


def test_step5_without_chunking_a_prompt_runs_whole_or_waits():
    # The engine refuses a budget that cannot hold a whole prompt (LLM checks it through EngineArgs); the
    # Scheduler itself takes any budget: a prompt longer than it would simply wait.
    with raises(ValueError, "stage 7: without chunking, LLM refuses a budget below max_model_len",
                match="max_num_batched_tokens"):
        EngineArgs(DEFAULT_MODEL, device="cpu", max_model_len=64, max_num_batched_tokens=16,
                   enable_chunked_prefill=False).create_engine_config()
    s = make_scheduler(budget=16, chunked=False)
    a, b = make_seq(1, [1, 2, 3]), make_seq(2, list(range(16)))
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    out = s.schedule()
    assert batch(out) == [(1, 1)], "stage 7: unchunked: b's 16 tokens do not fit next to a's decode: b waits whole"
    advance(s, out)
    s.finish(a, SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 16)], "stage 7: with the whole budget free, b's prompt runs in one step"
    advance(s, out)
    s.finish(b, SequenceStatus.FINISHED_STOPPED)
    s.add(make_seq(3, list(range(17))))
    assert s.schedule().is_empty and s.has_unfinished(), \
        "stage 7: unchunked, a 17-token prompt never fits a budget of 16: it waits (the engine refuses such a budget)"


def test_step6_prefix_cache_hits_skip_tokens_already_computed():
    s = make_scheduler(budget=64, caching=True)
    system = list(range(100, 108))  # two full blocks of 4 shared by both prompts
    a = make_seq(1, system + [1, 2, 3])
    s.add(a)
    advance(s, s.schedule())
    b = make_seq(2, system + [9])
    s.add(b)
    out = s.schedule()
    assert out.scheduled[1].num_computed_tokens == 8 and batch(out) == [(1, 1), (2, 1)], \
        "stage 7: b's first 8 tokens are cached: it computes only its last token, from position 8"
    advance(s, out)
    params = SamplingParams(temperature=0.0, max_tokens=100)
    group = SequenceGroup("r3", None, list(system), params)  # a request, as the engine makes it
    c = Sequence(3, "r3", list(system), 8, params, group=group)
    group.seqs = [c]
    s.add(c)
    out = s.schedule()
    assert out.scheduled[-1].num_computed_tokens == 4 and batch(out)[-1] == (3, 4), \
        "stage 7: a whole-prompt hit still computes the last token (its logits sample the first new token): the " \
        "lookup covers only whole blocks before it, so c's 8 tokens, 2 full blocks, compute the second again"
    assert group.num_cached_tokens == 4 and group.metrics.first_scheduled_time is not None, \
        "stage 7: a request's first admission records its prompt tokens found in the cache (num_cached_tokens, which " \
        "RequestOutput reports) and when it was first scheduled"

    # Only the first: a request preempted (recompute) and admitted again keeps what its first admission found.
    s = make_scheduler(budget=64, num_blocks=6, caching=True)
    x = make_seq(4, list(range(300, 308)))
    group = SequenceGroup("r5", None, list(range(200, 208)), params)
    e = Sequence(5, "r5", list(range(200, 208)), 8, params, group=group)
    group.seqs = [e]
    s.add(x)
    advance(s, s.schedule())
    s.add(e)
    advance(s, s.schedule())
    while e.status is SequenceStatus.RUNNING:  # x and e decode until the 6 blocks run out: e, the newest, goes
        advance(s, s.schedule())
    s.finish(x, SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(5, 4)] and out.scheduled[0].num_computed_tokens == 8, \
        "stage 7: e, preempted by recompute, comes back with its 2 full blocks of 12 tokens found in the cache"
    assert group.num_cached_tokens == 0, \
        "stage 7: num_cached_tokens is recorded at a request's first admission only (it found nothing cached then), " \
        f"not again when it is readmitted after a preemption (got {group.num_cached_tokens})"


def test_step7_a_partly_prefilled_prompt_swapped_out_comes_back_with_its_next_chunk():
    bm = BlockManager(4, 4, max_model_len=64, enable_prefix_caching=False, num_cpu_blocks=4)
    s = sched_mod.Scheduler(sched_mod.SchedulerConfig(8, 6, True, "swap"), bm)
    a, x = make_seq(1, [1, 2, 3]), make_seq(2, list(range(20)))
    s.add(a)
    s.add(x)
    advance(s, s.schedule())  # a's prompt and 3 of x's
    advance(s, s.schedule())  # a's decode and 5 more of x's
    out = s.schedule()  # a's decode takes the last block; x's next chunk needs one: x swaps itself out
    assert ids_of(out.preempted) == [2] and x.status is SequenceStatus.SWAPPED and x.num_computed_tokens == 8, \
        "stage 7: x is swapped out part way through its prompt, its 8 computed tokens' K/V to the CPU"
    advance(s, out)
    s.finish(a, SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 6)] and x.status is SequenceStatus.RUNNING, \
        "stage 7: x comes back with the next chunk of its prompt, as much as the budget holds (6 of its 12 left)"


def test_step8_one_step_one_metadata_for_decodes_and_chunks_together():
    s = make_scheduler(budget=8)
    a, b = make_seq(1, [1, 2, 3, 4, 5]), make_seq(2, list(range(20)))
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    out = s.schedule()  # a decodes its token 5; b prefills tokens 0..6
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)
    runner = ModelRunner(SimpleNamespace(config=config), None, 32, 4, "cpu", torch.float32)  # no block manager: out says it all
    step = runner.prepare(out)
    m = step.meta
    assert step.input_ids.tolist() == [NEW_TOKEN] + list(range(7)) and step.positions.tolist() == [5] + list(range(7)), \
        "stage 7: the step's rows: a's sampled token at position 5, then b's tokens 0..6"
    assert m.query_start_loc.tolist() == [0, 1, 8] and m.context_lens.tolist() == [6, 7], \
        "stage 7: per sequence its query rows (1 and 7) and its context after the step (6 and 7 tokens)"
    a_blocks, b_blocks = s.block_manager.block_ids(a), s.block_manager.block_ids(b)
    slot = lambda blocks, p: blocks[p // 4] * 4 + p % 4  # noqa: E731
    assert m.slot_mapping.tolist() == [slot(a_blocks, 5)] + [slot(b_blocks, p) for p in range(7)], \
        "stage 7: the slots your scheduler's output carries, a's then b's"
    assert m.block_tables.tolist() == [a_blocks, b_blocks], "stage 7: one block table row per sequence (-1 padded)"
    assert step.sample_rows == [0], "stage 7: only a samples: only the chunk that completes a prompt samples, and b's does not"


def test_step9_on_a_real_model_every_budget_gives_the_unchunked_logits_bit_for_bit():
    prompts = ["Once upon a time, there was a little girl named Lily.", "The little dog was sad because", "Tom"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    whole = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=16, record_logits=True,  # the reference, unchunked
                enable_chunked_prefill=False, max_num_batched_tokens=64)
    want = [o.outputs[0] for o in whole.generate(prompts, params)]
    for budget in (1, 7, 64):
        llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=16, record_logits=True, max_num_batched_tokens=budget,
                  scheduler_cls=sched_mod.Scheduler)
        for got, ref, prompt in zip((o.outputs[0] for o in llm.generate(prompts, params)), want, prompts):
            assert got.token_ids == ref.token_ids and torch.equal(got.logits, ref.logits), \
                f"stage 7: budget {budget}: {prompt!r} must get the unchunked logits bit for bit"


def test_step10_vllm_v0_without_chunking_gives_prompts_steps_of_their_own_and_decodes_wait():
    with raises(ValueError, "stage 7: chunked prefill schedules decodes first: prefill_first=True with it is refused",
                match="prefill_first"):
        sched_mod.SchedulerConfig(8, 16, True, "recompute", True)
    config = sched_mod.SchedulerConfig(8, 16, False, "recompute", True)  # chunking off, prefill_first on
    s = sched_mod.Scheduler(config, BlockManager(32, 4, max_model_len=64, enable_prefix_caching=False))
    a = make_seq(1, [1, 2, 3])
    s.add(a)
    advance(s, s.schedule())
    b, c = make_seq(2, list(range(10))), make_seq(3, [4, 5])
    s.add(b)
    s.add(c)
    out = s.schedule()
    assert batch(out) == [(2, 10), (3, 2)], \
        "stage 7: prefill_first (vLLM v0): the waiting prompts take the step whole, and a's decode waits for the next"
    advance(s, out)
    assert batch(s.schedule()) == [(1, 1), (2, 1), (3, 1)], "stage 7: prefill_first: no prompt waiting, so all decode"


def test_step11_the_next_step_is_scheduled_before_this_ones_tokens_are_known():
    s = make_scheduler(budget=16, caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=100)
    group = SequenceGroup("r1", None, [1, 2, 3], params)  # a request of one sequence, as the engine makes it
    a = Sequence(1, "r1", [1, 2, 3], 3, params, group=group)
    group.seqs = [a]
    b, c, d = make_seq(2, [4, 5], max_tokens=1), make_seq(3, [6], max_tokens=2), make_seq(4, [8, 9])
    for seq in (a, b, c, d):
        s.add(seq)
    first = s.schedule()  # every prompt samples its first token
    assert [seq.num_placeholders for seq in (a, b, c, d)] == [1, 0, 1, 1] and a.num_uncomputed_tokens == 1, \
        "stage 7: schedule() counts the token a step will sample as a placeholder if it is an ordinary next token: " \
        "not b's (its first token is its last: max_tokens=1), but c's (max_tokens=2: one more to come)"
    second = s.schedule()  # before first's tokens are known (async scheduling: the GPU still runs first)
    assert batch(second) == [(1, 1), (3, 1), (4, 1)] and second.scheduled[0].num_computed_tokens == 3 \
        and [(e.prev_sample_index, e.token_ids) for e in second.scheduled] == [(0, [0]), (2, [0]), (3, [0])], \
        "stage 7: a, c and d decode the tokens first samples for them: indexes 0, 2 and 3 of first's samples, " \
        "which the runner reads on the device (token_ids holds a 0 in their place)"
    s.finish(c, SequenceStatus.FINISHED_ABORTED)  # aborted while first and second are in flight
    s.update(first, SamplerOutput([NEW_TOKEN] * 4))
    assert a.token_ids[-1] == NEW_TOKEN and a.num_placeholders == 1 and b.status.finish_reason == "length", \
        "stage 7: update resolves first's placeholders in order (second's is still in flight)"
    assert c.output_token_ids == [] and d.output_token_ids == [NEW_TOKEN], \
        "stage 7: a sequence stopped (aborted) while its step was in flight gets nothing from it; the next ones do"
    assert s.block_manager.lookup(make_seq(9, [1, 2, 3, NEW_TOKEN, 5])).num_tokens == 4, \
        "stage 7: a's token 3 had its slot (second's decode) before it was known: update names it (set_token), and " \
        "a's first block, full and known now, is in the prefix cache"
    s.update(second, SamplerOutput([8, 8, 8]))
    assert a.output_token_ids == [NEW_TOKEN, 8] and a.num_placeholders == 0, \
        "stage 7: update(second) appends a's second token in its placeholder's place"
