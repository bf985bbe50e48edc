"""The fast tier holds only tests that start no process: in it
(``DISPATCH_TEST_TIER=fast``, what ``./scripts/test --fast`` sets) a test that
starts one fails with the marker to add, and the same test marked ``process``
runs. Each case runs pytest on a small test file in a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.process  # runs pytest in a child interpreter

STARTS_A_PROCESS = """
import os, subprocess, pytest

{mark}
def test_it():
    {body}
"""


def _run(tmp_path: Path, body: str, mark: str = "", tier: str = "fast") -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(STARTS_A_PROCESS.format(mark=mark, body=body))
    env = {**os.environ, "DISPATCH_TEST_TIER": tier, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.unit.conftest", "-c", os.devnull,
                           "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           str(tmp_path / "test_case.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


# The C helper's launches (vfork, not through os): the set-up builds it.
_BY_THE_HELPER = ("from dispatchd.tools import native; "
                  "native.lines.spawn_confined(b'/bin/true', [b'true'], [], 0, 1, 2, [], -1, [], -1, b'', 0)")


@pytest.mark.parametrize("body", ['subprocess.run(["true"])', "os.fork()", 'os.system("true")', _BY_THE_HELPER])
def test_a_process_started_in_the_fast_tier_fails_the_test(tmp_path: Path, body: str) -> None:
    out = _run(tmp_path, body)
    assert out.returncode == 1, out.stdout
    assert "in the fast tier: a test that starts a process carries @pytest.mark.process" in out.stdout


def test_the_same_test_marked_process_runs(tmp_path: Path) -> None:
    out = _run(tmp_path, 'subprocess.run(["true"], check=True)', mark="@pytest.mark.process")
    assert out.returncode == 0, out.stdout


def test_outside_the_fast_tier_nothing_is_refused(tmp_path: Path) -> None:
    out = _run(tmp_path, 'subprocess.run(["true"], check=True)', tier="")
    assert out.returncode == 0, out.stdout
