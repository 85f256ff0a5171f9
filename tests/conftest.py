"""The deeper tests' models: in the repository, under tests/models/, each with its PROVENANCE.md.

stories260K carries llama2.c's greedy tokens; the transformers-made tiny checkpoints carry transformers'
tokens and logits. `helpers.model_path` finds them; a missing model is an error, never a skip.

`--impl PKG` grades a learner's package here too: the deep tests of the memory layers
(test_memory_*.py) ask `pagedref.course.lesson()` for the module they check, as the stage tests do.
"""

from pagedref import course


def pytest_addoption(parser):
    course.pytest_options(parser)


def pytest_configure(config):
    course.pytest_setup(config)
