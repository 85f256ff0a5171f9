"""The `LLM` / `LLMEngine` API with vLLM's meanings: inputs, stop rules, logprobs, stats, errors, abort."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import model_path
from pagedref import LLM, SamplingParams
from pagedref.engine import BeamSearchParams
from pagedref.engine.model_runner import kv_block_bytes

STORIES = model_path("stories260K")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, device="cpu", max_model_len=128, num_kv_blocks=64, record_logits=True)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.block_manager.check_invariants()
    assert engine.block_manager.all_free()


# --- inputs and outputs --------------------------------------------------------------------------
def test_outputs_come_in_prompt_order_with_vllms_fields(llm):
    prompts = ["Once upon a time", {"prompt_token_ids": [1, 403, 407]}, "Lily"]
    params = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=5), GREEDY]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == ["Once upon a time", None, "Lily"]
    assert outs[0].prompt_token_ids == [1, 403, 407, 261, 378] and outs[1].prompt_token_ids == [1, 403, 407]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 8]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == ", there was"
    assert outs[1].outputs[0].token_ids[:2] == [261, 378]  # "a time": the same model, from fewer tokens
    assert_idle(llm)


def test_a_single_prompt_and_default_sampling_params(llm):
    out = llm.generate("Once upon a time")
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 16  # vLLM's default max_tokens


def test_eos_ids_of_generation_config_stop_unless_ignore_eos():
    # 'One day, a big bear said "Hello!"' ends its story (token 1) after 172 generated tokens.
    llm = LLM(STORIES, device="cpu", num_kv_blocks=64)
    prompt = 'One day, a big bear said "Hello!"'
    stop = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None))[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.token_ids[-1] == 1 and len(stop.token_ids) == 173
    assert stop.stop_reason is None and "\n" not in stop.text[-2:]
    on = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=180, ignore_eos=True))[0].outputs[0]
    assert on.finish_reason == "length" and len(on.token_ids) == 180 and on.token_ids[:173] == stop.token_ids


def test_stop_token_ids_and_stop_strings(llm):
    full = llm.generate("Once upon a time", GREEDY)[0].outputs[0]  # ", there was a little girl named Lily"
    by_id = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[261]))[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(261) + 1]  # the stop token is kept in the ids
    assert by_id.finish_reason == "stop" and by_id.stop_reason == 261 and by_id.text == ", there was"  # not in the text
    # "girl" spans three tokens ("g", "ir", "l"): stop strings are found in the text, not in the tokens
    by_str = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, stop=["girl", "xyz"]))[0].outputs[0]
    assert by_str.text == ", there was a little " and by_str.stop_reason == "girl" and by_str.finish_reason == "stop"
    kept = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, stop="little",
                                                            include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == ", there was a little"
    assert_idle(llm)


def test_generation_stops_at_max_model_len(llm):
    prompt = list(range(3, 3 + 120))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=50))[0].outputs[0]
    assert len(out.token_ids) == 128 - 120 and out.finish_reason == "length"
    full = llm.generate({"prompt_token_ids": list(range(3, 3 + 128))}, SamplingParams(max_tokens=50))[0].outputs[0]
    assert len(full.token_ids) == 1, "a prompt of max_model_len tokens still gets its one token"
    assert_idle(llm)


def test_logprobs_are_those_of_the_recorded_logits(llm):
    out = llm.generate("Lily", SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, step, row in zip(out.token_ids, out.logprobs, out.logits):
        lp = torch.log_softmax(row, -1)
        assert token in step and step[token].logprob == float(lp[token])
        top3 = lp.topk(3).indices.tolist()
        assert [t for t in step if step[t].rank <= 3] == top3
        assert step[top3[0]].decoded_token == llm.get_tokenizer().decode([top3[0]], skip_special_tokens=False)
        total += step[token].logprob
    assert out.cumulative_logprob == total
    assert llm.generate("Lily", GREEDY)[0].outputs[0].logprobs is None  # not asked, not computed


def test_unseeded_sampling_is_reproducible_from_the_llm_seed():
    params = SamplingParams(temperature=1.0, max_tokens=10)
    runs = [LLM(STORIES, device="cpu", num_kv_blocks=64, seed=s).generate(["Lily", "Tom"], params) for s in (0, 0, 1)]
    ids = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


# --- sharing: n > 1 -------------------------------------------------------------------------------
def test_parallel_samples_share_the_prompts_blocks(llm):
    engine = llm.llm_engine
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=10))
    engine.step()  # the prompt's prefill, then the fork
    stats = llm.get_stats()
    assert stats["num_shared_blocks"] == 2, "the prompt's 2 blocks are held by all 4 samples"
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    (out,) = done
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "4 seeded samples should not all agree"
    assert llm.get_stats()["peak_blocks_saved_by_sharing"] >= 3
    assert_idle(llm)


# --- the engine API -------------------------------------------------------------------------------
def test_abort_frees_the_requests_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("a", "Once upon a time", SamplingParams(n=2, temperature=1.0, max_tokens=100))
    engine.add_request("b", "Lily and Tom", SamplingParams(temperature=0, max_tokens=100))
    for _ in range(5):
        engine.step()
    assert llm.get_stats()["num_used_blocks"] > 0
    engine.abort_request("a")
    engine.abort_request(["b", "unknown"])
    assert_idle(llm)
    assert engine.step() == []


def test_step_returns_each_request_that_advanced(llm):
    engine = llm.llm_engine
    engine.add_request("x", "Tom", SamplingParams(temperature=0, max_tokens=3))
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    assert seen == [("x", 1, False), ("x", 2, False), ("x", 3, True)]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", "Tom")
        engine.add_request("y", "Tom")
    engine.abort_request("y")


def test_stats_report_the_pool_and_the_run(llm):
    llm.generate(["Once upon a time", "Lily and Tom"], SamplingParams(temperature=0, max_tokens=20))
    stats = llm.get_stats()
    for key in ("num_blocks", "num_used_blocks", "num_free_blocks", "num_cached_blocks", "num_shared_blocks",
                "token_state_fraction", "token_state_fraction_peak", "token_state_fraction_mean", "num_preemptions",
                "prefix_cache_hit_rate", "peak_num_running_seqs", "num_prompt_tokens", "num_generated_tokens"):
        assert key in stats, key
    assert stats["num_blocks"] == 64 and stats["num_used_blocks"] == 0 and stats["num_generated_tokens"] == 40
    assert stats["num_prompt_tokens"] == 5 + 5 and stats["peak_num_running_seqs"] == 2
    assert 0.5 < stats["token_state_fraction_mean"] <= stats["token_state_fraction_peak"] <= 1.0


def test_the_contiguous_baseline_gives_the_same_tokens_with_more_memory_reserved():
    prompts = ["Once upon a time", "Lily and Tom", "The little dog"]
    params = SamplingParams(temperature=0, max_tokens=20)
    paged = LLM(STORIES, device="cpu", max_model_len=128, num_kv_blocks=64)
    contiguous = LLM(STORIES, device="cpu", max_model_len=128, num_kv_blocks=64, kv_cache="contiguous")
    want = [o.outputs[0].token_ids for o in paged.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in contiguous.generate(prompts, params)] == want
    # each request reserved max_model_len = 128 slots for at most 20 + 6 tokens
    assert contiguous.get_stats()["token_state_fraction_peak"] < 0.25 < paged.get_stats()["token_state_fraction_mean"]
    assert contiguous.llm_engine.block_manager.all_free()
    with pytest.raises(ValueError, match="contiguous"):
        contiguous.generate("Lily", SamplingParams(n=2))
    with pytest.raises(ValueError, match="contiguous"):
        contiguous.beam_search(["Lily"], BeamSearchParams(beam_width=2, max_tokens=2))


def test_close_releases_the_engine():
    llm = LLM(STORIES, device="cpu", num_kv_blocks=40)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Lily")


def test_the_bundled_model_runs_with_vllms_defaults():
    import pagedref

    llm = LLM(model=pagedref.DEFAULT_MODEL)  # device "auto", dtype "auto": the CPU and float32 without a GPU
    out = llm.generate("The block table", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text
    assert (llm.get_stats()["device"], llm.get_stats()["dtype"]) == ("cpu", "float32")


def test_device_auto_takes_cuda_when_a_gpu_and_cupy_are_there(monkeypatch):
    import pagedref.kernels
    from pagedref.engine.config import resolve_device

    monkeypatch.setattr(pagedref.kernels, "gpu_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(pagedref.kernels, "gpu_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_logprobs_are_capped_by_max_logprobs_as_in_vllm():
    llm = LLM(STORIES, device="cpu", num_kv_blocks=40)
    with pytest.raises(ValueError, match="logprobs=21 is more than max_logprobs=20"):
        llm.generate("Lily", SamplingParams(max_tokens=2, logprobs=21))
    top = llm.generate("Lily", SamplingParams(temperature=0, max_tokens=2, logprobs=20))[0].outputs[0].logprobs
    assert all(len(lp) in (20, 21) for lp in top)  # the top 20, and the sampled token if it is not among them
    wide = LLM(STORIES, device="cpu", num_kv_blocks=40, max_logprobs=30)
    assert len(wide.generate("Lily", SamplingParams(temperature=0, max_tokens=1, logprobs=25))[0].outputs[0].logprobs[0]) >= 25
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(STORIES, device="cpu", num_kv_blocks=40, max_logprobs=-1)


# --- KV pool sizing -------------------------------------------------------------------------------
def test_cpu_pool_from_a_byte_budget_or_exact_blocks():
    from pagedref.models import ModelConfig

    block = kv_block_bytes(ModelConfig.from_pretrained(STORIES), 16, torch.float32)
    assert block == 2 * 5 * 16 * 4 * 8 * 4
    assert LLM(STORIES, device="cpu", cpu_kv_cache_bytes=100 * block + 7).num_kv_blocks == 100
    assert LLM(STORIES, device="cpu", cpu_kv_cache_bytes=10**12, max_num_seqs=3).num_kv_blocks == 3 * 32  # capped: never usable
    assert LLM(STORIES, device="cpu", num_kv_blocks=33).num_kv_blocks == 33
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512"):
        LLM(STORIES, device="cpu", num_kv_blocks=31)
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes"):
        LLM(STORIES, device="cpu", cpu_kv_cache_bytes=31 * block)


# --- bad input: refused before any work, with an error that names it -------------------------------
@pytest.mark.parametrize("prompts, params, error, match", [
    ([], None, ValueError, "prompts is empty"),
    ([{"prompt_token_ids": []}], None, ValueError, "no tokens"),
    ([""], None, ValueError, "prompt is empty"),
    ([{"prompt": ""}], None, ValueError, "prompt is empty"),
    (["a"], [SamplingParams(logprobs=21)], ValueError, "max_logprobs=20"),
    ([{"prompt_token_ids": list(range(3, 3 + 129))}], None, ValueError, "max_model_len=128"),
    ([{"prompt_token_ids": [1, 600]}], None, ValueError, "vocabulary"),
    ([{"prompt_token_ids": [1, "a"]}], None, TypeError, "prompt_token_ids"),
    ([3], None, TypeError, "prompt"),
    (["a", "b"], [GREEDY], ValueError, "sampling_params"),
    (["a"], [{"temperature": 0}], TypeError, "SamplingParams"),
])
def test_bad_requests_are_refused_before_any_work(llm, prompts, params, error, match):
    good = ["Once upon a time"]  # a valid prompt first: it must not run either
    steps = llm.llm_engine.num_steps
    if params is not None:
        params = [GREEDY] + params
    with pytest.raises(error, match=match):
        llm.generate(good + prompts if prompts else prompts, params)
    assert llm.llm_engine.num_steps == steps
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device"), (dict(kv_cache="ring"), "kv_cache"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_model_len=513), "max_position_embeddings"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=100), "max_num_batched_tokens"),
    (dict(dtype="int8"), "dtype"), (dict(num_kv_blocks=0), "num_kv_blocks"), (dict(swap_space=-1), "swap_space"),
    (dict(prefill_first=True), "prefill_first"),
])
def test_bad_engine_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(STORIES, **{"device": "cpu", **kwargs})


def model_copy(where, drop: str | None = None, config: dict | None = None):
    """A copy of stories260K's directory without one file, or with config.json keys overridden."""
    where.mkdir()
    for f in STORIES.iterdir():
        if f.is_file() and f.name != drop:
            shutil.copy(f, where / f.name)
    if config is not None:
        cfg = json.loads((STORIES / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**cfg, **config}))
    return where


def test_unknown_architecture_missing_weights_or_tokenizer_are_refused(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(model_copy(tmp_path / "arch", config={"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LLM(model_copy(tmp_path / "weights", drop="model.safetensors"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(model_copy(tmp_path / "tokenizer", drop="tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path / "nowhere")
