"""Tensor parallelism at the model level: sharded loading, the divisibility rules, and 2 gloo ranks on the CPU.

The two-rank test is SPMD with no engine: each spawned rank loads its shard and runs the test
driver's greedy loop (`helpers.greedy_generate`) on the same prompts. Both ranks hold the same
replicated residual stream after every all-reduce, so both compute the same logits and pick the same
tokens, with no message between them but the all-reduces inside the model.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.multiprocessing as mp

import helpers
from helpers import greedy_generate, model_path
from pagedref.distributed import TPGroup, check_tensor_parallel_size, destroy_tp_group, init_tp_group
from pagedref.distributed.parallel import free_port
from pagedref.models import LlamaForCausalLM, ModelConfig, load_model

TP_MODELS = ("stories260K", "tiny-llama3-hd64", "tiny-mistral-hd32")  # 8/4, 4/2, 4/4 query/KV heads
PROMPTS = [[1, 45, 300, 12, 7, 99, 4, 250, 31], [1, 17, 5], [1, 8, 200, 64, 3, 77, 41]]
NEW_TOKENS = 8
SPAWN_TIMEOUT_S = 120


def rank_kv_caches(model, num_blocks: int, block_size: int, fill: float = float("nan")):
    """helpers.make_kv_caches for one rank: its KV pool holds only the rank's own KV heads."""
    heads, d = model.model.layers[0].self_attn.num_kv_heads, model.config.head_dim
    shape = (num_blocks, block_size, heads, d)
    new = lambda: torch.full(shape, fill, dtype=model.lm_head.weight.dtype)  # noqa: E731
    return [(new(), new()) for _ in range(model.config.num_hidden_layers)]


def _rank_main(rank: int, port: int, out_path: str) -> None:
    """One of 2 ranks: every model, batched with chunked prefill, and each prompt alone."""
    helpers.make_kv_caches = rank_kv_caches  # the driver's pools, sized for this rank's heads
    tp = init_tp_group(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        results = {}
        for name in TP_MODELS:
            model = load_model(model_path(name), tp=tp)
            batched = greedy_generate(model, PROMPTS, NEW_TOKENS, chunk_size=4)
            alone = [greedy_generate(model, [p], NEW_TOKENS) for p in PROMPTS]
            results[name] = (batched, alone)
        torch.save(results, f"{out_path}.{rank}")
    finally:
        destroy_tp_group(tp)


def run_ranks(fn, nprocs: int, *args) -> None:
    """fn(rank, *args) in nprocs spawned processes; fails (after killing them) instead of hanging."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results"
    run_ranks(_rank_main, 2, free_port(), str(out))
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.parametrize("name", TP_MODELS)
def test_tp2_greedy_tokens_equal_the_single_process_run(two_ranks, name):
    ids, logits = greedy_generate(load_model(model_path(name)), PROMPTS, NEW_TOKENS, chunk_size=4)
    (tp_ids, tp_logits), _ = two_ranks[0][name]
    assert tp_ids == ids
    # Not bit-equal: the row-parallel layers add two half-length dot products instead of one
    # full-length one. Measured: at most 1.9e-5 apart (logits of magnitude ~10) on these models.
    assert max((a - b).abs().max().item() for a, b in zip(tp_logits, logits)) <= 1e-4


@pytest.mark.parametrize("name", TP_MODELS)
def test_both_ranks_compute_the_same_logits(two_ranks, name):
    (ids0, logits0), _ = two_ranks[0][name]
    (ids1, logits1), _ = two_ranks[1][name]
    assert ids0 == ids1
    assert all(torch.equal(a, b) for a, b in zip(logits0, logits1))


@pytest.mark.parametrize("name", TP_MODELS)
def test_tp2_keeps_batch_invariance(two_ranks, name):
    # The all-reduce sits inside the per-row function: each row is summed on its own, so a request's
    # logits under TP still do not depend on the batch or the chunking, bit for bit.
    (_, batched), alone = two_ranks[0][name]
    for got, (_, [want]) in zip(batched, alone):
        assert torch.equal(got, want)


# --- sharding without a process group: loading and the checks never communicate -----------------------
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_only_its_slice(rank):
    path = model_path("tiny-llama3-hd64")
    full = load_model(path)
    shard = load_model(path, tp=TPGroup(rank, 2))
    c = full.config
    q_rows = c.num_attention_heads // 2 * c.head_dim
    kv_rows = c.num_key_value_heads // 2 * c.head_dim
    inter = c.intermediate_size // 2
    f, s = full.model.layers[1], shard.model.layers[1]
    sl = lambda n: slice(rank * n, (rank + 1) * n)  # noqa: E731
    assert torch.equal(s.self_attn.q_proj.weight, f.self_attn.q_proj.weight[sl(q_rows)])
    assert torch.equal(s.self_attn.k_proj.weight, f.self_attn.k_proj.weight[sl(kv_rows)])
    assert torch.equal(s.self_attn.v_proj.weight, f.self_attn.v_proj.weight[sl(kv_rows)])
    assert torch.equal(s.self_attn.o_proj.weight, f.self_attn.o_proj.weight[:, sl(q_rows)])
    assert torch.equal(s.mlp.gate_proj.weight, f.mlp.gate_proj.weight[sl(inter)])
    assert torch.equal(s.mlp.up_proj.weight, f.mlp.up_proj.weight[sl(inter)])
    assert torch.equal(s.mlp.down_proj.weight, f.mlp.down_proj.weight[:, sl(inter)])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.1.input_layernorm.weight"):  # replicated
        assert torch.equal(shard.get_parameter(name), full.get_parameter(name))
    assert (s.self_attn.num_heads, s.self_attn.num_kv_heads) == (c.num_attention_heads // 2, c.num_key_value_heads // 2)


def test_qkv_biases_are_split_and_the_row_parallel_bias_is_whole():
    # Qwen2's q/k/v carry biases (split with their rows). tiny-qwen2 has 1 KV head, so build a 2-KV-head
    # config of the same family and check the parameter shapes a rank of 2 holds.
    config = dataclasses.replace(ModelConfig.from_pretrained(model_path("tiny-qwen2-hd128")),
                                 num_key_value_heads=2, o_proj_bias=True, mlp_bias=True)
    with torch.device("meta"):
        shard = LlamaForCausalLM(config, tp=TPGroup(1, 2))
    attn, mlp, d = shard.model.layers[0].self_attn, shard.model.layers[0].mlp, config.head_dim
    assert attn.q_proj.bias.shape == (config.num_attention_heads // 2 * d,)
    assert attn.k_proj.bias.shape == attn.v_proj.bias.shape == (d,)
    assert attn.o_proj.bias.shape == mlp.down_proj.bias.shape == (config.hidden_size,)
    assert mlp.up_proj.bias.shape == (config.intermediate_size // 2,)


def test_kv_heads_that_do_not_divide_are_refused():
    # tiny-qwen2 has 2 query heads and 1 KV head: pagedref does not replicate KV heads across ranks.
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 is not divisible by tensor_parallel_size=2"):
        load_model(model_path("tiny-qwen2-hd128"), tp=TPGroup(0, 2))


@pytest.mark.parametrize(("field", "value", "tp_size"), [
    ("num_attention_heads", 8, 3), ("num_key_value_heads", 4, 8), ("intermediate_size", 170, 4),
])
def test_every_split_dimension_is_checked(field, value, tp_size):
    config = ModelConfig.from_pretrained(model_path("stories260K"))  # 8 heads, 4 KV heads
    config = dataclasses.replace(config, **{field: value})
    with pytest.raises(ValueError, match=rf"{field}={value} is not divisible by tensor_parallel_size={tp_size}"):
        check_tensor_parallel_size(config, tp_size)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        LlamaForCausalLM(config, tp=TPGroup(0, tp_size))


@pytest.mark.parametrize(("tp_size", "error"), [(0, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError)])
def test_tensor_parallel_size_must_be_a_positive_int(tp_size, error):
    with pytest.raises(error, match="tensor_parallel_size"):
        check_tensor_parallel_size(ModelConfig.from_pretrained(model_path("stories260K")), tp_size)


def test_a_shard_of_a_wrong_shape_names_the_whole_tensor(tmp_path):
    # The shape check is on the checkpoint's whole tensor, as without TP.
    from safetensors.torch import load_file, save_file

    src = model_path("stories260K")
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"][:, :32].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"o_proj.weight.*shape \(64, 32\), the config implies \(64, 64\)"):
        load_model(tmp_path, tp=TPGroup(1, 2))
