"""The course runner: each `stages/NN_name/` folder is one stage, run in order, marked `stageN`.

`pytest stages -m stage3` runs one stage; `pytest stages --impl PKG_OR_PATH` grades a learner's
package (see pagedref/course.py) instead of the reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedref import course

_STAGE_DIR = re.compile(r"^(\d\d)_")


def pytest_addoption(parser):
    course.pytest_options(parser)  # --impl (tests/conftest.py adds the same option: the deep tests grade it too)


def pytest_configure(config):
    course.pytest_setup(config)


def _stage_of(item) -> int | None:
    for part in Path(str(item.fspath)).parts[::-1]:
        m = _STAGE_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        stage = _stage_of(item)
        if stage is not None:
            item.add_marker(getattr(pytest.mark, f"stage{stage}"))
    # Stages run in order: a learner sees stage 1 fail before anything built on it.
    items.sort(key=lambda it: (_stage_of(it) if _stage_of(it) is not None else 99))
