"""`python -m pagedref.bench step`: structure of its results (no timing is asserted: benchmarks are code)."""

import json

import pytest

from pagedref.bench import step


@pytest.mark.parametrize("workload", step.WORKLOADS)
@pytest.mark.parametrize("sampling", step.SAMPLING)
def test_measure_reports_every_phase_at_a_steady_batch(workload, sampling):
    r = step.measure(workload, num_seqs=4, vocab_size=512, steps=2, warmup=1, sampling=sampling)
    assert (r.workload, r.sampling, r.num_seqs, r.vocab_size, r.steps) == (workload, sampling, 4, 512, 2)
    assert set(r.phases_ms) == set(step.PHASES)
    assert r.total_ms > 0 and all(r.phases_ms[p] >= 0 for p in ("schedule", "prepare", "forward", "sample"))
    # every running sequence decodes one token per step; the chunked workload adds one prompt chunk
    assert r.mean_batched_tokens == (4 + step.CHUNK if workload == "chunked" else 4)


def test_main_json_has_one_result_per_case(capsys):
    assert step.main(["--num-seqs", "2", "3", "--workloads", "decode", "--sampling", "mixed",
                      "--vocab-size", "256", "--steps", "1", "--final-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "cpu" and all(r["final_only"] for r in doc["results"])
    assert [(r["workload"], r["sampling"], r["num_seqs"]) for r in doc["results"]] == [("decode", "mixed", 2),
                                                                                         ("decode", "mixed", 3)]


def test_main_prints_a_table(capsys):
    assert step.main(["--num-seqs", "2", "--workloads", "chunked", "--sampling", "greedy", "--vocab-size", "256",
                      "--steps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["sampling", "workload", "seqs", "total", *step.PHASES]
    assert out[2].split()[:3] == ["greedy", "chunked", "2"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="workload"):
        step.measure("prefill", 4, 512, 2)
    with pytest.raises(ValueError, match="num_seqs"):
        step.measure("decode", 0, 512, 2)
    with pytest.raises(ValueError, match="sampling"):
        step.request_params(0, 8, "beam")
