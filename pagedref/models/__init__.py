"""Llama-family models (Llama, Mistral, Qwen2) in torch, loaded from Hugging Face directories.

`load_model(path)` -> `LlamaForCausalLM` whose forward reads its KV cache through an attention
backend and the step's `AttentionMetadata`; `load_tokenizer(path)` -> `Tokenizer`;
`ModelConfig.from_pretrained(path)` -> the normalised config. See `llama.py` for how the CPU path
keeps every request's logits independent of the batch.
"""

from pagedref.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitectureError, resolve_dtype
from pagedref.models.llama import LlamaForCausalLM
from pagedref.models.loader import load_model, load_weights
from pagedref.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "resolve_dtype",
]
