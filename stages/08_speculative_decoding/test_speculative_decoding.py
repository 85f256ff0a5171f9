"""Stage 8 — speculative decoding on paged blocks, one lesson step per test, in order.

Steps 1-2 are your proposer alone. Steps 3-4 drive the (given) scheduler by hand with your proposer:
`schedule()` gives a speculating decode k + 1 rows and their slots, and `update()`, handed the rows'
tokens by hand, keeps the agreeing prefix and rolls the rest back (through stage 4's `truncate`). Steps
5-6 are your rejection sampler alone: greedy rows, then the distribution test. Steps 7-8 run the
reference engine with your proposers and your rejection sampler on stories260K, against llama2.c.

Run: pytest stages -m stage8 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import json

import torch

from pagedref import LLM
from pagedref.course import REPO_ROOT, lesson
from pagedref.engine.block_manager import BlockManager
from pagedref.engine.model_runner import ModelRunner
from pagedref.engine.sampling import SamplerOutput, SamplingParams
from pagedref.engine.scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from pagedref.engine.sequence import Sequence

spec = lesson("pagedref.engine.spec_decode")  # yours: proposers and the rejection sampler. The rest is given.

STORIES = REPO_ROOT / "tests" / "models" / "stories260K"  # a real pretrained Llama, and llama2.c's outputs for it
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def make_seq(seq_id: int, tokens: list[int], max_tokens: int = 100, prompt_len: int | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), prompt_len or len(tokens),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))


def stories_cases() -> list[dict]:
    return json.loads((STORIES / "llama2c_reference.json").read_text())["cases"]


def expected(case: dict) -> list[int]:
    n = case["first_bos_index"]
    return case["greedy_ids"][: n + 1] if n is not None else case["greedy_ids"][: 512 - len(case["prompt_ids"])]


def prompt(case: dict):
    return case["prompt"] or {"prompt": "", "prompt_token_ids": case["prompt_ids"]}


def test_step1_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    assert spec.ngram_propose([1, 2, 3, 9, 1, 2], 2, 1, 3) == [3, 9], \
        "stage 8: the suffix [1, 2] occurred at 0, followed by 3, 9: the draft"
    assert spec.ngram_propose([1, 2, 3, 1, 2, 5, 1, 2], 3, 1, 3) == [5, 1, 2], \
        "stage 8: [1, 2] occurred at 0 and at 3: the latest earlier occurrence (3) wins, its continuation is 5, 1, 2"
    assert spec.ngram_propose([7, 1, 2, 3, 4, 8, 2, 3, 4], 2, 2, 3) == [8, 2], \
        "stage 8: the longest suffix first: [2, 3, 4] (n = 3) occurred at 2, followed by 8, 2"
    assert spec.ngram_propose([1, 2, 5, 3, 2, 9, 1, 2], 2, 1, 3) == [5, 3], \
        "stage 8: the longest suffix first: [1, 2] (n = 2) occurred at 0, followed by 5, 3 (not [2]'s later match, 9, 1)"
    assert spec.ngram_propose([5, 6, 7], 3, 1, 3) == [], "stage 8: no suffix of min_n tokens occurred before: no draft"
    assert spec.ngram_propose([9, 5, 6, 7], 3, 2, 3) == [], "stage 8: the suffixes [6, 7] and [5, 6, 7] never occurred before"
    assert spec.ngram_propose([4, 4, 4], 5, 1, 1) == [4, 4, 4, 4, 4], \
        "stage 8: a continuation that reaches the end copies on from itself (overlapping copy): k tokens of the loop"
    assert spec.ngram_propose([1, 2, 3, 9, 1, 2], 5, 1, 3) == [3, 9, 1, 2, 3], "stage 8: ... the copy runs into the draft itself"
    assert spec.ngram_propose([1, 2, 1], 0, 1, 2) == [], "stage 8: k = 0 asks for nothing"


def test_step2_a_proposer_drafts_for_each_decoding_sequence_within_its_room():
    proposer = spec.NgramProposer(4, 1, 3)
    a = make_seq(1, [1, 2, 3, 1, 2])
    b = make_seq(2, [7, 8, 9])
    c = make_seq(3, [5, 6, 5, 6])
    drafts = proposer.propose([a, b, c], [4, 4, 2])
    assert len(drafts) == 3, "stage 8: propose returns one entry per sequence, in order"
    assert drafts[0].token_ids == [3, 1, 2, 3] and drafts[0].probs is None, \
        "stage 8: a's draft is what followed [1, 2] (copied on), and prompt lookup's drafts are deterministic (probs None)"
    assert drafts[1] is None, "stage 8: b's suffix never occurred before: None, no draft"
    assert drafts[2].token_ids == [5, 6], "stage 8: c has room for 2 drafts only (max_tokens, max_model_len): 2 at most"
    proposer.free(a)  # prompt lookup keeps no state: nothing to free, and nothing breaks


def make_scheduler(proposer, budget: int = 64, num_blocks: int = 16, block_size: int = 4, caching: bool = False):
    bm = BlockManager(num_blocks, block_size, max_model_len=64, enable_prefix_caching=caching)
    s = Scheduler(SchedulerConfig(8, budget, True, "recompute"), bm)
    s.proposer = proposer
    return s


def test_step3_a_speculating_decode_is_k_plus_1_query_rows_over_its_paged_context():
    s = make_scheduler(spec.NgramProposer(4, 1, 3))
    seq = make_seq(1, [1, 2, 3, 9, 1])  # 5 prompt tokens: blocks of 4
    s.add(seq)
    s.update(s.schedule(), SamplerOutput([2]))  # the prefill samples 2: [1, 2, 3, 9, 1, 2]
    out = s.schedule()
    [entry] = out.scheduled
    assert (entry.num_computed_tokens, entry.num_new_tokens, entry.num_draft_tokens) == (5, 5, 4), \
        "stage 8: the decode of position 5 carries 4 drafts: 5 query rows, positions 5..9"
    assert entry.token_ids == [2, 3, 9, 1, 2], "stage 8: row 0 is its last token, rows 1..4 its drafts (what followed [1, 2])"
    blocks = s.block_manager.block_ids(seq)
    assert len(blocks) == 3 and entry.slot_mapping == [blocks[p // 4] * 4 + p % 4 for p in range(5, 10)], \
        "stage 8: the drafts get slots like any token: positions 5..9 need a third block"
    assert seq.num_computed_tokens == 6 and entry.sample_seqs == [], \
        "stage 8: only the known tokens count as computed; the rows are verified in update, not sampled"
    config = type("C", (), dict(num_hidden_layers=1, num_key_value_heads=1, head_dim=2))
    runner = ModelRunner(type("M", (), {"config": config})(), None, 16, 4, "cpu", torch.float32)
    step = runner.prepare(out)
    assert step.meta.query_start_loc.tolist() == [0, 5] and step.meta.context_lens.tolist() == [10], \
        "stage 8: one sequence, 5 query rows over a context of 10: the prefill path, in the middle of decoding"
    assert step.spec_rows == [0, 1, 2, 3, 4] and step.sample_rows == [], "stage 8: every row is scored"


def test_step4_update_keeps_the_agreeing_prefix_and_gives_the_rejected_slots_back():
    s = make_scheduler(spec.NgramProposer(4, 1, 3))
    seq = make_seq(1, [1, 2, 3, 9, 1])
    s.add(seq)
    s.update(s.schedule(), SamplerOutput([2]))
    out = s.schedule()  # drafts 3, 9, 1, 2 at positions 6..9 (block 2 holds positions 8, 9)
    blocks, free_before = list(s.block_manager.block_ids(seq)), s.block_manager.num_free_blocks
    # the target's tokens per row (what the runner hands update): row 0 agrees with draft 3, row 1 says 7, not 9
    s.update(out, SamplerOutput([], spec=[spec.SpecTokens([3, 7, 5, 5, 5])]))
    assert seq.token_ids == [1, 2, 3, 9, 1, 2, 3, 7], \
        "stage 8: the accepted draft (3), then row 1's own token (7): 2 tokens from one step"
    assert seq.num_computed_tokens == 7 and s.block_manager.kv.num_tokens(seq.seq_id) == 7, \
        "stage 8: the K/V of 2 and the accepted 3 stay (positions 5, 6); 7 is computed next step"
    assert s.block_manager.block_ids(seq) == blocks[:2] and s.block_manager.num_free_blocks == free_before + 1, \
        "stage 8: the rejected drafts' slots are rolled back: the third block held only rejected drafts, back to the pool"
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (4, 1), "stage 8: the counters of get_stats()"
    nxt = s.schedule().scheduled[0]
    assert nxt.num_computed_tokens == 7 and nxt.token_ids[0] == 7, \
        "stage 8: the next step writes over the rejected slots: its row 0 is the target's token, at position 7"


def test_step5_greedy_verification_is_the_argmax_of_each_row():
    vocab, k = 6, 3
    logits = torch.randn(2 * (k + 1), vocab, generator=torch.Generator().manual_seed(0))
    entries = []
    for i in range(2):
        seq = make_seq(i, [1, 2, 3])
        e = ScheduledSequence(seq, k + 1, 2, [3, 0, 1, 2], [0], [2, 3, 4, 5], [])
        e.num_draft_tokens = k
        entries.append(e)
    tokens = spec.RejectionSampler()(logits, entries)
    assert tokens.tolist() == logits.argmax(-1).tolist(), \
        "stage 8: a greedy sequence's rows take their argmax: exactly the tokens plain decoding would choose"
    one_hot = torch.zeros(k + 1, vocab, dtype=torch.float64)
    one_hot[:, 4] = 1.0
    races = torch.ones(k + 1, vocab, dtype=torch.float64)
    got = spec.verify_rows(one_hot, torch.tensor([4, 2, 4]), None, torch.full((k,), 0.999, dtype=torch.float64), races)
    assert got.tolist() == [4, 4, 4, 4], \
        "stage 8: a draft the target is sure of is kept (4), a draft it gives probability 0 is replaced by the target's (4)"
    last = one_hot.clone()
    last[k] = torch.eye(vocab, dtype=torch.float64)[1]  # p_k: sure of 1
    got = spec.verify_rows(last, torch.tensor([4, 4, 4]), None, torch.full((k,), 0.999, dtype=torch.float64), races)
    assert got.tolist() == [4, 4, 4, 1], \
        "stage 8: after k kept drafts the last row gives the bonus token, drawn from p_k (row k), not from a draft's row"


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected_counts = counts.sum() * probs
    stat = ((counts - expected_counts) ** 2 / expected_counts).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2))


def test_step6_rejection_sampling_emits_the_targets_distribution():
    n = 100_000  # independent trials, one verified row each
    p = torch.tensor([0.30, 0.02, 0.15, 0.08, 0.20, 0.05, 0.12, 0.08], dtype=torch.float64)  # the target
    q = torch.tensor([0.05, 0.30, 0.05, 0.25, 0.05, 0.20, 0.05, 0.05], dtype=torch.float64)  # a poor draft
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    uniforms = torch.rand(n, generator=g, dtype=torch.float64)
    races = torch.empty(n + 1, len(p), dtype=torch.float64).exponential_(generator=g)
    p_values = {}
    for correction in (True, False):
        tokens = spec.verify_rows(p.expand(n + 1, -1), drafts, q.expand(n, -1), uniforms, races, correction)[:n]
        p_values[correction] = chi_square_p_value(torch.bincount(tokens, minlength=len(p)).double(), p)
    assert p_values[True] > 1e-3, (
        f"stage 8: with the residual correction the emitted tokens must follow the target p (chi-square p-value "
        f"{p_values[True]:.3g} <= 0.001): keep a draft with probability min(1, p/q), else draw from max(0, p - q)")
    assert p_values[False] < 1e-12, (
        f"stage 8: correction=False must draw a rejected row from p itself, and then the draft's bias shows "
        f"(p-value {p_values[False]:.3g}): the residual is what makes the output exact")


def engine_with(spec_config: dict) -> LLM:
    """The given engine on stories260K with `spec_config`, verifying with your rejection sampler."""
    llm = LLM(STORIES, device="cpu", num_kv_blocks=6 * 32 + 8, speculative_config=spec_config)
    llm.llm_engine.runner.rejection_sampler = spec.RejectionSampler()
    return llm


def with_your_draft_model(draft: str, k: int) -> tuple[LLM, object]:
    """engine_with a draft model, proposing through your DraftModelProposer over the given draft runner's pool."""
    llm = engine_with({"model": draft, "num_speculative_tokens": k})
    scheduler = llm.llm_engine.scheduler
    scheduler.proposer = spec.DraftModelProposer(scheduler.proposer.runner, 6 * 32 + 8, k, 512)
    return llm, scheduler.proposer


def generates_llama2c_tokens(llm: LLM, what: str) -> None:
    # Three of llama2.c's six prompts: two that end at its BOS, one that runs to the 512-token context (a draft
    # must stop at the room left). tests/test_spec_decode.py runs all six; each costs seconds on a CPU.
    cases = [stories_cases()[i] for i in (1, 3, 5)]
    outs = llm.generate([prompt(c) for c in cases], GREEDY)
    for out, case in zip(outs, cases):
        assert out.outputs[0].token_ids == expected(case), \
            f"stage 8: {what} must give llama2.c's tokens for {case['prompt']!r}, token for token"


def test_step7_on_stories260k_prompt_lookup_changes_no_token():
    llm = engine_with({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    engine = llm.llm_engine
    engine.scheduler.proposer = spec.NgramProposer(4, 1, 3)  # yours, in the given engine
    generates_llama2c_tokens(llm, "greedy speculation")
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] > 0 and 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"], \
        "stage 8: drafts were scored, and some kept"
    assert engine.block_manager.all_free(), "stage 8: every block is back in the pool when the requests are done"


def test_step8_a_draft_model_keeps_its_own_paged_cache_in_step(tmp_path):
    k = 3
    llm, proposer = with_your_draft_model(str(STORIES), k)  # the draft is the target itself, on a pool of 200 blocks
    generates_llama2c_tokens(llm, "greedy with a draft model")
    stats = llm.get_stats()
    rate = stats["spec_num_accepted_tokens"] / max(stats["spec_num_draft_tokens"], 1)
    assert rate >= 0.95, f"stage 8: a draft that is the target proposes what the target chooses: acceptance {rate:.1%} < 95%"
    assert stats["spec_mean_accepted_length"] > k, "stage 8: nearly k + 1 tokens per speculative step"
    assert not proposer.kv.seqs and proposer.kv.allocator.num_free == 6 * 32 + 8, \
        "stage 8: a finished sequence's draft blocks go back too (free(seq)): the draft's block tables end empty"
    small = spec.DraftModelProposer(proposer.runner, 1, k, 512)  # a draft pool of one block
    too_long = make_seq(99, list(range(1, proposer.runner.block_size + 2)))
    try:
        drafts = small.propose([too_long], [k])
    except NotImplementedError:  # (a skeleton's: it names what to write)
        raise
    except Exception as e:
        raise AssertionError(f"stage 8: a sequence the draft pool cannot hold gets no draft, never an error: propose "
                             f"raised {type(e).__name__}: {e}") from e
    assert drafts == [None] and not small.kv.seqs and small.kv.allocator.num_free == 1, \
        "stage 8: a sequence the draft pool cannot hold gets no draft, and holds no draft block"
    # a draft the target often rejects: stories260K's first 4 of its 5 layers
    from pagedref.bench.spec import shallow_draft

    llm, proposer = with_your_draft_model(str(shallow_draft(STORIES, 4, tmp_path / "draft")), k)
    engine = llm.llm_engine
    case = stories_cases()[1]
    engine.add_request("once", {"prompt": case["prompt"], "prompt_token_ids": case["prompt_ids"]}, GREEDY)
    seq = engine.requests["once"].seqs[0]
    while engine.has_unfinished_requests():  # the step contract, call by call
        try:
            out = engine.scheduler.schedule()  # (it asks your proposer for drafts)
        except NotImplementedError:
            raise
        except Exception as e:  # e.g. a table still holding rejected drafts leaves nothing to feed the draft
            raise AssertionError(f"stage 8: a proposal after the target rejected drafts failed ({type(e).__name__}: "
                                 f"{e}): before it proposes, the draft's table is rolled back to the tokens the target "
                                 "kept") from e
        if seq.seq_id in proposer.kv.seqs:  # right after a proposal: the draft's table holds the sequence's tokens
            drafted = proposer.kv.seqs[seq.seq_id].token_ids
            assert drafted[:seq.num_tokens] == seq.token_ids, (
                "stage 8: before it proposes, the draft's table is rolled back to the tokens the target kept, then "
                "catches up: the drafts the target rejected must not stay in it")
        engine.scheduler.update(out, engine.runner.execute(out))
    assert seq.output_token_ids == expected(case), "stage 8: a draft that is often wrong changes no token either"
    stats = llm.get_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], \
        "stage 8: this draft is right at times and wrong at times"
