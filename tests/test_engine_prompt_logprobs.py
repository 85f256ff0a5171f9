"""`SamplingParams(prompt_logprobs=k)` as vLLM has it: `RequestOutput.prompt_logprobs` = [None, {token: Logprob}, ...],
each prompt token's logprob given the ones before it (and the k most likely), bit for bit on the CPU the
log-softmax of a full forward's logits, whatever the chunking, preemption, n, or the async loop.
"""

from __future__ import annotations

import pytest
import torch

from helpers import build_metadata, make_kv_caches, model_path
from pagedref import LLM, SamplingParams
from pagedref.backends.reference import ReferenceBackend

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


def full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every position of one whole-prompt forward: [len(ids), vocab]."""
    bs = 16
    blocks = list(range(-(-len(ids) // bs)))
    meta = build_metadata([blocks], [list(range(len(ids)))], bs)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), make_kv_caches(model, len(blocks), bs), meta,
                       ReferenceBackend())
        logits = model.compute_logits(hidden)
    return torch.stack([torch.log_softmax(row, dim=-1) for row in logits])


def check(out, k: int, model) -> None:
    ids, got = out.prompt_token_ids, out.prompt_logprobs
    want = full_forward_logprobs(model, ids)
    assert len(got) == len(ids) and got[0] is None, "one entry per prompt token; the first has no context: None"
    for i in range(1, len(ids)):
        row = want[i - 1]  # the logits of the row before predict token i
        assert got[i][ids[i]].logprob == row[ids[i]].item(), f"prompt token {i}: not the full forward's bits"
        assert got[i][ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(got[i]) == set(top) | {ids[i]}, f"prompt token {i}: its own and the {k} most likely"


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=64, max_num_batched_tokens=1),  # one token a step: every row its own chunk
    dict(num_kv_blocks=64, max_num_batched_tokens=7),
    dict(num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=512),
    dict(num_kv_blocks=7, max_model_len=96, max_num_batched_tokens=16, async_scheduling=True),  # preemption, async
], ids=["budget-1", "budget-7", "unchunked", "preempted-async"])
def test_prompt_logprobs_are_the_full_forwards_bits(kw):
    llm = LLM(model_path("stories260K"), device="cpu", **kw)
    prompts = [PROMPT, "Lily and Tom", PROMPT + " with her dog"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, prompt_logprobs=0)]
    outs = llm.generate(prompts, params)
    if kw["num_kv_blocks"] == 7:
        assert llm.get_stats()["num_preemptions"] > 0, "the pool is meant to preempt (and recompute prompt rows)"
    check(outs[0], 2, llm.llm_engine.model)
    assert outs[1].prompt_logprobs is None, "only requests that ask get them"
    check(outs[2], 0, llm.llm_engine.model)
    assert outs[0].outputs[0].token_ids == llm.generate(prompts[0], params[1])[0].outputs[0].token_ids, \
        "asking for prompt logprobs changes no generated token"
    assert llm.llm_engine.block_manager.all_free()


def test_a_request_asking_for_prompt_logprobs_computes_its_whole_prompt():
    llm = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    cold = llm.generate(PROMPT, params)[0]
    warm = llm.generate(PROMPT, params)[0]  # the prefix cache holds the prompt's blocks now
    assert warm.num_cached_tokens == 0, "no prefix-cache hit: every prompt row gives its logprob"
    assert warm.prompt_logprobs == cold.prompt_logprobs
    assert llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))[0].num_cached_tokens > 0


def test_prompt_logprobs_are_checked_like_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate("Lily", SamplingParams(prompt_logprobs=21))
