"""`python -m pagedref.bench online` on the CPU: a smoke run of the whole path (it starts the server, sends
bench serve's requests over HTTP at a Poisson rate and at inf, reads every streamed token, stops the
server with SIGTERM, then runs the offline benchmark on the same requests), its report and figure, and
its usage errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e '.[serve]')")

from pagedref.bench import online  # noqa: E402
from pagedref.bench.serve import make_requests  # noqa: E402
from helpers import usage_error  # noqa: E402


def test_smoke_run_reports_benchmark_servings_figures(tmp_path, capsys):
    out = tmp_path / "online.json"
    argv = ["--device", "cpu", "--model-shape", "tiny", "--model-dir", str(tmp_path), "--num-prompts", "6",
            "--input-len", "12", "--output-len", "6", "--request-rate", "50,inf", "--compare-offline",
            "--json-out", str(out), "--plot", str(tmp_path / "online.png")]
    assert online.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
    for run in doc["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 6 * 6 and run["total_input_tokens"] == 6 * 12
        for figure in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(run[figure]) == {"mean", "median", "p99", "std"}
            assert 0 < run[figure]["median"] <= run[figure]["p99"]
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0
        assert run["engine_steps"] >= 6 and run["engine_steps_per_s"] > 0  # 6 tokens each: at least 6 steps
    assert doc["server_exit_status"] == 0  # SIGTERM: a clean shutdown
    assert doc["engine"]["num_kv_blocks"] == 4096 and doc["engine"]["enable_prefix_caching"] is False  # bench serve's
    assert doc["offline"]["output_tokens"] == 36 and doc["offline"]["online_inf_over_offline"] > 0
    assert doc["offline"]["engine_steps_per_s"] > 0 and doc["server_kv_blocks"] == doc["offline"]["kv_blocks"] == 4096
    report = capsys.readouterr().out
    assert "TTFT ms mean/med/P99" in report and "bench serve (offline" in report and "engine steps/s" in report
    assert (tmp_path / "online.png").stat().st_size > 0
    assert online.main(["--from-json", str(out)]) == 0  # replays the saved results
    assert "TPOT ms" in capsys.readouterr().out


def test_the_workload_is_bench_serves():
    """The same requests bench serve sends (its generator, its seed), turned into streamed completions."""
    reqs = make_requests(8, 512, 3)
    assert reqs == make_requests(8, 512, 3)
    assert online.serve_flags({"num_kv_blocks": 4096, "enable_prefix_caching": False, "max_num_batched_tokens": None}) == \
        ["--num-kv-blocks", "4096", "--no-enable-prefix-caching"]


@pytest.mark.parametrize("args, words", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--request-rate", "fast"], "not a number or 'inf'"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--num-kv-blocks", "-1"], "--num-kv-blocks must be >= 0"),
    (["--num-kv-blocks", "0"], "needs --device cuda"),
    (["--base-url", "http://127.0.0.1:9", "--compare-offline"], "--compare-offline"),
    (["--model", "/no/such/dir"], "not a model directory"),
])
def test_bad_flags_are_usage_errors(capsys, args, words):
    assert words in usage_error(online.main, capsys, "--device", "cpu", *args)
