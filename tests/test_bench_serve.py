"""`python -m pagedref.bench serve|latency` on the tiny shape, CPU, few requests: the pipeline and the
structure of the results (no timed asserts: the timings themselves are the benchmark's output)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedref.bench import latency, serve
from pagedref.bench.__main__ import main as bench_main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-models")


def test_serve_tiny_all_systems(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert bench_main(["serve", "--device", "cpu", "--model-shape", "tiny", "--num-prompts", "5", "--input-len", "12",
                       "--output-len", "6", "--model-dir", str(model_dir), "--json", "--json-out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == doc
    (shape,) = doc["shapes"]
    assert shape["shape"] == "tiny" and shape["num_prompts"] == 5
    by = {r["system"]: r for r in shape["results"]}
    assert list(by) == list(serve.SYSTEMS)
    for name in ("pagedref", "contiguous"):
        r = by[name]
        assert r["skipped"] is None and r["requests"] == 5
        assert r["output_tokens"] == 30 and r["prompt_tokens"] == 60  # exactly what was asked (ignore_eos)
        assert r["kv_blocks"] == 4096 and 0 < r["peak_kv_blocks_used"] <= r["kv_blocks"]
        assert 1 <= r["peak_running_seqs"] <= 5 and r["preemptions"] == 0
        assert r["output_tokens_per_s"] > 0
    # Same requests, same pool: paged holds ~one block per request, contiguous reserves max_model_len each.
    assert by["pagedref"]["peak_kv_blocks_used"] < by["contiguous"]["peak_kv_blocks_used"]
    assert by["pagedref"]["kv_token_state_share"] > by["contiguous"]["kv_token_state_share"]
    for name in ("hf-static", "hf-continuous"):  # transformers is optional: it runs, or says why not
        r = by[name]
        assert r["requests"] == 5 or r["skipped"]


def test_serve_table_is_printed_last(model_dir, capsys):
    assert serve.main(["--device", "cpu", "--num-prompts", "3", "--input-len", "5", "--output-len", "3", "--systems",
                       "pagedref,contiguous", "--model-dir", str(model_dir)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[-2].startswith("pagedref ") and lines[-1].startswith("contiguous ")
    assert "[serve]" in captured.err and "[serve]" not in captured.out  # progress on stderr


def test_sharegpt_lengths_follow_the_paper_and_vllms_filter():
    lengths = np.array(serve.sharegpt_lengths(np.random.default_rng(0), 2000))
    p, o = lengths[:, 0], lengths[:, 1]
    assert p.min() >= 4 and o.min() >= 4 and p.max() <= 1024 and (p + o).max() <= 2048
    # The filter trims the tails a little, so the means land near (below) the paper's 161 / 338.
    assert 120 < p.mean() < 175 and 270 < o.mean() < 345
    reqs = serve.make_requests(500, 128256, seed=3)
    assert len(reqs) == 500 and reqs == serve.make_requests(500, 128256, seed=3)
    assert all(0 <= t < 128256 for r in reqs[:20] for t in r.prompt_token_ids)


def test_static_batches_respect_the_kv_budget():
    rng = np.random.default_rng(1)
    reqs = [serve.BenchRequest([0] * int(p), int(o)) for p, o in serve.sharegpt_lengths(rng, 300)]
    for budget, cap in ((4096, 256), (65536, 256), (65536, 8)):
        batches = serve.static_batches(reqs, budget, cap)
        assert [r for b in batches for r in b] == reqs  # arrival order, nothing lost
        for b in batches:
            longest = max(len(r.prompt_token_ids) for r in b) + max(r.output_len for r in b)
            assert len(b) <= cap and (len(b) == 1 or len(b) * longest <= budget)


def test_static_token_state_share():
    # Two requests: prompts 4 and 2 (padded to 4), outputs 2 and 1 (the second idles one step).
    batch = [serve.BenchRequest([0] * 4, 2), serve.BenchRequest([0] * 2, 1)]
    share, steps = serve.static_token_state_share(batch)
    assert steps == 2
    assert share == pytest.approx(((4 + 2) / 8 + (5 + 3) / 10) / 2)


def test_random_model_dir_is_written_once_and_loads(model_dir):
    from pagedref.models import ModelConfig, load_model

    path = serve.random_model_dir("tiny", model_dir, "cpu")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert serve.random_model_dir("tiny", model_dir, "cpu") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    model = load_model(path)
    assert model.config == ModelConfig.from_dict(serve.SHAPES["tiny"])


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3.1-8b"])
def test_real_shapes_are_valid_configs(shape):
    from pagedref.models import ModelConfig

    c = ModelConfig.from_dict(serve.SHAPES[shape])
    assert c.rope_type == "llama3" and c.num_key_value_heads == 8 and c.vocab_size == 128256
    params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * (
        c.hidden_size * c.head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2) + 3 * c.hidden_size * c.intermediate_size)
    assert params / 1e9 == pytest.approx({"llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03}[shape], rel=0.01)


def _side_by_side(model_dir, capsys, systems: str) -> dict:
    """Three requests of 5 + 3 tokens through `systems` in one run: each system's result, by name."""
    assert serve.main(["--device", "cpu", "--num-prompts", "3", "--input-len", "5", "--output-len", "3", "--systems",
                       systems, "--model-dir", str(model_dir), "--json"]) == 0
    (shape,) = json.loads(capsys.readouterr().out)["shapes"]
    by = {r["system"]: r for r in shape["results"]}
    assert set(by) == set(systems.split(","))
    for r in by.values():
        assert r["skipped"] is None and r["requests"] == 3 and r["output_tokens"] == 9
    return by


def test_serve_tensor_parallel_side_by_side(model_dir, capsys):
    """`pagedref-tp2` is the same engine over 2 processes (gloo on the CPU): same requests, same tokens."""
    _side_by_side(model_dir, capsys, "pagedref,pagedref-tp2")


def test_serve_pagedref_eager_is_pagedref_without_graphs(model_dir, capsys):
    """`pagedref-eager` runs the same requests through the same engine with enforce_eager=True; the note says
    how each system's steps ran (on the CPU every step is eager)."""
    for r in _side_by_side(model_dir, capsys, "pagedref,pagedref-eager").values():
        assert r["note"].endswith("steps, eager")


def test_serve_pagedref_sync_is_pagedref_without_async_scheduling(model_dir, capsys):
    """`pagedref-sync` runs the same requests with async_scheduling=False (on the CPU both are synchronous
    by default: the same engine twice); the GPU run compares them."""
    for r in _side_by_side(model_dir, capsys, "pagedref,pagedref-sync").values():
        assert r["note"].endswith("steps, eager")


def test_the_note_counts_graph_replays():
    stats = {"num_cuda_graph_replays": 5, "num_piecewise_graph_replays": 2}
    assert serve._graph_note(stats) == ", 5 decode + 2 piecewise graph replays"
    assert serve._graph_note({"num_cuda_graph_replays": 0, "num_piecewise_graph_replays": 0}) == ", eager"
    assert serve._graph_note({**stats, "async_scheduling": True}) == ", 5 decode + 2 piecewise graph replays, async"


@pytest.mark.parametrize("args, named", [
    (["--systems", "pagedref,vllm"], "vllm"),
    (["--systems", "pagedref-tp0"], "pagedref-tp0"),
    (["--model-shape", "llama-70b"], "llama-70b"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-kv-blocks", "4"], "--num-kv-blocks"),
    (["--num-kv-blocks", "0", "--device", "cpu"], "--num-kv-blocks"),
    (["--input-len", "2000", "--output-len", "100"], "--input-len"),
])
def test_serve_bad_flags(capsys, args, named):
    with pytest.raises(SystemExit) as exc:
        serve.main(args)
    assert exc.value.code == 2 and named in capsys.readouterr().err


# --- latency --------------------------------------------------------------------------------------------


def test_latency_tiny_chunked_and_unchunked(model_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert bench_main(["latency", "--device", "cpu", "--num-short", "3", "--num-long", "1", "--budgets", "16",
                       "--long-prompt-len", "48", "--short-output-len", "4", "--long-output-len", "2",
                       "--model-dir", str(model_dir), "--json", "--json-out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == doc
    assert [r["config"] for r in doc["results"]] == ["no-chunking", "prefill-first", "chunked-16"]
    for r in doc["results"]:
        assert r["output_tokens"] == 3 * 4 + 2
        assert 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert r["makespan_s"] > 0 and r["preemptions"] == 0
    unchunked, prefill_first, chunked = doc["results"]
    # The 48-token prompt is spread over >= 3 steps of 16 tokens; unchunked it takes one step.
    assert chunked["steps"] > unchunked["steps"]
    assert chunked["max_num_batched_tokens"] == 16 and unchunked["max_num_batched_tokens"] > 48
    assert prefill_first["max_num_batched_tokens"] == unchunked["max_num_batched_tokens"], "only the policy differs"
    head = doc["table"].splitlines()[0]
    assert "p99/no-chunking" in head and "p99/prefill-first" in head, "P99 relative to each unchunked baseline"


def test_latency_runs_the_unchunked_policies_asked_for(model_dir, capsys):
    assert latency.main(["--device", "cpu", "--num-short", "2", "--num-long", "1", "--budgets", "16", "--unchunked",
                         "prefill-first", "--long-prompt-len", "20", "--short-output-len", "2", "--long-output-len", "1",
                         "--model-dir", str(model_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in doc["results"]] == ["prefill-first", "chunked-16"]
    assert latency.main(["--device", "cpu", "--num-short", "2", "--num-long", "1", "--budgets", "16", "--unchunked", "",
                         "--long-prompt-len", "20", "--short-output-len", "2", "--long-output-len", "1",
                         "--model-dir", str(model_dir), "--json"]) == 0
    assert [r["config"] for r in json.loads(capsys.readouterr().out)["results"]] == ["chunked-16"]


def test_latency_trace():
    trace = latency.make_trace(num_short=50, num_long=3, rate=10.0, long_interval=2.0, long_prompt_len=100,
                               short_output_len=8, long_output_len=2, vocab_size=512, seed=0, long_arrivals="fixed")
    assert [a.time for a in trace] == sorted(a.time for a in trace)
    longs = [a for a in trace if a.kind == "long"]
    assert [a.time for a in longs] == [1.0, 3.0, 5.0] and all(len(a.prompt_token_ids) == 100 for a in longs)
    chats = [a for a in trace if a.kind == "chat"]
    assert len(chats) == 50 and 2.0 < chats[-1].time < 10.0  # ~5 s of Poisson arrivals at 10/s
    burst = latency.make_trace(4, 0, float("inf"), 0.0, 10, 2, 2, 512, 0)
    assert [a.time for a in burst] == [0.0] * 4


def test_latency_trace_with_poisson_long_arrivals():
    args = dict(num_short=50, num_long=400, rate=10.0, long_interval=0.5, long_prompt_len=20, short_output_len=8,
                long_output_len=2, vocab_size=512, seed=0)
    fixed = latency.make_trace(**args, long_arrivals="fixed")
    poisson = latency.make_trace(**args)  # the default
    longs = lambda trace: [a for a in trace if a.kind == "long"]  # noqa: E731
    assert [a.prompt_token_ids for a in longs(poisson)] == [a.prompt_token_ids for a in longs(fixed)], \
        "only the long prompts' arrival times change"
    assert [a for a in poisson if a.kind == "chat"] == [a for a in fixed if a.kind == "chat"]
    gaps = np.diff([a.time for a in longs(poisson)])
    assert 0.4 < gaps.mean() < 0.6, "the same mean interval"
    assert (gaps < 0.1).mean() > 0.1, "now and then two long prompts arrive close together"
    with pytest.raises(ValueError, match="long_arrivals"):
        latency.make_trace(**args, long_arrivals="bursty")


@pytest.mark.parametrize("args, named", [
    (["--budgets", "512,x"], "--budgets"),
    (["--budgets", "0"], "--budgets"),
    (["--model-shape", "gpt2"], "gpt2"),
    (["--num-short", "0"], "--num-short"),
    (["--unchunked", "v0"], "--unchunked"),
])
def test_latency_bad_flags(capsys, args, named):
    with pytest.raises(SystemExit) as exc:
        latency.main(["--device", "cpu", *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_saved_results_reprint_and_plot(model_dir, tmp_path, capsys):
    """--from-json runs nothing: the device's --json-out is turned into the table and a figure here."""
    saved = tmp_path / "serve.json"
    serve.main(["--device", "cpu", "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--systems",
                "pagedref,contiguous", "--model-dir", str(model_dir), "--json-out", str(saved)])
    table = capsys.readouterr().out
    assert serve.main(["--from-json", str(saved), "--plot", str(tmp_path / "serve.png")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == table.strip().splitlines()[-2:]
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"

    saved = tmp_path / "latency.json"
    latency.main(["--device", "cpu", "--num-short", "2", "--num-long", "1", "--budgets", "16", "--long-prompt-len", "20",
                  "--short-output-len", "2", "--long-output-len", "1", "--model-dir", str(model_dir), "--json-out", str(saved)])
    capsys.readouterr()
    assert latency.main(["--from-json", str(saved), "--plot", str(tmp_path / "latency.png")]) == 0
    assert "no-chunking" in capsys.readouterr().out
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        serve.main(["--from-json", str(tmp_path / "missing.json")])
