"""Train the embedded default model: a small Llama on this project's own text, reproducibly, on a CPU.

One idea: the model that `python -m pagedref.generate` runs out of the box is a real trained model, and
this script is how it came to be. It reads the text the project owns (the markdown of `docs/`, the
stages' READMEs, README.md and the module docstrings of `pagedref/`), trains a byte-level BPE tokenizer
on it with `tokenizers`, then trains a 4-layer grouped-query-attention Llama with the model package's
own `LlamaForCausalLM.forward_train` (there is no second model implementation), and saves a Hugging
Face directory that `pagedref.models.load_model` loads like any other checkpoint.

Invariant: the checkpoint is a function of (corpus, seed, hyperparameters, torch version, thread
count). The corpus is collected in sorted path order and its sha256 is recorded in TRAINING.md beside
the weights; the data order comes from a seeded generator; the thread count is fixed (2).

    python -m pagedref.train_default                    # writes pagedref/assets/default-model
    python -m pagedref.train_default --steps 20 --out /tmp/m   # a quick run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedref import DEFAULT_MODEL as DEFAULT_OUT
from pagedref.models import LlamaForCausalLM, ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
BOS, EOS = "<s>", "</s>"  # ids 0 and 1: the trainer puts special tokens first


@dataclass(frozen=True)
class TrainConfig:
    # model (float32 weights: ~0.72 M parameters, ~2.9 MB of safetensors)
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # head_dim 32
    num_key_value_heads: int = 2  # GQA, 2 query heads per KV head
    max_position_embeddings: int = 256  # = the training window: positions beyond it were never trained
    # optimisation
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    init_std: float = 0.02
    seed: int = 0
    threads: int = 2


# ---------------------------------------------------------------------------------------------- corpus


def corpus_files(root: Path) -> list[Path]:
    """The project's own text, in sorted path order: docs/**/*.md, stages/*/README.md, README.md, pagedref/**/*.py."""
    found = set(root.glob("docs/**/*.md")) | set(root.glob("stages/*/README.md")) | set(root.glob("pagedref/**/*.py"))
    if (root / "README.md").is_file():
        found.add(root / "README.md")
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def prose(markdown: str) -> str:
    """The prose of a markdown text: without fenced code blocks, table rows, images and HTML comments, whose tokens
    (numbers, identifiers, pipes) a model this small would otherwise mix into every sentence."""
    lines, in_code = [], False
    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
            continue
        if in_code or stripped.startswith(("|", "![", "<!--")):
            continue
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def collect_corpus(root: Path) -> list[tuple[str, str]]:
    """[(relative path, text)]: the prose of each markdown file and of each Python module's docstring."""
    docs = []
    for path in corpus_files(root):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            text = ast.get_docstring(ast.parse(text), clean=True) or ""
        text = prose(text)
        if text.strip():
            docs.append((path.relative_to(root).as_posix(), text.strip() + "\n"))
    if not docs:
        raise FileNotFoundError(f"no corpus text under {root}: expected docs/, stages/*/README.md, README.md, pagedref/")
    return docs


def corpus_sha256(docs: list[tuple[str, str]]) -> str:
    """One hash over every (path, text) pair, in order: changes when any file, name or the order changes."""
    h = hashlib.sha256()
    for path, text in docs:
        h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2's scheme): any text encodes, nothing is unknown; <s> is prepended on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # BOS added by the post-processor, so `encode(text)` gives [<s>, ...] as Llama's tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


@dataclass
class TokenStream:
    ids: torch.Tensor  # [N] int64: every document's tokens followed by </s> (the model learns where a text ends)
    doc_starts: torch.Tensor  # [D] int64: where each document begins in ids

    def __len__(self) -> int:
        return len(self.ids)


def token_stream(tok: Tokenizer, texts: list[str]) -> TokenStream:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(enc.ids)
        ids.append(eos)
    return TokenStream(torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64))


def sample_batch(data: TokenStream, bos: int, batch_size: int, seq_len: int, gen: torch.Generator):
    """Windows led by <s>, as a prompt is: inputs [B, T], targets [B, T] (inputs shifted by one).

    A window starts anywhere, or (one in four) at a document's beginning, so that <s> followed by a
    document's first words (a title, a docstring's opening) is seen as often as a prompt will show it."""
    last = len(data) - seq_len
    starts = torch.randint(0, last, (batch_size,), generator=gen)
    at_doc = torch.rand(batch_size, generator=gen) < 0.25
    doc = data.doc_starts[torch.randint(0, len(data.doc_starts), (batch_size,), generator=gen)].clamp(max=last - 1)
    starts = torch.where(at_doc, doc, starts)
    body = torch.stack([data.ids[s : s + seq_len] for s in starts.tolist()])  # [B, T]
    window = torch.cat([torch.full((batch_size, 1), bos, dtype=torch.int64), body], dim=1)  # [B, T + 1]
    return window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------ model


def hf_config(tc: TrainConfig, bos: int, eos: int) -> dict:
    """config.json in transformers' Llama layout: the project's loader (and transformers) read it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tc.vocab_size,
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": tc.num_hidden_layers,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.hidden_size // tc.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": tc.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": tc.init_std,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def build_model(config: dict, init_std: float) -> LlamaForCausalLM:
    """The project's Llama, batched (training needs no batch invariance), initialised as transformers does."""
    model = LlamaForCausalLM(ModelConfig.from_dict(config), dtype=torch.float32, batch_invariant=False)
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=init_std)
    return model.train()


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay from lr to min_lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def lm_loss(model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.forward_train(inputs)  # [B, T, vocab] float32
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    loss = sum(lm_loss(model, x, y).item() for x, y in batches) / len(batches)
    model.train()
    return loss


@dataclass
class TrainResult:
    initial_eval_loss: float
    final_eval_loss: float
    final_train_loss: float  # mean over the last 20 steps
    losses: list[float]  # training loss of every step
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time of this process (both threads): steadier than wall time on a shared machine
    num_parameters: int
    corpus_tokens: int


def train(model: LlamaForCausalLM, stream: TokenStream, bos: int, tc: TrainConfig, log=print) -> TrainResult:
    gen = torch.Generator().manual_seed(tc.seed)  # the data order: one seeded generator, nothing else
    eval_gen = torch.Generator().manual_seed(tc.seed + 1)
    eval_batches = [sample_batch(stream, bos, tc.batch_size, tc.seq_len, eval_gen) for _ in range(4)]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]  # matrices decay; norm gains do not
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )
    initial = eval_loss(model, eval_batches)
    log(f"initial eval loss {initial:.4f} (ln vocab = {math.log(tc.vocab_size):.4f})")
    losses: list[float] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for step in range(tc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = sample_batch(stream, bos, tc.batch_size, tc.seq_len, gen)
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == tc.steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, tc):.2e}  {time.perf_counter() - t0:6.1f}s")
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    final = eval_loss(model, eval_batches)
    log(f"final eval loss {final:.4f} after {tc.steps} steps in {seconds:.1f}s")
    tail = losses[-20:]
    return TrainResult(
        initial_eval_loss=initial,
        final_eval_loss=final,
        final_train_loss=sum(tail) / len(tail),
        losses=losses,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        num_parameters=sum(p.numel() for p in model.parameters()),
        corpus_tokens=len(stream),
    )


# ------------------------------------------------------------------------------------------------- save


def save_checkpoint(out: Path, model: LlamaForCausalLM, tok: Tokenizer, config: dict) -> None:
    """Hugging Face layout: config.json, generation_config.json, model.safetensors, tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight")  # tied to model.embed_tokens.weight: stored once, as transformers does
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes it owner-only; it is package data
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"bos_token": BOS, "eos_token": EOS, "model_max_length": config["max_position_embeddings"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def write_training_md(out: Path, tc: TrainConfig, docs: list[tuple[str, str]], sha: str, res: TrainResult) -> None:
    size = (out / "model.safetensors").stat().st_size
    curve = ", ".join(f"{res.losses[i]:.3f}" for i in sorted({*range(0, len(res.losses), max(1, len(res.losses) // 10)), len(res.losses) - 1}))
    lines = [
        "# The embedded default model",
        "",
        "A small Llama (`LlamaForCausalLM`) trained on pagedref's own text by `python -m pagedref.train_default`.",
        "It is what `python -m pagedref.generate` runs when no `--model` is given. It has memorised and",
        "recombines the project's lessons: expect readable, on-topic, not always true text.",
        "",
        "## Corpus",
        "",
        f"- {len(docs)} files, {sum(len(t) for _, t in docs):,} characters, {res.corpus_tokens:,} tokens "
        "(each file's tokens followed by `</s>`)",
        "- the markdown of `docs/`, `stages/*/README.md`, `README.md`, and the module docstrings of `pagedref/`,",
        "  collected in sorted path order; of each, its prose (fenced code blocks, table rows and images dropped)",
        f"- sha256 over the (path, text) pairs as trained on: `{sha}`",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE trained with `tokenizers` on the same corpus: vocab {tc.vocab_size}, `<s>` = 0, `</s>` = 1,",
        "ByteLevel pre-tokenizer and decoder, `<s>` prepended by the post-processor.",
        "",
        "## Model and training",
        "",
        "| | |",
        "| --- | --- |",
        f"| parameters | {res.num_parameters:,} (float32; tied embeddings) |",
        f"| model.safetensors | {size:,} bytes |",
        f"| shape | hidden {tc.hidden_size}, {tc.num_hidden_layers} layers, {tc.num_attention_heads} query heads / "
        f"{tc.num_key_value_heads} KV heads (head_dim {tc.hidden_size // tc.num_attention_heads}), SwiGLU {tc.intermediate_size}, "
        f"context {tc.max_position_embeddings} |",
        f"| optimiser | AdamW (0.9, 0.95), lr {tc.lr:g} → {tc.min_lr:g} (warmup {tc.warmup_steps}, cosine), "
        f"weight decay {tc.weight_decay}, grad clip {tc.grad_clip} |",
        f"| data | {tc.steps} steps × {tc.batch_size} windows × {tc.seq_len} tokens, each window led by `<s>`, "
        f"starting anywhere or (one in four) at a document's beginning, drawn by `torch.Generator().manual_seed({tc.seed})` |",
        f"| seed | {tc.seed} (`torch.manual_seed`), {tc.threads} threads |",
        f"| time | {res.seconds:.0f} s wall, {res.cpu_seconds:.0f} s of CPU, on {os.cpu_count()} cores of "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, Python {platform.python_version()} |",
        f"| eval loss (4 fixed batches) | {res.initial_eval_loss:.3f} → {res.final_eval_loss:.3f} |",
        f"| train loss, last 20 steps | {res.final_train_loss:.3f} |",
        "",
        f"Training loss along the run: {curve}.",
        "",
        "The loss is measured on the training text: the point is a model that writes the project's prose, not",
        "one that generalises. Rerun the command above to reproduce the checkpoint; with the same corpus",
        "hash, seed, torch version and thread count the result is the same.",
        "",
        "## Hyperparameters (as passed)",
        "",
        "```json",
        json.dumps(asdict(tc), indent=2),
        "```",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m pagedref.train_default", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root to collect the corpus from")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    return p


def main(argv: list[str] | None = None) -> TrainResult:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a directory")
    d = TrainConfig()
    tc = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_position_embeddings=max(d.max_position_embeddings, args.seq_len),
        lr=args.lr,
        min_lr=args.lr / 10,
        warmup_steps=min(d.warmup_steps, max(1, args.steps // 10)),
        seed=args.seed,
        threads=args.threads,
    )
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)

    try:
        docs = collect_corpus(args.root.resolve())
    except FileNotFoundError as err:
        parser.error(f"--root {args.root}: {err}")
    sha = corpus_sha256(docs)
    texts = [t for _, t in docs]
    tok = train_tokenizer(texts, tc.vocab_size)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    stream = token_stream(tok, texts)
    if len(stream) <= tc.seq_len:
        parser.error(f"the corpus has {len(stream)} tokens, fewer than --seq-len {tc.seq_len}")
    log(f"corpus: {len(docs)} files, {len(stream):,} tokens, sha256 {sha[:16]}…")

    config = hf_config(tc, bos, eos)
    model = build_model(config, tc.init_std)
    result = train(model, stream, bos, tc, log)
    save_checkpoint(args.out, model, tok, config)
    write_training_md(args.out, tc, docs, sha, result)
    size = (args.out / "model.safetensors").stat().st_size
    print(
        f"saved {args.out}: {result.num_parameters:,} parameters, model.safetensors {size:,} bytes, "
        f"eval loss {result.initial_eval_loss:.3f} -> {result.final_eval_loss:.3f}, {result.seconds:.0f}s"
    )
    return result


if __name__ == "__main__":
    main()
