"""A Hugging Face `config.json` (+ `generation_config.json`) read into one flat, checked `ModelConfig`.

One idea: every layout found in the wild is normalised here, once, so the model code reads a single
vocabulary. transformers 4.x writes `rope_theta`, `rope_scaling` (with `type` or `rope_type`) and
`torch_dtype`; transformers 5.x writes one `rope_parameters` dict and `dtype`. Qwen2 has no
`head_dim` (it is hidden_size / num_attention_heads), Llama may say `head_dim` explicitly.

Invariant: a `ModelConfig` describes a model pagedref can run exactly. Anything it cannot (another
architecture, a rope type it does not implement, a sliding window that would bind, an activation
other than SiLU) is refused here with an error that names the offending key, before a weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# rope_type -> the keys its formula needs (see `pagedref.models.llama.rope_inv_freq`)
SUPPORTED_ROPE = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one of `SUPPORTED_ARCHITECTURES`."""


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """"float32" | "float16" | "bfloat16" (or the torch dtype) -> torch dtype; anything else is refused."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype
    else:
        raise TypeError(f"dtype must be a torch.dtype or one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: pagedref runs models in {', '.join(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = plain RoPE; else {"rope_type": "linear"|"llama3", <its parameters>}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias)
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos ∪ generation_config.json's eos (which may be a list)
    dtype: torch.dtype  # the dtype the checkpoint names

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json` and, when present, `path/generation_config.json`."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        cfg = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        gen = generation_config or {}
        arch = _architecture(cfg)
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or hidden // heads
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported: the Llama family's MLP is SwiGLU (silu)")
        max_pos = cfg["max_position_embeddings"]
        _check_sliding_window(cfg, arch, max_pos)
        rope_theta, rope_scaling = _rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            eos_token_ids=_union_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            dtype=_checkpoint_dtype(cfg),
        )


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(cfg.get("model_type"), cfg.get("model_type"))]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r}: pagedref runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling normalised to {"rope_type": ..., params} or None) from either layout."""
    if cfg.get("rope_parameters") is not None:  # transformers 5.x: one dict, theta inside
        params = dict(cfg["rope_parameters"])
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:  # transformers 4.x: theta at top level, scaling dict (or null) beside it
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported: pagedref implements {', '.join(SUPPORTED_ROPE)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1.0)")
    if rope_type == "default":
        return float(theta), None
    missing = [k for k in SUPPORTED_ROPE[rope_type] if k not in params]
    if missing:
        raise ValueError(f"rope scaling of type {rope_type!r} needs {', '.join(missing)} in the config")
    return float(theta), {"rope_type": rope_type, **{k: params[k] for k in SUPPORTED_ROPE[rope_type]}}


def _check_sliding_window(cfg: dict, arch: str, max_pos: int) -> None:
    # pagedref attends over the whole context. A window at least max_position_embeddings long never
    # binds, so full attention is then exact; a shorter one would change the model's outputs.
    window = cfg.get("sliding_window")
    in_use = cfg.get("use_sliding_window", True) if arch == "Qwen2ForCausalLM" else arch == "MistralForCausalLM"
    if in_use and window is not None and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos} is not supported: "
            "pagedref attends over the full context"
        )


def _union_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in [v] if isinstance(v, int) else (v or []):
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def _checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return resolve_dtype(name)
