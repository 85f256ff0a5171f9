"""CUDA graphs for decode steps (`pagedref.engine.cuda_graph`, `LLM(enforce_eager=False)`).

The CPU tests cover what needs no GPU: the captured batch sizes and token counts, the padding slot,
the host-side checks a replayed step gets instead of the kernels' own, that the flag changes nothing
on the CPU, and, with stand-in graphs that re-run what was captured, that the replays' data flow
(static buffers, padding, pieces around attention) gives the eager bits. The GPU tests (skipped
without one) compare graph replays with the eager forward: the same greedy tokens, float32 logits
within 1e-4 (the padded batch may change cuBLAS's algorithm, so not bit for bit), steps beyond the
captured context or token count falling back to eager, preemption.
"""

from __future__ import annotations

import pytest
import torch

from helpers import read_reference, model_path
from pagedref import LLM, SamplingParams
from pagedref.backends.cuda import CudaBackend
from pagedref.backends.metadata import AttentionMetadata
from pagedref.backends.reference import ReferenceBackend, write_kv
from pagedref.engine.cuda_graph import (DecodeGraphs, PiecewiseGraphs, context_buckets, decode_partition_size,
                                        graph_batch_sizes, num_scratch_blocks, padded_batch_size, piecewise_sizes)
from pagedref.engine.model_runner import allocate_kv_caches
from pagedref.kernels import gpu_available
from pagedref.models.llama import one_thread

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")


# --- what needs no GPU -----------------------------------------------------------------------------

def test_batch_sizes_follow_vllms_ladder_up_to_max_num_seqs():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(5) == [1, 2, 4, 5], "max_num_seqs itself is always captured"
    assert graph_batch_sizes(1) == [1]


def test_a_step_replays_the_smallest_captured_size_that_holds_it():
    sizes = graph_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 48)] == [1, 4, 8, 16, 32, 48]
    assert padded_batch_size(49, sizes) is None


def test_pieces_are_captured_for_token_counts_up_to_max_capture_size():
    sizes = piecewise_sizes(2048)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-3:] == [1792, 1920, 2048]
    assert piecewise_sizes(100)[-2:] == [96, 100], "max_capture_size itself is always captured"
    assert padded_batch_size(300, sizes) == 320 and padded_batch_size(2049, sizes) is None


def test_decode_graphs_are_captured_for_one_partition_of_context_and_for_the_longest():
    assert context_buckets(2048, 1024) == [1024, 2048] and context_buckets(512, 1024) == [512]
    assert decode_partition_size(torch.bfloat16, 128) == 1024, "v3 on the tensor cores"
    assert decode_partition_size(torch.float32, 128) == decode_partition_size(torch.bfloat16, 32) == 512, "v2"


def test_the_pool_gets_one_scratch_slot_per_padding_row():
    assert num_scratch_blocks(256, 16) == 16 and num_scratch_blocks(5, 16) == 1 and num_scratch_blocks(17, 8) == 3


def _meta(block_tables, context_lens, slots) -> AttentionMetadata:
    cl = torch.tensor(context_lens, dtype=torch.int32)
    return AttentionMetadata(torch.tensor(slots), torch.arange(len(cl) + 1, dtype=torch.int32), cl,
                             torch.tensor(block_tables, dtype=torch.int32), 1, int(cl.max()), 4)


def test_a_replayed_step_is_checked_on_the_host_as_the_eager_path_checks_it():
    pool = (torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8))  # 3 blocks of 4 slots
    backend = CudaBackend()
    backend.check_step(_meta([[0, 2]], [6], [9]), pool)  # block 2, slot 2 * 4 + 1
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 3 is not a physical block"):
        backend.check_step(_meta([[0, 3]], [6], [13]), pool)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 12 is outside the pool's 12 slots"):
        backend.check_step(_meta([[0, 2]], [6], [12]), pool)


def test_unchecked_lasts_only_for_its_block():
    backend = CudaBackend()
    with backend.unchecked():
        assert backend._unchecked
    assert not backend._unchecked
    with pytest.raises(RuntimeError), backend.unchecked():
        raise RuntimeError
    assert not backend._unchecked


def test_the_flag_changes_nothing_on_the_cpu():
    prompts, greedy = ["Once upon a time"], SamplingParams(temperature=0, max_tokens=8)
    eager = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, enforce_eager=True)
    graphs = LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64)  # enforce_eager=False: the default
    assert graphs.llm_engine.runner.graphs is None and graphs.llm_engine.runner.piecewise is None
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)]
    stats = graphs.get_stats()
    assert stats["num_cuda_graph_replays"] == stats["num_piecewise_graph_replays"] == 0


@pytest.mark.parametrize("flag", ["max_seq_len_to_capture", "max_capture_size"])
def test_capture_limits_must_be_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} must be at least 1"):
        LLM(model_path("stories260K"), device="cpu", num_kv_blocks=64, **{flag: 0})


class PaddedReference(ReferenceBackend):
    """The CPU reference backend taking a padded graph batch as the CUDA kernels do: padding rows (context 0)
    write their K/V to their scratch slots and attend to nothing; the host checks of the cuda backend."""

    _unchecked = False
    unchecked = CudaBackend.unchecked
    check_step = CudaBackend.check_step

    def __init__(self, first_scratch_slot: int) -> None:
        self.first_scratch_slot = first_scratch_slot

    def forward(self, q, k, v, kv_cache, meta, scale):
        n = int((meta.context_lens > 0).sum())  # the real rows come first
        assert (meta.context_lens[n:] == 0).all() and (meta.slot_mapping[:n] < self.first_scratch_slot).all()
        assert (meta.slot_mapping[n:] >= self.first_scratch_slot).all(), "padding must write only scratch slots"
        write_kv(k[n:], v[n:], *kv_cache, meta.slot_mapping[n:])
        real = AttentionMetadata(meta.slot_mapping[:n], meta.query_start_loc[: n + 1], meta.context_lens[:n],
                                 meta.block_tables[:n], 1, meta.max_context_len, meta.block_size)
        out = torch.zeros_like(q)
        out[:n] = super().forward(q[:n], k[:n], v[:n], kv_cache, real, scale)
        return out


class Rerun:
    """A stand-in CUDA graph: replay() recomputes the forward over the same static buffers into the same output."""

    def __init__(self, graphs: DecodeGraphs, bs: int, ctx: int, out: torch.Tensor) -> None:
        self.graphs, self.bs, self.ctx, self.out = graphs, bs, ctx, out

    def replay(self) -> None:
        self.out.copy_(self.graphs.forward(self.bs, self.ctx))


class StandInGraphs(DecodeGraphs):
    """DecodeGraphs whose capture records Reruns instead of CUDA graphs (replay() itself is the real one)."""

    def capture(self) -> None:
        with self.backend.unchecked():
            for ctx in self.buckets:
                for bs in self.sizes:
                    out = self.forward(bs, ctx).clone()
                    self.graphs[bs, ctx] = (Rerun(self, bs, ctx, out), out)


class Call:
    """A stand-in CUDA graph of one piece: replay() calls it again (on one thread, as the eager CPU forward)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        with one_thread(True):
            self.fn()


class StandInPiecewise(PiecewiseGraphs):
    """PiecewiseGraphs whose capture keeps each piece as a Call (replay() itself is the real one)."""

    def capture(self) -> None:
        for n in self.sizes:
            self.graphs[n] = [Call(fn) for fn in self.pieces(n)]


@pytest.mark.parametrize("max_num_seqs", [3, 8])  # 3: batches of 1-3, sizes 1, 2, 3; 8: padded to 4 and 8
def test_the_replay_data_flow_on_the_cpu_gives_the_eager_bits(max_num_seqs):
    # The CPU model is batch-invariant row by row, so padded batches must change no bit: this checks what
    # replay() copies into the static buffers (ids, positions, slots, context lengths, block tables) and,
    # for the steps with prefill, the pieces' hand-over around each eager attention call.
    name, greedy = "stories260K", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a girl"]
    kw = dict(num_kv_blocks=17, block_size=8, max_model_len=128, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=16, record_logits=True)
    eager = LLM(model_path(name), device="cpu", **kw).generate(prompts, greedy)
    llm = LLM(model_path(name), device="cpu", **kw)
    runner = llm.llm_engine.runner
    num_blocks = kw["num_kv_blocks"]  # the managed pool; the scratch blocks follow it
    runner.kv_caches = allocate_kv_caches(runner.model.config, num_blocks + num_scratch_blocks(max_num_seqs, 8), 8,
                                          torch.float32, "cpu")
    # Decode graphs for contexts of up to 24 and up to 64 tokens (one partition and the longest captured)
    runner.graphs = StandInGraphs(runner.model, PaddedReference(num_blocks * 8), runner.kv_caches, 8, max_num_seqs, 128,
                                  64, first_scratch_block=num_blocks, buckets=[24, 64])
    # Pieces for 1, 2, 4, 8 and 14 tokens: the steps with prefill of 3, 7 or 13 tokens replay them padded,
    # those of 15 or 16 run eagerly.
    runner.piecewise = StandInPiecewise(runner.model, runner.backend, runner.kv_caches, max_capture_size=14)
    graphed = llm.generate(prompts, greedy)
    stats = llm.get_stats()
    assert stats["num_cuda_graph_replays"] == runner.graphs.num_replays > 0
    assert min(runner.graphs.bucket_replays.values()) > 0, "decode steps replay both context buckets"
    assert stats["num_piecewise_graph_replays"] == runner.piecewise.num_replays > 0
    assert stats["num_cuda_graph_replays"] + stats["num_piecewise_graph_replays"] < stats["num_steps"], "some steps eager"
    assert stats["num_preemptions"] > 0, "the pool is small enough that preemption happens too"
    for e, g in zip(eager, graphed):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert torch.equal(g.outputs[0].logits, e.outputs[0].logits)
    assert llm.llm_engine.block_manager.all_free()


# --- on the GPU --------------------------------------------------------------------------------------

def _run(name: str, dtype: str = "float32", num_prompts: int = 4, max_tokens: int | list[int] = 24, **kw):
    """Greedy tokens and logits of the first num_prompts reference prompts, and the engine's stats."""
    if name.startswith("tiny"):  # prompts of 5, 37, 128 and 300 tokens
        prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in read_reference(name, "hf_reference.json")["cases"]]
    else:
        prompts = ["Once upon a time", "Lily and Tom", "The little dog", "One day"]
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * num_prompts
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths[:num_prompts]]
    llm = LLM(model_path(name), device="cuda", dtype=dtype, max_model_len=512, record_logits=True, **kw)
    try:
        outs = llm.generate(prompts[:num_prompts], greedy)
        return [(o.outputs[0].token_ids, o.outputs[0].logits) for o in outs], llm.get_stats()
    finally:
        llm.close()


def _eager_and_graphed(name: str, dtype: str = "float32", graphed_kw: dict | None = None, **kw):
    """The same requests run eagerly and with graphs (the default): (eager outputs, graphed outputs, graphed stats)."""
    eager, _ = _run(name, dtype, enforce_eager=True, **kw)
    graphed, stats = _run(name, dtype, **kw, **(graphed_kw or {}))
    return eager, graphed, stats


def _same(eager, graphed, atol: float = 1e-4) -> None:
    for (ids, logits), (g_ids, g_logits) in zip(eager, graphed):
        assert g_ids == ids
        assert (g_logits - logits).abs().max().item() <= atol


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-mistral-hd32", "tiny-qwen2-hd128", "stories260K"])
@pytest.mark.parametrize("max_num_seqs", [2, 256])  # 2: batches of 1 and 2; 256: 3 sequences padded to 4
def test_graph_replays_give_the_eager_tokens_and_logits(name, max_num_seqs):
    kw = dict(num_kv_blocks=128, max_num_seqs=max_num_seqs)
    eager, eager_stats = _run(name, enforce_eager=True, **kw)
    assert eager_stats["num_cuda_graph_replays"] == eager_stats["num_piecewise_graph_replays"] == 0
    graphed, stats = _run(name, **kw)  # graphs: the default on CUDA
    assert stats["num_cuda_graph_replays"] > 0, "decode steps must replay the captured graphs"
    assert stats["num_piecewise_graph_replays"] > 0, "the prefill steps must replay the pieces"
    _same(eager, graphed)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-qwen2-hd128"])
def test_chunked_prefill_mixed_with_decodes_replays_the_pieces(name):
    # 48-token budget: the 128- and 300-token prompts go in chunks next to the shorter ones' decodes.
    eager, graphed, stats = _eager_and_graphed(name, num_kv_blocks=128, max_num_batched_tokens=48)
    assert stats["num_piecewise_graph_replays"] > 10 and stats["num_cuda_graph_replays"] > 0
    assert stats["num_cuda_graph_replays"] + stats["num_piecewise_graph_replays"] == stats["num_steps"]
    _same(eager, graphed)


@pytest.mark.gpu
@needs_gpu
def test_prefill_first_steps_replay_the_pieces_and_decode_steps_the_graphs():
    # vLLM v0's policy, two sequences at a time. The second request stops first, so the third and then
    # the fourth prompt each get a prefill step of their own while the first request waits to decode.
    eager, graphed, stats = _eager_and_graphed("tiny-llama3-hd64", num_kv_blocks=128, max_num_seqs=2,
                                               max_tokens=[24, 6, 6, 12], enable_chunked_prefill=False,
                                               prefill_first=True)
    assert stats["num_cuda_graph_replays"] > 0 and stats["num_piecewise_graph_replays"] == 3
    assert stats["num_cuda_graph_replays"] + stats["num_piecewise_graph_replays"] == stats["num_steps"]
    _same(eager, graphed)


@pytest.mark.gpu
@needs_gpu
def test_steps_past_the_captured_sizes_fall_back():
    # Prompts of 5 and 37 tokens. The first step (42 tokens) is more than the 32 captured in pieces: eager.
    # Decode steps replay one graph until the longer sequence passes 48 tokens of context, then the pieces.
    eager, graphed, stats = _eager_and_graphed("tiny-llama3-hd64", num_kv_blocks=128, num_prompts=2,
                                               graphed_kw=dict(max_seq_len_to_capture=48, max_capture_size=32))
    assert stats["num_cuda_graph_replays"] > 0 and stats["num_piecewise_graph_replays"] > 0
    assert stats["num_cuda_graph_replays"] + stats["num_piecewise_graph_replays"] == stats["num_steps"] - 1
    _same(eager, graphed)


@pytest.mark.gpu
@needs_gpu
def test_preemption_under_graphs_keeps_every_request_right():
    # 34 blocks of 16 (one sequence of max_model_len needs 32); the 4 requests need 37 by their end.
    eager, graphed, stats = _eager_and_graphed("tiny-llama3-hd64", num_kv_blocks=34, max_num_batched_tokens=64)
    assert stats["num_preemptions"] > 0 and stats["num_cuda_graph_replays"] > 0
    assert stats["num_piecewise_graph_replays"] > 0
    assert [ids for ids, _ in graphed] == [ids for ids, _ in eager]


@pytest.mark.gpu
@needs_gpu
def test_decode_steps_replay_the_one_partition_graphs_until_a_context_passes_a_partition():
    # float32 decodes with v2's 512-token partitions: steps whose contexts fit one replay the graphs captured
    # without the reduction; once the 300-token prompt's sequence passes 512 tokens, the 1024-token ones.
    name = "tiny-llama3-hd64"
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in read_reference(name, "hf_reference.json")["cases"]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 260)]
    runs = {}
    for eager in (True, False):
        llm = LLM(model_path(name), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=128,
                  record_logits=True, enforce_eager=eager)
        try:
            runs[eager] = [(o.outputs[0].token_ids, o.outputs[0].logits) for o in llm.generate(prompts, greedy)]
            graphs = llm.llm_engine.runner.graphs
        finally:
            llm.close()
    assert graphs.buckets == [512, 1024]
    assert graphs.bucket_replays[512] > 0 and graphs.bucket_replays[1024] > 0
    _same(runs[True], runs[False])


@pytest.mark.gpu
@needs_gpu
def test_bfloat16_graphs_run_the_tensor_core_kernels_like_eager():
    eager, graphed, stats = _eager_and_graphed("tiny-llama3-hd64", "bfloat16", num_kv_blocks=128)
    assert stats["num_cuda_graph_replays"] > 0 and stats["num_piecewise_graph_replays"] > 0
    for (_, logits), (_, g_logits) in zip(eager, graphed):
        assert torch.isfinite(g_logits).all()
        # token 0 comes from the prefill step (pieces), token 1 from the first decode step (one graph):
        # before any bf16 near-tie could send the two runs down different continuations
        assert (g_logits[:2] - logits[:2]).abs().max().item() <= 5e-2
