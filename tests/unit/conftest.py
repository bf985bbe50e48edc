"""Fixtures of the unit suite."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from tests.unit.gitrepo import make_repo


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A plain git repository (``tests.unit.gitrepo.make_repo``)."""
    return make_repo(tmp_path / "repo")


# --- the fast tier ----------------------------------------------------------
# `./scripts/test --fast` runs this suite with DISPATCH_TEST_TIER=fast and
# `-m "not process"`: pure logic only. So that a test which starts a process
# cannot slip into it unmarked (and make the tier slow, or dependent on the
# machine), every way this interpreter starts one fails the test there, with
# the marker to add. The other tiers run the marked tests as before.

FAST_TIER = os.environ.get("DISPATCH_TEST_TIER") == "fast"


def _refused(what: str) -> Callable[..., NoReturn]:
    def refuse(*_args: object, **_kwargs: object) -> NoReturn:
        raise AssertionError(f"{what} in the fast tier: a test that starts a process carries "
                             "@pytest.mark.process (or `pytestmark = pytest.mark.process` for its module)")
    return refuse


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not FAST_TIER or request.node.get_closest_marker("process") is not None:
        return
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refused("subprocess"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refused(f"os.{name}"))
    # The C helper's own launches (vfork and exec: tools/_spawn.c, _confined.c).
    from dispatchd.tools import native

    if native.lines is not None:
        for name in ("spawn_subreaper", "spawn_confined"):
            monkeypatch.setattr(native.lines, name, _refused(f"the C helper's {name}"))
