"""`ModelRunner.prepare`: one step's AttentionMetadata for sequences whose block tables differ in length.

The block tables are built in one vectorized assignment (not one numpy call per sequence); these tests
pin what it must give: each row the sequence's own blocks in logical order, padded with -1.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedref.engine.block_manager import BlockManager
from pagedref.engine.model_runner import ModelRunner, argmax_only
from pagedref.engine.sampling import SamplerOutput, SamplingParams
from pagedref.engine.scheduler import Scheduler, SchedulerConfig
from pagedref.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_runner(prompt_lens: list[int], budget: int = 64):
    bm = BlockManager(64, BLOCK_SIZE, 64, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(8, budget, True), bm)
    seqs = [Sequence(i, f"r{i}", list(range(100 * i, 100 * i + n)), n, SamplingParams()) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        scheduler.add(seq)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)
    return ModelRunner(SimpleNamespace(config=config), None, 64, BLOCK_SIZE, "cpu", torch.float32), scheduler, seqs


def test_block_tables_are_each_sequences_blocks_padded_with_minus_one():
    runner, scheduler, seqs = make_runner([3, 17, 6, 1])  # 1, 5, 2 and 1 blocks
    step = runner.prepare(scheduler.schedule())
    tables = [scheduler.block_manager.block_ids(s) for s in seqs]
    width = max(len(t) for t in tables)
    assert step.meta.block_tables.dtype == torch.int32
    assert step.meta.block_tables.tolist() == [t + [-1] * (width - len(t)) for t in tables]


def test_decodes_and_prefills_together_give_one_row_per_sequence_in_batch_order():
    runner, scheduler, seqs = make_runner([5, 2])
    out = scheduler.schedule()
    scheduler.update(out, SamplerOutput([7, 7]))  # the prompts are computed; each samples one token
    late = Sequence(9, "r9", list(range(10)), 10, SamplingParams())
    scheduler.add(late)
    out = scheduler.schedule()  # two decodes, then late's whole prompt
    step = runner.prepare(out)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 9]
    assert step.meta.context_lens.tolist() == [6, 3, 10] and step.meta.query_start_loc.tolist() == [0, 1, 2, 12]
    assert step.positions.tolist() == [5, 2] + list(range(10))
    tables = [scheduler.block_manager.block_ids(s) for s in (seqs[0], seqs[1], late)]
    assert step.meta.block_tables.tolist() == [t + [-1] * (3 - len(t)) for t in tables]
    assert step.sample_rows == [0, 1, 11]


def test_a_step_keeps_its_logits_in_the_model_dtype_only_when_it_reads_nothing_but_argmaxes():
    def seq(params, record_logits=False):
        s = Sequence(0, "r", [1, 2], 2, params)
        s.logits = [] if record_logits else None
        return s
    greedy = SamplingParams(temperature=0.0)
    assert argmax_only([seq(greedy), seq(greedy)]), "greedy rows with nothing else asked read only argmaxes"
    assert not argmax_only([seq(greedy), seq(SamplingParams(temperature=0.8))]), "a sampled row reads the softmax"
    assert not argmax_only([seq(SamplingParams(temperature=0.0, logprobs=2))]), "logprobs read the float32 logits"
    assert not argmax_only([seq(greedy, record_logits=True)]), "recorded logits are float32 (LLM(record_logits=True))"


def test_the_argmax_of_16_bit_logits_is_the_argmax_of_their_float32_widening():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(64, 1000, generator=g) * 4).to(dtype)
        logits[:, 500] = logits.max(dim=-1).values  # ties: the first maximum wins in both
        logits[3] = float("-inf")
        logits[3, 7] = 0.0
        assert torch.equal(logits.argmax(-1), logits.float().argmax(-1)), dtype
