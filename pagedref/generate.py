"""`python -m pagedref.generate`: the command people run first — offline batched generation, vLLM's flags.

One idea: parse vLLM's flags into one `LLM` and one `SamplingParams` per prompt, feed every request to
the engine at once (continuous batching does the rest), print each completion, then a summary of what
the paged KV cache did: peak blocks in use, the share of KV memory holding token states, blocks shared
between the samples of one prompt, preemptions.

Invariant: nothing runs before every input is checked. A bad flag, a missing or malformed prompts file,
an unknown sampling field or a model that cannot be found is an argparse-style error that names it
(exit status 2), raised before a weight is loaded.

    python -m pagedref.generate                          # the embedded default model, its default prompts
    python -m pagedref.generate --model tests/models/stories260K --prompt "Once upon a time" \\
        --temperature 0 --max-tokens 200
    python -m pagedref.generate --prompts-file prompts.jsonl --json
    python -m pagedref.generate --tensor-parallel-size 2   # the model split over 2 processes (GPUs on cuda)
    python -m pagedref.generate --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedref import DEFAULT_MODEL

# With no prompt given: openings from the embedded model's own corpus (it has memorised its lessons).
# The first is sampled three times (n=3): it ends where the stage READMEs differ, so each sample picks
# a stage and follows it, and it is longer than one block, so its full block stays shared by the
# three sequences (only the partly filled last block is copied on write): the summary shows it.
DEFAULT_PROMPTS: list[dict[str, Any]] = [
    {"prompt": "## The tests, step by step\n\n`pytest stages -m stage", "n": 3, "temperature": 0.8, "top_k": 4},
    {"prompt": "# Stage 4", "temperature": 0.0},
    {"prompt": "# Stage 6", "temperature": 0.0},
]

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name": what the Hub accepts as a repo id


# ------------------------------------------------------------------------------------------ arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedref.generate",
        description="Offline batched generation with pagedref (vLLM's flags). "
        "With no --model: the small model embedded in the package, on its default prompts.",
    )
    add_engine_args(p)
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    src.add_argument("--prompts-file", type=Path, default=None, help=".txt (one prompt a line) or .jsonl ({\"prompt\": ..., sampling fields})")
    s = p.add_argument_group("sampling (SamplingParams; a .jsonl line's own fields win)")
    s.add_argument("--max-tokens", type=int, default=None, help="tokens to generate per completion (default 64)")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.8)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 0.95)")
    s.add_argument("--top-k", type=int, default=None, help="-1 = off (default)")
    s.add_argument("-n", type=int, default=None, help="completions per prompt (default 1); they share the prompt's blocks")
    s.add_argument("--seed", type=int, default=0, help="request i is seeded with seed + 1000 i: reproducible whatever the batch")
    p.add_argument("--json", action="store_true", help="print one JSON document (completions and summary) instead of text")
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and the engine's flags (`LLM(...)`'s, vLLM's names): this command's and `pagedref.serve`'s."""
    p.add_argument("--model", default=None, help="a local Hugging Face model directory, or a Hub id (needs huggingface_hub, online)")
    e = p.add_argument_group("engine (LLM)")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = cuda when a GPU and cupy are present")
    e.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto", help="auto = float32 on the CPU, the checkpoint's on CUDA")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="issue every step's launches eagerly instead of replaying CUDA graphs (cuda, one GPU; "
                        "the CPU and tensor parallelism always run eagerly)")
    e.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes (N GPUs on cuda; gloo processes on the CPU)")
    e.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the KV pool in blocks, instead of sizing it from memory (vLLM's --num-gpu-blocks-override; "
                        "the serving benchmarks fix it so that every system gets the same pool)")
    e.add_argument("--weight-gemm", choices=("torch", "pagedref"), default="torch",
                   help="who runs the projections on CUDA: torch (cuBLAS) or pagedref (gate/up with SiLU fused, and "
                        "down, on the project's Hopper GEMM; sm_90 only; faster at a 256-row decode step, slower for "
                        "big batches: docs/benchmarks.md)")
    e.add_argument("--speculative-config", type=str, default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 3}' or '{\"model\": DRAFT_DIR, \"num_speculative_tokens\": 3}'")


def check_engine_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine flags' values the engine would refuse, refused here with the flag's own name."""
    positive = {"--block-size": args.block_size, "--max-model-len": args.max_model_len, "--max-num-seqs": args.max_num_seqs,
                "--max-num-batched-tokens": args.max_num_batched_tokens,
                "--tensor-parallel-size": args.tensor_parallel_size, "--num-kv-blocks": args.num_kv_blocks}
    require_positive(parser, positive)
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    args.speculative_config = parse_speculative_config(parser, args.speculative_config)


def require_positive(parser: argparse.ArgumentParser, values: dict[str, int | None]) -> None:
    """Each flag given (not None) is at least 1, or its usage error names it."""
    for flag, value in values.items():
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")


def parse_speculative_config(parser: argparse.ArgumentParser, text: str | dict | None) -> dict[str, Any] | None:
    """--speculative-config's JSON, its keys and values checked (`SpeculativeConfig`), before any weight is loaded."""
    if text is None or isinstance(text, dict):
        return text
    from pagedref.engine.config import SpeculativeConfig

    try:
        config = json.loads(text)
        SpeculativeConfig.from_dict(config)
    except json.JSONDecodeError as err:
        parser.error(f"--speculative-config: not JSON ({err})")
    except (TypeError, ValueError) as err:
        parser.error(f"--speculative-config: {err}")
    return config


def engine_kwargs(args: argparse.Namespace, model_dir: Path, device: str) -> dict[str, Any]:
    """`LLM(...)`'s keywords from the engine flags (`add_engine_args`), with the model and device resolved."""
    return dict(model=str(model_dir), device=device, dtype=args.dtype, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
                enable_prefix_caching=args.enable_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
                num_kv_blocks=args.num_kv_blocks, tensor_parallel_size=args.tensor_parallel_size,
                enforce_eager=args.enforce_eager, speculative_config=args.speculative_config,
                weight_gemm=args.weight_gemm)


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag values the engine would refuse, refused here with the flag's own name."""
    check_engine_ranges(parser, args)
    require_positive(parser, {"--max-tokens": args.max_tokens, "-n": args.n})
    if args.temperature is not None and args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1 and args.top_k != -1:
        parser.error(f"--top-k must be -1 (off) or >= 1, got {args.top_k}")


# -------------------------------------------------------------------------------------------- prompts


@dataclass
class PromptSpec:
    prompt: str
    fields: dict[str, Any] = field(default_factory=dict)  # sampling fields set for this prompt alone
    where: str = ""  # "file:line", for error messages


def read_prompts_file(parser: argparse.ArgumentParser, path: Path) -> list[PromptSpec]:
    """.txt: one prompt a line (blank lines skipped). .jsonl: {"prompt": str, <sampling fields>} a line."""
    if not path.is_file():
        parser.error(f"--prompts-file {path}: no such file")
    if path.suffix not in (".txt", ".jsonl"):
        parser.error(f"--prompts-file {path}: expected a .txt or .jsonl file, got {path.suffix or 'no suffix'!r}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        parser.error(f"--prompts-file {path}: not UTF-8 text ({err})")
    specs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        if path.suffix == ".txt":
            specs.append(PromptSpec(line, where=where))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            parser.error(f"--prompts-file {where}:{err.colno}: invalid JSON at line {lineno}, column {err.colno} ({err.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            parser.error(f"--prompts-file {where}: each line must be an object with a string \"prompt\"")
        fields = {k: v for k, v in obj.items() if k != "prompt"}
        check_fields(parser, fields, where)
        specs.append(PromptSpec(obj["prompt"], fields, where))
    if not specs:
        parser.error(f"--prompts-file {path}: no prompts in it")
    return specs


def check_fields(parser: argparse.ArgumentParser, fields: dict[str, Any], where: str) -> None:
    """Only SamplingParams' own field names (their values are checked by SamplingParams itself)."""
    from dataclasses import fields as dataclass_fields

    from pagedref import SamplingParams

    known = [f.name for f in dataclass_fields(SamplingParams)]
    for key in fields:
        if key not in known:
            parser.error(f"--prompts-file {where}: unknown field {key!r} (known: prompt, {', '.join(known)})")


def gather_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[PromptSpec], bool]:
    """(prompts, whether they are the defaults): --prompt ones first, then the file's."""
    specs = [PromptSpec(p, where=f"--prompt #{i + 1}") for i, p in enumerate(args.prompt or [])]
    if args.prompts_file is not None:
        specs += read_prompts_file(parser, args.prompts_file)
    if specs:
        return specs, False
    return [PromptSpec(d["prompt"], {k: v for k, v in d.items() if k != "prompt"}, "default") for d in DEFAULT_PROMPTS], True


def sampling_fields(args: argparse.Namespace, spec: PromptSpec, index: int, is_default: bool) -> dict[str, Any]:
    """SamplingParams keywords for prompt `index`: built-in defaults < default prompt < flags < .jsonl line."""
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "n": args.n}
    given = {k: v for k, v in flags.items() if v is not None}
    # Request i's seed is seed + 1000 i; its n samples use seed + 1000 i + j (the engine adds j), so no two
    # sequences share a random stream while n <= 1000.
    base = {"max_tokens": 64, "temperature": 0.8, "top_p": 0.95, "top_k": -1, "n": 1, "seed": args.seed + 1000 * index}
    if is_default:  # a default prompt's fields are suggestions: any flag given overrides them
        return {**base, **spec.fields, **given}
    return {**base, **given, **spec.fields}


# ------------------------------------------------------------------------------------- model + device


def resolve_device(name: str, parser: argparse.ArgumentParser | None = None) -> str:
    """auto -> "cuda" when torch sees a GPU and cupy (the kernels' runtime) works, else "cpu" (the
    engine's own rule: `pagedref.engine.config.resolve_device`). With a parser, an explicit "cuda" that
    torch cannot see is its usage error."""
    from pagedref.engine.config import resolve_device as engine_device

    try:
        return engine_device(name)
    except ValueError as err:
        if parser is None:
            raise
        parser.error(f"--device {name}: {err}")


def resolve_model(parser: argparse.ArgumentParser, model: str | None) -> Path:
    """A local directory as it is; a Hub id fetched with huggingface_hub; None -> the embedded default."""
    if model is None:
        if not (DEFAULT_MODEL / "config.json").is_file():
            parser.error(f"the embedded default model is missing from {DEFAULT_MODEL}: run `python -m pagedref.train_default`")
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            parser.error(f"--model {model}: not a model directory (expected config.json, model.safetensors, tokenizer.json in it)")
        return path
    if not HF_ID.match(model):
        parser.error(f"--model {model}: no such directory, and not a Hugging Face id of the form org/name")
    return fetch_from_hub(parser, model)


def fetch_from_hub(parser: argparse.ArgumentParser, repo_id: str) -> Path:
    how = (f"download it where you are online (e.g. `huggingface-cli download {repo_id} --local-dir DIR`) "
           "and pass --model DIR, a local directory holding config.json, *.safetensors and tokenizer.json")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        parser.error(f"--model {repo_id}: no local directory of that name, and huggingface_hub is not installed to fetch it; {how}")
    patterns = ["*.json", "*.safetensors", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # offline, no such repo, gated, ...: every one ends the same way
        parser.error(f"--model {repo_id}: could not fetch it from the Hugging Face Hub ({type(err).__name__}: {err}); {how}")


# ----------------------------------------------------------------------------------------------- output


def summarize(stats: dict[str, Any], num_requests: int, elapsed: float) -> dict[str, Any]:
    """The run in numbers, from `LLM.get_stats()` (counted since this `generate` began)."""
    generated = stats["num_generated_tokens"]
    return {
        "requests": num_requests,
        "prompt_tokens": stats["num_prompt_tokens"],
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
        "num_kv_blocks": stats["num_blocks"],
        "block_size": stats["block_size"],
        "peak_kv_blocks_used": stats["peak_num_used_blocks"],
        "token_state_share_mean": stats["token_state_fraction_mean"],
        "token_state_share_peak": stats["token_state_fraction_peak"],
        "peak_shared_blocks": stats["peak_blocks_saved_by_sharing"],
        "peak_running_seqs": stats["peak_num_running_seqs"],
        "preemptions": stats["num_preemptions"],
        "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
        "steps": stats["num_steps"],
        "spec_num_draft_tokens": stats.get("spec_num_draft_tokens", 0),
        "spec_num_accepted_tokens": stats.get("spec_num_accepted_tokens", 0),
        "spec_acceptance_rate": stats.get("spec_acceptance_rate", 0.0),
        "spec_mean_accepted_length": stats.get("spec_mean_accepted_length", 0.0),
    }


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("generated tokens", f"{s['generated_tokens']} in {s['elapsed_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s"),
        ("peak KV blocks in use", f"{s['peak_kv_blocks_used']} of {s['num_kv_blocks']} (block_size {s['block_size']})"),
        ("token-state share of KV memory", f"{s['token_state_share_mean']:.1%} mean, {s['token_state_share_peak']:.1%} peak "
                                           "(the rest: the unfilled tail of each sequence's last block)"),
        ("shared blocks (peak)", f"{s['peak_shared_blocks']} block references served by shared blocks (n > 1 forks, prefix cache)"),
        ("peak running sequences", f"{s['peak_running_seqs']} over {s['steps']} steps"),
        ("preemptions", f"{s['preemptions']}"),
    ]
    if s.get("spec_num_draft_tokens"):  # speculative decoding (--speculative-config)
        rows.append(("speculative decoding", f"{s['spec_acceptance_rate']:.1%} of {s['spec_num_draft_tokens']} draft tokens "
                                             f"accepted, {s['spec_mean_accepted_length']:.2f} tokens per speculative step"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def to_json(outputs, summary: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        **meta,
        "requests": [
            {
                "prompt": out.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "completions": [
                    {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in out.outputs
                ],
            }
            for out in outputs
        ],
        "summary": summary,
    }


def print_completions(outputs) -> None:
    for i, out in enumerate(outputs):
        n = len(out.outputs)
        print(f"=== prompt {i + 1}/{len(outputs)}: {out.prompt!r} ({len(out.prompt_token_ids)} tokens)"
              + (f", {n} completions sharing its blocks" if n > 1 else "") + " ===")
        for c in out.outputs:
            if n > 1:
                print(f"--- completion {c.index + 1}/{n} ---")
            print(f"{out.prompt}{c.text}")
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
        print()


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_ranges(parser, args)
    specs, is_default = gather_prompts(parser, args)
    model_dir = resolve_model(parser, args.model)
    device = resolve_device(args.device, parser)

    from pagedref import LLM, SamplingParams

    params = []
    for i, spec in enumerate(specs):  # SamplingParams checks every value: a bad one is named with its line
        try:
            params.append(SamplingParams(**sampling_fields(args, spec, i, is_default)))
        except (TypeError, ValueError) as err:
            parser.error(f"{spec.where}: {err}")
    try:  # the engine refuses bad settings and prompts (too long, empty) before any work is scheduled
        llm = LLM(**engine_kwargs(args, model_dir, device), seed=args.seed)
        start = time.perf_counter()
        outputs = llm.generate([s.prompt for s in specs], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    except (TypeError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    stats = llm.get_stats()
    dtype = stats["dtype"]  # "auto" as the engine resolved it
    summary = summarize(stats, len(specs), elapsed)
    llm.close()  # frees the KV cache; with --tensor-parallel-size, stops the worker processes
    if args.json:
        meta = {"model": str(model_dir), "device": device, "dtype": dtype}
        print(json.dumps(to_json(outputs, summary, meta), indent=2, ensure_ascii=False))
    else:
        print_completions(outputs)
        print(f"model {model_dir} on {device} ({dtype})")
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
