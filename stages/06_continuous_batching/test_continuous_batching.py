"""Stage 6 — continuous batching and preemption, one lesson step per test, in order.

Steps 1–8 drive your scheduler and block manager by hand, with no model: `advance()` plays the
model runner (every sequence that samples in the step gets token 7) and hands the tokens to your
`Scheduler.update`. Step 9 runs the reference engine (model, runner, sampler) around your two classes
on a real pretrained model. `Sequence`, `SamplingParams` and the stop rules are given: they are not
this stage's lesson.

Run: pytest stages -m stage6 (add --impl PKG to grade your own package).
"""

from __future__ import annotations


import torch

from pagedref import DEFAULT_MODEL, LLM
from pagedref.course import lesson
from pagedref.engine import sequence as seq_mod
from pagedref.engine.sampling import SamplerOutput, SamplingParams

bm_mod = lesson("pagedref.engine.block_manager")
sched_mod = lesson("pagedref.engine.scheduler")

NEW_TOKEN = 7


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 100):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return seq_mod.Sequence(seq_id, f"r{seq_id}", list(range(10 * seq_id, 10 * seq_id + prompt_len)), prompt_len, params)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   mode: str = "recompute", num_cpu_blocks: int = 0):
    bm = bm_mod.BlockManager(num_blocks, block_size, max_model_len=64, enable_prefix_caching=False,
                             num_cpu_blocks=num_cpu_blocks)
    return sched_mod.Scheduler(sched_mod.SchedulerConfig(max_num_seqs, budget, True, mode), bm)


def advance(s, out) -> None:
    """The model runner's part (every sequence that samples gets NEW_TOKEN), then your update."""
    s.update(out, SamplerOutput([NEW_TOKEN] * len(out.sampling_seqs())))


def batch(out) -> list[tuple[int, int]]:
    return [(entry.seq.seq_id, entry.num_new_tokens) for entry in out.scheduled]


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


def test_step2_one_step_is_schedule_execute_update():
    s = make_scheduler(num_blocks=16)
    a = make_seq(1, 5)
    s.add(a)
    out = s.schedule()
    [entry] = out.scheduled
    assert (entry.seq, entry.num_new_tokens, entry.num_computed_tokens, entry.token_ids) == (a, 5, 0, a.token_ids), \
        "stage 6: the output says which tokens of which sequence the step computes (its prompt, from position 0)"
    blocks = s.block_manager.block_ids(a)
    assert entry.block_ids == blocks and entry.slot_mapping == [blocks[p // 4] * 4 + p % 4 for p in range(5)], \
        "stage 6: and where: the block table and the slots the block manager gave the tokens (computed once, there)"
    assert entry.sample_seqs == [a] and a.num_computed_tokens == 5, \
        "stage 6: schedule() counts the step's tokens as computed at once; the last row of a finished prompt samples"
    advance(s, out)
    assert a.output_token_ids == [NEW_TOKEN] and a.num_uncomputed_tokens == 1, \
        "stage 6: update() appends the sampled token (the one writer of what a step produced): a decodes next"


def test_step3_requests_join_the_running_batch_at_the_next_step():
    s = make_scheduler(num_blocks=16)
    a, b, c = make_seq(1, 5), make_seq(2, 3), make_seq(3, 6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert batch(out) == [(1, 5), (2, 3)], "stage 6: both waiting prompts fit: both prefill in the first step"
    assert a.status is seq_mod.SequenceStatus.RUNNING and s.running == [a, b]
    advance(s, out)
    s.add(c)  # arrives while a and b are decoding
    out = s.schedule()
    assert batch(out) == [(1, 1), (2, 1), (3, 6)], \
        "stage 6: iteration-level scheduling: c joins at once, its prefill in the same step as a's and b's decodes"


def test_step4_max_num_seqs_caps_the_batch():
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


def test_step5_a_finished_sequence_frees_its_blocks_at_once():
    s = make_scheduler(num_blocks=16)
    a, b = make_seq(1, 9, max_tokens=1), make_seq(2, 3)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.block_manager.num_free_blocks == 16 - 3 - 1, "stage 6: 9 tokens in blocks of 4 = 3 blocks, and b's 1"
    advance(s, out)
    assert a.status.finish_reason == "length", "stage 6: update() applies the stop rules: a has its max_tokens=1"
    assert s.block_manager.num_free_blocks == 16 - 1 and s.running == [b], \
        "stage 6: a finished sequence's blocks are freed in the update of the step it finished, not at the end of a batch"


def test_step6_out_of_blocks_the_latest_admitted_is_preempted_and_recomputed_later():
    s = make_scheduler(num_blocks=4)
    a, b = make_seq(1, 8), make_seq(2, 8)  # 2 blocks each: the pool is full after the prefills
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    out = s.schedule()  # a's decode needs a third block: none is free
    assert out.preempted == [b], "stage 6: the most recently admitted running sequence is the victim"
    assert batch(out) == [(1, 1)], "stage 6: a gets b's blocks and decodes"
    assert b.status is seq_mod.SequenceStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b, \
        "stage 6: recompute: b's blocks are freed, it goes to the front of the waiting queue with nothing computed"
    assert b.num_tokens == 9, "stage 6: preemption never drops tokens: b keeps its prompt and its sampled token"
    advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 9)], "stage 6: b resumes by prefilling its prompt *and* its generated token again"


def test_step7_or_its_blocks_are_swapped_to_cpu_memory_and_back():
    s = make_scheduler(num_blocks=4, mode="swap", num_cpu_blocks=4)
    a, b = make_seq(1, 8), make_seq(2, 8)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    b_blocks = s.block_manager.block_ids(b)
    out = s.schedule()
    assert out.preempted == [b] and b.status is seq_mod.SequenceStatus.SWAPPED
    assert [dev for dev, _ in out.blocks_to_swap_out] == b_blocks, \
        "stage 6: swap: every device block of b is copied to a CPU block (the runner copies before the forward)"
    assert b.num_computed_tokens == 8, "stage 6: swapped K/V are kept: nothing needs recomputing"
    cpu_blocks = [cpu for _, cpu in out.blocks_to_swap_out]
    advance(s, out)
    s.finish(a, seq_mod.SequenceStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert batch(out) == [(2, 1)], "stage 6: b comes back and simply decodes its next token"
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == cpu_blocks, \
        "stage 6: b's K/V are copied back from the CPU blocks they were swapped out to"


def test_step8_a_sequence_already_scheduled_in_this_step_is_never_the_victim():
    s = make_scheduler(num_blocks=2)
    a, b = make_seq(1, 2), make_seq(2, 4)  # one block each: the pool is full after the prefills
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    out = s.schedule()  # a's decode fits in its block; b's needs a second block
    assert batch(out) == [(1, 1)] and out.preempted == [b], \
        "stage 6: a is already scheduled in this step (its slots are promised), so b preempts itself"


def test_step9_on_a_real_model_every_request_gets_exactly_the_logits_it_gets_alone():
    prompts = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because", "One day"]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(4)]
    solo = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=8, record_logits=True)  # the reference, one at a time
    alone = [solo.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    # Your scheduler and block manager inside the engine. 5 blocks for 4 requests of up to 3 blocks
    # each: they join, leave and are preempted as they go.
    llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=64, num_kv_blocks=5, record_logits=True, max_num_batched_tokens=16,
              scheduler_cls=sched_mod.Scheduler, block_manager_cls=bm_mod.BlockManager)
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.get_stats()["num_preemptions"] > 0 and llm.get_stats()["peak_num_running_seqs"] > 1
    for prompt, got, want in zip(prompts, together, alone):
        assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits), \
            f"stage 6: {prompt!r}: batching or preemption changed its logits; on the CPU they must be bit-identical"
    assert llm.llm_engine.block_manager.all_free(), "stage 6: after generate every block is free again"
