"""Learner mode: the skeleton generated from the reference imports, fails every stage with a message
naming the stage and the function to write, and the reference passes the same tests.

Also: the stage registry in pagedref.course is the one list of stages, and it agrees with stages/;
and a learner package completed with the reference's own code passes every stage under --impl (the
stage tests reach the learner's modules only through `lesson()`, and the engine runs a learner's
scheduler and block manager through the step contract).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedref import course

ROOT = Path(__file__).resolve().parents[1]
# "stage 3: implement BlockTable.slot in mypagedref/memory/block_table.py — see stages/03_block_table/README.md";
# a name two stages teach: "stage 6 + stage 7: implement ... — see stages/06_.../README.md and stages/07_.../README.md"
MESSAGE = re.compile(r"((?:stage \d+)(?: \+ stage \d+)*): implement ([\w.]+) in ([\w/.]+\.py)"
                     r" — see (stages/\d\d_\w+/README\.md(?: and stages/\d\d_\w+/README\.md)*)")


def _stages_named(m: re.Match) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", m[1])]
LESSON_CALL = re.compile(r"""lesson\(\s*["'](pagedref[\w.]*)["']\s*\)""")
STAGES_WITH_TESTS = [s for s in course.STAGES if s.test_files()]


# --- the registry -------------------------------------------------------------------------------
def test_registry_matches_the_stage_folders():
    folders = sorted(p.name for p in (ROOT / "stages").iterdir() if p.is_dir() and re.match(r"^\d\d_", p.name))
    known = {s.folder for s in course.STAGES}
    assert set(folders) <= known, f"stage folders missing from pagedref.course.STAGES: {sorted(set(folders) - known)}"
    assert [s.number for s in course.STAGES] == list(range(1, len(course.STAGES) + 1))
    for s in course.STAGES:
        assert s.folder.startswith(f"{s.number:02d}_") and s.slug == s.folder.replace("_", "-")
        assert all(m.startswith("pagedref.") for m in s.modules) and s.modules
    assert course.stage(3).folder == "03_block_table"
    with pytest.raises(ValueError, match="no stage 9"):
        course.stage(9)


@pytest.mark.parametrize("stage", STAGES_WITH_TESTS, ids=lambda s: s.marker)
def test_stage_tests_study_their_lesson_modules(stage):
    """Every module a stage's tests ask `lesson()` for is a lesson of that stage or an earlier one,
    and they ask for one of the stage's own (so `--impl` really grades the stage)."""
    asked = {m for f in stage.test_files() for m in LESSON_CALL.findall(f.read_text())}
    taught = {m for s in course.STAGES if s.number <= stage.number for m in s.modules}
    assert asked <= taught, f"stage {stage.number} tests study modules no stage up to it lists: {sorted(asked - taught)}"
    assert asked & set(stage.modules), f"stage {stage.number}'s tests never call lesson() for {stage.modules}"


def test_teachers_of_a_name_in_a_shared_module():
    """A name in a module several stages list belongs to the first, and to a later one claiming it."""
    shared = [m for m in course.lesson_modules() if sum(m in s.modules for s in course.STAGES) > 1]
    for m in shared:
        listing = [s for s in course.STAGES if m in s.modules]
        assert course.teachers(m, "SomethingNobodyClaims") == listing[:1]
        for s in listing[1:]:
            for claim in s.claims:
                assert course.teachers(m, claim) == [listing[0], s]
                assert course.teachers(m, claim + ".inner") == [listing[0], s]
    assert course.teachers("pagedref.engine.scheduler", "Scheduler.schedule") == [course.stage(6), course.stage(7)]
    assert course.teachers("pagedref.engine.scheduler", "SchedulerOutput.is_empty") == [course.stage(6)]
    with pytest.raises(ValueError, match="not a lesson module"):
        course.teachers("pagedref.attention", "attention")


def test_list_prints_every_stage(capsys):
    assert course.main(["list"]) == 0
    out = capsys.readouterr().out
    for s in course.STAGES:
        assert re.search(rf"^{s.number}\s+stages/{s.folder}\s+{re.escape(s.title)}", out, re.M), out


# --- the skeleton -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def skeleton(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("learner") / "mypagedref"
    course.init(dest)
    return dest


def _present_lessons() -> list[str]:
    return [m for m in course.lesson_modules() if course.module_path(m) is not None]


def _public_api(module) -> dict[str, object]:
    """Classes and functions a module defines itself (not imports), public ones, members included."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            api[name] = str(inspect.signature(obj))
        elif inspect.isclass(obj):
            api[name] = "class"
            for member, value in vars(obj).items():
                if member.startswith("_") and member not in ("__init__", "__post_init__", "__call__"):
                    continue
                if inspect.isfunction(value):
                    api[f"{name}.{member}"] = str(inspect.signature(value))
                elif isinstance(value, property):
                    api[f"{name}.{member}"] = "property"
    return api


def test_skeleton_has_the_reference_api(skeleton, monkeypatch):
    monkeypatch.syspath_prepend(str(skeleton.parent))
    for module in _present_lessons():
        ref = importlib.import_module(module)
        ours = importlib.import_module("mypagedref" + module[len("pagedref"):])
        assert _public_api(ours) == _public_api(ref), module
        assert ours.__doc__ == ref.__doc__, f"{module}: the module docstring (its idea and invariant) is kept"
        for name, obj in vars(ref).items():  # errors are copied as they are: they are the interface
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module:
                assert inspect.getsource(getattr(ours, name)) == inspect.getsource(obj)


def test_every_skeleton_body_raises_its_stage(skeleton):
    """Each public function and method of the skeleton keeps its docstring and only raises
    NotImplementedError naming the stage that teaches it, its qualified name and its file."""
    for module in _present_lessons():
        rel = module.split(".")[1:]
        path = skeleton.joinpath(*rel, "__init__.py") if course.module_path(module).name == "__init__.py" \
            else skeleton.joinpath(*rel[:-1], rel[-1] + ".py")
        ref_tree = ast.parse(course.module_path(module).read_text())
        ref_docs = {q: ast.get_docstring(f) for q, f in _functions(ref_tree)}
        stubs = dict(_functions(ast.parse(path.read_text())))
        assert stubs, module
        for qualname, fn in stubs.items():
            assert ast.get_docstring(fn) == ref_docs[qualname], f"{module}.{qualname}: docstring changed"
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            assert len(body) == 1 and isinstance(body[0], ast.Raise), f"{module}.{qualname} keeps reference code"
            m = MESSAGE.fullmatch(body[0].exc.args[0].value)
            assert m, body[0].exc.args[0].value
            stages = course.teachers(module, qualname)
            assert _stages_named(m) == [s.number for s in stages] and m[2] == qualname
            assert m[4] == " and ".join(f"stages/{s.folder}/README.md" for s in stages)
            assert m[3] == path.relative_to(skeleton.parent).as_posix()


def _functions(tree: ast.Module, prefix: str = ""):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def test_init_refuses_bad_destinations(tmp_path):
    with pytest.raises(ValueError, match="identifier"):
        course.init(tmp_path / "my-pagedref")
    with pytest.raises(ValueError, match="identifier"):
        course.init(tmp_path / "pagedref")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        course.init(tmp_path / "taken")
    r = subprocess.run([sys.executable, "-m", "pagedref.course", "init", str(tmp_path / "taken")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


# --- grading: the skeleton fails every stage, the reference passes -------------------------------
_REPORTER = textwrap.dedent('''
    import json, os

    def _log(**record):
        with open(os.environ["COURSE_REPORT"], "a") as f:
            f.write(json.dumps(record) + "\\n")

    def pytest_collectreport(report):
        if report.failed:
            _log(nodeid=report.nodeid, when="collect", outcome="failed", message=str(report.longrepr)[-3000:])

    def pytest_runtest_logreport(report):
        if report.outcome != "passed" or report.when == "call":
            crash = getattr(report.longrepr, "reprcrash", None)
            _log(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                 message=crash.message if crash else str(report.longrepr))
''')


def _run_stages(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    """pytest in a subprocess (as a learner runs it); each test's outcome and crash message."""
    (tmp_path / "course_reporter.py").write_text(_REPORTER)
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.jsonl"
    env = {**os.environ, "COURSE_REPORT": str(report), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "course_reporter", *args],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    lines = report.read_text().splitlines() if report.exists() else []
    return [json.loads(line) for line in lines], r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.skipif(not STAGES_WITH_TESTS, reason="no stage has tests yet")
def test_skeleton_fails_every_stage_and_the_reference_passes(skeleton, tmp_path):
    marker = " or ".join(s.marker for s in STAGES_WITH_TESTS)
    results, log = _run_stages(tmp_path, "stages", "-m", marker, "--impl", str(skeleton),
                               "--continue-on-collection-errors")
    rerun = []
    for s in STAGES_WITH_TESTS:
        mine = [r for r in results if r["nodeid"].startswith(f"stages/{s.folder}/")]
        failed = [r for r in mine if r["outcome"] == "failed"]
        skipped = sum(r["outcome"] == "skipped" for r in mine)
        assert failed, f"stage {s.number}: no test fails against the empty skeleton ({skipped} skipped)\n{log}"
        for r in failed:
            m = MESSAGE.search(r["message"])
            assert "NotImplementedError" in r["message"] and m, \
                f"{r['nodeid']} fails against the skeleton without naming what to write: {r['message']}"
            assert min(_stages_named(m)) <= s.number, f"{r['nodeid']}: the message names only later stages: {r['message']}"
        named = {n for r in failed for n in _stages_named(MESSAGE.search(r["message"]))}
        assert s.number in named, f"stage {s.number}: no failure names stage {s.number} itself ({sorted(named)})"
        rerun += list(dict.fromkeys(r["nodeid"] for r in failed if r["when"] != "collect"))[:3]
    # A test module that calls a lesson while it is collected stops a learner's whole `pytest stages` run
    # at the first stub, before stage 1 is graded: lessons are called inside tests only.
    broken = [f"{r['nodeid']}: {MESSAGE.search(r['message'])[0] if MESSAGE.search(r['message']) else r['message']}"
              for r in results if r["when"] == "collect"]
    results, log = _run_stages(tmp_path, *rerun)  # the same tests, against the reference
    assert {r["nodeid"] for r in results if r["when"] == "call" and r["outcome"] == "passed"} == set(rerun), log
    assert not broken, "test modules that call a lesson at import time:\n" + "\n".join(broken)


# --- a learner who wrote the reference ------------------------------------------------------------
@pytest.mark.skipif(not STAGES_WITH_TESTS, reason="no stage has tests yet")
def test_a_learner_package_completed_with_the_reference_passes_every_stage(tmp_path):
    """What a learner who wrote exactly the reference has: `init` past the last stage (every lesson module
    as the reference writes it, its imports of lesson modules pointed at the learner's package)."""
    dest = tmp_path / "donepagedref"
    course.init(dest, from_stage=len(course.STAGES) + 1)
    results, log = _run_stages(tmp_path, "stages", "--impl", str(dest))
    failed = [f"{r['nodeid']}: {r['message'][:300]}" for r in results if r["outcome"] == "failed"]
    assert not failed, "\n".join(failed) + "\n" + log
    assert "passed" in log and " 0 passed" not in log, log


# --- issue 20: the lessons as a specification -------------------------------------------------------
SPECIFIED = [course.stage(n) for n in (1, 2, 3, 4, 6, 7, 8)]  # stage 5 (the kernels) is graded by its oracles


@pytest.mark.parametrize("stage", SPECIFIED, ids=lambda s: s.marker)
def test_each_lesson_states_the_interface_its_skeleton_declares(stage):
    """The README's interface block is generated from the reference (`course interface --write`), from
    the same docstrings and declarations the skeleton keeps: one text, in both places."""
    written = course.readme_interface(stage.number)
    assert written is not None, f"stage {stage.number}'s README has no interface block ({course.INTERFACE_BEGIN})"
    assert written == course.interface_markdown(stage.number), \
        f"stage {stage.number}'s interface block is stale: run `python -m pagedref.course interface --write`"


def _message_text(node: ast.AST) -> str:
    """The literal start of a message: a string, an f-string's first part, or a parenthesized concatenation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return ""


@pytest.mark.parametrize("stage", SPECIFIED, ids=lambda s: s.marker)
def test_every_check_in_a_stage_names_its_stage_and_rule(stage):
    """Every assert carries a "stage N: ..." message; every expected error goes through course.raises
    with one (pytest.raises fails with "DID NOT RAISE", which names no rule)."""
    bare = []
    for f in stage.test_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Assert) and not _message_text(node.msg).startswith(f"stage {stage.number}: "):
                bare.append(f"{f.name}:{node.lineno}: assert without a 'stage {stage.number}: ...' message")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.raises":
                bare.append(f"{f.name}:{node.lineno}: pytest.raises (use course.raises with the rule)")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "raises" and (
                    len(node.args) < 2 or not _message_text(node.args[1]).startswith(f"stage {stage.number}: ")):
                bare.append(f"{f.name}:{node.lineno}: raises() without a 'stage {stage.number}: ...' rule")
    assert not bare, "\n".join(bare)


@pytest.mark.parametrize("stage", SPECIFIED, ids=lambda s: s.marker)
def test_every_function_a_skeleton_asks_for_is_graded(stage):
    """A learner writes every stub of the stage's modules: each public function, method and property
    is called by the stage's own tests (a stub no test reaches would be a chore no one checks)."""
    source = "\n".join(f.read_text() for f in stage.test_files())
    missing = []
    for module in stage.modules:
        for name, kind in _public_api(importlib.import_module(module)).items():
            leaf = name.split(".")[-1]
            if kind == "class" or leaf.startswith("__"):
                continue  # classes are graded through their members, constructors through every test
            called = rf"\.{leaf}\b" if "." in name else rf"\b{leaf}\("
            if not re.search(called, source):
                missing.append(f"{module}.{name}")
    assert not missing, f"stage {stage.number}'s tests never call: {missing}"


def test_init_from_a_stage_writes_the_earlier_stages_as_reference_code(tmp_path):
    """`init --from-stage N`: the modules of the stages before N are the reference's code (imports pointing
    at the learner's package), the rest are skeletons; past the last stage, a copy of the whole reference."""
    dest = tmp_path / "mine"
    assert course.main(["init", str(dest), "--from-stage", "3"]) == 0
    for module, stubbed in (("memory/contiguous.py", False), ("memory/block_allocator.py", False),
                            ("memory/block_table.py", True), ("memory/sharing.py", True)):
        text = (dest / module).read_text()
        assert ("NotImplementedError" in text) == stubbed, module
        assert "from pagedref.memory" not in text.replace("from pagedref.memory.block_table import", ""), module
    assert "from mine.memory.block_table import MaxModelLenError" in (dest / "memory/contiguous.py").read_text()
    with pytest.raises(ValueError, match="from-stage"):
        course.init(tmp_path / "other", from_stage=0)
    copy = tmp_path / "copy"
    course.init(copy, from_stage=len(course.STAGES) + 1)
    assert not [p for p in copy.rglob("*.py") if "NotImplementedError(\"stage" in p.read_text()], \
        "past the last stage nothing is stubbed"


def test_init_from_stage_6_passes_stages_1_to_5_at_once(tmp_path):
    pkg = tmp_path / "from6"
    course.init(pkg, from_stage=6)
    failures = course.grade(pkg, [1, 2, 3, 4, 5], tmp_path)
    assert not failures, "stages 1-5 fail on a package started at stage 6:\n" + "\n".join(
        f"{f['nodeid']}: {f['message'][:300]}" for f in failures)


def test_course_raises_states_the_rule():
    with course.raises(KeyError, "stage 0: a rule", match="x"):
        raise KeyError("x")
    for body, why in ((lambda: None, "nothing was raised"), (lambda: {}["y"], "got KeyError"),
                      (lambda: (_ for _ in ()).throw(ValueError("other")), "does not contain")):
        with pytest.raises(AssertionError, match=rf"^stage 0: the rule \(.*{why}"):
            with course.raises((ValueError, IndexError) if "contain" in why else IndexError, "stage 0: the rule", match="x"):
                body()
    with pytest.raises(NotImplementedError):  # a skeleton's own message passes through
        with course.raises(Exception, "stage 0: the rule"):
            raise NotImplementedError("stage 0: implement f")
