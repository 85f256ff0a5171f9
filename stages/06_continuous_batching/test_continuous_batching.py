"""Stage 6 — continuous batching and preemption, one lesson step per test, in order.

Step 2 checks your block manager alone. Steps 3–14 drive your scheduler and block manager by hand,
with no model: `advance()` plays the model runner (every sequence that samples in the step gets
token 7) and hands the tokens to your `Scheduler.update`. Step 15 runs the reference engine (model,
runner, sampler) around your two classes on a real pretrained model. `Sequence`, `SamplingParams`,
beam search's ranking and the stop rules are given: they are not this stage's lesson.

Messages name sequences by their ids (a: 1, b: 2, ...).

Run: pytest stages -m stage6 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import torch

from pagedref import DEFAULT_MODEL, LLM
from pagedref.course import lesson, raises
from pagedref.engine import sequence as seq_mod
from pagedref.engine.beam_search import BeamState, round_params
from pagedref.engine.sampling import BeamSearchParams, SamplerOutput, SamplingParams

bm_mod = lesson("pagedref.engine.block_manager")
sched_mod = lesson("pagedref.engine.scheduler")
bt = lesson("pagedref.memory.block_table")  # your stage 3: its MaxModelLenError

NEW_TOKEN = 7
STATS_KEYS = {"num_blocks", "num_free_blocks", "num_used_blocks", "num_shared_blocks", "num_cached_blocks",
              "token_state_fraction", "prefix_cache_hit_rate", "num_swapped_blocks"}


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 100):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return seq_mod.Sequence(seq_id, f"r{seq_id}", list(range(10 * seq_id, 10 * seq_id + prompt_len)), prompt_len, params)


def seq_of(seq_id: int, token_ids: list[int]):
    """A sequence whose prompt is token_ids."""
    return seq_mod.Sequence(seq_id, f"r{seq_id}", list(token_ids), len(token_ids), SamplingParams(temperature=0.0))


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   mode: str = "recompute", num_cpu_blocks: int = 0):
    bm = bm_mod.BlockManager(num_blocks, block_size, max_model_len=64, enable_prefix_caching=False,
                             num_cpu_blocks=num_cpu_blocks)
    return sched_mod.Scheduler(sched_mod.SchedulerConfig(max_num_seqs, budget, True, mode), bm)


def advance(s, out) -> None:
    """The model runner's part (every sequence that samples gets NEW_TOKEN), then your update."""
    s.update(out, SamplerOutput([NEW_TOKEN] * len(out.sampling_seqs())))


def batch(out) -> list[tuple[int, int]]:
    """The step's batch as (sequence id, tokens computed) pairs, in batch order."""
    return [(entry.seq.seq_id, entry.num_new_tokens) for entry in out.scheduled]


def ids(seqs) -> list[int]:
    return [seq.seq_id for seq in seqs]


def test_step1_a_sequence_is_its_tokens_and_how_many_are_computed():
    seq = make_seq(1, prompt_len=5)
    assert (seq.num_tokens, seq.num_computed_tokens, seq.num_uncomputed_tokens) == (5, 0, 5), \
        "stage 6: a new sequence has its prompt's tokens and none computed"
    assert seq.is_prefill, "stage 6: more than one token to compute = a prompt to prefill"
    seq.num_computed_tokens = 5
    seq.token_ids.append(NEW_TOKEN)
    assert seq.output_token_ids == [NEW_TOKEN] and seq.num_uncomputed_tokens == 1 and not seq.is_prefill, \
        "stage 6: after the prefill and one sample, exactly one token (the sampled one) waits: a decode"
    assert seq.status is seq_mod.SequenceStatus.WAITING, "stage 6: a sequence starts WAITING"


def test_step2_the_block_manager_speaks_sequences_and_tokens():
    bm = bm_mod.BlockManager(16, 4, max_model_len=64)  # prefix caching is on by default
    a = make_seq(1, 6)
    hit = bm.lookup(a)
    assert hit.num_tokens == 0 and bm.can_allocate(a, 6, hit), "stage 6: a cold cache finds nothing; 2 blocks fit"
    cached, slots = bm.allocate(a, 6, hit)
    blocks = bm.block_ids(a)
    assert cached == 0 and len(blocks) == 2 and slots == [blocks[p // 4] * 4 + p % 4 for p in range(6)], \
        "stage 6: allocate gives the prompt's tokens their slots (stage 3's slot mapping) through stage 4's manager"
    assert bm.has_blocks(a) and bm.kv.block_ids(a.seq_id) == blocks and bm.num_free_blocks == 14, \
        "stage 6: the sequence is known to the memory layer (bm.kv) by its seq_id, and holds 2 of the 16 blocks"
    assert bm.live_usage() == (0.75, 2, 0), \
        "stage 6: live_usage() = (token states / used slots: 6 of 8, used blocks, block references saved by sharing)"
    sharer = seq_of(3, [])
    bm.fork(a, sharer)
    assert bm.live_usage() == (0.75, 2, 2), \
        "stage 6: a fork shares both blocks, the partly filled one too: a shared block counts once, 2 references saved"
    bm.free(sharer)
    assert bm.cpu is None and not bm.can_swap_out(a), "stage 6: without num_cpu_blocks there is no swap pool"
    with raises(bt.MaxModelLenError, "stage 6: a sequence past max_model_len is refused (stage 3's MaxModelLenError)"):
        bm.allocate(make_seq(5, 65), 65)
    a.num_computed_tokens = 6
    a.token_ids.append(NEW_TOKEN)
    assert bm.can_append(a, 2), "stage 6: 2 more tokens fit (the second block has 2 free slots)"
    slots, copies = bm.append_slots(a, 2)  # token 6 is known; token 7 is a placeholder, sampled later
    assert slots == [blocks[1] * 4 + 2, blocks[1] * 4 + 3] and copies == [], \
        "stage 6: append_slots returns the new tokens' slots (a token still unknown gets one too) and no copy"
    a.token_ids.append(9)  # token 7 is known now
    b = seq_of(2, a.token_ids + [1])
    assert bm.lookup(b).num_tokens == 4, \
        "stage 6: a block whose last token was unknown when it filled up is not in the prefix cache yet"
    bm.set_token(a, 7)
    assert bm.lookup(b).num_tokens == 8, "stage 6: set_token names the token: a's second block becomes findable"
    logprobs = seq_mod.Sequence(6, "r6", a.token_ids + [1], 9, SamplingParams(temperature=0.0, prompt_logprobs=1))
    hit = bm.lookup(logprobs)
    assert hit.num_tokens == 0 and bm.allocate(logprobs, 9, hit)[0] == 0, \
        "stage 6: a sequence that asks for its prompt's logprobs finds nothing cached: each prompt token is computed"
    bm.free(logprobs)
    child = seq_of(3, [])
    bm.fork(a, child)
    assert bm.block_ids(child) == blocks and bm.live_usage() == (1.0, 2, 2), \
        "stage 6: a fork shares every block: live_usage() = (token states / used slots, used blocks, references saved)"
    assert set(bm.stats()) == STATS_KEYS and bm.stats()["num_shared_blocks"] == 2, \
        "stage 6: stats() has stage 4's keys, plus num_swapped_blocks"
    bm.check_invariants()
    bm.free(a)
    assert bm.block_ids(child) == blocks and not bm.has_blocks(a) and not bm.all_free(), \
        "stage 6: free drops a's references; its child still holds the blocks"
    bm.free(child)
    bm.free(make_seq(4, 3))  # holds nothing: nothing to give back
    assert bm.all_free() and bm.num_free_blocks == 16 and bm.live_usage() == (0.0, 0, 0), \
        "stage 6: freed by both, the blocks are free (and cached); an empty pool's live_usage() is (0.0, 0, 0)"


def test_step3_the_watermark_keeps_1_percent_free_for_the_running_sequences():
    bm = bm_mod.BlockManager(150, 4, max_model_len=600, enable_prefix_caching=False)
    assert bm.watermark_blocks == 1, "stage 6: the watermark is int(0.01 * 150) = 1 block: rounded down, as vLLM's"
    whole = make_seq(1, 600)
    assert bm.can_allocate(whole, 600), \
        "stage 6: an idle pool admits whatever fits, all 150 blocks: the watermark never keeps a request out for good"
    x = make_seq(2, 147 * 4)
    bm.allocate(x, x.num_tokens)
    y, z = make_seq(3, 8), make_seq(4, 12)
    assert bm.can_allocate(y, 8), "stage 6: 3 free blocks, y takes 2: 1 stays free, the watermark: admitted"
    assert not bm.can_allocate(z, 12), \
        "stage 6: 3 free blocks, z takes 3: none would stay free for the running sequences (watermark 1): refused"
    assert not bm.can_allocate(make_seq(5, 16), 16), "stage 6: 4 blocks do not fit in 3: refused"
    assert bm.can_append(x, 12), "stage 6: the watermark holds back admissions only: a running sequence may take all"
    bm.allocate(y, 8)  # 1 block stays free
    y.num_computed_tokens = 8
    y.token_ids += [NEW_TOKEN] * 8
    free, blocks = bm.num_free_blocks, list(bm.block_ids(y))
    assert bm.append_slots(y, 8) is None and bm.num_free_blocks == free and bm.block_ids(y) == blocks, \
        "stage 6: append_slots returns None when the pool is short (2 blocks, 1 free), and takes nothing"
    got = bm.append_slots(y, 4)
    assert got is not None and len(got[0]) == 4 and bm.num_free_blocks == 0, \
        "stage 6: the watermark holds back admissions only: a running sequence may take all"
    bm = bm_mod.BlockManager(150, 4, max_model_len=600, enable_prefix_caching=False)
    bm.allocate(make_seq(6, 1), 1)
    assert not bm.can_allocate(make_seq(7, 149 * 4), 149 * 4), \
        "stage 6: one block in use is not an idle pool: the other 149 fit, but none would stay free: refused"


def test_step4_one_step_is_schedule_execute_update():
    s = make_scheduler(num_blocks=16)
    a = make_seq(1, 5)
    s.add(a)
    assert s.has_unfinished() and ids(s.waiting) == [1], "stage 6: add() puts a at the back of the waiting queue"
    out = s.schedule()
    [entry] = out.scheduled
    assert (entry.seq.seq_id, entry.num_new_tokens, entry.num_computed_tokens, entry.token_ids) == (1, 5, 0, a.token_ids), \
        "stage 6: the output says which tokens of which sequence the step computes (its prompt, from position 0)"
    blocks = s.block_manager.block_ids(a)
    assert entry.block_ids == blocks and entry.slot_mapping == [blocks[p // 4] * 4 + p % 4 for p in range(5)], \
        "stage 6: and where: the block table and the slots the block manager gave the tokens (computed once, there)"
    assert (entry.context_len, out.num_batched_tokens, out.is_empty) == (5, 5, False), \
        "stage 6: context_len = num_computed_tokens + num_new_tokens; num_batched_tokens sums the step's new tokens"
    assert ids(entry.sample_seqs) == [1] and ids(out.sampling_seqs()) == [1] and a.num_computed_tokens == 5, \
        "stage 6: schedule() counts the step's tokens as computed at once; the last row of a finished prompt samples"
    advance(s, out)
    assert a.output_token_ids == [NEW_TOKEN] and a.num_uncomputed_tokens == 1, \
        "stage 6: update() appends the sampled token (the one writer of what a step produced): a decodes next"
    with raises(RuntimeError, "stage 6: update() takes each step once, in the order schedule() returned them"):
        advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.is_empty and not s.has_unfinished(), "stage 6: nothing left: an empty output, and nothing unfinished"


def test_step5_requests_join_the_running_batch_at_the_next_step():
    s = make_scheduler(num_blocks=16)
    a, b, c = make_seq(1, 5), make_seq(2, 3), make_seq(3, 6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert batch(out) == [(1, 5), (2, 3)], "stage 6: both waiting prompts fit: both prefill in the first step"
    assert a.status is seq_mod.SequenceStatus.RUNNING and ids(s.running) == [1, 2], \
        "stage 6: admitted sequences are RUNNING, in s.running in admission order"
    advance(s, out)
    s.add(c)  # arrives while a and b are decoding
    assert s.num_requests() == {"running": 2, "waiting": 1, "swapped": 0}, "stage 6: num_requests() counts each queue"
    out = s.schedule()
    assert batch(out) == [(1, 1), (2, 1), (3, 6)], \
        "stage 6: iteration-level scheduling: c joins at once, its prefill in the same step as a's and b's decodes"


def test_step6_max_num_seqs_caps_the_batch():
    s = make_scheduler(num_blocks=16, max_num_seqs=2)
    seqs = [make_seq(i, 3) for i in (1, 2, 3)]
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert batch(out) == [(1, 3), (2, 3)], "stage 6: max_num_seqs=2: the third request waits"
    advance(s, out)
    s.finish(seqs[0], seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 1), (3, 3)], "stage 6: the step after one finishes, the waiting request takes its place"


def test_step7_a_finished_sequence_frees_its_blocks_at_once():
    s = make_scheduler(num_blocks=16)
    a, b = make_seq(1, 9, max_tokens=1), make_seq(2, 3)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.block_manager.num_free_blocks == 16 - 3 - 1, "stage 6: 9 tokens in blocks of 4 = 3 blocks, and b's 1"
    advance(s, out)
    assert a.status.finish_reason == "length", "stage 6: update() applies the stop rules: a has its max_tokens=1"
    assert s.num_generated_tokens == 2, "stage 6: num_generated_tokens counts the tokens update() appended: a's and b's"
    assert s.block_manager.num_free_blocks == 16 - 1 and ids(s.running) == [2], \
        "stage 6: a finished sequence's blocks are freed in the update of the step it finished, not at the end of a batch"


def test_step8_n_samples_fork_after_the_prompt_and_share_its_blocks():
    s = make_scheduler(num_blocks=16)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    group = seq_mod.SequenceGroup("r1", None, [1, 2, 3, 4, 5, 6], params)  # as LLMEngine.add_request makes it
    group.seqs = [seq_mod.Sequence(1 + i, "r1", [1, 2, 3, 4, 5, 6], 6, params, i, group=group) for i in range(2)]
    s.add(group.seqs[0])
    out = s.schedule()
    assert batch(out) == [(1, 6)] and ids(out.sampling_seqs()) == [1, 2], \
        "stage 6: n=2: the prompt is prefilled once, and its last row samples the first token of both sequences"
    s.update(out, SamplerOutput([7, 8]))
    bm = s.block_manager
    assert ids(s.running) == [1, 2] and [seq.output_token_ids for seq in group.seqs] == [[7], [8]], \
        "stage 6: update() forks the prompt's sequence into 2, each with its own first token"
    assert bm.block_ids(group.seqs[1]) == bm.block_ids(group.seqs[0]) and bm.num_free_blocks == 14, \
        "stage 6: the fork shares the prompt's 2 blocks (stage 4's fork): no block taken"
    out = s.schedule()
    shared = bm.block_ids(group.seqs[1])[:1]
    assert batch(out) == [(1, 1), (2, 1)] and len(out.blocks_to_copy) == 1, \
        "stage 6: both write a token into the shared, partly filled block: the first copies it, the last writes in place"
    assert ids(out.sampling_seqs()) == [1, 2], "stage 6: forked once: from now on each samples its own next token"
    assert [bm.block_ids(seq)[0] for seq in group.seqs] == shared * 2, "stage 6: the full first block stays shared"


def test_step9_out_of_blocks_the_latest_admitted_is_preempted_and_recomputed_later():
    s = make_scheduler(num_blocks=4, num_cpu_blocks=4)  # preemption_mode="recompute", though a swap pool is there
    a, b, c, d = make_seq(1, 4), make_seq(2, 3), make_seq(3, 8), make_seq(4, 2)
    for seq in (a, b, c):  # 1 + 1 + 2 blocks: the pool is full after the prefills
        s.add(seq)
    advance(s, s.schedule())
    s.add(d)  # waits: no block is free
    out = s.schedule()  # a's decode needs a second block: none is free
    assert ids(out.preempted) == [3], \
        "stage 6: the victim is the most recently admitted running sequence (c), not the oldest other one (b)"
    assert batch(out) == [(1, 1), (2, 1)], "stage 6: a gets one of c's 2 blocks and decodes; b decodes in its block"
    assert c.status is seq_mod.SequenceStatus.WAITING and c.num_computed_tokens == 0, \
        "stage 6: recompute: c's blocks are freed and nothing of it counts as computed"
    assert ids(s.waiting) == [3, 4], \
        "stage 6: the preempted c goes to the *front* of the waiting queue, ahead of d, which arrived later"
    assert c.num_tokens == 9, "stage 6: preemption never drops tokens: c keeps its prompt and its sampled token"
    advance(s, out)
    for _ in range(3):  # a and b decode; b takes the last free block
        advance(s, s.schedule())
    out = s.schedule()  # a needs a block again: b is the most recently admitted running sequence now
    assert ids(out.preempted) == [2] and ids(s.waiting) == [2, 3, 4], \
        "stage 6: b is the victim now, and goes to the front of the waiting queue, ahead of c"
    assert (s.num_preemptions, s.num_swap_outs) == (2, 0), "stage 6: num_preemptions counts both; none swapped"
    advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    s.finish(b, seq_mod.SequenceStatus.FINISHED_STOPPED)  # (a waiting sequence can finish: an abort)
    out = s.schedule()
    assert batch(out) == [(3, 9), (4, 2)], \
        "stage 6: c resumes first, prefilling its prompt *and* its generated token again; then d, which came later"


def test_step10_or_its_blocks_are_swapped_to_cpu_memory_and_back():
    s = make_scheduler(num_blocks=4, mode="swap", num_cpu_blocks=4)
    a, b, d = make_seq(1, 8), make_seq(2, 8), make_seq(4, 3)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    b_blocks = s.block_manager.block_ids(b)
    out = s.schedule()
    assert ids(out.preempted) == [2] and b.status is seq_mod.SequenceStatus.SWAPPED and ids(s.swapped) == [2], \
        "stage 6: preemption_mode='swap': the victim b goes to s.swapped, SWAPPED"
    assert [dev for dev, _ in out.blocks_to_swap_out] == b_blocks, \
        "stage 6: swap: every device block of b is copied to a CPU block (the runner copies before the forward)"
    assert b.num_computed_tokens == 8 and (s.num_preemptions, s.num_swap_outs) == (1, 1), \
        "stage 6: swapped K/V are kept: nothing needs recomputing; num_swap_outs counts the swap"
    cpu_blocks = [cpu for _, cpu in out.blocks_to_swap_out]
    advance(s, out)
    s.add(d)  # d would fit in the one free block, but b (3 blocks) does not fit back yet
    out = s.schedule()
    assert batch(out) == [(1, 1)] and d.status is seq_mod.SequenceStatus.WAITING, \
        "stage 6: while a sequence is swapped out no new request is admitted: swapped sequences come back first"
    advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 1), (4, 3)], \
        "stage 6: swapped sequences come back before waiting ones: b simply decodes its next token, then d joins"
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == cpu_blocks, \
        "stage 6: b's K/V are copied back from the CPU blocks they were swapped out to"
    assert b.status is seq_mod.SequenceStatus.RUNNING and ids(s.running) == [2, 4] \
        and out.scheduled[0].slot_mapping == [s.block_manager.block_ids(b)[2] * 4], \
        "stage 6: b is RUNNING again, and its token 8 has its slot in b's third block"

    # Two victims in one step, one with a single computed token: both swapped, both back in one step.
    s = make_scheduler(num_blocks=3, mode="swap", num_cpu_blocks=8)
    a, b, c = make_seq(1, 4), make_seq(2, 4), make_seq(3, 1)  # a block each: the pool is full after the prefills
    for seq in (a, b, c):
        s.add(seq)
    advance(s, s.schedule())
    out = s.schedule()  # a's decode needs a block: c is the victim; then b's needs one: b swaps itself out
    assert ids(out.preempted) == [3, 2] and ids(s.swapped) == [2, 3] and s.num_swap_outs == 2, \
        "stage 6: both victims are swapped (c with its single computed token too), the oldest first in s.swapped"
    assert len(out.blocks_to_swap_out) == 2, "stage 6: blocks_to_swap_out holds the copies of both victims"
    advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 1), (3, 1)] and len(out.blocks_to_swap_in) == 2, \
        "stage 6: both come back in one step, oldest first: blocks_to_swap_in holds both copies"


def test_step11_the_swap_pool_and_the_prefix_cache():
    bm = bm_mod.BlockManager(8, 4, max_model_len=64, enable_prefix_caching=True, num_cpu_blocks=3)
    assert bm.cpu.num_free == 3, "stage 6: the swap pool (bm.cpu, stage 2's allocator) has num_cpu_blocks blocks"
    a, big = make_seq(1, 10), make_seq(2, 20)
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    blocks = bm.block_ids(a)
    assert bm.can_swap_out(a), "stage 6: 3 free CPU blocks for a's 3 device blocks"
    copies = bm.swap_out(a)
    assert [dev for dev, _ in copies] == blocks and not bm.has_blocks(a) and bm.num_free_blocks == 8, \
        "stage 6: swap_out copies each device block to a CPU block, in logical order, and frees the device blocks"
    assert bm.stats()["num_swapped_blocks"] == 3 and bm.cpu_tables[a.seq_id] == [cpu for _, cpu in copies], \
        "stage 6: the CPU table of a holds its 3 CPU blocks (stats: num_swapped_blocks)"
    assert not bm.all_free(), "stage 6: a swapped sequence still holds its CPU blocks: not all free"
    bm.check_invariants()
    bm.allocate(big, 20)  # 5 blocks, the 5 never used: 3 stay free, a's 2 full blocks among them (cached)
    assert bm.can_swap_in(a, 1) and not bm.can_swap_in(a, 3), \
        "stage 6: can_swap_in counts exactly: a's 2 cached full blocks (free, so taking them uses 2 free blocks) " \
        "and the new blocks for the rest: 10 + 1 tokens need 1 more (3 in all: fits), 10 + 3 need 2 more (4: no)"
    assert not bm.can_swap_out(big), "stage 6: 5 device blocks do not fit in a swap pool of 3 CPU blocks"
    back = bm.swap_in(a)
    assert bm.block_ids(a)[:2] == blocks[:2] and back == [(copies[2][1], bm.block_ids(a)[2])], \
        "stage 6: a's 2 full blocks are still in the prefix cache on the device: swap_in reuses them and copies " \
        "back only the partly filled last block"
    assert bm.stats()["num_swapped_blocks"] == 0 and bm.cpu.num_used == 0, "stage 6: swap_in frees the CPU blocks"
    bm.swap_out(a)
    bm.cpu_tables[a.seq_id].append(bm.cpu_tables[a.seq_id][0])  # a CPU block held twice
    with raises(AssertionError, "stage 6: check_invariants() checks the swap pool too: a CPU block held twice"):
        bm.check_invariants()
    bm.cpu_tables[a.seq_id].pop()
    bm.free(a)
    bm.free(big)
    assert bm.all_free(), "stage 6: free gives back a swapped sequence's CPU blocks too"
    small = bm_mod.BlockManager(4, 4, max_model_len=64, num_cpu_blocks=1)
    small.allocate(a, 3)
    assert small.can_swap_out(a), "stage 6: a swap pool of one CPU block holds a sequence of one block"


def test_step12_a_sequence_already_scheduled_in_this_step_is_never_the_victim():
    s = make_scheduler(num_blocks=2)
    a, b = make_seq(1, 2), make_seq(2, 4)  # one block each: the pool is full after the prefills
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    out = s.schedule()  # a's decode fits in its block; b's needs a second block
    assert batch(out) == [(1, 1)] and ids(out.preempted) == [2], \
        "stage 6: a is already scheduled in this step (its slots are promised), so b preempts itself"


def test_step13_a_step_that_preempts_admits_nothing():
    s = make_scheduler(num_blocks=3, budget=2)
    a, b = make_seq(1, 2), make_seq(2, 2)
    s.add(a)
    s.add(b)
    for _ in range(5):  # budget 2: a's prompt, then b's in 1-token chunks beside a's decodes; then both decode
        advance(s, s.schedule())
    out = s.schedule()  # b's decode needs its second block: none is free, and a is already scheduled
    assert ids(out.preempted) == [2], "stage 6: b preempts itself (a is already scheduled)"
    assert batch(out) == [(1, 1)] and b.status is seq_mod.SequenceStatus.WAITING, \
        "stage 6: a step that preempted admits no waiting request, not even b, which would fit its 1-token chunk " \
        "into the block it just gave back (preempted and admitted in one step: ping-pong)"
    assert s.block_manager.num_free_blocks == 1, "stage 6: b's block is free for the next step"


def test_step14_idle_beams_give_their_blocks_back_before_anyone_is_preempted():
    s = make_scheduler(num_blocks=4, max_num_seqs=2)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    x = make_seq(seq_mod.next_seq_id(), 4)
    group = seq_mod.SequenceGroup("beam", None, [1, 2, 3, 4], params)  # as LLMEngine.add_request makes it
    first = seq_mod.Sequence(seq_mod.next_seq_id(), "beam", [1, 2, 3, 4], 4, round_params(params), 0, group=group)
    first.logprobs, first.cumulative_logprob = [], 0.0
    group.seqs, group.beam = [first], BeamState(params, [first])
    s.add(x)
    s.add(first)

    def candidates(*tokens, step=-0.1):  # a beam's report: its 2 x beam_width most likely next tokens
        return (step, {t: seq_mod.Logprob(step * (k + 1), k + 1) for k, t in enumerate(tokens)})

    out = s.schedule()
    s.update(out, SamplerOutput([NEW_TOKEN, 50], logprobs=[None, candidates(50, 51, 52, 53)]))
    beams = list(group.beam.live)
    assert [seq.token_ids[-1] for seq in beams] == [50, 51] and ids(s.running) == [x.seq_id] + ids(beams), \
        "stage 6: update() ranks the round: the 2 best candidates fork the first beam"
    assert s.num_generated_tokens == 2, "stage 6: num_generated_tokens counts x's token and the beam's report"
    out = s.schedule()  # max_num_seqs=2: x and the first beam; the second waits for the next step
    s.update(out, SamplerOutput([NEW_TOKEN, 60], logprobs=[None, candidates(60, 61, 62, 63)]))
    idle = beams[0]
    assert idle.is_idle and s.block_manager.num_free_blocks == 0, \
        f"stage 6: beam {idle.seq_id} has reported: idle until beam {beams[1].seq_id} reports; the pool is full"
    out = s.schedule()  # the second beam's decode needs a block
    assert ids(out.preempted) == [] and batch(out) == [(x.seq_id, 1), (beams[1].seq_id, 1)], \
        f"stage 6: when blocks run short, idle beams give theirs back first: beam {idle.seq_id}'s, not a preemption"
    assert not s.block_manager.has_blocks(idle) and idle.seq_id not in ids(s.running) + ids(s.waiting), \
        f"stage 6: the idle beam {idle.seq_id} holds no block and waits in no queue (its round's ranking decides)"
    assert (idle.num_computed_tokens, idle.status, s.num_preemptions) == (0, seq_mod.SequenceStatus.WAITING, 1), \
        "stage 6: its K/V are gone: nothing computed, WAITING; num_preemptions counts the blocks taken back"
    s.update(out, SamplerOutput([NEW_TOKEN, 70], logprobs=[None, candidates(70, 71, 72, 73, step=-0.04)]))
    survivors = group.beam.live  # the best: the idle beam's 60, then the second beam's 70
    assert [seq.token_ids[-2:] for seq in survivors] == [[50, 60], [51, 70]] and group.seqs == survivors, \
        "stage 6: the round is ranked once the second beam reports: one survivor of each beam"
    assert (survivors[0].status, survivors[0].num_computed_tokens) == (seq_mod.SequenceStatus.WAITING, 0) \
        and ids(s.waiting) == ids(survivors[:1]), \
        "stage 6: a survivor of the beam whose blocks were taken back waits to be recomputed from its tokens"
    assert survivors[1].status is seq_mod.SequenceStatus.RUNNING and ids(s.running) == [x.seq_id, survivors[1].seq_id] \
        and all(beam.status is seq_mod.SequenceStatus.FINISHED_STOPPED for beam in beams), \
        "stage 6: the other forks its running parent's blocks; the parents are finished"
    assert s.num_requests() == {"running": 2, "waiting": 0, "swapped": 0}, \
        "stage 6: num_requests() counts a request once, where its first sequence is: running before swapped and waiting"
    out = s.schedule()  # x and the running survivor decode; the other survivor waits for blocks
    s.update(out, SamplerOutput([NEW_TOKEN, 80], logprobs=[None, candidates(80, 81, 82, 83)]))
    advance(s, s.schedule())  # x alone: the survivor that reported is idle, waiting for the other's report
    out = s.schedule()  # x needs a block: the idle survivor's are taken back
    assert ids(out.preempted) == [] and s.num_preemptions == 2, \
        "stage 6: blocks taken back from an idle beam again: num_preemptions counts each time"


def test_step15_the_same_scheduler_over_stage_1s_reservations():
    bm_mod.ContiguousBlockManager(16, 4, max_model_len=64)  # exactly one reservation
    with raises(ValueError, "stage 6: a pool that cannot hold one reservation of max_model_len is refused"):
        bm_mod.ContiguousBlockManager(15, 4, max_model_len=64)
    bm = bm_mod.ContiguousBlockManager(48, 4, max_model_len=64)  # room for 3 reservations of 64 slots
    s = sched_mod.Scheduler(sched_mod.SchedulerConfig(8, 64, True, "recompute"), bm)
    seqs = [make_seq(i, 3) for i in (1, 2, 3, 4)]
    for seq in seqs:
        s.add(seq)
    assert bm.lookup(seqs[0]).num_tokens == 0, "stage 6: a reservation is private: no prefix cache"
    out = s.schedule()
    assert batch(out) == [(1, 3), (2, 3), (3, 3)], \
        "stage 6: ContiguousBlockManager reserves max_model_len (16 blocks) per sequence: 3 fit where paged fits all 4"
    assert [e.slot_mapping for e in out.scheduled] == [[0, 1, 2], [64, 65, 66], [128, 129, 130]] \
        and bm.block_ids(seqs[1]) == [16], "stage 6: each reservation is one stretch, first fit (stage 1)"
    assert bm.num_free_blocks == 0 and bm.live_usage() == (9 / 192, 48, 0) and bm.stats() == {
        "num_blocks": 48, "num_free_blocks": 0, "num_used_blocks": 48, "num_shared_blocks": 0, "num_cached_blocks": 0,
        "token_state_fraction": 9 / 192, "prefix_cache_hit_rate": 0.0, "num_swapped_blocks": 0}, \
        "stage 6: the reservations hold the whole pool for 9 tokens (stage 1's token_state_fraction: 9 of 192 slots); " \
        "stats() has BlockManager's keys, with nothing shared, cached or swapped"
    assert not bm.can_swap_out(seqs[0]) and bm.has_blocks(seqs[0]), "stage 6: reservations are never swapped"
    with raises(ValueError, "stage 6: a reservation cannot be shared: fork raises ValueError"):
        bm.fork(seqs[0], make_seq(9, 3))
    bm.set_token(seqs[0], 0)  # nothing is cached by content: nothing to do
    bm.check_invariants()
    advance(s, out)
    for _ in range(12):
        advance(s, s.schedule())
    assert s.num_preemptions == 0 and bm.block_ids(seqs[0]) == [0, 1, 2, 3], \
        "stage 6: a reservation always holds its sequence's next token: nothing is ever preempted"
    s.finish(seqs[0], seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 1), (3, 1), (4, 3)], "stage 6: a finished reservation's stretch takes the next request"
    advance(s, out)
    for seq in seqs[1:3]:
        s.finish(seq, seq_mod.SequenceStatus.FINISHED_STOPPED)
    last, n = seqs[3], seqs[3].num_computed_tokens
    assert bm.live_usage()[1:] == (16, 0) and (bm.stats()["num_used_blocks"], bm.stats()["num_free_blocks"]) == (16, 32), \
        "stage 6: one reservation left: 16 blocks used, 32 free"
    bm.check_invariants()
    assert bm.can_append(last, 64 - n) and not bm.can_append(last, 65 - n), \
        "stage 6: can_append: up to the reservation's 64 slots, not one more"
    s.finish(last, seq_mod.SequenceStatus.FINISHED_STOPPED)
    assert bm.all_free(), "stage 6: every reservation released"


def test_step16_on_a_real_model_every_request_gets_exactly_the_logits_it_gets_alone():
    prompts = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because", "One day"]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(4)]
    solo = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=8, record_logits=True)  # the reference, one at a time
    alone = [solo.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    # Your scheduler and block manager inside the engine. 5 blocks for 4 requests of up to 3 blocks
    # each: they join, leave and are preempted as they go.
    llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=5, record_logits=True, max_num_batched_tokens=16,
              scheduler_cls=sched_mod.Scheduler, block_manager_cls=bm_mod.BlockManager)
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["peak_num_running_seqs"] > 1, \
        "stage 6: 5 blocks for 4 growing requests: the engine must batch them and preempt (it reads your counters)"
    for prompt, got, want in zip(prompts, together, alone):
        assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits), \
            f"stage 6: {prompt!r}: batching or preemption changed its logits; on the CPU they must be bit-identical"
    assert llm.llm_engine.block_manager.all_free(), "stage 6: after generate every block is free again"
