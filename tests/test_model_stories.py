"""stories260K (a real pretrained Llama) against llama2.c's run.c: greedy ids token for token, and its tokenizer.

Acceptance of issue 4: float32 on the CPU, every prompt of llama2c_reference.json, up to the
model's end-of-story token (BOS, id 1: `first_bos_index`) or over the whole context when it never
comes; one request at a time and all prompts in one batch (sequences leave the batch as they finish).
"""

from __future__ import annotations

import pytest
import torch

from helpers import greedy_generate, read_reference, model_path
from pagedref.models import load_model, load_tokenizer

REF = read_reference("stories260K", "llama2c_reference.json")
CASES = REF["cases"]


def until_bos(case: dict) -> list[int]:
    """The reference's generated ids up to and including the first BOS (all of them when there is none)."""
    n = case["first_bos_index"]
    return case["greedy_ids"] if n is None else case["greedy_ids"][: n + 1]


@pytest.fixture(scope="module")
def model():
    return load_model(model_path("stories260K"), dtype=torch.float32)


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt on its own: (generated ids, logits) per case."""
    runs = [greedy_generate(model, [c["prompt_ids"]], len(until_bos(c))) for c in CASES]
    return [(ids[0], logits[0]) for ids, logits in runs]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[repr(c["prompt"])[:24] for c in CASES])
def test_greedy_alone_matches_run_c(alone, i):
    assert alone[i][0] == until_bos(CASES[i])


def test_greedy_batched_matches_run_c_and_is_bitwise_the_alone_run(model, alone):
    ids, logits = greedy_generate(model, [c["prompt_ids"] for c in CASES], [len(until_bos(c)) for c in CASES])
    for case, got, got_logits, (_, alone_logits) in zip(CASES, ids, logits, alone):
        assert got == until_bos(case), case["prompt"]
        assert torch.equal(got_logits, alone_logits), case["prompt"]


def test_config_reads_both_eos_ids():
    # config.json says eos 2; generation_config.json says [2, 1] (BOS ends a story): the union is both.
    model_config = load_model(model_path("stories260K")).config
    assert model_config.eos_token_ids == (2, 1)
    assert model_config.bos_token_id == 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(model_path("stories260K"))


@pytest.mark.parametrize("case", CASES, ids=[repr(c["prompt"])[:24] for c in CASES])
def test_tokenizer_encodes_like_run_c(tokenizer, case):
    assert tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    assert tokenizer.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"][1:]


@pytest.mark.parametrize("case", CASES, ids=[repr(c["prompt"])[:24] for c in CASES])
def test_tokenizer_decodes_the_reference_text(tokenizer, case):
    # byte-fallback tokens of "ë" and the emoji must be fused before UTF-8 decoding; BOS is skipped
    generated = until_bos(case)[:-1] if case["first_bos_index"] is not None else until_bos(case)
    assert tokenizer.decode(case["prompt_ids"] + generated) == case["text_until_bos"]


def test_tokenizer_special_ids(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 512)
    assert tokenizer.decode([1, 403, 2], skip_special_tokens=False) == "<s> Once</s>"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_batched_ops_match_run_c():
    # The GPU path of the model (batched ops) with the reference attention backend reading the CUDA pools.
    model = load_model(model_path("stories260K"), device="cuda", batch_invariant=False)
    ids, _ = greedy_generate(model, [c["prompt_ids"] for c in CASES], [len(until_bos(c)) for c in CASES])
    assert ids == [until_bos(c) for c in CASES]
