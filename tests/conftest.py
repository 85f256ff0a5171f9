"""Shared fixtures of the deeper tests: where the shared models live.

The models with oracle outputs are never copied into the repository: they live in ../shared/models
beside it (always present in CI) and are read there; a missing model is an error, never a skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import SHARED_MODELS, shared_model  # noqa: F401  (re-exported for other test modules)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    if not SHARED_MODELS.is_dir():
        raise FileNotFoundError(f"shared models directory not found at {SHARED_MODELS}")
    return SHARED_MODELS
