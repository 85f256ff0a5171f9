"""The step's attention metadata: everything an attention layer needs to find each token's K/V.

Built once per step by the model runner and shared by every layer (vLLM's `AttentionMetadata`).
Invariant: for sequence s of the step, its query tokens are rows query_start_loc[s] ..
query_start_loc[s+1]-1 of q; they are the *last* query_len tokens of its context of context_lens[s]
tokens, so query row j of s sits at position context_lens[s] - query_len + j and sees keys
0 .. that position. The K/V of every new token are written to slot_mapping[token] (slot =
physical_block * block_size + offset) before anyone reads, and block_tables[s, i] is the physical
block holding the sequence's logical block i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths (0, q0, q0+q1, ...)
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, rows padded with -1
    max_query_len: int  # host copies of the maxima, so kernels can size launches without a sync
    max_context_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one new token: the decode kernel's case."""
        return self.max_query_len == 1

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            move(self.slot_mapping), move(self.query_start_loc), move(self.context_lens),
            move(self.block_tables), self.max_query_len, self.max_context_len, self.block_size,
        )
