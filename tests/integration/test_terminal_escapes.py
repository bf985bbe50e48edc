"""Names a session chose, in what dispatchd prints and logs, against a real daemon.

A session plants files whose directories' names hold ESC sequences (erase
the line, move up, conceal, OSC 52 to the clipboard), a newline followed by
a forged line of the report or of the log, branches named with a C1 CSI and
a bidi override, and a background job whose command holds the same escapes.
``dispatch session close``, ``dispatch status``, ``dispatch session
restore`` and ``dispatch jobs`` print them escaped, one line each, and the
daemon's log keeps one line per event; the twin in each test is an ordinary
name (accents, CJK) printed as it is. ``--json`` is unchanged: the raw names,
escaped by JSON itself.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import dispatch
from tests.conftest import Daemon, shell
from tests.integration.test_cli import run

# Erase this line and the one above, go back, print a green "all clean", write
# the clipboard (OSC 52), conceal everything after.
HOSTILE = "b\x1b[2K\x1b[1A\x1b[2K\r\x1b[32mall clean: nothing moved\x1b[0m\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[8m"
HOSTILE_SHOWN = ("b\\x1b[2K\\x1b[1A\\x1b[2K\\r\\x1b[32mall clean: nothing moved\\x1b[0m"
                 "\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[8m")
# A newline, then a line the report would print.
FORGED_REPORT = "moved aside or put back: nothing else, all clean"
NEWLINE = f"c\n{FORGED_REPORT}"
NEWLINE_SHOWN = f"c\\n{FORGED_REPORT}"
# A newline, then a line the log would write.
FORGED_LOG = "2026-12-01 04:20:00,000 INFO dispatchd event=session_close session=deadbeef0000"
IN_LOG = f"x\n{FORGED_LOG}\n"
IN_LOG_SHOWN = f"x\\n{FORGED_LOG}\\n"
ORDINARY = "plain é 日本"
EVIL_BRANCH = "evil\u009b\u202etxt"  # a C1 CSI, then a right-to-left override
ACTED_ON = ("\x1b", "\x07", "\r", "\x9b", "\u202e")  # what a terminal would act on, none of it printed


def _plant(s: dispatch.Session, *names: str) -> None:
    """An ``.envrc`` (a file direnv runs) in a directory of each name."""
    words = " ".join(f"mkdir -p -- {shlex.quote(n)} && echo x > {shlex.quote(n)}/.envrc &&" for n in names)
    r = shell(s, f"{words} echo ok")
    assert r.output == "ok\n", (r.output, r.error)


def _moved_lines(text: str, worktree: Path) -> dict[str, str]:
    """The report's lines, by the directory they name (as printed)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"\s*moved aside or put back: {re.escape(str(worktree))}/(.*)/\.envrc\.[^/]+: "
                         r"a repository or a file your tools run, changed or new", line)
        assert m, line
        found[m.group(1)] = line
    return found


def test_a_close_s_report_and_status_show_planted_names_escaped(daemon: Daemon, client: dispatch.Client,
                                                                worktree: Path) -> None:
    """Y plants and closes with ``dispatch session close``; X, on the same
    worktree, keeps Y's report, which ``dispatch status`` prints. Each name
    is one line, escaped; the ordinary one is printed as it is."""
    seen = len(daemon.log())
    with client.open_session(str(worktree)) as x:
        out = run(daemon, "session", "open", "--worktree", str(worktree))
        assert out.returncode == 0, out.stderr
        y = out.stdout.strip()
        with client.session(y) as ys:
            _plant(ys, HOSTILE, NEWLINE, IN_LOG, ORDINARY)
        closed = run(daemon, "session", "close", y)
        assert closed.returncode == 0 and closed.stderr == "", closed.stderr
        assert not any(c in closed.stdout for c in ACTED_ON), closed.stdout
        assert sorted(_moved_lines(closed.stdout, worktree)) == sorted(
            [HOSTILE_SHOWN, NEWLINE_SHOWN, IN_LOG_SHOWN, ORDINARY])  # four lines: none forged
        assert not any(line.startswith(FORGED_REPORT) for line in closed.stdout.splitlines())

        status = run(daemon, "status")
        assert status.returncode == 0 and status.stderr == ""
        assert not any(c in status.stdout for c in ACTED_ON)
        mine = [line for line in status.stdout.splitlines() if "moved aside or put back: " in line]
        assert sorted(_moved_lines("\n".join(mine), worktree)) == sorted(
            [HOSTILE_SHOWN, NEWLINE_SHOWN, IN_LOG_SHOWN, ORDINARY])
        # --json: the names themselves, as JSON escapes them.
        as_json = json.loads(run(daemon, "status", "--json").stdout)
        paths = [p["path"] for s in as_json["sessions"] if s["id"] == x.id for p in s["protected"]]
        assert sorted(p.split("/")[-2] for p in paths) == sorted([HOSTILE, NEWLINE, IN_LOG, ORDINARY])

    log = daemon.log()[seen:]
    assert not any(c in log for c in ACTED_ON)
    assert not any(line.startswith(FORGED_LOG[:23]) for line in log.splitlines())  # no forged record
    quarantined = [line for line in log.splitlines()
                   if f"event=tool_file_quarantined path={worktree}/" in line]
    assert len(quarantined) == 4, quarantined  # one line an event, within the bound: each logged
    assert any(f"path={worktree}/{IN_LOG_SHOWN}/.envrc." in line for line in quarantined), quarantined
    assert any(f"path={worktree}/{ORDINARY}/.envrc." in line for line in quarantined), quarantined
    assert "event=log_lines_left_out" not in log


def test_a_close_of_many_files_logs_the_first_and_a_count(daemon: Daemon, client: dispatch.Client,
                                                         worktree: Path) -> None:
    """45 planted files: the reply lists every one, the log the first 20
    and one line for the other 25, so the log's earlier lines stay."""
    seen = len(daemon.log())
    with client.open_session(str(worktree)) as s:
        r = shell(s, "for i in $(seq 1 45); do mkdir d$i && echo x > d$i/.envrc; done; echo ok")
        assert r.output == "ok\n", r.error
        sid = s.id
    assert len(s.protected) == 45
    log = daemon.log()[seen:]
    assert f"event=session_open session={sid}" in daemon.log()
    assert len([line for line in log.splitlines() if f"event=tool_file_quarantined path={worktree}/" in line]) == 20
    assert ("event=log_lines_left_out count=25 after=20: moved aside or put back by this check, not logged one by "
            "one; the close's reply and `dispatch status` list them") in log


def test_a_restore_prints_refs_and_labels_escaped(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    """Branches made after a checkpoint, displaced by its restore: one named
    with a C1 CSI and a bidi override, one ordinary (the twin)."""
    git = ["git", "-c", "user.email=u@example.invalid", "-c", "user.name=u"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=worktree, check=True)
    subprocess.run([*git, "commit", "-qm", "first", "--allow-empty"], cwd=worktree, check=True)
    with client.open_session(str(worktree)) as s:
        made = run(daemon, "session", "checkpoint", s.id, "--label", "before \x1b[8mhidden")
        assert made.returncode == 0, made.stderr
        cid = made.stdout.strip()
        listed = run(daemon, "session", "checkpoints", s.id)
        assert listed.stdout.rstrip("\n").endswith("  before \\x1b[8mhidden"), listed.stdout
        r = shell(s, f"git branch {shlex.quote(EVIL_BRANCH)} && git branch plain-é && echo ok")
        assert r.output == "ok\n", r.error
        restored = run(daemon, "session", "restore", s.id, cid)
        assert restored.returncode == 0, restored.stderr
        assert not any(c in restored.stdout for c in ACTED_ON), restored.stdout
        kept = [line for line in restored.stdout.splitlines() if line.startswith("a value it moved is kept as ")]
        assert sorted(line.rsplit("/", 1)[1] for line in kept) == ["evil\\u009b\\u202etxt", "plain-é"], kept


def test_the_job_list_shows_a_command_s_escapes_escaped(daemon: Daemon, client: dispatch.Client,
                                                       worktree: Path) -> None:
    hostile = "sleep 60 # \x1b[2K\r\x1b[32mno jobs running\x1b[8m \x1b]52;c;ZWNobyBwd25lZA==\x07"
    ordinary = "sleep 61 # grep 'a\\.b' é"
    with client.open_session(str(worktree)) as s:
        first = shell(s, hostile, background=True).metadata["job"]
        second = shell(s, ordinary, background=True).metadata["job"]
        listed = run(daemon, "jobs", "--session", s.id)
        assert listed.returncode == 0, listed.stderr
        # The carriage return is white space (commands are listed on one line,
        # their white space collapsed, as before); ESC and BEL are escaped; the
        # ordinary command's backslash stays as written.
        assert listed.stdout == (
            f"{first}\trunning\tsleep 60 # \\x1b[2K \\x1b[32mno jobs running\\x1b[8m \\x1b]52;c;ZWNobyBwd25lZA==\\x07\n"
            f"{second}\trunning\t{ordinary}\n")
