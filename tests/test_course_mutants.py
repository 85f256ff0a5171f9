"""The project's own wrong versions of the lessons (tests/mutations/*.patch): each one, applied to a copy
of the reference, must fail a test of its stage whose message names the lesson's rule.

This is what a learner's deliberately wrong package meets under `pytest stages --impl`; the runner is
`python -m pagedref.course mutants` (a second a mutant in stages 1-5; stages 6-8 run real models, longer).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pagedref import course

MUTANTS = course.load_mutants()


def test_every_mutant_names_a_stage_with_tests_and_applies(tmp_path):
    assert MUTANTS, "tests/mutations/ holds no mutant"
    pkg = tmp_path / "mutant"
    course.init(pkg, from_stage=len(course.STAGES) + 1)
    for m in MUTANTS:
        assert course.stage(m.stage).test_files(), f"{m.name}: stage {m.stage} has no tests"
        assert m.name.startswith(f"stage{m.stage}_"), f"{m.name}: the file name starts with its stage"
        for file, before, after in m.hunks:
            text = (pkg.joinpath(*file.split("/")[1:])).read_text()
            assert text.count(before) == 1, f"{m.name}: a hunk is found {text.count(before)} times in {file}"
            assert before != after, f"{m.name}: a hunk changes nothing"


@pytest.mark.parametrize("number", sorted({m.stage for m in MUTANTS}), ids=lambda n: f"stage{n}")
def test_every_wrong_version_fails_a_test_that_names_its_rule(number):
    # The copy every mutant starts from (course.init past the last stage) passes every stage: tests/test_course.py's
    # test_a_learner_package_completed_with_the_reference_passes_every_stage grades such a copy, once for all stages.
    results = course.run_mutants([m for m in MUTANTS if m.stage == number], log=lambda line: None,
                                 check_reference=False)
    survived = [r for r in results if not r.killed]
    assert not survived, "wrong versions that no test of their stage catches with the rule's message:\n" + "\n".join(
        f"{r.mutant.name} (rule: {r.mutant.rule}; expect /{r.mutant.expect}/): "
        + ("; ".join(f"{f['nodeid'].split('::')[-1]}: {f['message'][:200]}" for f in r.failures[:3]) or "every test passed")
        for r in survived)


def test_the_scheduler_fuzzer_grades_a_learner_package(tmp_path):
    """tests/test_engine_fuzz.py under --impl runs the learner's scheduler and block manager: a copy of the
    reference passes it, and a wrong version (decodes over the token budget) fails it."""
    def fuzz(pkg):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "tests/test_engine_fuzz.py", "--impl", str(pkg)],
                              capture_output=True, text=True, cwd=course.REPO_ROOT, timeout=900)
    good, bad = tmp_path / "good" / "fuzzed", tmp_path / "bad" / "fuzzed"
    course.init(good, from_stage=len(course.STAGES) + 1)
    shutil.copytree(good, bad)
    course.apply_mutant(next(m for m in MUTANTS if m.name == "stage7_decodes_ignore_the_budget"), bad)
    r = fuzz(good)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    r = fuzz(bad)
    assert r.returncode == 1 and "token budget exceeded" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
