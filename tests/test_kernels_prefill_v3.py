"""Prefill v3 (cuda/paged_prefill_hopper.cu: wgmma, warp specialisation, sm_90a): where it runs, how it
compiles, and its contract on the GPU beyond the shared sweeps of test_kernels_gpu.py.

One idea: v3 is a third kernel behind the same launcher, chosen from the model's shapes and the
device (16-bit, head_dim 64 or 128, compute capability 9.0) and never from the batch; on the GPU it
must give what v1 and v2 give (the float64 oracle within 1e-2) and keep their bit invariances where
its own structure could break them: chunks cut at its 64-row consumer and 128-row CTA boundaries and
at its 128-key tiles, the stage ring wrapping many times, the second consumer of a CTA idle.
The CPU tests need no GPU (the compile test needs nvcc); the GPU tests skip without an sm_90 device.
"""

import shutil
import subprocess

import pytest
import torch

from pagedref import kernels
from pagedref.kernels import build, gpu_available, launch, splitk
from pagedref.kernels import testing as T
from pagedref.kernels.launch import _prefill_version

HOPPER = (9, 0)


def test_v3_is_chosen_from_dtype_head_dim_and_device_only():
    for head_dim in build.PREFILL_V3_HEAD_DIMS:
        assert _prefill_version(3, 2, head_dim, HOPPER) == 3
        for other in ((8, 0), (8, 9), (10, 0), (12, 0), None):  # wgmma is sm_90a's alone
            assert _prefill_version(3, 2, head_dim, other) == 2
        assert _prefill_version(3, 4, head_dim, HOPPER) == 1  # float32: CUDA cores
    for head_dim in set(splitk.MMA_HEAD_DIMS) - set(build.PREFILL_V3_HEAD_DIMS):
        assert _prefill_version(3, 2, head_dim, HOPPER) == 2
    assert _prefill_version(2, 2, 128, HOPPER) == 2 and _prefill_version(1, 2, 128, HOPPER) == 1


def test_v3_config_names_its_target_and_rejects_what_it_cannot_run():
    cfg = build.prefill_config("bfloat16", 128, 16, version=3)
    assert cfg.file == "paged_prefill_hopper.cu" and cfg.arch == "sm_90a"
    assert ("KV_STAGES", build.prefill_v3_stages(128)) in cfg.defines
    assert build.prefill_config("bfloat16", 128, 16, version=3, stages=2) != cfg
    with pytest.raises(ValueError, match="v3"):
        build.prefill_config("float32", 128, 16, version=3)
    with pytest.raises(ValueError, match="head_dim"):
        build.prefill_config("float16", 96, 16, version=3)
    assert cfg in build.ci_configs()


def test_v3_shared_memory_fits_an_sm():
    # The query tile, the K/V stage ring, alignment slack and barriers: under the H100/H200's 227 KB.
    for head_dim in build.PREFILL_V3_HEAD_DIMS:
        for stages in range(2, build.prefill_v3_stages(head_dim) + 1):
            assert build.prefill_v3_shared_bytes(head_dim, stages) <= 227 * 1024
    assert build.prefill_v3_shared_bytes(128) == (128 + 2 * 3 * 128) * 128 * 2 + 1024 + 3 * 16 + 16


def test_v3_schedules_are_compile_time_knobs_and_the_choice_keeps_the_epilogue():
    cfg = build.prefill_config("bfloat16", 128, 16, version=3)
    for name, schedule in build.PREFILL_V3_SCHEDULES.items():
        other = build.prefill_config("bfloat16", 128, 16, version=3, schedule=schedule)
        assert other in build.ci_configs() and (other == cfg) == (schedule == build.PrefillV3Schedule()), name
        assert ("V3_PERSISTENT", int(schedule.persistent)) in other.defines
        # setmaxnreg's budget is the launch's 168 x 384 registers: the persistent producer takes 56, so 2 x 224.
        assert ("V3_PRODUCER_REGS", 56 if schedule.persistent else 40) in other.defines
    # The launcher's choice from the longest context: persistent up to the threshold, the plain grid past
    # it, and never another epilogue, so never another bit.
    limit = launch.PREFILL_V3_PERSISTENT_MAX_CONTEXT
    chosen = {ctx: launch.prefill_v3_schedule(ctx) for ctx in (1, 512, limit, limit + 1, 8192, 10**6)}
    assert chosen[limit].persistent and not chosen[limit + 1].persistent
    assert len({s.rcp_epilogue for s in chosen.values()}) == 1
    assert all(s.tma for s in chosen.values())  # whole key tiles by TMA boxes, either grid
    assert ("V3_TMA", 1) in build.prefill_config("bfloat16", 128, 16, version=3, schedule=chosen[1]).defines
    with pytest.raises(ValueError, match="bt_shfl"):  # TMA loads each table entry once a tile already
        build.prefill_config("bfloat16", 128, 16, version=3, schedule=build.PrefillV3Schedule(tma=True, bt_shfl=True))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("schedule", list(build.PREFILL_V3_SCHEDULES))
@pytest.mark.parametrize("head_dim", build.PREFILL_V3_HEAD_DIMS)
def test_v3_compiles_for_sm90a_without_spills(head_dim, schedule, tmp_path):
    # setmaxnreg only works under a register cap at entry (__launch_bounds__(384, 1): 168); ptxas says
    # so when it ignores it (C7508) or when it serialises the wgmmas (C7514, C7520: an accumulator read
    # while in flight, a wgmma in a branch it thinks divergent); neither may happen, nor a spill.
    cfg = build.prefill_config("bfloat16", head_dim, 16, version=3, schedule=build.PREFILL_V3_SCHEDULES[schedule])
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v", *cfg.options(),
           str(cfg.source), "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr
    assert "serialized" not in res.stderr and "C7508" not in res.stderr, res.stderr  # C7514, C7520, setmaxnreg


def _hopper() -> bool:
    return gpu_available() and torch.cuda.get_device_capability() == HOPPER


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100 / H200) and cupy")


def prefill(p, **kw):
    return kernels.paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc,
                                 p.scale, **kw)


@pytest.mark.parametrize("head_dim", build.PREFILL_V3_HEAD_DIMS)
@pytest.mark.parametrize("block_size", splitk.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.gpu
@needs_hopper
def test_v3_matches_the_oracle_and_is_the_default(dtype, block_size, head_dim):
    # Rows 1, 64, 65, 128, 129 and 300; contexts from 1 to 2600 (the ring wraps ten times); a chunk of
    # 129 rows after 1000 cached tokens.
    p = T.make_problem([1, 64, 65, 128, 129, 300, 1129, 2600], [1, 64, 65, 128, 129, 300, 129, 700], num_heads=8,
                       num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=head_dim + block_size)
    out = prefill(p, version=3, out=torch.full_like(p.q, float("nan")))
    assert torch.isfinite(out).all(), "NaN in the output: a row never written, or a slot no token owns was read"
    assert T.max_rel_err(out, T.oracle(p), p) <= 1e-2
    assert T.same_bits(prefill(p), out)  # the default on this device
    assert T.max_rel_err(prefill(p, version=2), out.double().cpu().numpy(), p) <= 1e-2


@pytest.mark.parametrize("head_dim", build.PREFILL_V3_HEAD_DIMS)
@pytest.mark.gpu
@needs_hopper
def test_v3_chunks_cut_at_its_own_boundaries_change_no_bit(head_dim):
    # Cuts at and around a consumer's 64 rows, a CTA's 128 and a key tile's 128: each row's
    # arithmetic depends only on its position and the key-tile grid.
    whole = T.make_problem([700], [700], num_heads=4, num_kv_heads=1, head_dim=head_dim, dtype=torch.bfloat16, seed=31)
    out = prefill(whole, version=3)
    for cut in (1, 63, 64, 65, 127, 128, 129, 256, 383, 699):
        chunk = T.select(whole, [0])
        chunk.q = whole.q[cut:].contiguous()
        chunk.query_start_loc = torch.tensor([0, 700 - cut], dtype=torch.int32, device="cuda")
        assert T.same_bits(prefill(chunk, version=3), out[cut:]), cut


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (7, 1), (16, 2)])
@pytest.mark.gpu
@needs_hopper
def test_v3_placement_and_batch_change_no_bit(num_heads, num_kv_heads):
    p = T.make_problem([700, 40, 1200, 16, 333], [100, 40, 260, 1, 333], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=128, dtype=torch.float16, seed=num_heads)
    out = prefill(p, version=3)
    assert T.max_rel_err(out, T.oracle(p), p) <= 1e-2
    assert T.same_bits(out, prefill(T.permute_blocks(p, seed=5), version=3))
    for seqs in ([2], [4, 0], [3, 1, 2]):
        rows = torch.cat([torch.arange(r.start, r.stop) for r in (T.seq_rows(p, s) for s in seqs)]).cuda()
        assert T.same_bits(prefill(T.select(p, seqs), version=3), out[rows])


@pytest.mark.parametrize("head_dim", build.PREFILL_V3_HEAD_DIMS)
@pytest.mark.gpu
@needs_hopper
def test_v3_schedules_change_no_bit(head_dim):
    # More work items than SMs (a persistent CTA walks several, of different lengths, reloading Q between
    # them), empty items (rows past a short sequence's chunk), an idle second consumer, GQA, a cached
    # prefix: every schedule gives the plain grid's bits with the same epilogue, and the launcher's
    # choice (schedule=None) one of them.
    lens = [1, 64, 65, 129, 300, 700, 1500, 2600] * 3
    p = T.make_problem(lens, [1, 64, 65, 129, 300, 200, 1500, 700] * 3, num_heads=16, num_kv_heads=4,
                       head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim)
    plain = {rcp: prefill(p, version=3, schedule=build.PrefillV3Schedule(rcp_epilogue=rcp)) for rcp in (False, True)}
    ref = T.oracle(p)  # float64, once for both epilogues
    for rcp, out in plain.items():
        assert T.max_rel_err(out, ref, p) <= 1e-2, rcp
    for name, schedule in build.PREFILL_V3_SCHEDULES.items():
        out = prefill(p, version=3, schedule=schedule, out=torch.full_like(p.q, float("nan")))
        assert T.same_bits(out, plain[schedule.rcp_epilogue]), name
    epilogue = launch.prefill_v3_schedule(max(lens)).rcp_epilogue
    out = prefill(p)  # the launcher's choice: the plain grid (contexts past PREFILL_V3_PERSISTENT_MAX_CONTEXT)
    assert T.same_bits(out, plain[epilogue])
    # Without the long sequences the choice turns persistent: the other rows keep their bits.
    short = [s for s, n in enumerate(lens) if n <= launch.PREFILL_V3_PERSISTENT_MAX_CONTEXT]
    assert launch.prefill_v3_schedule(max(lens[s] for s in short)).persistent
    rows = torch.cat([torch.arange(r.start, r.stop) for r in (T.seq_rows(p, s) for s in short)]).cuda()
    assert T.same_bits(prefill(T.select(p, short)), out[rows])
    # A persistent grid whose CTAs each take several items of one long sequence, and one item alone;
    # block sizes 32 and 8 (a tile's block-table entries over 4 and 16 lanes, TMA boxes of 32 and 8 rows);
    # contexts that end on a key tile's last key (TMA gathers every tile, the last one too, and the
    # NaN-filled slots after the context are never read) and one key past it.
    cases = (([5000], [5000], 32), ([130], [130], 8), ([1024, 256, 129, 2048], [1024, 200, 129, 77], 16),
             ([384, 640], [384, 640], 8), ([4096], [1000], 32))
    for lens, q_lens, block_size in cases:
        p = T.make_problem(lens, q_lens, num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=block_size,
                           dtype=torch.float16, seed=7)
        ref = prefill(p, version=3, schedule=build.PREFILL_V3_SCHEDULES["rcp bt"])
        assert T.max_rel_err(ref, T.oracle(p), p) <= 1e-2, lens
        for name in ("persistent rcp", "persistent rcp bt", "rcp tma", "persistent rcp tma"):
            out = prefill(p, version=3, schedule=build.PREFILL_V3_SCHEDULES[name], out=torch.full_like(p.q, float("nan")))
            assert T.same_bits(out, ref), (lens, name)


@pytest.mark.parametrize("head_dim", build.PREFILL_V3_HEAD_DIMS)
@pytest.mark.gpu
@needs_hopper
def test_v3_persistent_idle_consumer_does_not_free_q_early(head_dim):
    # Chunks of at most 64 rows after a long cached prefix: every work item leaves the second consumer
    # idle while the first runs 16 key tiles. The idle one reaches its next item while the other still
    # reads this item's Q; its "Q is read" arrival must wait for that item's first tile, or it completes
    # this item's q_empty phase and the producer loads the next Q over the one in use (wrong rows).
    lens, q_lens = [2048 - 7 * i for i in range(40)], [64 - i % 5 for i in range(40)]
    p = T.make_problem(lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16, seed=3)
    assert launch.prefill_v3_schedule(max(lens)).persistent  # what the engine would launch here
    plain = prefill(p, version=3, schedule=build.PrefillV3Schedule(rcp_epilogue=True))
    assert T.max_rel_err(plain, T.oracle(p), p) <= 1e-2
    for name in ("persistent rcp", "persistent rcp tma"):  # Q by cp.async either way; tiles by rows or boxes
        for _ in range(3):  # a race: several launches
            out = prefill(p, version=3, schedule=build.PREFILL_V3_SCHEDULES[name], out=torch.full_like(p.q, float("nan")))
            assert T.same_bits(out, plain), f"the persistent grid's rows differ from the plain grid's ({name})"
