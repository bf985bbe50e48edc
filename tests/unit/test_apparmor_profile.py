"""packaging/apparmor: the profile that lets dispatchd's launcher make user
namespaces where Ubuntu's AppArmor restricts them, checked by apparmor_parser.

``apparmor_parser -Q -K`` parses without loading anything into the kernel
(this machine has no AppArmor LSM). The ``userns`` rule and ``abi/4.0`` need
AppArmor 4 (Debian 13, Ubuntu 23.10+): with an older parser (Debian 12's
3.0.8) the profile is parsed whole where it can be, else the rest of it
(attachment, flags, includes) with those two lines taken out, and the test
says which.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dispatchd.kernel import APPARMOR_FIX

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGING = REPO / "packaging" / "apparmor"
PROFILE = PACKAGING / "dispatchd"
ABI4 = "/etc/apparmor.d/abi/4.0"


def _parse(path: Path) -> subprocess.CompletedProcess[str]:
    parser = shutil.which("apparmor_parser") or "/usr/sbin/apparmor_parser"
    return subprocess.run([parser, "-Q", "-K", str(path)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def parser() -> None:
    if not (shutil.which("apparmor_parser") or os.path.exists("/usr/sbin/apparmor_parser")):
        pytest.skip("apparmor_parser is not installed (scripts/_common.sh installs the apparmor package as root)")


def test_the_profile_grants_userns_to_the_launcher_alone() -> None:
    text = PROFILE.read_text()
    assert "profile dispatchd /usr/libexec/dispatchd/dispatchd-launch flags=(unconfined) {\n  userns,\n" in text
    rules = [line for line in text.splitlines() if line and not line.lstrip().startswith("#")]
    assert [line for line in rules if line.startswith("profile ")] == [rules[2]] and rules[0] == "abi <abi/4.0>,"


@pytest.mark.process  # runs apparmor_parser or a shell script
def test_the_profile_parses(parser: None, tmp_path: Path) -> None:
    if os.path.exists(ABI4):
        out = _parse(PROFILE)
        assert out.returncode == 0, out.stderr
        return
    # AppArmor 3: the same profile but the two lines it predates.
    older = tmp_path / "dispatchd"
    older.write_text(PROFILE.read_text().replace("abi <abi/4.0>,", "abi <abi/3.0>,").replace("  userns,\n", ""))
    out = _parse(older)
    assert out.returncode == 0, out.stderr
    # ... and the parser is indeed too old for the rule, not the profile wrong.
    out = _parse(PROFILE)
    assert out.returncode != 0 and "Could not open 'abi/4.0'" in out.stderr, out.stderr


@pytest.mark.process  # runs apparmor_parser or a shell script
def test_a_broken_profile_is_refused_by_the_parser(parser: None, tmp_path: Path) -> None:
    """The twin: the parser does reject what is wrong."""
    broken = tmp_path / "broken"
    broken.write_text("profile dispatchd /usr/libexec/dispatchd/dispatchd-launch flags=(unconfined) {\n  nonsense\n}\n")
    assert _parse(broken).returncode != 0


@pytest.mark.process  # runs apparmor_parser or a shell script
def test_the_launcher_runs_dispatchd_isolated_and_the_installer_parses() -> None:
    launcher = (PACKAGING / "dispatchd-launch").read_text()
    assert launcher.splitlines()[-1] == 'exec @PYTHON@ -I -m dispatchd "$@"'
    assert subprocess.run(["sh", "-n", str(PACKAGING / "dispatchd-launch")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(PACKAGING / "install")]).returncode == 0
    assert os.access(PACKAGING / "install", os.X_OK)
    assert APPARMOR_FIX.startswith("sudo packaging/apparmor/install ")  # what status tells the user to run


@pytest.mark.process  # runs apparmor_parser or a shell script
def test_the_installer_refuses_an_ordinary_user() -> None:
    if os.geteuid() == 0:
        pytest.skip("run as root")
    out = subprocess.run([str(PACKAGING / "install")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith("install: run it as root")
