"""Batch invariance on the CPU reference path: a sequence's logits do not depend on the step it runs in.

Bit for bit (torch.equal), a request's logits are the same whether it runs alone or batched with
others, whether its prompt is prefilled in one chunk or in chunks of 1 or 7 tokens (a later chunk's
queries read the earlier chunks' K/V from the cache), whatever the block size and wherever its
blocks lie in the pool. This is what lets the engine promise that scheduling never changes outputs.
"""

from __future__ import annotations

import pytest
import torch

from helpers import greedy_generate, read_reference, model_path
from pagedref.models import load_model

NEW_TOKENS = 12


def prompts_of(name: str) -> list[list[int]]:
    if name == "stories260K":
        return [c["prompt_ids"] for c in read_reference(name, "llama2c_reference.json")["cases"]]
    return [c["prompt_ids"] for c in read_reference(name, "hf_reference.json")["cases"]]


@pytest.fixture(scope="module", params=[("stories260K", "float32"), ("tiny-llama3-hd64", "float32"),
                                        ("tiny-qwen2-hd128", "float32"), ("tiny-mistral-hd32", "float16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request):
    name, dtype = request.param
    model = load_model(model_path(name), dtype=dtype)
    prompts = prompts_of(name)
    ids, logits = greedy_generate(model, prompts, NEW_TOKENS)  # the batch, each prompt prefilled whole
    return model, prompts, ids, logits


def assert_same(runs_a, runs_b):
    (ids_a, logits_a), (ids_b, logits_b) = runs_a, runs_b
    assert ids_a == ids_b
    for la, lb in zip(logits_a, logits_b):
        assert torch.equal(la, lb)


def test_alone_equals_batched(setup):
    model, prompts, ids, logits = setup
    for i, prompt in enumerate(prompts):
        assert_same(greedy_generate(model, [prompt], NEW_TOKENS), ([ids[i]], [logits[i]]))


@pytest.mark.parametrize("chunk_size", [1, 7])
def test_chunked_prefill_equals_whole_prefill(setup, chunk_size):
    # Batched too: sequences with short prompts decode while the long ones are still prefilling.
    model, prompts, ids, logits = setup
    assert_same(greedy_generate(model, prompts, NEW_TOKENS, chunk_size=chunk_size), (ids, logits))


@pytest.mark.parametrize("block_size, seed", [(1, 1), (5, 2), (32, 3)])
def test_block_size_and_placement_do_not_matter(setup, block_size, seed):
    model, prompts, ids, logits = setup
    assert_same(greedy_generate(model, prompts, NEW_TOKENS, block_size=block_size, seed=seed), (ids, logits))


def test_per_row_path_leaves_the_thread_setting_as_it_found_it():
    model = load_model(model_path("stories260K"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        greedy_generate(model, [[1, 403, 407]], 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
