"""Speculative decoding in the engine (issue 19): exact by construction, on the step contract.

- Acceptance: stories260K's greedy continuations equal llama2.c's run.c token for token with
  speculative_config n-gram (k = 4) and draft = the target itself (k = 3), all prompts in one batch; with
  draft = target every draft is accepted (the rate is >= 95%); the counters are in get_stats().
- Greedy speculation changes nothing, bit for bit on the CPU: the tokens *and* the logits that chose them
  equal the non-speculative engine's, for both methods and any k, under chunked prefill, preemption (a
  small pool), prefix caching, n > 1 (copy-on-write of a shared block), stop strings, eos and max_tokens
  falling inside an accepted run, logprobs, and beam search beside it.
- The rollback: after every update a speculating sequence's block table holds exactly its computed
  tokens' slots (the rejected drafts' whole blocks back in the pool, refcounts right), the draft model's
  table holds only tokens the target kept, and when the requests are done every block of both pools is free.
- Sampling: seeded requests reproduce; what cannot be combined is refused by name.
(The rejection sampler's distribution test: tests/test_spec_decode_sampling.py.)
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import model_path, read_reference
from pagedref import DEFAULT_MODEL, LLM, SamplingParams
from pagedref.engine.sampling_params import BeamSearchParams
from pagedref.engine.spec_decode import DraftModelProposer, NgramProposer, ngram_propose
from pagedref.kernels import gpu_available

STORIES = model_path("stories260K")
CASES = read_reference("stories260K", "llama2c_reference.json")["cases"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT = {"model": str(STORIES), "num_speculative_tokens": 3}  # draft = the target itself
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def expected(case: dict) -> list[int]:
    n = case["first_bos_index"]
    return case["greedy_ids"][: n + 1] if n is not None else case["greedy_ids"][: 512 - len(case["prompt_ids"])]


def prompt(case: dict):
    return case["prompt"] or {"prompt": "", "prompt_token_ids": case["prompt_ids"]}


def stories(spec=None, **kw) -> LLM:
    return LLM(STORIES, device="cpu", num_kv_blocks=kw.pop("num_kv_blocks", 6 * 32 + 8), speculative_config=spec, **kw)


def checked_generate(llm: LLM, prompts, params) -> list:
    """generate(), step by step, checking the rollback after every update: the block manager's invariants,
    every running sequence's table = its computed tokens, the draft's table = tokens the target kept."""
    engine = llm.llm_engine
    ids = []
    for i, p in enumerate(prompts):
        text, token_ids = engine.process_prompt(p)
        ids.append(f"c{i}")
        engine.add_request(ids[-1], {"prompt": text, "prompt_token_ids": token_ids},
                           params[i] if isinstance(params, list) else params)
    done = {}
    proposer = engine.scheduler.proposer
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        bm = engine.block_manager
        bm.check_invariants()
        for seq in engine.scheduler.running:
            assert bm.kv.num_tokens(seq.seq_id) == seq.num_computed_tokens < seq.num_tokens, \
                "after update a sequence holds the slots of its computed tokens, no rejected draft's"
        if isinstance(proposer, DraftModelProposer):
            proposer.kv.check_invariants()
            for seq_id, sb in proposer.kv.seqs.items():
                seq = next((s for s in engine.scheduler.running if s.seq_id == seq_id), None)
                if seq is not None:  # its draft tokens past the target's are the next proposal's business
                    n = min(len(sb.token_ids), seq.num_tokens)
                    assert sb.token_ids[:proposer.states[seq_id].known] == seq.token_ids[:proposer.states[seq_id].known]
                    assert n >= 0
    assert engine.block_manager.all_free(), "every target block is free once the requests are done"
    if isinstance(proposer, DraftModelProposer):
        assert not proposer.kv.seqs and proposer.kv.allocator.num_free == proposer.kv.allocator.num_total, \
            "every draft block is free once the requests are done"
    return [done[i] for i in ids]


# --- acceptance: llama2.c's outputs, token for token ---------------------------------------------------
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram-k4", "draft=target-k3"])
def test_stories260k_greedy_with_speculation_matches_llama2c(spec):
    llm = stories(spec)
    outs = checked_generate(llm, [prompt(c) for c in CASES], GREEDY)
    for out, case in zip(outs, CASES):
        got, want = out.outputs[0].token_ids, expected(case)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, f"{case['prompt']!r}: differs from run.c at generated token {first}"
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
    rate = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert stats["spec_acceptance_rate"] == pytest.approx(rate)
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"])
    assert stats["num_generated_tokens"] == sum(len(expected(c)) for c in CASES)
    if "model" in spec:
        assert rate >= 0.95, f"draft = target: every draft the target would choose itself, acceptance {rate:.1%}"
        assert stats["num_steps"] < 0.4 * stats["num_generated_tokens"], "k = 3 accepted: ~4 tokens a step"


def test_without_speculation_the_counters_are_zero():
    llm = stories()
    llm.generate([prompt(CASES[1])], SamplingParams(temperature=0.0, max_tokens=8))
    stats = llm.get_stats()
    assert (stats["spec_num_drafts"], stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"],
            stats["spec_acceptance_rate"], stats["spec_mean_accepted_length"]) == (0, 0, 0, 0.0, 0.0)


# --- greedy speculation changes nothing, bit for bit -------------------------------------------------
def compare(spec, prompts, params, **kw):
    """(speculative outputs, plain outputs), both with each token's logits recorded."""
    base = LLM(DEFAULT_MODEL, device="cpu", record_logits=True, **kw)
    want = base.generate(prompts, params)
    llm = LLM(DEFAULT_MODEL, device="cpu", record_logits=True, speculative_config=spec, **kw)
    got = checked_generate(llm, prompts, params)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
            assert torch.equal(a.logits, b.logits), "the verifying rows compute the plain decode's logits bit for bit"
            if b.logprobs is not None:
                assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
    return llm


PROMPTS = ["# Stage 4", "## The tests, step by step\n\n`pytest stages -m stage", "# Stage 6", "The block table",
           "Speculative decoding"]


@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_is_bit_exact_for_any_k(method, k):
    spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4} if method == "ngram"
            else {"model": str(DEFAULT_MODEL), "num_speculative_tokens": k})
    llm = compare(spec, PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), max_model_len=128)
    assert llm.get_stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_preemption_and_a_small_pool(method):
    spec = NGRAM if method == "ngram" else {"model": str(DEFAULT_MODEL), "num_speculative_tokens": 3}
    llm = compare(spec, PROMPTS * 2, SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True),
                  max_model_len=128, num_kv_blocks=16, max_num_batched_tokens=24)
    assert llm.get_stats()["num_preemptions"] > 0, "the pool is small enough to preempt"


def test_preemption_by_swap():
    llm = compare({"model": str(DEFAULT_MODEL), "num_speculative_tokens": 3}, PROMPTS * 2,
                  SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True), max_model_len=128, num_kv_blocks=16,
                  preemption_mode="swap", swap_space=0.01)
    assert llm.get_stats()["num_swap_outs"] > 0, "the pool is small enough to swap"


@settings(max_examples=8, deadline=None)
# a prompt of n = 2 whose last token is computed alone (budget 3): a "decode" that must fork, never speculate
@example(k=1, method="ngram", budget=3, blocks=16, block_size=4, n=2, caching=False, lookup=1, seed=0)
@given(k=st.integers(1, 6), method=st.sampled_from(["ngram", "draft"]), budget=st.sampled_from([3, 8, 64]),
       blocks=st.sampled_from([16, 24, 64]), block_size=st.sampled_from([4, 16]), n=st.sampled_from([1, 2]),
       caching=st.booleans(), lookup=st.integers(1, 4), seed=st.integers(0, 1000))
def test_fuzz_greedy_speculation_equals_plain_decoding(k, method, budget, blocks, block_size, n, caching, lookup, seed):
    rng = random.Random(seed)
    prompts = [rng.choice(PROMPTS) + rng.choice(["", " the", " stage", "\n\n"]) for _ in range(rng.randint(1, 5))]
    params = [SamplingParams(n=n, temperature=0.0, max_tokens=rng.randint(1, 70), ignore_eos=rng.random() < 0.7)
              for _ in prompts]
    spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup} if method == "ngram"
            else {"model": str(DEFAULT_MODEL), "num_speculative_tokens": k})
    compare(spec, prompts, params, max_model_len=128, num_kv_blocks=blocks * 16 // block_size, block_size=block_size,
            max_num_batched_tokens=budget, enable_prefix_caching=caching)


def test_n_samples_share_their_prompt_and_copy_on_write_with_speculation():
    params = SamplingParams(n=3, temperature=0.0, max_tokens=40, ignore_eos=True)
    compare(NGRAM, ["## The tests, step by step\n\n`pytest stages -m stage", "# Stage 4"], params, max_model_len=128)


def test_prefix_caching_stops_and_logprobs_inside_an_accepted_run():
    system = "## The tests, step by step\n\n`pytest stages -m stage"
    params = [SamplingParams(temperature=0.0, max_tokens=50, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=50, stop=["test"]),
              SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[17, 43])]
    llm = compare(NGRAM, [system + " 4", system + " 6", system, "# Stage 4"], params, max_model_len=128)
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0


def test_beam_search_runs_beside_speculation_unchanged():
    base = LLM(DEFAULT_MODEL, device="cpu", max_model_len=128)
    llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=128, speculative_config=NGRAM)
    params = BeamSearchParams(beam_width=2, max_tokens=12)
    want = base.beam_search(["# Stage 4"], params)
    got = llm.beam_search(["# Stage 4"], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in want[0].sequences]
    assert llm.llm_engine.block_manager.all_free()


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory):
    """A draft that is not the target: the default model's first 2 of its 4 layers (same vocabulary)."""
    from pagedref.bench.spec import shallow_draft as make

    return make(DEFAULT_MODEL, 2, tmp_path_factory.mktemp("draft") / "shallow")


def test_draft_equal_to_the_target_under_sampling_has_every_draft_accepted():
    # q == p row for row (the same model, the same parameters, batch-invariant logits): never a rejection
    llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=128,
              speculative_config={"model": str(DEFAULT_MODEL), "num_speculative_tokens": 4})
    checked_generate(llm, PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True))
    stats = llm.get_stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shallower_draft_is_rejected_at_times_and_its_cache_follows(shallow_draft, temperature):
    spec = {"model": str(shallow_draft), "num_speculative_tokens": 5}
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=60, ignore_eos=True)
    if temperature == 0.0:  # greedy: still the target's own tokens and logits, bit for bit
        llm = compare(spec, PROMPTS, params, max_model_len=128)
    else:
        llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=128, speculative_config=spec)
        checked_generate(llm, PROMPTS, params)
    stats = llm.get_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "some drafts rejected, some kept"


# --- sampling: reproducible, and the proposals' own behaviour ------------------------------------------
@pytest.mark.parametrize("spec", [NGRAM, {"model": str(DEFAULT_MODEL), "num_speculative_tokens": 3}],
                         ids=["ngram", "draft"])
def test_seeded_requests_are_reproducible(spec):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=40) for i in range(4)]
    runs = []
    for _ in range(2):
        llm = LLM(DEFAULT_MODEL, device="cpu", max_model_len=128, speculative_config=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)])
        assert llm.llm_engine.block_manager.all_free()
    assert runs[0] == runs[1]


def naive_ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: try every n from the longest down, every earlier window from the latest."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for p in range(num - 1 - n, -1, -1):
            if tokens[p:p + n] == tokens[num - n:]:
                copied = tokens[p + n:]
                while len(copied) < k:
                    copied = copied + [copied[len(copied) - (num - p - n)]]
                return copied[:k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_proposals_equal_the_definition(tokens, k, min_n, extra):
    """The vectorised lookup (matches grown backwards from the last token) proposes what the definition does."""
    max_n = min_n + extra
    assert ngram_propose(tokens, k, min_n, max_n) == naive_ngram_propose(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_ngram_proposals_are_the_latest_earlier_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2], 2, 1, 3) == [3, 9]
    assert ngram_propose([1, 2, 3, 1, 2, 5, 1, 2], 3, 1, 3) == [5, 1, 2], "the latest occurrence of [1, 2]"
    assert ngram_propose([7, 1, 2, 3, 4, 8, 2, 3, 4], 2, 2, 3) == [8, 2], "the longest suffix first: [2, 3, 4]"
    assert ngram_propose([5, 6, 7], 3, 1, 3) == [], "no suffix occurred before"
    assert ngram_propose([4, 4, 4], 5, 1, 1) == [4] * 5, "a repeating pattern repeats on (an overlapping copy)"
    assert ngram_propose([5, 7, 5, 7], 3, 1, 2) == [5, 7, 5]
    assert ngram_propose([1, 2, 3, 9, 1, 2], 5, 1, 3) == [3, 9, 1, 2, 3], "the copy runs into the proposal itself"
    assert ngram_propose([1, 2, 1], 0, 1, 2) == []
    p = NgramProposer(4, 2, 3)
    from pagedref.engine.sequence import Sequence
    seqs = [Sequence(0, "a", [1, 2, 3, 1, 2], 2, GREEDY), Sequence(1, "b", [1, 2, 3], 3, GREEDY)]
    drafts = p.propose(seqs, [2, 4])
    assert drafts[0].token_ids == [3, 1] and drafts[0].probs is None and drafts[1] is None


# --- refused by name -------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, match", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 2}, "unknown key"),
    ({"model": str(STORIES), "num_speculative_tokens": 2}, "vocab_size"),  # stories260K's 512 tokens, not 1024
    ("ngram", "dict"),
])
def test_bad_speculative_configs_are_refused_by_name(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(DEFAULT_MODEL, device="cpu", speculative_config=config)


def test_what_speculation_cannot_be_combined_with_is_refused_by_name():
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(DEFAULT_MODEL, device="cpu", speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="contiguous"):
        LLM(DEFAULT_MODEL, device="cpu", speculative_config=NGRAM, kv_cache="contiguous")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(DEFAULT_MODEL, device="cpu", speculative_config=NGRAM, tensor_parallel_size=2)


# --- on the GPU (the device; skipped without one) -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram-k4", "draft=target-k3"])
def test_cuda_greedy_with_speculation_equals_without(spec):
    """fp32 on the kernels: the speculative engine (eager and piecewise graphs) emits the plain engine's
    greedy tokens for stories260K (the paged prefill kernel scores the k + 1 rows)."""
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=6 * 32 + 8, max_num_seqs=8)
    want = LLM(STORIES, **kw).generate([prompt(c) for c in CASES], GREEDY)
    for eager in (True, False):
        llm = LLM(STORIES, speculative_config=spec, enforce_eager=eager, **kw)
        got = llm.generate([prompt(c) for c in CASES], GREEDY)
        for g, w, case in zip(got, want, CASES):
            a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert a == b, f"{case['prompt']!r} (eager={eager}): differs at generated token {first}"
            assert a == expected(case), "llama2.c's tokens, as the plain CUDA engine gives them (test_engine_models)"
        assert llm.llm_engine.block_manager.all_free() and llm.get_stats()["spec_num_draft_tokens"] > 0
        llm.close()


# --- the command line and the benchmarks -------------------------------------------------------------------
def test_generate_cli_speculates_and_prints_the_acceptance_rate(capsys):
    from pagedref import generate

    case = CASES[1]
    args = ["--model", str(STORIES), "--device", "cpu", "--temperature", "0", "--max-tokens", "512", "--prompt",
            case["prompt"], "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}']
    assert generate.main(args) == 0
    out = capsys.readouterr().out
    assert case["text_until_bos"] in out, "the speculative CLI prints run.c's story"
    assert "speculative decoding" in out and "draft tokens accepted" in out
    for bad, named in (('{"method": "ngram"', "not JSON"), ('{"method": "ngam", "num_speculative_tokens": 2}', "method")):
        with pytest.raises(SystemExit) as e:
            generate.main(["--speculative-config", bad])
        assert e.value.code == 2 and named in capsys.readouterr().err


def test_bench_serve_and_bench_spec_run_with_speculation(tmp_path, capsys):
    from pagedref.bench import serve, spec

    assert serve.main(["--device", "cpu", "--num-prompts", "4", "--output-len", "12", "--systems", "pagedref,contiguous",
                       "--workload", "copy", "--model-dir", str(tmp_path), "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}']) == 0
    out = capsys.readouterr().out
    assert "speculative:" in out and "drafts accepted" in out
    doc = tmp_path / "spec.json"
    assert spec.main(["--device", "cpu", "--batch-sizes", "1,3", "--input-len", "24", "--output-len", "10",
                      "--model-dir", str(tmp_path), "--json-out", str(doc)]) == 0
    out = capsys.readouterr().out
    for method in spec.METHODS:
        assert f" {method} " in out
    import json

    rows = json.loads(doc.read_text())["results"]
    assert {(r["batch"], r["method"]) for r in rows} == {(b, m) for b in (1, 3) for m in spec.METHODS}
    assert all(not r.get("skipped") for r in rows) and all(r["output_tokens"] == r["batch"] * 10 for r in rows)
    assert next(r for r in rows if r["method"] == "self")["acceptance_rate"] == 1.0
    with pytest.raises(SystemExit):
        spec.main(["--device", "cpu", "--methods", "none,eagle"])
