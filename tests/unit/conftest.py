"""Fixtures of the unit suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.gitrepo import make_repo


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A plain git repository (``tests.unit.gitrepo.make_repo``)."""
    return make_repo(tmp_path / "repo")
