"""The sanitizer driver (`python -m pagedref.kernels.selfcheck`) must not pass over nothing: a filter that
selects no kernel run is a failure, so compute-sanitizer's clean report over zero launches cannot read as
a clean kernel. (The runs themselves need a GPU: tests/test_kernels_gpu.py and the device.)"""

from __future__ import annotations

import functools

from pagedref.kernels import selfcheck, testing


def test_a_filter_that_selects_no_run_fails(monkeypatch):
    # The problems are built before the filter: on the CPU, so no GPU is needed to reach it.
    monkeypatch.setattr(testing, "make_problem", functools.partial(testing.make_problem, device="cpu"))
    failures = selfcheck.check_attention(only="decode v9 no such kernel")
    assert len(failures) == 1 and "no attention run matches" in failures[0], failures
    failures = selfcheck.check_attention(head_dims={7})
    assert len(failures) == 1 and "head_dims=[7]" in failures[0], failures
