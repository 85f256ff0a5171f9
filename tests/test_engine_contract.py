"""The step contract (docs/architecture.md, pagedref/engine/scheduler.py), checked on the code itself.

- One writer: a sequence's computed count and placeholders, the scheduler's queues and a sequence's
  token list are written only by the Scheduler (and Sequence itself): found by walking every module's AST.
- The slot mapping is computed once, by the memory layer: the runner copies what the scheduler handed
  over, and an admission looks its prompt up in the prefix cache once.
- No import cycles: between modules (every import, lazy ones included) and between pagedref's packages;
  the modules that used to make one import first in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedref.engine.block_manager import BlockManager
from pagedref.engine.model_runner import ModelRunner
from pagedref.engine.sampling import SamplerOutput, SamplingParams
from pagedref.engine.scheduler import Scheduler, SchedulerConfig
from pagedref.engine.sequence import Sequence

PACKAGE = Path(__file__).resolve().parents[1] / "pagedref"
WRITERS = {"pagedref/engine/scheduler.py", "pagedref/engine/sequence.py"}
STATE = {"num_computed_tokens", "num_placeholders"}  # a sequence's counts: assigned only by the writers
QUEUES = {"running", "waiting", "swapped"}  # the scheduler's queues: mutated only by the writers
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "remove", "pop", "popleft", "clear"}


def modules() -> dict[str, Path]:
    """Every module of pagedref by dotted name (a package by its __init__.py)."""
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every write of the guarded state in a module."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in STATE:
                    found.append((node.lineno, f".{sub.attr} assigned"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in QUEUES:
                found.append((node.lineno, f".{owner.attr}.{node.func.attr}()"))
            if isinstance(owner, ast.Attribute) and owner.attr == "token_ids":
                found.append((node.lineno, f".token_ids.{node.func.attr}()"))
    return found


def test_the_writing_rule_sees_the_writes_it_guards():
    tree = ast.parse("seq.num_computed_tokens += 1\nscheduler.running.append(s)\nseq.num_placeholders = 0\n"
                     "self.waiting.appendleft(s)\nseq.token_ids.append(7)\nx = seq.num_computed_tokens\n")
    assert sorted(writes(tree)) == [(1, ".num_computed_tokens assigned"), (2, ".running.append()"),
                                    (3, ".num_placeholders assigned"), (4, ".waiting.appendleft()"), (5, ".token_ids.append()")]


def test_sequence_state_is_written_only_by_the_scheduler():
    offenders = []
    for name, path in modules().items():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel in WRITERS:
            continue
        for line, what in writes(ast.parse(path.read_text())):
            # the memory layer's own lists (a block table's token ids, KVCacheManager's sequences) are its own state
            if what.startswith(".token_ids") and not rel.startswith("pagedref/engine/"):
                continue
            offenders.append(f"{rel}:{line}: {what}")
    assert not offenders, "only the Scheduler (and Sequence) may write a sequence's state:\n" + "\n".join(offenders)


# --- the slot mapping: computed once, where the memory layer computes it ----------------------------------
def make_scheduler(caching: bool = False):
    bm = BlockManager(32, 4, max_model_len=64, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(8, 64, True), bm)


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", list(tokens), len(tokens), SamplingParams(temperature=0.0, max_tokens=50))


def test_the_runner_uses_the_slots_the_block_manager_returned(monkeypatch):
    s = make_scheduler()
    given = []
    real = s.block_manager.kv.append_slots

    def append_slots(seq_id, token_ids):  # what the memory layer returns, recorded
        slots, copies = real(seq_id, token_ids)
        given.append(list(slots))
        return slots, copies

    monkeypatch.setattr(s.block_manager.kv, "append_slots", append_slots)
    for i, n in enumerate((5, 9, 1)):
        s.add(seq(i, range(100 * i, 100 * i + n)))
    s.update(s.schedule(), SamplerOutput([7, 7, 7]))
    out = s.schedule()  # three decodes: their slots come from append_slots, once each
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)
    runner = ModelRunner(SimpleNamespace(config=config), None, 32, 4, "cpu", torch.float32)
    assert [e.slot_mapping for e in out.scheduled] == given[-3:]
    assert runner.prepare(out).meta.slot_mapping.tolist() == sum(given[-3:], []), "the runner recomputes nothing"


def test_one_admission_looks_the_prompt_up_in_the_prefix_cache_once(monkeypatch):
    s = make_scheduler(caching=True)
    system = list(range(100, 112))
    s.add(seq(0, system + [1, 2]))
    s.update(s.schedule(), SamplerOutput([7]))
    calls = []
    real = s.block_manager.kv.lookup
    monkeypatch.setattr(s.block_manager.kv, "lookup", lambda tokens: calls.append(1) or real(tokens))
    s.add(seq(1, system + [3]))
    out = s.schedule()
    assert out.scheduled[-1].num_computed_tokens == 12, "a prefix-cache hit of 3 blocks"
    assert len(calls) == 1, f"one admission, {len(calls)} prefix lookups"


def test_requests_by_state_for_the_servers_metrics():
    s = make_scheduler()
    for i in range(3):
        s.add(seq(i, [1, 2, 3]))
    assert s.num_requests() == {"running": 0, "swapped": 0, "waiting": 3}
    s.schedule()
    assert s.num_requests() == {"running": 3, "swapped": 0, "waiting": 0}


# --- no import cycles ----------------------------------------------------------------------------------
def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pagedref modules a module imports, anywhere in it (lazy and TYPE_CHECKING imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in found if m in known and m not in (name, "pagedref")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules_or_packages():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items() if name != "pagedref"}
    assert cycles(graph) == [], "modules that import each other (directly or round a loop)"
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731  pagedref.engine.llm -> pagedref.engine
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        packages.setdefault(top(name), set()).update(top(d) for d in deps if top(d) != top(name))
    assert cycles(packages) == [], "packages of pagedref that import each other (directly or round a loop)"


@pytest.mark.parametrize("module", ["pagedref.engine.sequence", "pagedref.engine.sampling", "pagedref.engine.scheduler",
                                    "pagedref.engine.config", "pagedref.distributed.worker", "pagedref.bench.step"])
def test_each_former_cycle_member_imports_first_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
