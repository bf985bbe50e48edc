"""The shell helpers of scripts/_common.sh that need no root: how the demo
echoes commands, and the end-of-run cleanup of a root test run."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the shell helpers in bash

REPO = Path(__file__).resolve().parent.parent.parent


def _default_sigint() -> None:
    # A test process may ignore SIGINT (an xdist worker does), and bash can
    # trap no signal it was started ignoring: the scripts get it as a shell
    # started from a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f". scripts/_common.sh\n{script}"], cwd=REPO, capture_output=True,
                          text=True, timeout=30, preexec_fn=_default_sigint)


def test_commands_are_echoed_with_their_quotes() -> None:
    out = bash("""show_command dispatch exec --session abc -- bash -c 'echo "written by the agent" > notes.txt'
show_command dispatch call --session abc read_file '{"path": "../../etc/passwd"}'
show_command dispatch exec -- python3 -c 'import socket' "it's"
show_command dispatch status""")
    assert out.stdout.splitlines() == [
        """dispatch exec --session abc -- bash -c 'echo "written by the agent" > notes.txt'""",
        """dispatch call --session abc read_file '{"path": "../../etc/passwd"}'""",
        """dispatch exec -- python3 -c 'import socket' 'it'\\''s'""",
        "dispatch status",
    ]
    # What is printed, pasted into a shell, gives the same words back.
    again = subprocess.run(["bash", "-c", "printf '%s\\n' " + out.stdout.splitlines()[2]], capture_output=True,
                           text=True)
    assert again.stdout.splitlines() == ["dispatch", "exec", "--", "python3", "-c", "import socket", "it's"]


def test_the_end_of_a_run_removes_its_copy(tmp_path: Path) -> None:
    dest = tmp_path / "dispatchd-run-x"
    (dest / "sub").mkdir(parents=True)
    (dest / "sub" / "f").write_text("x")
    out = bash(f"_RUN_DEST={dest} _RUN_CGROUP=; _end_run")
    assert (out.returncode, out.stderr) == (0, "")
    assert not dest.exists()


def test_an_interrupted_run_removes_its_copy_too(tmp_path: Path) -> None:
    dest = tmp_path / "dispatchd-run-y"
    dest.mkdir()
    out = bash(f"_RUN_DEST={dest} _RUN_CGROUP=; trap _end_run EXIT; trap 'exit 130' INT; kill -INT $$; sleep 5")
    assert out.returncode == 130 and not dest.exists()
