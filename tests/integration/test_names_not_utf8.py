"""Names that are not UTF-8, with a real daemon: a directory ``bad\\xff``
holding the ``.envrc`` a session planted, a branch ``bad\\xff``, a directory
a checkpoint cannot read. Each is reported whole (as ``\\xNN``) in the
close's reply, in every session's ``status``, in the daemon's log and in
an error's message, and the worktree stays openable. Before, one such name
made the close's reply unsendable (the client saw the connection lost, and
every ``status`` failed while a session of the worktree lived), or made
every later open of the worktree fail until the daemon restarted. Each test
has its twin: a name that is UTF-8 (``caf\\u00e9``), reported as it is.

Also here: a close report over the bound says how many items it leaves
out, and a close whose baseline record cannot be rewritten (a write the
kernel refuses) reports what its check did, and why the record was not
rewritten."""

from __future__ import annotations

import os
import re
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, shell, wait_until
from tests.integration.test_cli import run

# (what printf makes of it in a session, the name's bytes, how the daemon shows it)
NAMES = [("bad\\377", b"bad\xff", "bad\\xff"), ("caf\\303\\251", b"caf\xc3\xa9", "caf\u00e9")]
IDS = ["not-utf8", "utf8"]
ENV = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.invalid",
       "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.invalid"}


class _FileLogDaemon(Daemon):
    """Logging to a file, as autostart runs it: where a name that is not
    UTF-8 cost the line ("--- Logging error ---", on stderr)."""

    def __init__(self, base: Path) -> None:
        self.file_log = base / "file.log"
        super().__init__(base, "--log-level", "info", "--log-file", str(self.file_log))

    def log(self) -> str:
        return self.file_log.read_text(errors="surrogateescape") if self.file_log.exists() else ""

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def ndaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_FileLogDaemon]:
    _refuse_root()
    d = _FileLogDaemon(tmp_path_factory.mktemp("names"))
    yield d
    assert d.stop() == 0, d.stderr()


def git(cwd: Path, *args: str | bytes) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=ENV,
                          timeout=60).stdout.decode("utf-8", "surrogateescape")


def rev(repo: Path, ref: bytes) -> str:
    out = subprocess.run(["git", "rev-parse", "--verify", "-q", ref], cwd=repo, capture_output=True, env=ENV)
    return out.stdout.decode().strip()


@pytest.fixture
def repo(worktree: Path) -> Path:
    git(worktree, "init", "-q", "-b", "main")
    git(worktree, "add", ".")
    git(worktree, "commit", "-qm", "one")
    (worktree / "README.md").write_text("two\n")
    git(worktree, "commit", "-qam", "two")
    return worktree


@pytest.mark.parametrize(("made", "raw", "shown"), NAMES, ids=IDS)
def test_a_file_name_not_utf8_is_reported_whole_and_status_still_answers(
        ndaemon: _FileLogDaemon, worktree: Path, made: str, raw: bytes, shown: str) -> None:
    """A plants ``NAME/.envrc`` and closes while B, on the same worktree,
    lives: A's close lists it moved aside, and B's status, the daemon's
    status (``dispatch status``, ``--json``) and ``session list`` answer and
    show it; the log has its line."""
    seen = len(ndaemon.log())
    with ndaemon.connect() as c:
        a = c.open_session(str(worktree))
        b = c.open_session(str(worktree))
        try:
            r = shell(a, f'd=$(printf "{made}") && mkdir "$d" && echo "echo planted" > "$d/.envrc" && echo ok')
            assert r.output == "ok\n", (r.output, r.error)
            a.close()
            [item] = a.protected
            assert item["path"].startswith(f"{worktree}/{shown}/.envrc.quarantined-by-dispatchd-"), item
            assert item["why"] == "a repository or a file your tools run, changed or new"
            aside = os.listdir(os.path.join(os.fsencode(worktree), raw))
            assert len(aside) == 1 and aside[0].startswith(b".envrc.quarantined-by-dispatchd-"), aside
            assert [p["path"] for p in b.status()["protected"]] == [item["path"]]
            assert any(p["path"] == item["path"] for s in c.status()["sessions"] for p in s["protected"])
            for args in (("status",), ("status", "--json"), ("session", "list")):
                out = run(ndaemon, *args)
                assert out.returncode == 0 and out.stderr == "", (args, out.stderr)
            # dispatch prints the reply's text with every backslash doubled
            # (dispatchd/display.py): the \xNN of a byte not UTF-8 as \\xNN.
            assert shown.replace("\\", "\\\\") in run(ndaemon, "status").stdout
        finally:
            b.close()
    log = ndaemon.log()[seen:]
    assert f"event=tool_file_quarantined path={worktree}/{shown}/.envrc" in log
    assert "Logging error" not in ndaemon.stderr()


@pytest.mark.parametrize(("made", "raw", "shown"), NAMES, ids=IDS)
def test_a_branch_not_utf8_a_session_makes_leaves_the_worktree_openable(
        ndaemon: _FileLogDaemon, repo: Path, made: str, raw: bytes, shown: str) -> None:
    """The session's ``git branch NAME``: the opens after it work (its
    baseline records the branch). Before, every open of the worktree was
    refused with ``internal error: UnicodeEncodeError`` until a restart,
    even once the branch was gone."""
    with ndaemon.connect() as c:
        with c.open_session(str(repo)) as s:
            r = shell(s, f'git branch "$(printf "{made}")" && echo ok')
            assert r.output == "ok\n", (r.output, r.error)
        assert s.protected == []  # a new branch is the session's work, and stays
        for _ in range(2):
            with c.open_session(str(repo)) as s:
                assert shell(s, "git branch --list | wc -l").output == "2\n"
    assert rev(repo, b"refs/heads/" + raw) == rev(repo, b"main")


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
@pytest.mark.parametrize(("made", "raw", "shown"), NAMES, ids=IDS)
def test_the_users_branch_not_utf8_is_put_back_under_its_own_name(
        ndaemon: _FileLogDaemon, repo: Path, made: str, raw: bytes, shown: str, packed: bool) -> None:
    """The user's branch NAME, which a session deletes, is put back: the
    very ref (not one named with U+FFFD), and the close says so."""
    git(repo, "branch", raw)
    if packed:
        git(repo, "pack-refs", "--all")
    before = rev(repo, b"refs/heads/" + raw)
    with ndaemon.connect() as c, c.open_session(str(repo)) as s:
        r = shell(s, f'git update-ref -d "refs/heads/$(printf "{made}")" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
    assert [(p["path"], p["why"]) for p in s.protected] == [
        (f"refs/heads/{shown}", f"deleted by a session; put back at {before[:12]}"),
        ("logs", "1 reflogs a session cut put back (1 lines of your `git reflog`, and the commits only they name): "
                 f"refs/heads/{shown}")]  # its reflog, deleted with it, under its own name too
    assert rev(repo, b"refs/heads/" + raw) == before
    assert "\ufffd" not in git(repo, "for-each-ref", "--format=%(refname)")


@pytest.mark.parametrize(("made", "raw", "shown"), NAMES, ids=IDS)
def test_a_restore_displaces_a_branch_not_utf8_and_says_so(
        ndaemon: _FileLogDaemon, repo: Path, made: str, raw: bytes, shown: str) -> None:
    """A branch made after a checkpoint: the restore keeps it under
    ``refs/dispatchd/displaced/`` (its record, which names the refs, is
    written whole) and its reply names it."""
    with ndaemon.connect() as c, c.open_session(str(repo)) as s:
        cid = s.checkpoint()
        r = shell(s, f'git branch "$(printf "{made}")" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
        done = s.restore(cid)
        [kept] = done["displaced"]
        assert re.fullmatch(rf"refs/dispatchd/displaced/[0-9T]+/refs/heads/{re.escape(shown)}", kept), kept
    assert rev(repo, os.fsencode(kept).replace(shown.encode(), raw)) == rev(repo, b"main")


@pytest.mark.parametrize(("made", "raw", "shown"), NAMES, ids=IDS)
def test_a_checkpoint_refused_for_a_directory_not_utf8_names_it(
        ndaemon: _FileLogDaemon, worktree: Path, made: str, raw: bytes, shown: str) -> None:
    """A directory the checkpoint cannot read: a refusal naming it, never
    a connection lost (the error's message could not be sent)."""
    with ndaemon.connect() as c, c.open_session(str(worktree)) as s:
        r = shell(s, f'd=$(printf "{made}") && mkdir "$d" && chmod 000 "$d" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
        try:
            with pytest.raises(dispatch.DispatchError) as refused:
                s.checkpoint()
            assert refused.value.code == "checkpoint_refused", refused.value
            assert f"checkpoint refused: {shown}: a directory that cannot be read" in str(refused.value)
            assert s.status()["id"] == s.id  # the connection still serves
        finally:
            os.chmod(os.path.join(os.fsencode(worktree), raw), 0o755)


@pytest.mark.parametrize("files", [250, 10])
def test_a_long_close_report_says_how_many_it_leaves_out(ndaemon: _FileLogDaemon, repo: Path, files: int) -> None:
    """A session rewinds a branch and leaves an ``.envrc`` in each of FILES
    directories: the close lists the branch first, then the files, at most
    200 items, and then how many it left out. The twin: 10 files, all
    listed (the branch first too), nothing said left out."""
    git(repo, "branch", "feature")
    with ndaemon.connect() as c, c.open_session(str(repo)) as s:
        r = shell(s, f"git update-ref refs/heads/feature HEAD~1 && for i in $(seq 1 {files}); do mkdir n$i && "
                     "echo x > n$i/.envrc; done && echo ok")
        assert r.output == "ok\n", (r.output, r.error)
    assert s.protected[0]["path"] == "refs/heads/feature"
    envrcs = [p for p in s.protected if p["why"] == "a repository or a file your tools run, changed or new"]
    if files == 10:
        assert len(s.protected) == 11 and len(envrcs) == 10
        return
    assert len(s.protected) == 201 and len(envrcs) == 199
    assert s.protected[-1] == {"path": str(repo), "time": s.protected[-1]["time"], "why": (
        "and 51 more moved aside or put back, not listed here (51 a repository or a file your tools run, "
        "changed or new): the daemon's log names each")}
    assert len(list(repo.glob("n*/.envrc.quarantined-by-dispatchd-*"))) == 250  # every one moved all the same


@pytest.mark.parametrize("refused", [True, False], ids=["write-refused", "twin"])
def test_a_close_whose_record_cannot_be_rewritten_reports_its_check(
        ndaemon: _FileLogDaemon, worktree: Path, refused: bool) -> None:
    """Two sessions; the first closes while the kernel refuses the daemon's
    writes (RLIMIT_FSIZE 0: EFBIG, where a full disk gives ENOSPC, on the
    same write): its close lists the ``.envrc`` it moved aside and names the
    record it could not rewrite and why, and the temporary file of a cut
    write is swept as at every end. Before, the close failed with
    ``internal error: OSError`` and the list was in the log only."""
    with ndaemon.connect() as c:
        a = c.open_session(str(worktree))
        b = c.open_session(str(worktree))
        try:
            r = shell(a, 'echo "echo planted" > .envrc && echo cut > .f.dispatchd-0123abcd.tmp && echo ok')
            assert r.output == "ok\n", (r.output, r.error)
            soft, hard = resource.prlimit(ndaemon.proc.pid, resource.RLIMIT_FSIZE)
            if refused:
                resource.prlimit(ndaemon.proc.pid, resource.RLIMIT_FSIZE, (0, hard))
            try:
                a.close()
            finally:
                resource.prlimit(ndaemon.proc.pid, resource.RLIMIT_FSIZE, (soft, hard))
            assert a.protected[0]["path"].startswith(f"{worktree}/.envrc.quarantined-by-dispatchd-"), a.protected
            assert not (worktree / ".envrc").exists() and not (worktree / ".f.dispatchd-0123abcd.tmp").exists()
            if not refused:
                assert len(a.protected) == 1
                return
            [said] = a.protected[1:]
            top = ndaemon.state / "dispatchd" / "baselines"
            assert re.fullmatch(rf"{re.escape(str(top))}/[0-9a-f]{{16}}\.json", said["path"]), said
            assert said["why"].startswith("the worktree's baseline record could not be rewritten without this session "
                                          "(File too large, EFBIG): this end's check ran all the same"), said
            assert b.status()["protected"] == a.protected[:1]
        finally:
            b.close()
    # The last end rewrites nothing: its record goes (just after its reply).
    assert wait_until(lambda: not list((ndaemon.state / "dispatchd" / "baselines").glob("*.json")))
