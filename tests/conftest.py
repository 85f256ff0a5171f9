"""The deeper tests' models: in the repository, under tests/models/, each with its PROVENANCE.md.

stories260K carries llama2.c's greedy tokens; the transformers-made tiny checkpoints carry transformers'
tokens and logits. `helpers.model_path` finds them; a missing model is an error, never a skip.

`--impl PKG` grades a learner's package here too: the deep tests of the memory layers
(test_memory_*.py) ask `pagedref.course.lesson()` for the module they check, as the stage tests do.
"""

import contextlib
import fcntl
import os
import tempfile

import pytest

from pagedref import course

# GPU tests share the device; a test that measures the device's free memory (the pool sizing by profiling) needs
# it to itself. Under pytest-xdist each GPU test in tests/ holds GPU_LOCK shared while it runs, and such a test
# holds it exclusively (gpu_to_itself): it waits until no other worker's test runs, and theirs wait for it. The
# turnstile lets the exclusive test in: once it waits there, no new test takes the lock shared, so a suite that
# always has some GPU test running cannot keep it out. (stages/' GPU tests run small kernels, megabytes: they
# do not take it.)
GPU_LOCK = os.path.join(tempfile.gettempdir(), "pagedref-gpu-tests.lock")
GPU_TURNSTILE = GPU_LOCK + ".turnstile"


@contextlib.contextmanager
def _gpu_lock(exclusive: bool):
    with open(GPU_TURNSTILE, "a") as gate, open(GPU_LOCK, "a") as lock:
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_EX)  # held to the end: shared takers queue at the gate
            fcntl.flock(lock, fcntl.LOCK_EX)  # the tests already running finish
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


def pytest_addoption(parser):
    course.pytest_options(parser)


def pytest_configure(config):
    course.pytest_setup(config)


@pytest.fixture(autouse=True)
def _share_the_gpu(request):
    if request.node.get_closest_marker("gpu") is None or "gpu_to_itself" in request.fixturenames:
        yield
        return
    with _gpu_lock(exclusive=False):
        yield


@pytest.fixture
def gpu_to_itself():
    """The GPU with no other test of this run on it (other workers' processes stay, idle, with their memory)."""
    with _gpu_lock(exclusive=True):
        yield
