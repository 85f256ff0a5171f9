"""`python -m pagedref.generate`: the embedded default model end to end, llama2.c's reference text from
stories260K, prompts files, and argparse-style errors (exit status 2, the bad flag or file named)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pagedref import generate, train_default
from helpers import REPO_ROOT, model_path


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedref.generate", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def run_json(capsys, *args: str) -> dict:
    assert generate.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def usage_error(capsys, *args: str) -> str:
    """The stderr of a run that must stop with argparse's usage error (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        generate.main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- the embedded default model ----------------------------------------------------------------------


def test_default_model_prints_readable_completions_and_the_summary():
    """The README's first command: no flags at all (the default prompts, one of them sampled n=3)."""
    res = run_cli("--max-tokens", "32")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for spec in generate.DEFAULT_PROMPTS:
        assert repr(spec["prompt"]) in out
    assert "completion 3/3" in out  # the n=3 prompt
    for label in ("requests", "prompt tokens", "generated tokens", "tokens/s", "peak KV blocks in use",
                  "token-state share of KV memory", "shared blocks", "preemptions"):
        assert label in out
    assert "Processed prompts" in res.stderr  # the progress bar goes to stderr, not into the output


def test_default_model_writes_the_projects_prose(capsys):
    """Readable: consecutive words of the completions are pairs the project's own text uses. An untrained
    model repeats or mixes pieces ("block block, the the"): about 70% of its pairs are found, against
    over 95% for the embedded model on its default prompts."""
    doc = run_json(capsys, "--max-tokens", "32")
    corpus_pairs = set()
    for _, text in train_default.collect_corpus(REPO_ROOT):
        words = re.findall(r"[a-z]+", text.lower())
        corpus_pairs.update(zip(words, words[1:]))
    pairs = [p for r in doc["requests"] for c in r["completions"]
             for words in [re.findall(r"[a-z]+", c["text"].lower())] for p in zip(words, words[1:])]
    assert len(pairs) >= 30
    assert sum(p in corpus_pairs for p in pairs) / len(pairs) > 0.85


def test_json_document_holds_text_token_ids_and_summary(capsys):
    doc = run_json(capsys, "--max-tokens", "8")
    reqs = doc["requests"]
    assert [r["prompt"] for r in reqs] == [p["prompt"] for p in generate.DEFAULT_PROMPTS]
    assert [len(r["completions"]) for r in reqs] == [p.get("n", 1) for p in generate.DEFAULT_PROMPTS]
    for r in reqs:
        for c in r["completions"]:
            assert isinstance(c["text"], str) and 1 <= len(c["token_ids"]) <= 8
            assert c["finish_reason"] in ("stop", "length")
    s = doc["summary"]
    assert s["requests"] == 3
    assert s["generated_tokens"] == sum(len(c["token_ids"]) for r in reqs for c in r["completions"])
    assert s["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert 0 < s["peak_kv_blocks_used"] <= s["num_kv_blocks"]
    assert s["peak_shared_blocks"] >= 1  # the n=3 samples share their prompt's block
    assert 0 < s["token_state_share_mean"] <= 1 and s["preemptions"] == 0


def test_seed_makes_sampling_reproducible(capsys):
    a = run_json(capsys, "--max-tokens", "6", "--temperature", "1.0", "--seed", "7")
    b = run_json(capsys, "--max-tokens", "6", "--temperature", "1.0", "--seed", "7")
    ids = lambda d: [c["token_ids"] for r in d["requests"] for c in r["completions"]]  # noqa: E731
    assert ids(a) == ids(b)


# --- a real pretrained model: llama2.c's reference ---------------------------------------------------


def test_stories260k_reproduces_llama2c_reference_text(capsys):
    model = model_path("stories260K")
    ref = json.loads((model / "llama2c_reference.json").read_text())
    cases = [c for c in ref["cases"] if c["prompt"]]  # an empty text is refused (the BOS-only case: test_model_stories)
    args = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--temperature", "0", "--max-tokens", "512"]
    for c in cases:
        args += ["--prompt", c["prompt"]]
    doc = run_json(capsys, *args)
    assert len(doc["requests"]) == len(cases) == 5
    for case, req in zip(cases, doc["requests"]):
        assert req["prompt_token_ids"] == case["prompt_ids"]
        (c,) = req["completions"]
        bos = case["first_bos_index"]
        if bos is None:  # no end-of-story within the context: generated until max_model_len (512)
            assert c["finish_reason"] == "length"
            assert c["token_ids"] == case["greedy_ids"][: 512 - len(case["prompt_ids"])]
        else:  # stops at BOS (generation_config.json's eos [2, 1]), as run.c does
            assert c["finish_reason"] == "stop"
            assert c["token_ids"] == case["greedy_ids"][: bos + 1]
            assert case["prompt"] + c["text"] == case["text_until_bos"]


# --- prompts files --------------------------------------------------------------------------------------


def test_prompts_file_txt_one_prompt_a_line(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("Once upon a time\n\nLily and Tom\n")
    doc = run_json(capsys, "--model", str(model_path("stories260K")), "--prompts-file", str(f), "--max-tokens", "3",
                   "--temperature", "0")
    assert [r["prompt"] for r in doc["requests"]] == ["Once upon a time", "Lily and Tom"]  # blank line skipped


def test_prompts_file_jsonl_fields_override_flags(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "Once upon a time", "n": 2, "max_tokens": 3, "seed": 1}) + "\n"
                 + json.dumps({"prompt": "The dog"}) + "\n")
    doc = run_json(capsys, "--model", str(model_path("stories260K")), "--prompts-file", str(f), "--max-tokens", "5",
                   "--prompt", "Lily")
    assert [r["prompt"] for r in doc["requests"]] == ["Lily", "Once upon a time", "The dog"]  # --prompt ones first
    lens = [[len(c["token_ids"]) for c in r["completions"]] for r in doc["requests"]]
    assert lens[1] == [3, 3]  # its own n and max_tokens
    assert all(n <= 5 for n in lens[0] + lens[2])  # the flag's max_tokens


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    (["--bogus"], "--bogus"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "0"], "--top-k"),
    (["-n", "0"], "-n"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--device", "tpu"], "--device"),
    (["--block-size", "0"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--weight-gemm", "cutlass"], "--weight-gemm"),
])
def test_bad_flags_are_usage_errors(capsys, args, named):
    assert named in usage_error(capsys, *args)


def test_bad_prompts_files_are_named(tmp_path, capsys):
    assert "no such file" in usage_error(capsys, "--prompts-file", str(tmp_path / "missing.txt"))
    csv = tmp_path / "p.csv"
    csv.write_text("a\n")
    assert ".txt or .jsonl" in usage_error(capsys, "--prompts-file", str(csv))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert "no prompts" in usage_error(capsys, "--prompts-file", str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x",\n')
    err = usage_error(capsys, "--prompts-file", str(bad))
    assert f"{bad}:2:" in err and "line 2, column 16" in err  # where the JSON breaks: line and column
    bad.write_text('{"prompt": "ok", "temprature": 0.5}\n')
    err = usage_error(capsys, "--prompts-file", str(bad))
    assert f"{bad}:1" in err and "temprature" in err
    bad.write_text('{"prompt": "ok", "max_tokens": "ten"}\n')
    assert "max_tokens" in usage_error(capsys, "--prompts-file", str(bad))
    bad.write_text('{"prompt": "ok", "top_p": 2.0}\n')
    err = usage_error(capsys, "--prompts-file", str(bad))
    assert f"{bad}:1" in err and "top_p" in err
    bad.write_text('["not", "an", "object"]\n')
    assert '"prompt"' in usage_error(capsys, "--prompts-file", str(bad))


def test_bad_models_are_named(tmp_path, capsys):
    assert "no such directory" in usage_error(capsys, "--model", str(tmp_path / "nope" / "deeper" / "x"))
    assert "not a model directory" in usage_error(capsys, "--model", str(tmp_path))
    err = usage_error(capsys, "--model", str(model_path("stories260K")), "--max-model-len", "100000")
    assert "max_model_len" in err
    long_prompt = "Once upon a time " * 200
    err = usage_error(capsys, "--model", str(model_path("stories260K")), "--prompt", long_prompt)
    assert "max_model_len" in err


def test_hub_id_offline_says_how_to_pass_a_local_directory():
    res = run_cli("--model", "meta-llama/Llama-3.2-1B", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2
    assert "meta-llama/Llama-3.2-1B" in res.stderr and "local directory" in res.stderr


def test_auto_device_needs_a_gpu_and_cupy(monkeypatch):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert generate.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # a GPU but no cupy: `import cupy` fails
    assert generate.resolve_device("auto") == "cpu"
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)  # a GPU and a working cupy
    assert generate.resolve_device("auto") == "cuda"
    assert generate.resolve_device("cpu") == "cpu"


def test_the_hopper_gemm_on_the_cpu_is_refused_by_name(capsys):
    err = usage_error(capsys, "--device", "cpu", "--weight-gemm", "pagedref")
    assert "weight_gemm" in err and "sm_90" in err
