"""What the benchmarks share: the random-weight models, the ShareGPT-like lengths, the device helpers,
the environment a result was measured in, and the output flags (--json, --json-out, --plot, --from-json).

One idea: `bench serve`, `latency`, `online`, `profile` and `step` measure different things on the same
ground: the same real model shapes with random weights (nothing is downloaded), the same request
lengths, the same record of where and when a number was measured. Each helper lives here once.

Invariant: a helper here depends on no benchmark module; the benchmarks depend on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from pagedref.bench.memory import MAX_MODEL_LEN, WORKLOADS, lognormal_lengths

# Real configurations (as on the Hub, transformers 4.x layout), so that the weights' and the KV cache's
# shapes, and so the memory traffic, are the real models'. "tiny" runs on a CPU in seconds (tests).
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 128256,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        **_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": {
        **_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 16384, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}
INIT_STD = 0.02  # transformers' initializer_range: random weights of a sensible scale (no NaN, no overflow)


def random_model_dir(shape: str, root: Path, device: str, seed: int = 0, log=print) -> Path:
    """A Hugging Face directory with `shape`'s config and random weights, made once and reused.

    config.json, generation_config.json, model.safetensors (the checkpoint's dtype; norms 1, every
    other tensor N(0, 0.02)), and a word-level tokenizer.json ("t0".."tN": the engine wants one; the
    benchmarks pass token ids).
    """
    import torch
    from safetensors.torch import save_file

    from pagedref.models import LlamaForCausalLM, ModelConfig

    cfg = SHAPES[shape]
    path = root / f"pagedref-random-{shape}"
    done = path / ".complete"
    if done.is_file() and json.loads((path / "config.json").read_text()) == cfg:
        return path
    log(f"[serve] writing random {shape} weights to {path} ...")
    path.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(cfg)
    with torch.device("meta"):  # names and shapes only: the project's own model says what the loader reads
        skeleton = LlamaForCausalLM(config, dtype=config.dtype)
    gen_device = device if device == "cuda" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    tensors = {}
    for name, p in skeleton.named_parameters():  # a tied lm_head is listed once, as the embedding
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=config.dtype)
        else:
            t = torch.empty(p.shape, dtype=torch.float32, device=gen_device).normal_(0.0, INIT_STD, generator=gen)
            t = t.to(config.dtype).cpu()
        tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
    word_tokenizer(cfg["vocab_size"]).save(str(path / "tokenizer.json"))
    done.write_text("ok\n")
    return path


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def sharegpt_lengths(rng: np.random.Generator, num: int, max_model_len: int = MAX_MODEL_LEN) -> list[tuple[int, int]]:
    """num (prompt, output) lengths from the paper's ShareGPT lognormals, kept as vLLM keeps ShareGPT pairs."""
    w = WORKLOADS[0]
    assert w.name == "sharegpt"
    kept: list[tuple[int, int]] = []
    while len(kept) < num:
        p = lognormal_lengths(rng, w.input_mean, w.input_sigma, 4 * num)
        o = lognormal_lengths(rng, w.output_mean, w.output_sigma, 4 * num)
        ok = (p >= 4) & (o >= 4) & (p <= 1024) & (p + o <= max_model_len)
        kept += list(zip(p[ok].tolist(), o[ok].tolist()))
    return kept[:num]


def sync_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def size_pair(text: str, form: str, example: str) -> tuple[int, int]:
    """'AxB' -> (A, B), both >= 1: an argparse type for a pair of sizes, e.g. form "KxN", example "4096x16896"."""
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {form}, e.g. {example}; got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"both sizes of {form} must be >= 1; got {text!r}")
    return a, b


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Each named flag that is set (not None) is at least 1, or its usage error names the flag."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def progress(msg: str) -> None:
    """A benchmark's progress line, on stderr at once (its results go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def environment(device: str) -> dict[str, Any]:
    import torch

    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "python": platform.python_version(),
           "torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers
    except ImportError:
        transformers = None
    env["transformers"] = transformers.__version__ if transformers else None
    # A copy of the tree (the GPU machine) may have no .git, or a stale one: PAGEDREF_COMMIT says which commit it is.
    env["commit"] = os.environ.get("PAGEDREF_COMMIT") or git_commit()
    return env


def git_commit() -> str | None:
    try:
        repo = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def add_output_flags(p: argparse.ArgumentParser, figure: str) -> None:
    p.add_argument("--json", action="store_true", help="print the results as one JSON document instead of the table")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON document to this file")
    p.add_argument("--plot", type=Path, default=None, help=f"draw {figure} into this PNG (matplotlib)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="run nothing: print (and --plot) the results saved by an earlier --json-out")


def parse_or_replay(parser: argparse.ArgumentParser, argv: list[str] | None, print_report, plot) -> argparse.Namespace | None:
    """The parsed flags; or, with --from-json, None once the saved results are printed (and plotted)."""
    args = parser.parse_args(argv)
    if args.from_json is None:
        return args
    if not args.from_json.is_file():
        parser.error(f"--from-json {args.from_json}: no such file")
    emit(json.loads(args.from_json.read_text()), args, print_report, plot)
    return None


def emit(doc: dict[str, Any], args: argparse.Namespace, print_report, plot) -> None:
    """--json-out, the figure (--plot), then the results on stdout: one JSON document (--json) or the report."""
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))
    if args.plot:
        plot(doc, args.plot)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=150, metadata={"Software": None})
    fig.clf()
