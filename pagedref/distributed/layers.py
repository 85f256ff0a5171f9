"""Megatron-style parallel linear layers: a column-parallel layer splits the outputs, a row-parallel one the inputs.

One idea: in y = x Wᵀ, split W by output rows and each rank computes its own slice of y with no
communication (column-parallel: q/k/v, whose slices are whole heads, and gate/up); feed such a slice
straight into a layer split by input columns and each rank computes a partial sum of the full y,
which one all-reduce completes (row-parallel: o after attention, down after the MLP). So a decoder
layer costs two all-reduces of [tokens, hidden] and nothing else; every other operation (norms,
RoPE, attention over the rank's own heads, SiLU) is local.

Each layer names, in `shard_dims`, the dimension of each of its parameters that is split across the
ranks (None: every rank holds all of it); `pagedref.models.loader` reads only this rank's slice.

Invariant: with one rank (`TPGroup()`), both are exactly `nn.Linear`: the same parameters, the same
`F.linear` call, the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedref.distributed.parallel import TPGroup


def _split(features: int, tp: TPGroup, what: str) -> int:
    if features % tp.size:
        raise ValueError(f"{what}={features} is not divisible by tensor_parallel_size={tp.size}")
    return features // tp.size


class ColumnParallelLinear(nn.Linear):
    """y[:, rank's slice] = x W[rank's rows]ᵀ + b[rank's slice]: out_features / tp outputs, no communication."""

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None,
                 tp: TPGroup = TPGroup()):
        super().__init__(in_features, _split(out_features, tp, "out_features"), bias=bias, dtype=dtype)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """y = Σ_ranks x[:, rank's slice] W[:, rank's columns]ᵀ (+ b once): the input split, the output all-reduced."""

    shard_dims = {"weight": 1, "bias": None}

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None,
                 tp: TPGroup = TPGroup()):
        super().__init__(_split(in_features, tp, "in_features"), out_features, bias=bias, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in_features / tp] -> [T, out_features]
        # The bias belongs to the sum once, not once per rank: rank 0 adds it to its partial sum.
        partial = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(partial)
