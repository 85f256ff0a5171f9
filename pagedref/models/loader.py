"""Load a Hugging Face model directory: config, safetensors weights (single file or sharded), into our model.

One idea: the model is built with no weights at all (on the meta device), then every parameter is
filled by name from the checkpoint, converted to the requested dtype on the way.

Invariant: every parameter of the model comes from the checkpoint, with the checkpoint's shape; a
missing file or tensor, or a shape that does not match the config, is an error naming it. Tensors
the model does not use (an `lm_head.weight` beside tied embeddings, old `rotary_emb.inv_freq`
buffers) are ignored, as transformers does.

Tensor parallelism: a model built for one rank of N (`tp`) reads only its slice of each split
parameter (`safe_open(...).get_slice(name)`, so no rank ever holds the whole matrix): the rank's rows
of the column-parallel q/k/v/gate/up projections, its columns of the row-parallel o/down projections,
as each layer's `shard_dims` says. The shape check is on the whole tensor, as with one rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pagedref.distributed.parallel import TPGroup
from pagedref.models.config import ModelConfig, resolve_dtype
from pagedref.models.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it, from the index of a sharded checkpoint or the one file."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} in {path} names shard {shard.name}, which is missing")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no weights in model directory {path}: expected {SINGLE_FILE} or {INDEX_FILE}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy every parameter of `model` from the checkpoint in `path`, by its Hugging Face name."""
    files = checkpoint_files(path)
    by_file: dict[Path, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():  # tied lm_head is the embedding: listed once, by that name
        if name not in files:
            where = INDEX_FILE if (Path(path) / INDEX_FILE).is_file() else SINGLE_FILE
            raise ValueError(f"checkpoint {Path(path) / where} has no tensor {name!r}")
        by_file.setdefault(files[name], []).append((name, param))
    tp: TPGroup = getattr(model, "tp", TPGroup())
    for file, params in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name, param in params:
                module, _, leaf = name.rpartition(".")
                dim = getattr(model.get_submodule(module), "shard_dims", {}).get(leaf)  # None: not split
                whole = list(param.shape)
                if dim is not None:
                    whole[dim] *= tp.size
                tensor = f.get_slice(name)
                if list(tensor.get_shape()) != whole:
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has shape {tuple(tensor.get_shape())}, "
                        f"the config implies {tuple(whole)}"
                    )
                param.copy_(tensor[rank_slice(whole, dim, tp)])  # casts to the model dtype and moves to its device


def rank_slice(shape: list[int], dim: int | None, tp: TPGroup) -> tuple[slice, ...]:
    """The index of this rank's shard of a tensor of `shape` split along `dim` (everything when dim is None)."""
    index = [slice(None)] * len(shape)
    if dim is not None:
        n = shape[dim] // tp.size
        index[dim] = slice(tp.rank * n, (tp.rank + 1) * n)
    return tuple(index)


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = torch.float32,
    batch_invariant: bool = True,
    tp: TPGroup = TPGroup(),
) -> LlamaForCausalLM:
    """The model in `path` (this rank's shard of it under `tp`), in eval mode with gradients off.
    dtype None or "auto" = the checkpoint's own. On a GPU's batched path (not batch_invariant) its q/k/v
    and gate/up projections are merged into one matrix each once loaded (`merge_projections`)."""
    config = ModelConfig.from_pretrained(path)
    dtype = config.dtype if dtype is None or dtype == "auto" else resolve_dtype(dtype)
    checkpoint_files(path)  # fail on a missing weight file before allocating anything
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype, batch_invariant=batch_invariant, tp=tp)
    model.materialize(device)
    load_weights(model, path)
    if torch.device(device).type == "cuda" and not batch_invariant:
        model.merge_projections()
    return model.eval().requires_grad_(False)
