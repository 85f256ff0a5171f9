"""The engine on real checkpoints, against outputs of programs nobody on this project wrote (issue 4).

- stories260K (a pretrained Llama) vs llama2.c's run.c: greedy ids token for token up to the model's
  end-of-story token (BOS, id 1, an eos id of its generation_config.json), or to max_model_len when it
  never comes; one request at a time, and all prompts together in one `generate`.
- tiny-* (transformers' own random Llama-3 / Qwen2 / Mistral) vs transformers: greedy ids exactly and
  logits within 1e-4, all prompts of a model in one batch, with and without chunked prefill.

Every check runs on the CPU (reference backend) and, where a GPU and cupy are present, on CUDA (the
stage 5 kernels; `pytest -m gpu` on the device), in float32 both.
"""

from __future__ import annotations

import pytest
import torch

from helpers import HF_MODELS, read_reference, model_path
from pagedref import LLM, SamplingParams
from pagedref.kernels import gpu_available

STORIES = read_reference("stories260K", "llama2c_reference.json")["cases"]
MAX_MODEL_LEN = 512  # stories260K's context


def expected_stories_ids(case: dict) -> list[int]:
    """run.c's ids up to and including the first BOS; without one, until the context is full."""
    n = case["first_bos_index"]
    return case["greedy_ids"][: n + 1] if n is not None else case["greedy_ids"][: MAX_MODEL_LEN - len(case["prompt_ids"])]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")])]


@pytest.fixture(scope="module", params=DEVICES)
def stories(request):
    llm = LLM(model_path("stories260K"), device=request.param, num_kv_blocks=6 * 32 + 8)
    yield llm
    llm.close()


GREEDY_TO_THE_END = SamplingParams(temperature=0.0, max_tokens=None)


def check_stories_output(out, case) -> None:
    want = expected_stories_ids(case)
    got = out.outputs[0].token_ids
    first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"prompt {case['prompt']!r}: differs from run.c at generated token {first_diff}"
    assert out.outputs[0].finish_reason == ("stop" if case["first_bos_index"] is not None else "length")
    if case["first_bos_index"] is not None:  # the text is run.c's, after the prompt, without the BOS
        assert out.prompt + out.outputs[0].text == case["text_until_bos"]


def stories_prompt(case: dict):
    """The case's text; run.c's empty prompt is BOS alone, given as its ids (an empty text is refused)."""
    return case["prompt"] or {"prompt": "", "prompt_token_ids": case["prompt_ids"]}


@pytest.mark.parametrize("i", range(len(STORIES)), ids=[repr(c["prompt"])[:24] for c in STORIES])
def test_stories260k_greedy_alone_matches_llama2c(stories, i):
    case = STORIES[i]
    out = stories.generate(stories_prompt(case), GREEDY_TO_THE_END)[0]
    assert out.prompt_token_ids == case["prompt_ids"], "the tokenizer must encode the prompt as run.c does"
    check_stories_output(out, case)
    assert stories.llm_engine.block_manager.all_free()


def test_stories260k_greedy_all_prompts_in_one_batch_match_llama2c(stories):
    outs = stories.generate([stories_prompt(c) for c in STORIES], GREEDY_TO_THE_END)
    for out, case in zip(outs, STORIES):
        assert out.prompt == case["prompt"]
        check_stories_output(out, case)
    stats = stories.get_stats()
    assert stats["peak_num_running_seqs"] == len(STORIES)
    assert stats["num_generated_tokens"] == sum(len(expected_stories_ids(c)) for c in STORIES)
    assert stories.llm_engine.block_manager.all_free()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [None, 48])
@pytest.mark.parametrize("name", HF_MODELS)
def test_tiny_hf_models_batched_match_transformers(name, budget, device):
    ref = read_reference(name, "hf_reference.json")
    cases = ref["cases"]
    llm = LLM(model_path(name), device=device, max_model_len=512, num_kv_blocks=4 * 32, record_logits=True,
              max_num_batched_tokens=budget or 2048)
    # One more token than the references: the last logits row predicts next_id_after_greedy.
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["greedy_ids"]) + 1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params)
    for k, (out, case) in enumerate(zip(outs, cases)):
        got = out.outputs[0].token_ids
        assert got[:-1] == case["greedy_ids"], f"{name} case {k}: greedy ids differ from transformers'"
        if "logits" in case:
            assert got[-1] == case["next_id_after_greedy"]
            want = torch.tensor(case["logits"], dtype=torch.float32)
            diff = (out.outputs[0].logits - want).abs().max().item()
            assert diff <= 1e-4, f"{name}: logits differ from transformers' by {diff}"
    assert llm.get_stats()["peak_num_running_seqs"] == len(cases), "all prompts must run in one batch"
    assert llm.llm_engine.block_manager.all_free()
    llm.close()
