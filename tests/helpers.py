"""Test-only helpers: where the test models are, and a small paged driver for the model tests.

The driver is deliberately not the engine: no scheduler, no block manager. Every sequence gets, up
front, all the blocks it will ever need, taken from a shuffled pool, and every unfinished sequence
advances in every step (its next prefill chunk, or one decode token). It builds the step's
AttentionMetadata by hand, so the model and the backend are tested on their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from pagedref.backends.metadata import AttentionMetadata
from pagedref.backends.reference import ReferenceBackend

REPO_ROOT = Path(__file__).resolve().parents[1]
# The test models and their oracle outputs live in the repository (tests/models/, each with its
# PROVENANCE.md): a clone with nothing beside it runs every test. They stay outside the installed
# package: only the tests read them.
TEST_MODELS = REPO_ROOT / "tests" / "models"
HF_MODELS = ("tiny-llama3-hd64", "tiny-qwen2-hd128", "tiny-mistral-hd32")


def model_path(name: str) -> Path:
    """Path of tests/models/<name>; an error naming it if it is missing (nothing is skipped)."""
    path = TEST_MODELS / name
    if not path.is_dir():
        raise FileNotFoundError(f"test model {name!r} not found at {path}")
    return path


def usage_error(main, capsys, *args: str) -> str:
    """The stderr of `main(args)`, a CLI's run that must stop with argparse's usage error (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


def read_reference(name: str, file: str) -> dict:
    return json.loads((model_path(name) / file).read_text())


def make_kv_caches(model, num_blocks: int, block_size: int, fill: float = float("nan")):
    """One (k_cache, v_cache) per layer, each [num_blocks, block_size, Hkv, d], filled with `fill`
    (NaN by default: a slot read before it is written poisons the output, so the tests would see it)."""
    c = model.config
    w = model.lm_head.weight
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    new = lambda: torch.full(shape, fill, dtype=w.dtype, device=w.device)  # noqa: E731
    return [(new(), new()) for _ in range(c.num_hidden_layers)]


@dataclass
class _Seq:
    tokens: list[int]  # prompt, then the generated tokens
    prompt_len: int
    max_new_tokens: int
    blocks: list[int]  # physical block of each logical block
    num_computed: int = 0  # tokens whose K/V are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32, one per generated token

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


def greedy_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    chunk_size: int | None = None,
    block_size: int = 16,
    seed: int = 0,
    backend=None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill (in chunks of chunk_size prompt tokens, or whole) and decode greedily, all sequences together.

    Returns, per sequence, the generated token ids and the logits [max_new_tokens, vocab] (on the CPU)
    that chose them. The model may live on any device; the metadata is built on the CPU and moved there.
    """
    device = model.lm_head.weight.device
    backend = backend or ReferenceBackend()
    max_new = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    need = [-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_new)]
    num_blocks = sum(need) + 3  # three blocks nobody owns: their NaNs must never be read
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, taken = [], 0
    for p, n, nb in zip(prompts, max_new, need):
        seqs.append(_Seq(list(p), len(p), n, pool[taken : taken + nb]))
        taken += nb
    kv_caches = make_kv_caches(model, num_blocks, block_size)
    while not all(s.done for s in seqs):
        step = [s for s in seqs if not s.done]
        chunks = []
        for s in step:  # the tokens this step computes: a prefill chunk, or the one token sampled last
            end = len(s.tokens) if chunk_size is None else min(len(s.tokens), s.num_computed + chunk_size)
            chunks.append(list(range(s.num_computed, end)))
        meta = build_metadata([s.blocks for s in step], chunks, block_size)
        input_ids = torch.tensor([s.tokens[p] for s, c in zip(step, chunks) for p in c], dtype=torch.int64)
        positions = torch.tensor([p for c in chunks for p in c], dtype=torch.int64)
        hidden = model(input_ids.to(device), positions.to(device), kv_caches, meta.to(device), backend)
        last_rows = meta.query_start_loc[1:].long() - 1
        logits = model.compute_logits(hidden[last_rows.to(device)]).cpu()  # [S, vocab]
        for i, (s, c) in enumerate(zip(step, chunks)):
            s.num_computed = c[-1] + 1
            if s.num_computed == len(s.tokens):  # the whole known sequence is in the cache: sample
                s.logits.append(logits[i])
                s.tokens.append(int(logits[i].argmax()))
    return [s.tokens[s.prompt_len :] for s in seqs], [torch.stack(s.logits) for s in seqs]


def build_metadata(block_tables: list[list[int]], chunks: list[list[int]], block_size: int) -> AttentionMetadata:
    """The step's metadata when sequence i owns physical blocks block_tables[i] and computes positions chunks[i]."""
    slots = [table[p // block_size] * block_size + p % block_size for table, c in zip(block_tables, chunks) for p in c]
    query_lens = [len(c) for c in chunks]
    context_lens = [c[-1] + 1 for c in chunks]  # a chunk is always the last tokens of its context so far
    tables = torch.full((len(chunks), max(map(len, block_tables))), -1, dtype=torch.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=block_size,
    )
