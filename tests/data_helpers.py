"""Data sets in tests: found through engine/datasets.py, or the test is skipped by the data set's name
with the ways to provide it (never failed because a folder is absent)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import datasets
from engine.errors import DataUnavailableError


def dataset_or_skip(name: str) -> Path:
    try:
        return datasets.resolve(name)
    except DataUnavailableError as e:
        pytest.skip(f"needs data set {name!r}: {e}")
