"""CUDA graphs: a decode step's whole forward replayed with one call, any other step's in pieces.

One idea: issued eagerly from Python, a decode step's forward is ~50 small kernels per layer, each
costing more host time than the GPU spends on it (bench serve on an H200: 15.5 ms per step at the 1B
shape eagerly, 5.3 ms with these graphs). A CUDA graph records the launches once, for one batch size and fixed
tensor addresses, and replays them all with one call (vLLM's and nano-vllm's `capture_cudagraph`):

- static input buffers (token ids, positions, slot mapping, context lengths, block tables), sized for
  the largest batch; a step copies its inputs into them;
- one graph per batch size of a ladder (1, 2, 4, 8, 16, 32, ... up to max_num_seqs); a step of n
  sequences replays the smallest captured size >= n. Its extra rows are padding: context length 0,
  so the decode kernel's CTAs for them exit at once, and each its own slot in *scratch blocks* that
  the pool holds past the blocks the block manager hands out, so their K/V writes land where no
  sequence ever reads (vLLM instead gives them slot -1, which its cache kernel skips: the same
  effect without touching the verified kernels);
- the decode kernel's grid is fixed at capture by a context length, so each batch size is captured
  twice: for contexts of up to one split-K partition of the decode kernel (1024 tokens on the tensor
  cores), where every sequence writes its output directly and no reduction is launched, and for up to
  `max_seq_len_to_capture` tokens (its CTAs past a shorter context exit at once, and the reduction
  merges the partitions of the longer ones). A step replays the smaller that holds its longest context:
  at 256 sequences of ~200 tokens the long one launched 8192 CTAs of an empty reduction and 2048 of
  empty partitions per layer. A sequence's bits do not depend on which (its partitions are its own).
  A longer context, or any step with a prefill chunk, goes to the pieces.

A step with prefill tokens cannot be one graph: the prefill kernel's grid and its loops follow each
sequence's query and context lengths. But attention is the only operation that mixes tokens, so
`PiecewiseGraphs` (vLLM V1's piecewise graphs) captures the rest, per padded token count (1, 2, 4,
8, 16, ... up to `max_capture_size` tokens): one graph from the embedding to layer 0's q/k/v, one
from each layer's attention output to the next layer's q/k/v, one to the final norm. Attention runs
eagerly between them on the real rows only, reading and writing static buffers. Padding rows carry
stale but finite values through the per-token work; no kernel reads them and no K/V is written for them.
On the fused CUDA path the pieces leave q and k unrotated in one [q | k | v] buffer and the backend's
K/V write rotates them from the positions, as in the one-graph decode step (`forward_fused`): one
launch instead of a RoPE kernel plus the cache write, and one buffer copy instead of three.

Invariant: rows 0..n-1 of a replay are what the eager forward computes for the same n sequences up
to the linear layers' rounding (they multiply a padded batch, and cuBLAS may pick another algorithm
for it: the eager GPU path's batching caveat, docs/numerics.md); attention of a sequence depends on
neither the other rows nor the grid, and padded rows write only into the scratch blocks. The step's
block ids, context lengths and slots are checked on the host before every step, replayed or eager
(`ModelRunner.run_model`, on the metadata's host copy: no sync between the steps' launches). A piecewise step's rows 0..T-1 are likewise the eager
ones up to the linear layers' rounding; its attention is the eager call itself, checks included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedref.backends.metadata import AttentionMetadata
from pagedref.kernels.fused import RotaryTables
from pagedref.kernels.splitk import MMA_PARTITION_SIZE, PARTITION_SIZE, mma_supported
from pagedref.memory.block_table import cdiv

BATCH_SIZE_LADDER = (1, 2, 4, 8) + tuple(range(16, 4097, 16))  # vLLM's capture sizes
MAX_SEQ_LEN_TO_CAPTURE = 8192  # vLLM's default: longer contexts run eagerly
# Token counts of the piecewise graphs (vLLM's spacing: finer where steps are small), up to
# max_capture_size, 2048 by default (vLLM: 512) so that chunks of a 2048-token budget and the serving
# benchmark's mixed steps of ~300-1500 tokens (256 decodes plus admitted prompts) are captured; a
# larger step's GPU work dwarfs its launches.
PIECEWISE_SIZES = (1, 2, 4) + tuple(range(8, 256, 8)) + tuple(range(256, 1024, 32)) + tuple(range(1024, 8193, 128))


@dataclass(frozen=True)
class CUDAGraphConfig:
    """What an engine captures (vLLM's names): decode graphs for batches up to max_num_seqs and contexts up
    to max_seq_len_to_capture; piecewise graphs for steps of up to max_capture_size tokens."""

    max_num_seqs: int
    max_model_len: int
    max_seq_len_to_capture: int = MAX_SEQ_LEN_TO_CAPTURE
    max_capture_size: int = 2048


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: the ladder up to max_num_seqs, and max_num_seqs itself."""
    return sorted({b for b in BATCH_SIZE_LADDER if b < max_num_seqs} | {max_num_seqs})


def num_scratch_blocks(max_num_seqs: int, block_size: int) -> int:
    """Blocks the pool adds past the managed ones: one distinct slot for each padding row of the largest batch."""
    return cdiv(max(graph_batch_sizes(max_num_seqs)), block_size)


def decode_partition_size(dtype: torch.dtype, head_dim: int) -> int:
    """Tokens per split-K partition of the decode kernel the cuda backend runs for this dtype and head_dim
    (v3 on the tensor cores where it applies, else v2: `kernels.launch`'s choice, from the shapes alone)."""
    elem_size = torch.empty((), dtype=dtype).element_size()
    return MMA_PARTITION_SIZE if mma_supported(elem_size, head_dim) else PARTITION_SIZE


def context_buckets(max_context_len: int, partition_size: int) -> list[int]:
    """The context lengths decode graphs are captured for: one partition's, and the longest captured."""
    return sorted({min(partition_size, max_context_len), max_context_len})


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences (None: more than the largest)."""
    return next((b for b in sizes if b >= num_seqs), None)


class DecodeGraphs:
    """The captured decode graphs of one model and KV pool, and the buffers they read."""

    def __init__(self, model, backend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_seqs: int, max_model_len: int, max_seq_len_to_capture: int = MAX_SEQ_LEN_TO_CAPTURE, *,
                 first_scratch_block: int, buckets: list[int] | None = None) -> None:
        """kv_caches: the pool; its blocks from first_scratch_block on are never handed to a sequence.
        buckets: the context lengths captured (default `context_buckets` at the decode kernel's partition)."""
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_context_len = min(max_model_len, max_seq_len_to_capture)
        k_cache = kv_caches[0][0]  # [num_blocks, block_size, Hkv, head_dim] in the model's dtype
        partition = decode_partition_size(k_cache.dtype, k_cache.shape[-1])
        self.buckets = buckets or context_buckets(self.max_context_len, partition)
        if max(self.buckets) != self.max_context_len:
            raise ValueError(f"the longest context bucket must be the captured context, {self.max_context_len}")
        device = k_cache.device
        max_bs, max_blocks = self.sizes[-1], cdiv(max_model_len, block_size)
        num_blocks = k_cache.shape[0]
        if (num_blocks - first_scratch_block) * block_size < max_bs:
            raise ValueError(f"the pool's scratch blocks ({first_scratch_block}..{num_blocks - 1}) hold fewer than the "
                             f"{max_bs} padding slots the largest graph needs")
        i64 = dict(dtype=torch.int64, device=device)
        self.pad_slots = first_scratch_block * block_size + torch.arange(max_bs, **i64)  # row i pads into its own slot
        self.input_ids = torch.zeros(max_bs, **i64)  # [max_bs]
        self.positions = torch.zeros(max_bs, **i64)  # [max_bs]
        self.slot_mapping = self.pad_slots.clone()  # [max_bs]
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)  # [max_bs]
        self.block_tables = torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=device)  # [max_bs, max_blocks]
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)  # one query row each
        # (bs, context bucket) -> (graph, its output [bs, hidden])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.bucket_replays = dict.fromkeys(self.buckets, 0)  # replays per context bucket
        self.capture()

    def meta(self, bs: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.query_start_loc[: bs + 1], self.context_lens[:bs],
                                 self.block_tables[:bs], max_query_len=1, max_context_len=max_context_len,
                                 block_size=self.block_size)

    def forward(self, bs: int, max_context_len: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self.meta(bs, max_context_len),
                          self.backend)

    @torch.no_grad()
    def capture(self) -> None:
        """One graph per batch size and context bucket, largest first, all in one memory pool (a replay at a
        time uses it). The buffers hold padding only (scratch slots, contexts 0): capturing writes only
        into the scratch blocks."""
        pool = None
        with self.backend.unchecked():
            for ctx in reversed(self.buckets):
                for bs in reversed(self.sizes):
                    if ctx == self.buckets[-1]:  # warm-up outside the graph: kernels loaded, allocator primed
                        self.forward(bs, ctx)  # (once per size: the shorter bucket launches a subset of them)
                        torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.forward(bs, ctx)  # [bs, hidden], in the graph's pool
                    pool = pool or graph.pool()
                    self.graphs[bs, ctx] = (graph, out)
        torch.cuda.synchronize()

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """A decode-only step of at most the largest captured batch, every context within the capture. (Its block
        tables always fit the buffer: no sequence holds more than cdiv(max_model_len, block_size) blocks.)"""
        return meta.is_decode_only and meta.num_seqs <= self.sizes[-1] and meta.max_context_len <= self.max_context_len

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [n, hidden], valid until the next replay. The caller checks the
        step's values first (`ModelRunner.run_model`: on the host copy of the metadata, no sync)."""
        n, w = meta.num_seqs, meta.block_tables.shape[1]
        bs = padded_batch_size(n, self.sizes)
        ctx = next(c for c in self.buckets if c >= meta.max_context_len)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].copy_(self.pad_slots[n:bs])
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:bs].fill_(0)
        self.block_tables[:n, :w].copy_(meta.block_tables)  # columns past w: stale, never read (past the context)
        graph, out = self.graphs[bs, ctx]
        graph.replay()
        self.num_replays += 1
        self.bucket_replays[ctx] += 1
        return out[:n]


def piecewise_sizes(max_capture_size: int) -> list[int]:
    """The token counts captured in pieces: the ladder up to max_capture_size, and max_capture_size itself."""
    return sorted({n for n in PIECEWISE_SIZES if n < max_capture_size} | {max_capture_size})


class PiecewiseGraphs:
    """Every step that is not one decode graph: the per-token work of each layer replayed from graphs
    captured for the step's padded token count, attention run eagerly in between."""

    def __init__(self, model, backend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_capture_size: int) -> None:
        self.model, self.backend, self.kv_caches = model.model, backend, kv_caches  # the LlamaModel: its pieces
        self.sizes = piecewise_sizes(max_capture_size)
        attn, n = self.model.layers[0].self_attn, self.sizes[-1]
        h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        device, dtype = kv_caches[0][0].device, kv_caches[0][0].dtype  # the pool holds the model's dtype
        i64, f32, act = (dict(dtype=t, device=device) for t in (torch.int64, torch.float32, dtype))
        # RoPE in the backend's K/V write (the fused path): the pieces hand over q and k unrotated
        self.rope_in_backend = self.model.uses_fused(kv_caches[0][0]) and getattr(backend, "fuses_rope", False)
        # The static buffers every piece reads and writes (rows past the step's T: padding).
        self.input_ids = torch.zeros(n, **i64)  # [n]
        self.positions = torch.zeros(n, **i64)  # [n]
        self.cos = torch.zeros(n, d // 2, **f32)  # [n, d/2]
        self.sin = torch.zeros(n, d // 2, **f32)  # [n, d/2]
        self.x = torch.zeros(n, model.config.hidden_size, **act)  # [n, hidden] the residual stream
        self.qkv = torch.zeros(n, (h + 2 * hkv) * d, **act)  # [n, (H + 2 Hkv) d] each row q | k | v
        self.q, self.k, self.v = attn.split_heads(self.qkv)  # [n, H, d], [n, Hkv, d] x 2: views into qkv
        self.attn = torch.zeros(n, h, d, **act)  # [n, H, d] attention's output, written between the pieces
        self.hidden = torch.zeros(n, model.config.hidden_size, **act)  # [n, hidden] the final norm's output
        self.graphs: dict[int, list] = {}  # n -> its num_layers + 1 graphs, in forward order
        self.num_replays = 0
        self.capture()

    def pieces(self, n: int) -> list:
        """The num_layers + 1 functions between attention calls, on the first n rows of the buffers."""
        m = self.model
        ids, pos, cos, sin, x, qkv, q, k, v, attn, hidden = (t[:n] for t in (
            self.input_ids, self.positions, self.cos, self.sin, self.x, self.qkv, self.q, self.k, self.v, self.attn,
            self.hidden))

        def layer_in(i: int, x_new: torch.Tensor) -> None:
            x.copy_(x_new)
            if self.rope_in_backend:
                qkv.copy_(m.layer_qkv(i, x))  # [n, (H + 2 Hkv) d], q and k unrotated
                return
            for buf, t in zip((q, k, v), m.layer_in(i, x, cos, sin)):
                buf.copy_(t)

        def first() -> None:
            x0, c, s = m.embed(ids, pos)
            cos.copy_(c)
            sin.copy_(s)
            layer_in(0, x0)

        def between(i: int):  # layer i's output and layer i + 1's input (the final norm after the last layer)
            if i + 1 < len(m.layers):
                return lambda: layer_in(i + 1, m.layer_out(i, x, attn))
            return lambda: hidden.copy_(m.final_norm(m.layer_out(i, x, attn)))

        return [first] + [between(i) for i in range(len(m.layers))]

    @torch.no_grad()
    def capture(self) -> None:
        """Largest size first, all pieces in one memory pool: nothing a piece leaves in the pool outlives
        its replay (what crosses pieces is in the static buffers), so the pieces may share it."""
        pool = None
        for n in reversed(self.sizes):
            pieces = self.pieces(n)
            for fn in pieces:  # warm-up outside the graphs: cuBLAS's choices made, the allocator primed
                fn()
            torch.cuda.synchronize()
            self.graphs[n] = []
            for fn in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    fn()
                pool = pool or graph.pool()
                self.graphs[n].append(graph)
        torch.cuda.synchronize()

    def can_replay(self, meta: AttentionMetadata) -> bool:
        return meta.num_tokens <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [T, hidden], valid until the next replay."""
        t = meta.num_tokens
        graphs = self.graphs[padded_batch_size(t, self.sizes)]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        graphs[0].replay()
        # the backend rotates q and k by the tokens' rows of the tables, which the first piece gathered
        rope = dict(rope=RotaryTables(self.cos[:t], self.sin[:t])) if self.rope_in_backend else {}
        for i, kv_cache in enumerate(self.kv_caches):
            # attention on the real rows only: it writes their K/V and reads every sequence's context
            out = self.backend.forward(self.q[:t], self.k[:t], self.v[:t], kv_cache, meta,
                                       self.model.layers[i].self_attn.scale, **rope)
            self.attn[:t].copy_(out)
            graphs[i + 1].replay()
        self.num_replays += 1
        return self.hidden[:t]
