"""`EngineArgs` -> `EngineConfig`: every LLM argument checked in one place, and the defaults that depend on
the device (async scheduling, the batch limits on a large GPU), resolved before anything heavy loads."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from helpers import model_path
from pagedref import LLM
from pagedref.engine import config as config_mod
from pagedref.engine.config import EngineArgs, SchedulerConfig

STORIES = model_path("stories260K")


def test_every_llm_keyword_is_an_engine_argument_with_the_same_default():
    llm = {k: p.default for k, p in inspect.signature(LLM.__init__).parameters.items() if k != "self"}
    args = {k: p.default for k, p in inspect.signature(EngineArgs).parameters.items()}
    assert list(llm) == list(args), "LLM's keywords and EngineArgs's fields, in the same order"
    for name, default in llm.items():
        if name not in ("scheduler_cls", "block_manager_cls"):  # LLM names pagedref's classes, EngineArgs None (the same)
            assert args[name] == default, name


def test_the_cpu_defaults():
    config = EngineArgs(STORIES, device="cpu").create_engine_config()
    s = config.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.async_scheduling) == (256, 2048, False)
    assert (config.device, config.dtype, config.max_model_len) == ("cpu", torch.float32, 512)
    assert not config.uses_cuda_graphs


@pytest.mark.parametrize("memory_gib, want", [(141, (1024, 16384)), (80, (1024, 16384)), (40, (256, 8192))])
def test_a_large_gpu_gets_vllms_larger_batch_defaults(monkeypatch, memory_gib, want):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=memory_gib << 30))
    d = config_mod.device_defaults("cuda")
    assert (d["max_num_seqs"], d["max_num_batched_tokens"]) == want


def test_async_scheduling_is_refused_with_tensor_parallelism_by_name():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size=1"):
        LLM(STORIES, device="cpu", tensor_parallel_size=2, async_scheduling=True)


def test_the_scheduler_config_checks_itself():
    with pytest.raises(ValueError, match="prefill_first"):
        SchedulerConfig(8, 16, True, "recompute", True)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        SchedulerConfig(max_num_seqs=0)


def test_weight_gemm_resolves_to_op_names_and_refuses_what_cannot_run_by_name():
    assert EngineArgs(STORIES, device="cpu").create_engine_config().weight_gemm == ()
    resolve = config_mod.resolve_weight_gemm
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['ffn'\]"):
        resolve(("gate_up", "ffn"), "cpu", 1)
    with pytest.raises(ValueError, match="'torch', 'pagedref' or a list"):
        resolve("cublas", "cpu", 1)
    with pytest.raises(ValueError, match="sm_90 CUDA GPU"):
        LLM(STORIES, device="cpu", weight_gemm="pagedref")
    with pytest.raises(ValueError, match="sm_90 CUDA GPU"):
        resolve(["down"], "cpu", 1)
    assert resolve((), "cpu", 1) == ()  # no ops: nothing to run on the GPU's GEMM


def test_weight_gemm_puts_the_named_projections_on_the_gemm_and_nothing_else():
    from pagedref.models import load_model

    model = load_model(STORIES, device="cpu").set_weight_gemm(("o", "gate_up", "lm_head"))
    layer = model.model.layers[0]
    assert layer.self_attn.weight_gemm == {"o"} and layer.mlp.weight_gemm == {"gate_up"} and model.lm_head_on_gemm
    with pytest.raises(ValueError, match=r"\['mlp'\] are not among"):
        model.set_weight_gemm(["mlp"])
