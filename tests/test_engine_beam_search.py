"""Beam search on forked, copy-on-write blocks equals a brute-force beam search that recomputes every beam.

The brute force shares nothing: it runs each beam's whole token list through the model on its own
(the test driver in helpers.py, no engine), takes the 2 × beam_width best next tokens, and ranks
extensions by vLLM's score. On the CPU the logits are batch invariant, so the two must agree exactly:
same tokens, same cumulative logprobs, same order.
"""

from __future__ import annotations

import pytest
import torch

from helpers import greedy_generate, read_reference, model_path
from pagedref import LLM
from pagedref.engine import BeamSearchParams

EOS = (2, 1)  # stories260K: generation_config's eos ids (1 ends a story)


def brute_force_beam_search(model, prompt, beam_width, max_tokens, length_penalty=1.0):
    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] in EOS)) ** length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            _, logits = greedy_generate(model, [tokens], 1)
            logprobs = torch.log_softmax(logits[0][0], dim=-1)
            top = logprobs.topk(2 * beam_width)
            for token, lp in zip(top.indices.tolist(), top.values.tolist()):
                (completed if token in EOS else candidates).append((tokens + [token], cum + lp))
        beams = sorted(candidates, key=score, reverse=True)[:beam_width]
    return sorted(completed + beams, key=score, reverse=True)[:beam_width]


def check(llm, prompt_ids, beam_width, max_tokens, length_penalty=1.0):
    out = llm.beam_search([{"prompt_token_ids": prompt_ids}],
                          BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty))
    got = [(s.tokens, s.cum_logprob) for s in out[0].sequences]
    want = brute_force_beam_search(llm.llm_engine.model, prompt_ids, beam_width, max_tokens, length_penalty)
    assert got == want, "beam search on forked blocks must equal the brute force exactly"
    assert llm.llm_engine.block_manager.all_free(), "beam search must give back every block"
    return out[0].sequences


@pytest.fixture(scope="module")
def llm():
    return LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64)


def test_beams_cross_a_block_boundary_sharing_their_prefix(llm):
    prompt = llm.get_tokenizer().encode("Lily and Tom went to the park to play")
    assert len(prompt) < 16 < len(prompt) + 6  # the beams' last block fills up during the search
    beams = check(llm, prompt, beam_width=3, max_tokens=6)
    assert len(beams) == 3 and all(b.finish_reason == "length" for b in beams)
    assert beams[0].text.startswith("Lily and Tom went to the park")
    assert llm.get_stats()["peak_blocks_saved_by_sharing"] > 0, "beams must share their prefix blocks"


def test_a_beam_that_ends_the_story_is_complete(llm):
    case = read_reference("stories260K", "llama2c_reference.json")["cases"][4]
    n = case["first_bos_index"]
    prompt = case["prompt_ids"] + case["greedy_ids"][:n]  # run.c's next token is the end-of-story BOS
    beams = check(llm, prompt, beam_width=2, max_tokens=3, length_penalty=0.5)
    assert any(b.tokens[-1] == 1 and b.finish_reason == "stop" for b in beams)


def test_beam_search_in_a_pool_so_small_that_idle_beams_are_preempted():
    # 4 blocks: one sequence of max_model_len. 4 beams of 17+ tokens need 5 (4 private last blocks).
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=4, max_num_batched_tokens=16)
    prompt = llm.get_tokenizer().encode("Once upon a time, there was a little girl named Lily. She")
    check(llm, prompt, beam_width=4, max_tokens=8)
    assert llm.get_stats()["num_preemptions"] > 0
