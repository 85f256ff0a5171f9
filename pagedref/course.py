"""The course: its stages, which implementation the stage tests exercise, and learner mode.

One idea: a stage test never imports the module under study directly; it asks `lesson(name)`, which
returns the reference module (`pagedref...`) or, under `pytest stages --impl PKG`, the learner's module
at the same relative path (`PKG...`). So the same tests grade the reference and a learner's package.

`STAGES` is the one list of the stages (number, folder, title, lesson modules); the site, the stage
markers and learner mode all read it. Learner mode, `python -m pagedref.course init DIR`, writes a
skeleton package generated from the reference *source* (its AST), so the two cannot drift: every public
class and function keeps its signature and docstring and gets a body that raises
`NotImplementedError("stage N: implement ...")`; module docstrings, imports, constants, dataclass
fields and exception classes are kept as they are (they are not the lesson). Modules that are not
lessons are not copied: the skeleton imports them from `pagedref` itself.

`init --from-stage N` writes the reference code of the stages before N (its imports pointing at the
learner's package) and skeletons from N on; past the last stage it is a copy of the whole reference,
which `mutants` mutates: each wrong version kept under tests/mutations/ must fail a stage test whose
message names the lesson's rule. `interface` writes each lesson's "The interface" block, generated from
the same docstrings and declarations the skeleton keeps, so the lesson and the skeleton state one text.

Invariant: for every lesson module, the skeleton defines the same public names, with the same
signatures, as the reference; `python -m pagedref.course list` shows the stages.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import enum
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tokenize
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REFERENCE = "pagedref"
REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: stages/ and docs/ live beside pagedref/
_impl = os.environ.get("PAGEDREF_IMPL", REFERENCE)


def set_impl(impl: str) -> None:
    """Select the implementation: a package name, or a path to a package folder."""
    global _impl
    path = Path(impl)
    if path.exists():
        path = path.resolve()
        sys.path.insert(0, str(path.parent))
        impl = path.name
    _impl = impl


def impl_name() -> str:
    return _impl


def pytest_options(parser) -> None:
    """`--impl`, for stages/ and tests/ alike: each conftest calls this (the first one adds it)."""
    try:
        parser.addoption("--impl", default=None, help="package name or path of the implementation to grade")
    except ValueError:  # added already, by the other folder's conftest
        pass


def pytest_setup(config) -> None:
    """Select the implementation `--impl` names, and register the stageN markers."""
    impl = config.getoption("--impl")
    if impl and Path(impl).name != impl_name():
        set_impl(impl)
    for n in range(0, 10):
        config.addinivalue_line("markers", f"stage{n}: tests of course stage {n}")


def lesson(module: str) -> ModuleType:
    """`lesson("pagedref.memory.block_table")` → that module of the implementation under test."""
    if not module.startswith(REFERENCE):
        raise ValueError(f"lesson() takes a pagedref module name, got {module!r}")
    return importlib.import_module(_impl + module[len(REFERENCE):])


@contextlib.contextmanager
def raises(expected: type[BaseException] | tuple[type[BaseException], ...], rule: str, match: str | None = None):
    """`pytest.raises` for the stage tests, whose failure states the lesson's rule:
    `with raises(contig.MaxModelLenError, "stage 1: admit refuses max_len > max_model_len"): ...`.
    `match` is a regex the error's message must contain. A skeleton's NotImplementedError passes
    through unchanged: it names what to write."""
    __tracebackhide__ = True
    names = " or ".join(e.__name__ for e in (expected if isinstance(expected, tuple) else (expected,)))
    try:
        yield
    except NotImplementedError:
        raise
    except expected as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{rule} (a {type(e).__name__} was raised, but its message {str(e)!r} "
                                 f"does not contain {match!r})") from e
        return
    except Exception as e:
        raise AssertionError(f"{rule} (expected {names}, got {type(e).__name__}: {e})") from e
    raise AssertionError(f"{rule} (expected {names}; nothing was raised)")


# --- the stages ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    number: int
    folder: str  # stages/<folder>/ holds the lesson (README.md) and its tests (test_*.py)
    title: str
    modules: tuple[str, ...]  # the lesson modules: what a learner writes in this stage
    # Qualified names ("Scheduler", "Scheduler.schedule") in a module an earlier stage already lists that
    # this stage teaches too; everything else in a shared module belongs to the first stage listing it.
    claims: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        """"01-contiguous-cache": the docs page is docs/stages/<slug>.md."""
        return self.folder.replace("_", "-")

    @property
    def path(self) -> Path:
        return REPO_ROOT / "stages" / self.folder

    @property
    def readme(self) -> Path:
        return self.path / "README.md"

    @property
    def marker(self) -> str:
        return f"stage{self.number}"

    def test_files(self) -> list[Path]:
        return sorted(self.path.glob("test_*.py"))


STAGES: tuple[Stage, ...] = (
    Stage(1, "01_contiguous_cache", "The contiguous KV cache", ("pagedref.memory.contiguous",)),
    Stage(2, "02_block_allocator", "The block allocator", ("pagedref.memory.block_allocator",)),
    Stage(3, "03_block_table", "Block tables and the paged KV cache", ("pagedref.memory.block_table",)),
    Stage(4, "04_sharing", "Sharing: copy-on-write and prefix caching", ("pagedref.memory.sharing",)),
    Stage(5, "05_paged_attention_kernel", "The paged-attention kernels",
          ("pagedref.kernels.splitk", "pagedref.kernels.validate", "pagedref.kernels.build", "pagedref.kernels.launch",
           "pagedref.kernels")),
    Stage(6, "06_continuous_batching", "Continuous batching and preemption",
          ("pagedref.engine.block_manager", "pagedref.engine.scheduler")),
    Stage(7, "07_chunked_prefill", "Chunked prefill", ("pagedref.engine.scheduler",),
          claims=("Scheduler",)),  # stage 7 extends stage 6's Scheduler with the token budget
    Stage(8, "08_speculative_decoding", "Speculative decoding on paged blocks", ("pagedref.engine.spec_decode",)),
)


def stage(number: int) -> Stage:
    for s in STAGES:
        if s.number == number:
            return s
    raise ValueError(f"there is no stage {number}: the stages are {[s.number for s in STAGES]}")


def lesson_modules() -> list[str]:
    """Every lesson module once, in stage order."""
    return list(dict.fromkeys(m for s in STAGES for m in s.modules))


def teachers(module: str, qualname: str) -> list[Stage]:
    """The stages that teach `qualname` of `module`: the first stage listing the module, and every
    later stage listing it that claims the name or its class (stage 7 extends stage 6's Scheduler)."""
    listing = [s for s in STAGES if module in s.modules]
    if not listing:
        raise ValueError(f"{module} is not a lesson module of any stage")
    claimed = [s for s in listing[1:] if any(qualname == c or qualname.startswith(c + ".") for c in s.claims)]
    return [listing[0], *claimed]


def module_path(module: str) -> Path | None:
    """The reference source file of `module` (a package's __init__.py), or None if it is not there."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


# --- learner mode: the skeleton -----------------------------------------------------------------
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kept_whole(obj: object) -> bool:
    """Classes copied as they are: errors, enums, protocols, typed dicts and named tuples."""
    if not isinstance(obj, type):
        return False
    return (issubclass(obj, (BaseException, enum.Enum)) or getattr(obj, "_is_protocol", False)
            or typing.is_typeddict(obj) or (issubclass(obj, tuple) and hasattr(obj, "_fields")))


def _loaded_names(nodes: list[ast.AST]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def _signature_refs(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The parts of a stubbed function that still run: decorators, defaults, annotations."""
    a = fn.args
    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return [*fn.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d),
            *(x.annotation for x in args if x.annotation), *([fn.returns] if fn.returns else [])]


class _Skeleton:
    """Rewrites one lesson module's source into its skeleton by editing line ranges (comments survive).
    With from_stage N, what only stages before N teach stays reference code (imports pointing at the
    learner's package); the rest is stubbed."""

    def __init__(self, module: str, package: str, source: str, reference: ModuleType, from_stage: int = 1):
        self.module, self.package, self.reference = module, package, reference
        self.from_stage = from_stage
        self.stubbed = 0  # functions stubbed: 0 means a copy of the reference
        self.lines = source.splitlines(keepends=True)
        self.tree = ast.parse(source)
        self.relpath = package + "/" + "/".join(module.split(".")[1:]) + (
            "/__init__.py" if Path(reference.__file__).name == "__init__.py" else ".py")
        self.edits: list[tuple[int, int, str]] = []  # (first line, last line) 1-based inclusive → text

    # ---- helpers
    def _written(self, node: ast.stmt, qualname: str) -> bool:
        """Reference code is kept for a definition that only stages before from_stage teach, all of it."""
        if any(s.number >= self.from_stage for s in teachers(self.module, qualname)):
            return False
        return all(self._written(n, f"{qualname}.{n.name}") for n in getattr(node, "body", [])
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    def _keep(self, node: ast.stmt) -> None:
        """Keep a definition's reference code; its imports (of lesson modules) point at the package."""
        for n in ast.walk(node):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                self._rewrite_import(n, self.reference.__package__ or self.module)

    def _start(self, node: ast.stmt) -> int:
        decorators = getattr(node, "decorator_list", [])
        return min([node.lineno, *(d.lineno for d in decorators)])

    def _drop(self, node: ast.stmt) -> None:
        self.edits.append((self._start(node), node.end_lineno, ""))

    def _message(self, qualname: str) -> str:
        stages = teachers(self.module, qualname)
        return (" + ".join(f"stage {s.number}" for s in stages) + f": implement {qualname} in {self.relpath}"
                " — see " + " and ".join(f"stages/{s.folder}/README.md" for s in stages))

    def _header_end(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
        """(line, col) just past the ':' that ends the signature (found with the tokenizer)."""
        text = "".join(self.lines[fn.lineno - 1: fn.end_lineno])
        depth = 0
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP:
                if tok.string in "([{":
                    depth += 1
                elif tok.string in ")]}":
                    depth -= 1
                elif tok.string == ":" and depth == 0:
                    return fn.lineno + tok.end[0] - 1, tok.end[1]
        raise ValueError(f"{self.module}: cannot find the end of the signature of {fn.name}")

    def _stub(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str) -> None:
        end_line, end_col = self._header_end(fn)
        header = "".join(self.lines[self._start(fn) - 1: end_line - 1]) + self.lines[end_line - 1][:end_col]
        first = fn.body[0]
        indent = " " * (first.col_offset if first.lineno > end_line else fn.col_offset + 4)
        body = ""
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            if first.lineno > end_line:
                body = "".join(self.lines[first.lineno - 1: first.end_lineno])
            else:  # a docstring on the def line itself
                body = indent + ast.get_source_segment("".join(self.lines), first) + "\n"
        body += f"{indent}raise NotImplementedError({json.dumps(self._message(qualname), ensure_ascii=False)})\n"
        self.stubbed += 1
        self.edits.append((self._start(fn), fn.end_lineno, header + "\n" + body))

    def _rewrite_import(self, node: ast.Import | ast.ImportFrom, package_of_module: str) -> None:
        """Imports of lesson modules point at the learner's package; relative imports become absolute."""
        lessons = set(lesson_modules())
        ours = lambda name: self.package + name[len(REFERENCE):]  # noqa: E731
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package_of_module.split(".")[: len(package_of_module.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if not base.startswith(REFERENCE):
                return
            def is_lesson(alias: ast.alias) -> bool:  # a submodule, or a name defined in `base`
                full = f"{base}.{alias.name}"
                return full in lessons if module_path(full) is not None else base in lessons

            mine = [a for a in node.names if is_lesson(a)]
            theirs = [a for a in node.names if a not in mine]
            new = ([ast.ImportFrom(base, theirs, 0)] if theirs else []) + (
                [ast.ImportFrom(ours(base), mine, 0)] if mine else [])
            if not node.level and len(new) == 1 and new[0].module == node.module:
                return  # an import of support code: kept as it is written
        else:
            if not any(a.name in lessons and a.asname for a in node.names):
                return
            new = [ast.Import([ast.alias(ours(a.name), a.asname) if a.name in lessons and a.asname else a
                               for a in node.names])]
        text = "".join(" " * node.col_offset + ast.unparse(n) + "\n" for n in new)
        self.edits.append((node.lineno, node.end_lineno, text))

    # ---- the module, its classes
    def _body(self, body: list[ast.stmt], prefix: str, namespace: object, top: bool) -> None:
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        kept_code = [n for n in body if not isinstance(n, defs)]
        needed = _loaded_names(kept_code)
        for n in body:  # what still runs of the definitions that stay
            if isinstance(n, ast.ClassDef):
                needed |= _loaded_names([*n.bases, *n.keywords, *n.decorator_list])
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_private(n.name):
                needed |= _loaded_names(_signature_refs(n))
        remains = bool(kept_code)  # a class body left empty needs a `pass`
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and self._written(n, prefix + n.name):
                self._keep(n)
                remains = True
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_private(n.name) and n.name not in needed:
                    self._drop(n)
                else:
                    self._stub(n, prefix + n.name)
                    remains = True
            elif isinstance(n, ast.ClassDef):
                if _is_private(n.name) and n.name not in needed:
                    self._drop(n)
                    continue
                remains = True
                obj = getattr(namespace, n.name, None)
                if not _kept_whole(obj):
                    self._body(n.body, prefix + n.name + ".", obj, top=False)
            elif top and isinstance(n, ast.If) and ast.unparse(n.test) in ('__name__ == "__main__"', "__name__ == '__main__'"):
                if self.from_stage <= max(s.number for s in STAGES if self.module in s.modules):
                    self._drop(n)  # (a module some stage still asks for is no program yet)
            else:
                for node in ast.walk(n):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        self._rewrite_import(node, self.reference.__package__ or self.module)
        if not remains and not top:
            last = body[-1]
            self.edits.append((last.end_lineno + 1, last.end_lineno, " " * last.col_offset + "pass\n"))

    def source(self) -> str:
        self._body(self.tree.body, "", self.reference, top=True)
        out, line = [], 1
        for first, last, text in sorted(self.edits, key=lambda e: (e[0], e[1])):
            out.extend(self.lines[line - 1: first - 1])
            out.append(text)
            line = max(line, last + 1)
        out.extend(self.lines[line - 1:])
        text = re.sub(r"\n{4,}", "\n\n\n", "".join(out))
        lessons = " and ".join(f"stages/{s.folder}/README.md" for s in STAGES if self.module in s.modules)
        if not self.stubbed:
            header = (f"# Reference code of {self.module}, copied by `python -m pagedref.course init --from-stage "
                      f"{self.from_stage}`:\n# the stages before {self.from_stage} come written. The lesson: {lessons}.\n")
        else:
            header = (f"# Skeleton of {self.module}, generated from the reference by `python -m pagedref.course init`.\n"
                      f"# Write the bodies that raise NotImplementedError; `pytest stages --impl PATH` grades them.\n")
        return header + text


def skeleton_source(module: str, package: str, from_stage: int = 1) -> str:
    """The skeleton of one lesson module, for a learner package named `package`: what only stages before
    `from_stage` teach is the reference code, the rest is stubbed."""
    path = module_path(module)
    if path is None:
        raise ModuleNotFoundError(f"{module} is not in the reference yet")
    return _Skeleton(module, package, path.read_text(), importlib.import_module(module), from_stage).source()


def init(dest: str | os.PathLike, force: bool = False, from_stage: int = 1) -> list[Path]:
    """Write the learner package at `dest` (its name is dest's basename): the reference code of the
    stages before `from_stage`, skeletons from it on (past the last stage: a copy of the whole
    reference, as `mutants` uses). Returns the files written."""
    if not 1 <= from_stage <= len(STAGES) + 1:
        raise ValueError(f"--from-stage must be one of the stages 1..{len(STAGES)}, got {from_stage}")
    dest = Path(dest)
    package = dest.resolve().name
    if not package.isidentifier() or package == REFERENCE:
        raise ValueError(f"{dest} cannot be a learner package: its name must be a Python identifier other than "
                         f"{REFERENCE!r}, e.g. mypagedref")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise FileExistsError(f"{dest} is not empty; choose a new folder or pass --force to overwrite")
    written: list[Path] = []

    def write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path not in written:
            written.append(path)

    write(dest / "__init__.py", f'"""{package}: my pagedref, written stage by stage (`pytest stages --impl {dest}`)."""\n')
    for module in lesson_modules():
        if module_path(module) is None:
            print(f"skipped {module}: not in the reference yet", file=sys.stderr)
            continue
        parts = module.split(".")[1:]
        for i in range(1, len(parts)):  # the packages on the way, empty
            init_py = dest.joinpath(*parts[:i], "__init__.py")
            if not init_py.exists():
                write(init_py, "")
        is_package = module_path(module).name == "__init__.py"
        target = dest.joinpath(*parts, "__init__.py") if is_package else dest.joinpath(*parts[:-1], parts[-1] + ".py")
        write(target, skeleton_source(module, package, from_stage))
    return written


# --- the interface: what a stage's tests use, stated once ---------------------------------------
INTERFACE_BEGIN = ("<!-- interface: generated by `python -m pagedref.course interface --write` from the reference's "
                   "docstrings and declarations, which the skeleton keeps: edit them there -->")
INTERFACE_END = "<!-- /interface -->"


def _interface_of_module(module: str, number: int, package: str) -> str:
    """The part of `module` that stage `number` teaches, as the skeleton declares it: public classes
    with their fields and annotated attributes, signatures and docstrings; no bodies, no imports."""
    source = module_path(module).read_text()
    sk = _Skeleton(module, package, source, importlib.import_module(module))
    lines, seg = sk.lines, lambda a, b: "".join(sk.lines[a - 1: b])

    def is_doc(node: ast.stmt) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    def function(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        end_line, end_col = sk._header_end(fn)
        text = seg(sk._start(fn), end_line - 1) + lines[end_line - 1][:end_col]
        first = fn.body[0]
        if not is_doc(first):
            return text + " ...\n"
        if first.lineno == end_line:  # a docstring on the def line itself
            return text + " " + ast.get_source_segment(source, first) + "\n"
        return text + "\n" + seg(first.lineno, first.end_lineno)

    def names(node: ast.stmt) -> list[str]:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        return [t.id for t in targets if isinstance(t, ast.Name)]

    def members(body: list[ast.stmt], prefix: str, namespace: object) -> list[str]:
        out = []
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(n.name):
                continue
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if number not in (s.number for s in teachers(module, prefix + n.name)):
                    continue
                out.append(function(n) if not isinstance(n, ast.ClassDef) else cls(n, prefix, namespace))
            elif isinstance(n, (ast.Assign, ast.AnnAssign)) and names(n) and not any(map(_is_private, names(n))):
                if prefix or number in (s.number for s in teachers(module, names(n)[0])):
                    out.append(seg(n.lineno, n.end_lineno))
        return out

    def cls(node: ast.ClassDef, prefix: str, namespace: object) -> str:
        obj = getattr(namespace, node.name, None)
        if _kept_whole(obj):
            return seg(sk._start(node), node.end_lineno)
        end_line, end_col = sk._header_end(node)
        text = seg(sk._start(node), end_line - 1) + lines[end_line - 1][:end_col] + "\n"
        if is_doc(node.body[0]):
            text += seg(node.body[0].lineno, node.body[0].end_lineno)
        inner = members(node.body, f"{prefix}{node.name}.", obj)
        return text + "".join(inner) if inner or is_doc(node.body[0]) else text.rstrip("\n") + " ...\n"

    body = [n for n in sk.tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.If, ast.Expr))]
    return "\n\n".join(members(body, "", sk.reference))


def interface_markdown(number: int, package: str = "mypagedref") -> str:
    """Stage `number`'s interface block for its README: one code block per lesson module."""
    blocks = []
    for module in stage(number).modules:
        if module_path(module) is None:
            continue
        rel = "/".join(module.split(".")[1:]) + ("/__init__.py" if module_path(module).name == "__init__.py" else ".py")
        code = _interface_of_module(module, number, package)
        if code:
            blocks.append(f"```python\n# {package}/{rel}\n{code.rstrip()}\n```\n")
    return f"{INTERFACE_BEGIN}\n\n" + "\n".join(blocks) + f"\n{INTERFACE_END}"


def readme_interface(number: int) -> str | None:
    """The interface block written in stage `number`'s README now, or None if it has none."""
    text = stage(number).readme.read_text() if stage(number).readme.is_file() else ""
    m = re.search(re.escape(INTERFACE_BEGIN) + r".*?" + re.escape(INTERFACE_END), text, re.S)
    return m[0] if m else None


def write_interface(number: int) -> bool:
    """Rewrite stage `number`'s README interface block from the reference; True if it changed."""
    old = readme_interface(number)
    if old is None:
        return False
    new = interface_markdown(number)
    if new != old:
        readme = stage(number).readme
        readme.write_text(readme.read_text().replace(old, new))
    return new != old


# --- mutants: the project's own wrong versions, each caught by a stage test naming its rule ------
MUTATIONS = REPO_ROOT / "tests" / "mutations"
_REPORTER = '''
import json, os

_session = None


def pytest_sessionstart(session):
    global _session
    _session = session


def _record(nodeid, message):
    with open(os.environ["COURSE_REPORT"], "a") as f:
        f.write(json.dumps({"nodeid": nodeid, "message": message}) + "\\n")
    # Grading a wrong version: its first failure that names the broken rule decides it, so the stage's
    # later (slower) tests need not run. Stopped as -x stops (exit code 1, the failures reported).
    catch = os.environ.get("COURSE_CATCH")
    if catch:
        from pagedref.course import names_rule

        stage, expect = catch.split(":", 1)
        if names_rule(message, int(stage), expect):
            _session.shouldfail = "the wrong version is caught"


def pytest_runtest_logreport(report):
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        _record(report.nodeid, crash.message if crash else str(report.longrepr))


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid, str(report.longrepr)[-2000:])
'''


@dataclass(frozen=True)
class Mutant:
    """A wrong version of a lesson module, kept as a unified diff against the reference with a header:
    `stage: N`, `rule: <the lesson's rule it breaks>`, `expect: <regex a failing test's message matches>`."""

    path: Path
    stage: int
    rule: str
    expect: str
    hunks: tuple[tuple[str, str, str], ...]  # (file in the reference, text before, text after)

    @property
    def name(self) -> str:
        return self.path.stem


def load_mutant(path: Path) -> Mutant:
    header, hunks, file, before, after = {}, [], None, None, None
    lines = path.read_text().splitlines(keepends=True)
    i = next((k for k, line in enumerate(lines) if line.startswith("--- ")), len(lines))
    for line in lines[:i]:
        if m := re.match(r"^(stage|rule|expect):\s*(.+?)\s*$", line):
            header[m[1]] = m[2]
    for line in lines[i:]:
        if line.startswith("--- "):
            continue
        if line.startswith("+++ "):
            file = line[4:].strip().split("\t")[0].removeprefix("b/")
        elif line.startswith("@@"):
            if before is not None:
                hunks.append((file, "".join(before), "".join(after)))
            before, after = [], []
        elif before is not None and line[:1] in (" ", "-", "+", "\n"):
            text = line[1:] if line[:1] != "\n" else "\n"
            if line[:1] != "+":
                before.append(text)
            if line[:1] != "-":
                after.append(text)
    if before is not None:
        hunks.append((file, "".join(before), "".join(after)))
    missing = {"stage", "rule", "expect"} - set(header)
    if missing or not hunks:
        raise ValueError(f"{path}: a mutant needs stage:, rule:, expect: lines and a diff ({sorted(missing)} missing)")
    return Mutant(path, int(header["stage"]), header["rule"], header["expect"], tuple(hunks))


def load_mutants(stages: list[int] | None = None, folder: Path = MUTATIONS) -> list[Mutant]:
    mutants = [load_mutant(p) for p in sorted(folder.glob("stage*.patch"))]
    return [m for m in mutants if stages is None or m.stage in stages]


def apply_mutant(mutant: Mutant, package_dir: Path) -> None:
    """Apply the diff to a copy of the reference (`init --from-stage` past the last stage): each hunk's
    text is found once in the copied module (its line numbers are not used: the copy has a header)."""
    for file, before, after in mutant.hunks:
        target = package_dir.joinpath(*Path(file).parts[1:])
        text = target.read_text()
        if text.count(before) != 1:
            raise ValueError(f"{mutant.path.name}: a hunk is found {text.count(before)} times in {file}, not once "
                             f"(the reference changed: update the mutant)")
        target.write_text(text.replace(before, after))


def names_rule(message: str, stage: int, expect: str) -> bool:
    """Whether a failing test's message names a rule of `stage` ("stage N: ...") and matches `expect`."""
    return bool(re.search(rf"\bstage {stage}: ", message) and re.search(expect, message, re.S))


def grade(package_dir: Path, numbers: list[int], workdir: Path, stop_at: Mutant | None = None) -> list[dict]:
    """Run stages `numbers`' tests against a package, in a subprocess: the failures, with messages.
    With `stop_at`, the run stops at the first failure that catches that wrong version (names_rule)."""
    # Written whole, then renamed into place: run_mutants' parallel gradings share it, and a pytest starting
    # meanwhile imports either copy, never a half-written one.
    tmp = workdir / f"_course_report.{threading.get_ident()}.tmp"
    tmp.write_text(_REPORTER)
    os.replace(tmp, workdir / "_course_report.py")
    report = workdir / f"report-{package_dir.parent.name}.jsonl"
    report.unlink(missing_ok=True)
    env = {"PAGEDREF_CUDA_DIR": str(REPO_ROOT / "cuda"),  # a copied kernels/build.py finds the kernels anywhere
           **os.environ, "COURSE_REPORT": str(report),
           **({"COURSE_CATCH": f"{stop_at.stage}:{stop_at.expect}"} if stop_at else {}),
           "PYTHONPATH": os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH", "")) if p)}
    folders = [f"stages/{stage(n).folder}" for n in numbers]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_course_report",
                        *folders, "--impl", str(package_dir)], capture_output=True, text=True, cwd=REPO_ROOT,
                       env=env, timeout=900)
    failures = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    if r.returncode not in (0, 1) or (r.returncode == 1 and not failures):
        raise RuntimeError(f"pytest could not grade {package_dir} (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    return failures


@dataclass
class MutantResult:
    mutant: Mutant
    failures: list[dict]  # the stage's failing tests, up to the first that catches it (all, if none does)
    caught_by: list[dict]  # those whose message names the rule: "stage N: ..." and matches `expect`

    @property
    def killed(self) -> bool:
        return bool(self.caught_by)


def run_mutants(mutants: list[Mutant], log=print, jobs: int | None = None,
                check_reference: bool = True) -> list[MutantResult]:
    """Grade each mutant with its stage's tests, on a copy of the reference; the copy must pass first
    (check_reference=False: the caller has checked that, as tests/test_course.py does for the whole course).
    `jobs` gradings run at once (default: one per CPU). Each is its own pytest process, which stops at the first
    failure that catches its mutant (grade's stop_at): on CI's two cores two at a time graded all 95 in 6.1
    minutes instead of 9.8, and stopping at the catch took stage 8's ten from 329 s to 157 (2026-12-02).
    Results come back in the mutants' order; each is logged as it is graded."""
    with tempfile.TemporaryDirectory(prefix="pagedref-mutants-") as tmp:
        base = Path(tmp) / "ref" / "mutant"
        init(base, from_stage=len(STAGES) + 1)
        numbers = sorted({m.stage for m in mutants})
        failures = grade(base, numbers, Path(tmp)) if check_reference else []
        if failures:
            raise RuntimeError("the reference copy fails its own stages, so no mutant can be graded:\n"
                               + "\n".join(f"{f['nodeid']}: {f['message'][:300]}" for f in failures))

        def one(i: int) -> MutantResult:
            m = mutants[i]
            work = Path(tmp) / f"m{i}" / "mutant"
            shutil.copytree(base, work)
            apply_mutant(m, work)
            failures = grade(work, [m.stage], Path(tmp), stop_at=m)
            caught = [f for f in failures if names_rule(f["message"], m.stage, m.expect)]
            shutil.rmtree(work.parent)
            what = (f"caught by {caught[0]['nodeid'].split('::')[-1]}" if caught else
                    f"SURVIVED ({len(failures)} failures, none naming the rule /{m.expect}/)")
            log(f"stage {m.stage}  {m.name:<44} {what}")
            return MutantResult(m, failures, caught)

        with ThreadPoolExecutor(max(1, jobs or os.cpu_count() or 1)) as pool:
            return list(pool.map(one, range(len(mutants))))


# --- command line -------------------------------------------------------------------------------
def _list() -> None:
    print(f"{'stage':<6}{'folder':<36}{'title':<44}lesson modules")
    for s in STAGES:
        mark = "" if s.path.is_dir() else "  (not written yet)"
        print(f"{s.number:<6}{'stages/' + s.folder:<36}{s.title:<44}{', '.join(s.modules)}{mark}")
    print("\nRun one stage: pytest stages -m stage1    Grade your own: pytest stages -m stage1 --impl DIR")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedref.course", description="The pagedref course.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the stages")
    p = sub.add_parser("init", help="write a skeleton package to implement, stage by stage")
    p.add_argument("dir", help="folder of the new package; its name is the package name (e.g. mypagedref)")
    p.add_argument("--force", action="store_true", help="overwrite a folder that is not empty")
    p.add_argument("--from-stage", type=int, default=1, choices=[s.number for s in STAGES], metavar="N",
                   help="start at stage N: the stages before it come as reference code (default 1)")
    p = sub.add_parser("interface", help="print a stage's interface, or write it into the lessons")
    p.add_argument("--stage", type=int, action="append", choices=[s.number for s in STAGES], metavar="N")
    p.add_argument("--write", action="store_true", help="rewrite each README's interface block from the reference")
    p = sub.add_parser("mutants", help="grade the wrong versions kept in tests/mutations/ with the stage tests")
    p.add_argument("--stage", type=int, action="append", choices=[s.number for s in STAGES], metavar="N")
    p.add_argument("--name", default="", help="only the mutants whose file name contains this")
    args = parser.parse_args(argv)
    if args.command == "list":
        _list()
        return 0
    if args.command == "interface":
        numbers = args.stage or [s.number for s in STAGES if readme_interface(s.number) is not None]
        for n in numbers:
            if args.write:
                print(f"stage {n}: {'rewritten' if write_interface(n) else 'up to date (or no interface block)'}")
            else:
                print(interface_markdown(n))
        return 0
    if args.command == "mutants":
        mutants = [m for m in load_mutants(args.stage) if args.name in m.name]
        results = run_mutants(mutants)
        survived = [r for r in results if not r.killed]
        print(f"{len(results) - len(survived)} of {len(results)} mutants caught by a test naming their rule")
        return 1 if survived else 0
    try:
        files = init(args.dir, force=args.force, from_stage=args.from_stage)
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    print(f"wrote {len(files)} files to {args.dir}. Next: pytest stages -m stage{args.from_stage} --impl {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
