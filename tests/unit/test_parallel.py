"""./scripts/test's parallel runs (pytest-xdist, ``--dist loadscope``): the
tests of a module run on one worker, so a module-wide fixture (a daemon per
module, per mode) is made once per parameter, as in a run in one process,
and each worker has a temporary directory of its own. Each case runs pytest
on small test files in a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.process  # runs pytest in a child interpreter

CASE = """
import os, pytest

@pytest.fixture(scope="module", params=["full", "degraded"])
def shared(request):
    with open(os.environ["SETUPS"], "a") as f:
        f.write(f"{request.param} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")
    return request.param

@pytest.mark.parametrize("i", range(8))
def test_with_the_shared_fixture(shared, i):
    pass

@pytest.mark.parametrize("i", range(8))
def test_alone(i):
    pass
"""

OTHER = """
import os, pytest

@pytest.mark.parametrize("i", range(8))
def test_elsewhere(i, tmp_path_factory):
    with open(os.environ["ALONE"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {tmp_path_factory.getbasetemp()}\\n")
"""


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str], list[str]]:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "test_case.py").write_text(CASE)
    (tmp_path / "test_other.py").write_text(OTHER)
    setups, alone = tmp_path / "setups", tmp_path / "alone"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1",
           "SETUPS": str(setups), "ALONE": str(alone)}
    env.pop("DISPATCH_TEST_STATS", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", os.devnull,
                          "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"), "-p", "no:cacheprovider", *args, str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    read = lambda p: p.read_text().splitlines() if p.exists() else []  # noqa: E731
    return out, read(setups), read(alone)


def test_a_module_fixture_is_made_once_per_parameter_across_workers(tmp_path: Path) -> None:
    out, setups, elsewhere = _run(tmp_path / "parallel", "-n", "3", "--dist", "loadscope")
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(s.split()[0] for s in setups) == ["degraded", "full"], setups
    assert len({s.split()[1] for s in setups}) == 1  # on one worker
    assert len(elsewhere) == 8  # the other module's tests all ran, on one worker, in its own directory
    (worker, basetemp), = {tuple(line.split()) for line in elsewhere}
    assert basetemp.endswith(f"/popen-{worker}")
    # The twin: in one process, the same two.
    out, setups, _ = _run(tmp_path / "one")
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(s.split()[0] for s in setups) == ["degraded", "full"], setups
