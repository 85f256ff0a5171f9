"""`python -m pagedref.bench spec`: what speculative decoding buys, and what it costs, at batch 1 and 32.

One idea: the same greedy requests, the same model and pool, run with and without speculation
(`LLM(speculative_config=...)`, stage 8); output tokens/s, the acceptance rate and the tokens emitted per
speculative step side by side, per batch size. A speculative step scores k + 1 rows per sequence: nearly
free when a step is bound by reading the weights (batch 1), not when the batch already fills the GPU
(batch 32 and more), where rejected rows are paid work. Greedy output is identical either way (the
engine's contract), so only the time differs: the bench checks the token counts.

The methods (`--methods`):
  none      no speculation (the baseline)
  ngram     prompt lookup, k = --k, lookup lengths --prompt-lookup-min..--prompt-lookup-max
  shallow   a draft model made of the target's first --draft-layers layers (its embedding, norm and
            LM head too: the same vocabulary; written once beside the target, `shallow_draft`)
  self      the target as its own draft: every draft accepted, the draft costs a target's step (the
            mechanics' upper bound on acceptance, and their cost)
and any `--speculative-config JSON` on top.

The workloads (`--workload`):
  copy      copy-heavy: each prompt is a passage followed by its own opening, so an answer that goes on
            copying the passage repeats long spans of the prompt (an edit or extract task's shape)
  sharegpt  random prompts of the ShareGPT-like lengths' mean (`bench serve`'s)
Random weights (`--model-shape`, as every bench here) do not copy their prompt as a trained model
would: their acceptance rates are the model's, reported beside every number, not a copy task's. Pass
`--model DIR` for a trained checkpoint (the embedded default model, stories260K, a Hub download).

Invariant: every method sees the same prompts and output lengths; tokens/s counts the tokens asked for.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedref.bench.common import (SHAPES, add_output_flags, emit, environment, free_device, parse_or_replay, progress, pyplot,
                                   random_model_dir, save_figure, sync_device)

METHODS = ("none", "ngram", "shallow", "self")
WORKLOADS = ("copy", "sharegpt")


def shallow_draft(model_dir: str | Path, num_layers: int, out: str | Path) -> Path:
    """A draft model made of a checkpoint's first num_layers layers, with its embedding, final norm and LM
    head (so the same vocabulary and tokenizer): layer-skipping self-speculation's draft, made once."""
    import torch
    from safetensors.torch import load_file, save_file

    from pagedref.models.loader import checkpoint_files

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in 1..{config['num_hidden_layers'] - 1}, got {num_layers}")
    done = out / ".complete"
    if done.is_file() and json.loads((out / "config.json").read_text())["num_hidden_layers"] == num_layers:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(checkpoint_files(model_dir).values())):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    done.write_text("ok\n")
    return out


def make_prompts(workload: str, num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """num prompts of input_len tokens. copy: a passage, then its first quarter again (the answer that goes
    on copying repeats the passage); sharegpt: random tokens."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num):
        if workload == "copy":
            passage = rng.integers(3, vocab_size, input_len - input_len // 4).tolist()
            prompts.append(passage + passage[: input_len // 4])
        else:
            prompts.append(rng.integers(3, vocab_size, input_len).tolist())
    return prompts


def spec_configs(args: argparse.Namespace, draft_dir: Path | None, model_dir: Path) -> dict[str, dict[str, Any] | None]:
    configs: dict[str, dict[str, Any] | None] = {}
    for m in args.methods.split(","):
        if m == "none":
            configs[m] = None
        elif m == "ngram":
            configs[m] = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.prompt_lookup_max,
                          "prompt_lookup_min": args.prompt_lookup_min}
        elif m == "shallow":
            configs[m] = {"model": str(draft_dir), "num_speculative_tokens": args.k}
        elif m == "self":
            configs[m] = {"model": str(model_dir), "num_speculative_tokens": args.k}
    for i, text in enumerate(args.speculative_config or []):
        configs[f"custom{i}"] = json.loads(text)
    return configs


def run_one(model_dir: Path, spec: dict[str, Any] | None, prompts: list[list[int]], output_len: int,
            llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One engine, one batch of requests all at once (after a short warm-up); its speed and counters."""
    from pagedref import LLM, SamplingParams

    llm = LLM(model=str(model_dir), speculative_config=spec, **llm_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                          ignore_eos=True))
        sync_device(llm_kwargs["device"])
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        sync_device(llm_kwargs["device"])
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != output_len * len(prompts):
            raise RuntimeError(f"generated {produced} tokens, {output_len * len(prompts)} were asked for")
        if not llm.llm_engine.block_manager.all_free():  # every rolled-back draft slot and finished block returned
            raise RuntimeError("blocks are still held after every request finished")
        stats = llm.get_stats()
        return {"elapsed_s": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
                "steps": stats["num_steps"], "acceptance_rate": stats["spec_acceptance_rate"],
                "mean_accepted_length": stats["spec_mean_accepted_length"],
                "draft_tokens": stats["spec_num_draft_tokens"], "accepted_tokens": stats["spec_num_accepted_tokens"],
                "outputs": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.close()
        del llm
        free_device(llm_kwargs["device"])


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'batch':>5} {'method':<10} {'out tok/s':>10} {'vs none':>8} {'steps':>7} {'accept':>7} {'tok/step':>8}  note"
    lines = [head, "-" * len(head)]
    base = {r["batch"]: r["output_tokens_per_s"] for r in rows if r["method"] == "none" and not r.get("skipped")}
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['batch']:>5} {r['method']:<10} skipped: {r['skipped']}")
            continue
        ratio = f"{r['output_tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
        spec = r["method"] != "none" and r["draft_tokens"] > 0  # a proposer that never found a draft: plain decodes
        accept = f"{r['acceptance_rate']:.1%}" if spec else "-"
        per_step = f"{r['mean_accepted_length']:.2f}" if spec else "1.00"
        note = r.get("note", "") or ("no draft proposed" if r["method"] != "none" and not spec else "")
        lines.append(f"{r['batch']:>5} {r['method']:<10} {r['output_tokens_per_s']:>10.1f} {ratio:>8} {r['steps']:>7} "
                     f"{accept:>7} {per_step:>8}  {note}")
    return "\n".join(lines)


def print_report(doc: dict[str, Any]) -> None:
    env, w = doc["environment"], doc["workload"]
    print(f"\nspec: {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    print(f"{doc['model']}: {w['workload']} prompts of {w['input_len']} tokens, {w['output_len']} greedy output tokens each, "
          f"k = {w['k']} (tok/step: tokens emitted per speculative step of a sequence, the target's own included)")
    print(format_table(doc["results"]))


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = [r for r in doc["results"] if not r.get("skipped")]
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [next((r["output_tokens_per_s"] for r in rows if r["batch"] == b and r["method"] == m), 0) for b in batches]
        ax.bar(np.arange(len(batches)) + i * width, vals, width, label=m)
    ax.set_xticks(np.arange(len(batches)) + width * (len(methods) - 1) / 2, [f"batch {b}" for b in batches])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{doc['model']}, {doc['workload']['workload']} workload ({doc['environment'].get('gpu', 'cpu')})",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedref.bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default=None, help=f"{'|'.join(SHAPES)} (random weights; default llama-3.2-1b on "
                                                        "cuda, tiny on cpu)")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint directory instead of a random shape")
    p.add_argument("--workload", choices=WORKLOADS, default="copy")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated: requests run at once")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="one more configuration to run (vLLM's speculative_config keys; repeatable)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the methods above")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=None, help="the shallow draft's layers (default: 1/8 of the "
                                                                   "target's, at least 1)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 512 on cuda, 64 on cpu)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 256 on cuda, 32 on cpu)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the KV pool (default: sized by the engine)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the random-weight checkpoints (and the shallow draft) are written once and reused")
    add_output_flags(p, "output tokens/s per method and batch size")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_or_replay(parser, argv, print_report, plot)
    if args is None:
        return 0
    from pagedref.engine.config import SpeculativeConfig
    from pagedref.generate import resolve_device

    device = resolve_device(args.device, parser)
    for m in args.methods.split(","):
        if m not in METHODS:
            parser.error(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    for flag, value in (("--batch-sizes", min(batches)), ("--k", args.k)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    for text in args.speculative_config or []:
        try:
            SpeculativeConfig.from_dict(json.loads(text))
        except (ValueError, TypeError) as err:  # (json.JSONDecodeError is a ValueError)
            parser.error(f"--speculative-config {text}: {err}")
    log = progress
    input_len = args.input_len or (512 if device == "cuda" else 64)
    output_len = args.output_len or (256 if device == "cuda" else 32)
    if args.model is not None:
        model_dir, name = args.model, str(args.model)
    else:
        name = args.model_shape or ("llama-3.2-1b" if device == "cuda" else "tiny")
        if name not in SHAPES:
            parser.error(f"--model-shape {name!r}: choose from {', '.join(SHAPES)}")
        model_dir = random_model_dir(name, args.model_dir, device, seed=args.seed, log=log)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    draft_dir = None
    if "shallow" in args.methods.split(","):
        layers = args.draft_layers or max(1, config["num_hidden_layers"] // 8)
        draft_dir = shallow_draft(model_dir, layers, Path(args.model_dir) / f"{Path(model_dir).name}-first{layers}layers")
    configs = spec_configs(args, draft_dir, Path(model_dir))
    dtype = "bfloat16" if device == "cuda" else "float32"
    max_model_len = input_len + output_len + args.k + 1
    # at most the largest batch at once; CUDA graphs for its decode steps, and piecewise ones up to its speculative
    # steps' k + 1 rows a sequence (capturing the defaults' 1024 sequences and 2048 tokens would take longer than the run)
    llm_kwargs = dict(device=device, dtype=dtype, max_model_len=max_model_len, num_kv_blocks=args.num_kv_blocks,
                      enforce_eager=args.enforce_eager, enable_prefix_caching=False, max_num_seqs=max(batches),
                      max_capture_size=max(256, max(batches) * (args.k + 1)))
    doc = {"benchmark": "spec", "command": "python -m pagedref.bench spec " + " ".join(argv if argv is not None else sys.argv[1:]),
           "environment": environment(device), "model": name,
           "workload": {"workload": args.workload, "input_len": input_len, "output_len": output_len, "k": args.k,
                        "draft_layers": None if draft_dir is None else json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"]},
           "results": []}
    for batch in batches:
        prompts = make_prompts(args.workload, batch, input_len, config["vocab_size"], args.seed)
        reference = None
        for method, spec in configs.items():
            log(f"[spec] batch {batch}: {method}")
            try:
                row = run_one(Path(model_dir), spec, prompts, output_len, llm_kwargs)
                outputs = row.pop("outputs")
                if reference is None:
                    reference = outputs
                if device == "cpu" and outputs != reference:  # the CPU's greedy is exact; a GPU's agrees to rounding
                    raise RuntimeError("greedy outputs differ from the first method's (the CPU promises bit equality)")
                row["note"] = "" if outputs == reference else "outputs differ from none's (bf16 rounding)"
            except Exception as err:  # keep the other methods' numbers (a GPU run is expensive)
                log(f"[spec] {method} failed: {type(err).__name__}: {err}")
                row = {"skipped": f"{type(err).__name__}: {err}"}
                free_device(device)
            doc["results"].append({"batch": batch, "method": method, "config": spec, **row})
            if args.json_out:
                args.json_out.write_text(json.dumps(doc, indent=2))
    emit(doc, args, print_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
