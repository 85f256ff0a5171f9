"""`python -m pagedref.train_default`: a short run of the real script gives a checkpoint the project's loader
and engine load, its loss falls, and the same inputs give the same bytes; the shipped checkpoint fits the
package (the full training is not rerun here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from pagedref import train_default
from pagedref.models import ModelConfig, load_model, load_tokenizer

QUICK = ["--steps", "12", "--batch-size", "4", "--seq-len", "64", "--quiet"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, train_default.TrainResult]:
    out = tmp_path_factory.mktemp("default-model")
    return out, train_default.main([*QUICK, "--out", str(out)])


def test_quick_run_writes_a_loadable_llama_checkpoint(quick_run):
    out, _ = quick_run
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "TRAINING.md"):
        assert (out / name).is_file(), name
    config = ModelConfig.from_pretrained(out)
    assert config.architecture == "LlamaForCausalLM" and config.num_key_value_heads < config.num_attention_heads
    model = load_model(out, dtype="float32")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert names == {n for n, _ in model.named_parameters()}  # HF names, tied lm_head stored once
    assert "lm_head.weight" not in names
    tok = load_tokenizer(out)
    ids = tok.encode("The block table maps logical blocks")
    assert ids[0] == tok.bos_token_id == config.bos_token_id == 0  # BOS added by the post-processor
    assert tok.decode(ids) == "The block table maps logical blocks"  # byte-level: lossless
    assert 1 in config.eos_token_ids and tok.eos_token_id == 1


def test_quick_run_loss_decreases(quick_run):
    _, res = quick_run
    assert res.final_eval_loss < res.initial_eval_loss
    assert res.losses[-1] < res.losses[0]
    assert len(res.losses) == 12


def test_quick_checkpoint_serves_through_the_engine(quick_run):
    from pagedref import LLM, SamplingParams

    out, _ = quick_run
    llm = LLM(model=str(out), device="cpu", dtype="float32", num_kv_blocks=64)
    (res,) = llm.generate(["PagedAttention"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(res.outputs[0].token_ids) == 5


def test_training_is_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--quiet"]
    train_default.main([*args, "--out", str(a)])
    train_default.main([*args, "--out", str(b)])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_corpus_is_the_projects_own_text_in_sorted_order(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.md").write_text("# B\n")
    (tmp_path / "docs" / "sub" / "a.md").write_text("# A\n")
    (tmp_path / "stages" / "01_x").mkdir(parents=True)
    (tmp_path / "stages" / "01_x" / "README.md").write_text("stage one\n")
    (tmp_path / "stages" / "01_x" / "notes.md").write_text("not collected\n")
    (tmp_path / "pagedref").mkdir()
    (tmp_path / "pagedref" / "m.py").write_text('"""The docstring."""\nSECRET = "code is not corpus"\n')
    (tmp_path / "pagedref" / "empty.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    docs = train_default.collect_corpus(tmp_path)
    assert [p for p, _ in docs] == ["README.md", "docs/b.md", "docs/sub/a.md", "pagedref/m.py", "stages/01_x/README.md"]
    assert dict(docs)["pagedref/m.py"] == "The docstring.\n"
    sha = train_default.corpus_sha256(docs)
    assert sha == train_default.corpus_sha256(train_default.collect_corpus(tmp_path))
    (tmp_path / "docs" / "b.md").write_text("# B changed\n")
    assert sha != train_default.corpus_sha256(train_default.collect_corpus(tmp_path))


@pytest.mark.parametrize("args, named", [
    (["--steps", "0"], "--steps"),
    (["--batch-size", "-1"], "--batch-size"),
    (["--root", "/nonexistent/pagedref"], "--root"),
    (["--seq-len", "10000000"], "--seq-len"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, named):
    with pytest.raises(SystemExit) as exc:
        train_default.main([*args, "--out", str(tmp_path / "out"), "--quiet"])
    assert exc.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_root_without_text_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_default.main(["--root", str(tmp_path), "--out", str(tmp_path / "out"), "--quiet"])
    assert "no corpus text" in capsys.readouterr().err


def test_shipped_default_model_is_small_trained_and_documented():
    d = train_default.DEFAULT_OUT
    assert (d / "model.safetensors").stat().st_size <= 3_000_000
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    training = (d / "TRAINING.md").read_text()
    assert "sha256" in training and "eval loss" in training
    # Trained, not random: the model predicts its own corpus far better than chance (ln 1024 = 6.93). The
    # median over every corpus file's opening, so that later edits of a few docs do not move it.
    import statistics

    import torch

    model = load_model(d, dtype="float32")
    tok = load_tokenizer(d)
    losses = []
    for _, text in train_default.collect_corpus(train_default.REPO_ROOT):
        ids = torch.tensor([tok.encode(text[:400])])
        logits = model.forward_train(ids)
        losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert statistics.median(losses) < 2.0, f"median loss {statistics.median(losses):.2f} over the corpus"
