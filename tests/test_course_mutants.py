"""The project's own wrong versions of the lessons (tests/mutations/*.patch): each one, applied to a copy
of the reference, must fail a test of its stage whose message names the lesson's rule.

This is what a learner's deliberately wrong package meets under `pytest stages --impl`; the runner is
`python -m pagedref.course mutants` (about a second a mutant).
"""

from __future__ import annotations

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
    results = course.run_mutants([m for m in MUTANTS if m.stage == number], log=lambda line: None)
    survived = [r for r in results if not r.killed]
    assert not survived, "wrong versions that no test of their stage catches with the rule's message:\n" + "\n".join(
        f"{r.mutant.name} (rule: {r.mutant.rule}; expect /{r.mutant.expect}/): "
        + ("; ".join(f"{f['nodeid'].split('::')[-1]}: {f['message'][:200]}" for f in r.failures[:3]) or "every test passed")
        for r in survived)
