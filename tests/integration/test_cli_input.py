"""``dispatch`` given what dispatchd cannot carry (the protocol is JSON, in
UTF-8): a worktree, a policy or a command argument that is not UTF-8, and a
``call @FILE`` whose file is not, each get one line naming the argument or
the file, exit 2, and no session. The twins: an odd name that is UTF-8 (a
newline in it) and a UTF-8 file are used as given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dispatch
from tests.conftest import Daemon
from tests.integration.test_cli import _env, sessions_on


def _run(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart", *args]
    return subprocess.run(cmd, capture_output=True, env=_env(), timeout=60, stdin=subprocess.DEVNULL)


def _refused(done: subprocess.CompletedProcess[bytes], line: str) -> None:
    assert (done.returncode, done.stdout, done.stderr) == (2, b"", (line + "\n").encode()), done


def _git_dir(tmp_path: Path, name: bytes) -> str:
    path = os.fsencode(tmp_path) + b"/" + name
    os.makedirs(path)
    subprocess.run(["git", "init", "-q", path], check=True)
    return os.fsdecode(path)


def test_arguments_not_utf8_are_refused_by_name(daemon: Daemon, client: dispatch.Client, worktree: Path,
                                               tmp_path: Path) -> None:
    bad = _git_dir(tmp_path, b"wt\xff")
    shown = str(tmp_path) + "/wt\\xff"
    _refused(_run(daemon, "exec", "--worktree", bad, "--", "pwd"),
             f"dispatch: --worktree: the path is not UTF-8 ({shown}), which dispatchd cannot carry")
    _refused(_run(daemon, "session", "open", "--worktree", bad),
             f"dispatch: --worktree: the path is not UTF-8 ({shown}), which dispatchd cannot carry")
    _refused(_run(daemon, "exec", "--worktree", str(worktree), "--policy", os.fsdecode(b"p\xfe"), "--", "pwd"),
             "dispatch: --policy: the name is not UTF-8 (p\\xfe), which dispatchd cannot carry")
    _refused(_run(daemon, "exec", "--worktree", str(worktree), "--", "echo", os.fsdecode(b"a\xfe")),
             "dispatch: the command: an argument is not UTF-8 (a\\xfe), which dispatchd cannot carry")
    assert sessions_on(client, worktree) == [] and sessions_on(client, Path(bad)) == []


def test_a_worktree_with_a_newline_in_its_name_is_used(daemon: Daemon, client: dispatch.Client,
                                                       tmp_path: Path) -> None:
    odd = _git_dir(tmp_path, b"wt\nnl\xc3\xa9")  # the twin: odd, and UTF-8
    done = _run(daemon, "exec", "--worktree", odd, "--", "pwd")
    assert (done.returncode, done.stdout) == (0, os.fsencode(odd) + b"\n"), done
    assert sessions_on(client, Path(odd)) == []


def test_call_arguments_from_a_file_not_utf8_name_the_file(daemon: Daemon, client: dispatch.Client,
                                                           worktree: Path, tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_bytes(b'{"command": "echo \xff > ran.txt"}')
    _refused(_run(daemon, "call", "--worktree", str(worktree), "shell_exec", f"@{args}"),
             f"dispatch: the tool's arguments ({args}) are not UTF-8 (byte 18), which dispatchd cannot carry")
    assert not (worktree / "ran.txt").exists()
    assert sessions_on(client, worktree) == []


def test_call_arguments_from_a_utf8_file_are_used(daemon: Daemon, client: dispatch.Client,
                                                  worktree: Path, tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_text('{"command": "echo \u00e9"}', encoding="utf-8")  # the twin
    done = _run(daemon, "call", "--worktree", str(worktree), "shell_exec", f"@{args}")
    assert done.returncode == 0 and '"output": "\\u00e9\\n"' in done.stdout.decode(), done
