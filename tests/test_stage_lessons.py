"""Every stage's tests read as its lesson: `test_stepN_...` in the order of its README's
"The tests, step by step", one numbered item per test, no unnumbered test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

STAGES = sorted(p for p in (Path(__file__).resolve().parents[1] / "stages").iterdir() if re.match(r"\d\d_", p.name))


def steps_in_readme(stage: Path) -> list[int]:
    text = (stage / "README.md").read_text()
    section = text.split("## The tests, step by step", 1)
    assert len(section) == 2, f"{stage.name}/README.md has no 'The tests, step by step' section"
    body = section[1].split("\n## ", 1)[0]
    return [int(n) for n in re.findall(r"^(\d+)\. ", body, flags=re.M)]


def stage_test_names(stage: Path) -> list[str]:
    """Test function names, files in name order, functions in file order (the order pytest runs them)."""
    names = []
    for f in sorted(stage.glob("test_*.py")):
        names += re.findall(r"^def (test_\w+)\(", f.read_text(), flags=re.M)
    return names


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_each_stage_test_is_a_numbered_step_of_its_lesson(stage):
    names = stage_test_names(stage)
    steps = [int(m.group(1)) if (m := re.match(r"test_step(\d+)_", n)) else None for n in names]
    assert None not in steps, f"{stage.name}: tests not named test_stepN_...: {[n for n, s in zip(names, steps) if s is None]}"
    assert steps == list(range(1, len(steps) + 1)), f"{stage.name}: steps out of order: {steps}"
    assert steps_in_readme(stage) == steps, f"{stage.name}: the README lists steps {steps_in_readme(stage)}, the tests are {steps}"
