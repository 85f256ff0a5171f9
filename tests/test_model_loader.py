"""Loading Hugging Face directories: both config layouts, sharded weights, dtypes, and every refusal.

Scratch model directories are built in tmp_path from the test models (symlinked or rewritten), never
in the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import HF_MODELS, greedy_generate, model_path
from pagedref.models import (
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    ModelConfig,
    UnsupportedArchitectureError,
    load_model,
    load_tokenizer,
)
from pagedref.models.llama import RotaryEmbedding

PROMPTS = [[1, 5, 300, 7, 42, 9, 77], [1, 250]]


def scratch_copy(name: str, tmp_path: Path, skip: tuple[str, ...] = ()) -> Path:
    """tmp_path/name: symlinks to the test model's files (except `skip`), so single files can be replaced."""
    src, dst = model_path(name), tmp_path / name
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


def rewrite_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(cfg))


def same_params(a: LlamaForCausalLM, b: LlamaForCausalLM) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


# --- config ------------------------------------------------------------------------------------------


def test_config_fields_of_each_layout_and_architecture():
    llama = ModelConfig.from_pretrained(model_path("tiny-llama3-hd64"))  # transformers 5.x layout
    assert (llama.architecture, llama.head_dim, llama.num_key_value_heads, llama.rope_theta) == ("LlamaForCausalLM", 64, 2, 500000.0)
    assert llama.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    assert not llama.tie_word_embeddings and not llama.attention_bias and llama.dtype == torch.float32
    qwen = ModelConfig.from_pretrained(model_path("tiny-qwen2-hd128"))
    assert qwen.head_dim == 128  # no head_dim key: hidden_size / num_attention_heads
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.tie_word_embeddings and qwen.rope_scaling is None
    mistral = ModelConfig.from_pretrained(model_path("tiny-mistral-hd32"))
    assert (mistral.architecture, mistral.head_dim, mistral.rms_norm_eps) == ("MistralForCausalLM", 32, 1e-6)
    stories = ModelConfig.from_pretrained(model_path("stories260K"))  # transformers 4.x layout
    assert (stories.rope_theta, stories.rope_scaling, stories.eos_token_ids) == (10000.0, None, (2, 1))


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_transformers_4x_config_loads_the_same_model(tmp_path, type_key):
    path = scratch_copy("tiny-llama3-hd64", tmp_path)

    def to_4x(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        params[type_key] = params.pop("rope_type")
        cfg["rope_scaling"] = params
        cfg["torch_dtype"] = cfg.pop("dtype")

    rewrite_config(path, to_4x)
    assert ModelConfig.from_pretrained(path) == ModelConfig.from_pretrained(model_path("tiny-llama3-hd64"))
    a, b = load_model(path), load_model(model_path("tiny-llama3-hd64"))
    assert same_params(a, b)
    assert torch.equal(a.model.rotary.cos, b.model.rotary.cos) and torch.equal(a.model.rotary.sin, b.model.rotary.sin)


def test_linear_rope_scaling_divides_positions():
    base = ModelConfig.from_pretrained(model_path("stories260K"))
    linear = ModelConfig.from_dict({**_raw("stories260K"), "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain, scaled = RotaryEmbedding(base), RotaryEmbedding(linear)
    # position 2p with frequencies / 2 is position p (scaling by 2 is exact in floating point)
    assert torch.equal(scaled.cos[0::2], plain.cos[:256]) and torch.equal(scaled.sin[0::2], plain.sin[:256])


def _raw(name: str) -> dict:
    return json.loads((model_path(name) / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda c: c.update(architectures=["GPT2LMHeadModel"]), UnsupportedArchitectureError,
         "unsupported architecture 'GPT2LMHeadModel': pagedref runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ValueError,
         "rope_type 'yarn' is not supported: pagedref implements default, linear, llama3"),
        (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), ValueError, "rope_type 'dynamic' is not supported"),
        (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
         "rope scaling of type 'llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        (lambda c: c.update(hidden_act="gelu"), ValueError, "hidden_act 'gelu' is not supported"),
        (lambda c: c.update(num_key_value_heads=3), ValueError, "num_attention_heads 8 is not a multiple of num_key_value_heads 3"),
        (lambda c: c.update(torch_dtype="float64"), ValueError, "unsupported dtype 'float64'"),
    ],
    ids=["architecture", "yarn", "dynamic", "llama3-incomplete", "gelu", "heads", "dtype"],
)
def test_config_refusals(edit, error, message):
    cfg = _raw("stories260K")
    edit(cfg)
    with pytest.raises(error, match=message.replace("(", "\\(").replace(")", "\\)")):
        ModelConfig.from_dict(cfg)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = scratch_copy("tiny-mistral-hd32", tmp_path)
    rewrite_config(path, lambda c: c.update(architectures=["PhiForCausalLM"], model_type="phi"))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(path)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_sliding_window_that_binds_is_refused_one_that_cannot_is_accepted():
    mistral = _raw("tiny-mistral-hd32")
    with pytest.raises(ValueError, match="sliding_window=256 < max_position_embeddings=1024 is not supported"):
        ModelConfig.from_dict({**mistral, "sliding_window": 256})
    assert ModelConfig.from_dict({**mistral, "sliding_window": 4096}).architecture == "MistralForCausalLM"
    qwen = _raw("tiny-qwen2-hd128")  # Qwen2 only slides when use_sliding_window is true
    assert ModelConfig.from_dict({**qwen, "sliding_window": 256}).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="sliding_window=256"):
        ModelConfig.from_dict({**qwen, "sliding_window": 256, "use_sliding_window": True})


# --- weights -----------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    name = "tiny-qwen2-hd128"  # tied embeddings: the index has no lm_head.weight
    path = scratch_copy(name, tmp_path, skip=("model.safetensors",))
    tensors = load_file(model_path(name) / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00003.safetensors": names[0::3], "model-00002-of-00003.safetensors": names[1::3],
              "model-00003-of-00003.safetensors": names[2::3]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, single = load_model(path), load_model(model_path(name))
    assert same_params(sharded, single)
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # still tied after loading
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names shard model-00002-of-00003.safetensors, which is missing"):
        load_model(path)


def test_missing_weight_file_is_named(tmp_path):
    path = scratch_copy("stories260K", tmp_path, skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    path = scratch_copy("tiny-llama3-hd64", tmp_path, skip=("model.safetensors",))
    tensors = load_file(model_path("tiny-llama3-hd64") / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors has no tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_model(path)


def test_tensor_shape_that_contradicts_the_config_is_named(tmp_path):
    path = scratch_copy("tiny-mistral-hd32", tmp_path)
    rewrite_config(path, lambda c: c.update(intermediate_size=300))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' in model.safetensors has shape \(256, 128\), the config implies \(300, 128\)"):
        load_model(path)


def test_missing_config_and_tokenizer_are_named(tmp_path):
    path = scratch_copy("stories260K", tmp_path, skip=("tokenizer.json", "config.json"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in model directory"):
        load_tokenizer(path)
    with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
        load_model(path)


@pytest.mark.parametrize("dtype, error", [("float64", ValueError), (torch.int8, ValueError), (32, TypeError)])
def test_bad_dtype_is_refused(dtype, error):
    with pytest.raises(error, match="dtype"):
        load_model(model_path("stories260K"), dtype=dtype)


def test_loaded_model_is_ready_for_inference():
    model = load_model(model_path("tiny-llama3-hd64"))
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied: its own lm_head.weight
    assert model.config.architecture == "LlamaForCausalLM"
    tied = load_model(model_path("tiny-qwen2-hd128"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # tied: one parameter, loaded once


@pytest.mark.parametrize("name", HF_MODELS + ("stories260K",))
@pytest.mark.parametrize("dtype, max_rel_err", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_half_precision_models_run_close_to_float32(name, dtype, max_rel_err):
    # Greedy ids may part ways after a near tie, so compare the first decision's logits, norm-relative.
    ref = greedy_generate(load_model(model_path(name)), PROMPTS, 1)[1]
    model = load_model(model_path(name), dtype=dtype)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    got = greedy_generate(model, PROMPTS, 1)[1]
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32  # compute_logits always returns float32
        assert ((g - r).norm() / r.norm()).item() <= max_rel_err


def test_auto_dtype_is_the_checkpoints():
    assert load_model(model_path("stories260K"), dtype="auto").lm_head.weight.dtype == torch.float32
    assert load_model(model_path("stories260K"), dtype=None).lm_head.weight.dtype == torch.float32
