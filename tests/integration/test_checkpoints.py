"""Checkpoints and restores through a real daemon and real sessions
(dispatchd/daemon/checkpoints/, docs/checkpoints.md)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
import dispatch.aio
from dispatchd.policy import default_policy_dir
from tests.conftest import Daemon, _refuse_root, shell
from tests.integration.test_cli import run
from tests.sleeping import is_asleep, wait_until_asleep, with_sleep_after

IDENTITY = "GIT_AUTHOR_NAME=agent GIT_AUTHOR_EMAIL=agent@example.invalid " \
           "GIT_COMMITTER_NAME=agent GIT_COMMITTER_EMAIL=agent@example.invalid"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Policies: the shipped ones; 'tiny' (a checkpoint may copy 64 bytes);
    'small' (256 KiB: the test repository, not 1 MiB more);
    'undo' (a checkpoint before every write); 'undo-tiny' (both); 'sleepy'
    (sessions sleep after 0.1 s idle)."""
    _refuse_root()
    base = tmp_path_factory.mktemp("checkpoints")
    policies = base / "policies"
    shutil.copytree(default_policy_dir(), policies)
    text = (policies / "default.toml").read_text()
    for name, new in (("tiny", "max_bytes = 64"), ("small", "max_bytes = 262144"), ("undo", "before_writes = true"),
                      ("undo-tiny", "before_writes = true\nmax_bytes = 64")):
        (policies / f"{name}.toml").write_text(
            text.replace("before_writes = false", "").replace("max_bytes = 4294967296", "").replace(
                "[checkpoints]", f"[checkpoints]\n{new}"))
    (policies / "sleepy.toml").write_text(with_sleep_after(text, 0.1))
    d = Daemon(base, "--policies", str(policies))
    yield d  # the client is tests/conftest.py's, connected to this daemon
    assert d.stop() == 0, d.log()


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = Path(os.path.realpath(tmp_path)) / "repo"
    (r / "src").mkdir(parents=True)
    (r / "src" / "main.py").write_text("def main():\n    return 42\n")
    (r / "gone.txt").write_text("deleted later\n")
    (r / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(r / "run.sh", 0o755)
    os.symlink("src/main.py", r / "link")
    (r / "dir").mkdir()
    (r / "dir" / "inner.txt").write_text("inner\n")
    git(r, "init", "-q", "-b", "main")
    git(r, "config", "user.email", "user@example.invalid")
    git(r, "config", "user.name", "user")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "init")
    git(r, "branch", "feature")
    return r


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry below ``root`` but git's object files (kept apart, and
    left when newer), ``.git/refs/dispatchd`` (the values a restore kept)
    and ``.git/logs`` (reflogs, appended to: each test asserts them apart):
    kind, mode, content or target."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir in (os.path.join(".git", "objects"), os.path.join(".git", "logs")):
            dirnames[:] = []
            continue
        if rel_dir == os.path.join(".git", "refs"):
            dirnames[:] = [d for d in dirnames if d != "dispatchd"]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if rel == os.path.join(".git", "logs"):
                continue
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", 0, os.fsencode(os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), b"")
            else:
                out[rel] = ("f", stat.S_IMODE(st.st_mode), Path(path).read_bytes())
    return out


def ok(result: dispatch.Result) -> dispatch.Result:
    assert result.is_success, (result.error, result.metadata)
    return result


def test_a_restore_puts_files_and_git_back(client: dispatch.Client, repo: Path) -> None:
    before = snapshot(repo)
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint(label="clean")
        assert [(c["id"], c["label"]) for c in s.checkpoints()] == [(cid, "clean")]
        ok(s.registry.get("write_file").call({"path": "src/main.py", "content": "def main():\n    return 0\n"}))
        ok(shell(s, "rm gone.txt && echo new > created.txt && mkdir newdir && echo x > newdir/x && chmod 600 run.sh"
                    " && ln -sfn gone.txt link && rm -r dir && ln -s /etc dir"))
        ok(shell(s, f"git add -A && {IDENTITY} git commit -qm change && git branch -D feature"))
        assert "feature" not in git(repo, "branch")
        change = git(repo, "rev-parse", "main").strip()
        done = s.restore(cid)
        assert done["checkpoint"] == cid and done["removed"] >= 3 and done["written"] >= 4
        # Refs are set as git sets them, not copied back as files: the packed-refs the
        # session's `git branch -D` left (a header, no ref) stays; every ref's value is back.
        after = snapshot(repo)
        assert after.pop(os.path.join(".git", "packed-refs"))[2].startswith(b"# pack-refs with:")
        assert after == before
        # The value main was moved from is kept (feature, deleted before, had none to keep).
        assert len(done["displaced"]) == 1 and done["displaced"][0].startswith("refs/dispatchd/displaced/")
        assert done["displaced"][0].endswith("/refs/heads/main")
        assert git(repo, "rev-parse", done["displaced"][0]).strip() == change
        assert git(repo, "log", "--format=%s", "main") == "init\n"
        assert git(repo, "branch", "--format=%(refname:short)").split() == ["feature", "main"]
        assert git(repo, "status", "--porcelain") == ""
        git(repo, "fsck", "--no-dangling")
        # The session goes on from there.
        assert ok(shell(s, "cat src/main.py")).output.startswith("def main():\n    return 42")
    # The end's checks moved nothing aside; the reflog `git branch -D feature` took with the branch is put back.
    assert [(p["path"], p["why"]) for p in s.protected] == [
        ("logs", "1 reflogs a session cut put back (1 lines of your `git reflog`, and the commits only they name): "
                 "refs/heads/feature")]
    assert len(git(repo, "reflog", "show", "feature").splitlines()) == 2  # its line, and the restore's after it


def test_a_restore_keeps_what_it_replaces_and_is_undone_by_restoring_that(client: dispatch.Client,
                                                                          repo: Path) -> None:
    """The user works beside the session after its checkpoint: a secret git
    ignores, notes, an edit and a commit. A restore removes them from the
    worktree (what a restore is), and keeps them first in a checkpoint of
    their own (``before``): restoring it brings every one back, the commit
    on its branch. Before, nothing of them was kept anywhere."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        (repo / ".gitignore").write_text(".env\n")
        (repo / ".env").write_text("TOKEN=the-users\n")
        (repo / "NOTES.md").write_text("mine\n")
        (repo / "src" / "main.py").write_text("def main():\n    return 7\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "the user's own")
        users, head = snapshot(repo), git(repo, "rev-parse", "HEAD")
        done = s.restore(cid)
        assert not (repo / ".env").exists() and git(repo, "log", "--format=%s", "main") == "init\n"
        assert done["before"] != cid and [c["label"] for c in s.checkpoints()][-1] == f"before restoring {cid}"
        undone = s.restore(done["before"])
        assert snapshot(repo) == users and git(repo, "rev-parse", "HEAD") == head
        assert (repo / ".env").read_text() == "TOKEN=the-users\n"
        assert undone["before"] not in (cid, done["before"])
        # main moved forward again (nothing new to keep); the value the first restore
        # kept stays where it is (a restore never removes a kept value).
        assert undone["displaced"] == [] and len(done["displaced"]) == 1
        assert git(repo, "rev-parse", done["displaced"][0]) == head


def test_what_a_restore_replaces_outlives_the_session(client: dispatch.Client, repo: Path, daemon: Daemon) -> None:
    """The user writes a secret git ignores and makes a commit by hand beside
    a session; the session restores an earlier checkpoint and ends. The
    secret's bytes are in the kept files named by the reply, the commit is
    reachable from a ref under refs/dispatchd/displaced/ (a gc keeps it),
    though the session's checkpoints went with it."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint(label="agent milestone")
        ok(shell(s, "echo agent-edit >> dir/inner.txt"))
        (repo / ".env").write_text("API_KEY=user-secret-123\n")
        git(repo, "commit", "-qam", "the user's own commit")
        users = git(repo, "rev-parse", "HEAD").strip()
        done = s.restore(cid)
        assert not (repo / ".env").exists() and git(repo, "rev-parse", "main").strip() != users
        sid = s.id
    assert not (daemon.state / "dispatchd" / "checkpoints" / sid).exists()  # the session's went
    kept = Path(done["kept"])
    assert kept.parent == daemon.state / "dispatchd" / "before-restore"
    assert kept.name.endswith(f"-{sid}-{done['before']}")
    assert (kept / "worktree" / ".env").read_bytes() == b"API_KEY=user-secret-123\n"
    assert (kept / "worktree" / "dir" / "inner.txt").read_text() == "inner\nagent-edit\n"
    about = json.loads((kept / "about.json").read_text())
    assert (about["worktree"], about["session"], about["restored"], about["before"]) == (
        str(repo), sid, cid, done["before"])
    assert about["expires"] - about["created"] == 7 * 86400
    [ref] = done["displaced"]
    assert ref.endswith("/refs/heads/main")
    assert git(repo, "for-each-ref", "--format=%(refname)", "--contains", users) == f"{ref}\n"
    git(repo, "gc", "-q", "--prune=now")
    assert users in git(repo, "log", "--all", "--format=%H")
    assert git(repo, "log", "-1", "--format=%s", ref) == "the user's own commit\n"


def test_a_restore_whose_replaced_files_cannot_be_kept_changes_nothing(client: dispatch.Client, repo: Path,
                                                                        daemon: Daemon) -> None:
    """Where what the worktree holds cannot be kept past the session (the
    directory refuses it), the restore is refused and nothing is removed;
    the twin: once it can, the restore goes through; forced, it goes
    through without (its ``before`` still named for an undo meanwhile)."""
    kept_dir = daemon.state / "dispatchd" / "before-restore"
    kept_dir.mkdir(mode=0o700, exist_ok=True)  # made by the first restore kept, whichever test ran it
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        (repo / "mine.txt").write_text("mine\n")
        os.chmod(kept_dir, 0o500)
        try:
            with pytest.raises(dispatch.RequestFailed) as err:
                s.restore(cid)
            assert (repo / "mine.txt").read_text() == "mine\n"
            forced = s.restore(cid, force=True)
        finally:
            os.chmod(kept_dir, 0o700)
        assert err.value.code == "checkpoint_refused"
        assert err.value.message == (
            "restore refused: the worktree as it is now could not be kept first, and a restore would lose it "
            f"(checkpoint refused: it could not be kept past the session in {kept_dir} (Permission denied)); nothing "
            "was changed (force=True, `dispatch session restore --force`: restore anyway, without keeping it)")
        assert forced["kept"] == "" and forced["before"] and not (repo / "mine.txt").exists()
        (repo / "mine.txt").write_text("mine again\n")
        done = s.restore(cid)
        assert (Path(done["kept"]) / "worktree" / "mine.txt").read_text() == "mine again\n"


def _shared_clone(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """``git clone --shared`` of a repository of commits a, b on main and
    ``side`` off a: every commit is in the source's objects (the clone's
    alternates), none in the clone's own; its commits by name."""
    src = Path(os.path.realpath(tmp_path)) / "src"
    src.mkdir()
    git(src, "init", "-q", "-b", "main")
    for name in ("a", "b"):
        (src / "f.txt").write_text(f"{name}\n")
        git(src, "add", "f.txt")
        git(src, "-c", "user.name=u", "-c", "user.email=u@example.invalid", "commit", "-qm", name)
    git(src, "branch", "side", "main~1")
    git(src, "checkout", "-q", "side")
    (src / "s.txt").write_text("side\n")
    git(src, "add", "s.txt")
    git(src, "-c", "user.name=u", "-c", "user.email=u@example.invalid", "commit", "-qm", "side")
    git(src, "checkout", "-q", "main")
    clone = src.parent / "clone"
    git(src.parent, "clone", "-q", "--shared", str(src), str(clone))
    assert (clone / ".git" / "objects" / "info" / "alternates").read_text() == f"{src}/.git/objects\n"
    return clone, {name: git(src, "rev-parse", rev).strip() for name, rev in
                   (("a", "main~1"), ("b", "main"), ("side", "side"))}


@pytest.mark.parametrize("beside", ["a", "side"])
def test_a_restore_keeps_a_shared_clone_s_branch_only_when_not_moved_forward(client: dispatch.Client,
                                                                            tmp_path: Path, beside: str) -> None:
    """The user moves main beside the session, back to ``a`` or to ``side``;
    the restore puts it at ``b`` again. From ``a``, forward along commits
    the clone borrows (its alternates, as the baseline recorded them):
    nothing to keep (it was kept as a displaced ref, the ancestry asked of
    the clone's own objects only). The twin, from ``side`` (no ancestor of
    ``b``): the value it had is kept."""
    clone, ids = _shared_clone(tmp_path)
    with client.open_session(str(clone)) as s:
        cid = s.checkpoint()
        git(clone, "reset", "-q", "--hard", ids[beside])
        done = s.restore(cid)
        assert git(clone, "rev-parse", "main").strip() == ids["b"]
    if beside == "a":
        assert done["displaced"] == [] and git(clone, "for-each-ref", "refs/dispatchd/") == ""
        return
    [ref] = done["displaced"]
    assert ref.startswith("refs/dispatchd/displaced/") and ref.endswith("/refs/heads/main")
    assert git(clone, "rev-parse", ref).strip() == ids["side"]


def test_a_restore_that_moves_no_ref_keeps_none(client: dispatch.Client, repo: Path) -> None:
    """The twin: a restore that changes files only leaves no displaced ref
    (what it replaced is still kept as files)."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        ok(shell(s, "echo scratch > scratch.txt"))
        done = s.restore(cid)
    assert done["removed"] == 1 and done["displaced"] == []
    assert git(repo, "for-each-ref", "refs/dispatchd/") == ""
    assert not (repo / ".git" / "refs" / "dispatchd").exists()
    assert (Path(done["kept"]) / "worktree" / "scratch.txt").read_text() == "scratch\n"


def test_a_restore_that_cannot_keep_what_is_there_changes_nothing(client: dispatch.Client, repo: Path) -> None:
    """Over the byte budget, the worktree as it is cannot be kept first: the
    restore is refused and nothing is removed. The twin: under the budget
    (the same file gone), the restore goes through."""
    with client.open_session(str(repo), policy="small") as s:
        cid = s.checkpoint()
        (repo / "big.bin").write_bytes(b"x" * 1024 * 1024)
        with pytest.raises(dispatch.RequestFailed) as err:
            s.restore(cid)
        assert err.value.code == "checkpoint_refused"
        assert err.value.message == (
            "restore refused: the worktree as it is now could not be kept first, and a restore would lose it "
            "(checkpoint refused: it would copy more than 262144 bytes (the policy's [checkpoints] max_bytes; "
            "reflink clones and links are not counted)); nothing was changed (force=True, `dispatch session restore "
            "--force`: restore anyway, without keeping it)")
        assert (repo / "big.bin").read_bytes() == b"x" * 1024 * 1024
        (repo / "big.bin").unlink()
        (repo / "small.txt").write_text("s\n")
        assert s.restore(cid)["removed"] == 1 and not (repo / "small.txt").exists()
        # A session can make the worktree unkeepable on purpose (a sparse file of 5 GiB costs
        # no disk): the user can still restore, choosing to lose what is there.
        ok(shell(s, "truncate -s 5G sparse.bin"))
        with pytest.raises(dispatch.RequestFailed):
            s.restore(cid)
        done = s.restore(cid, force=True)
        assert done["before"] == "" and not (repo / "sparse.bin").exists()


def test_deleted_git_objects_come_back_from_the_keep(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        ok(shell(s, "rm -rf .git/objects/* .git/refs/heads/feature"))
        done = s.restore(cid)
        assert done["objects"] > 0
        git(repo, "fsck", "--no-dangling")
        assert git(repo, "log", "--format=%s", "feature") == "init\n"


def test_a_restore_does_not_follow_a_symlink_the_session_planted(client: dispatch.Client, repo: Path,
                                                                  tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        # The directory swapped for a symlink to a place the session cannot
        # write, and whose contents the restore would write if it followed it.
        ok(shell(s, f"rm -r dir && ln -s {outside} dir && rm src/main.py && ln -s {outside}/main.py src/main.py"))
        s.restore(cid)
        assert os.listdir(outside) == []
        assert not (repo / "dir").is_symlink() and (repo / "dir" / "inner.txt").read_text() == "inner\n"
        assert not (repo / "src" / "main.py").is_symlink()
        assert (repo / "src" / "main.py").read_text() == "def main():\n    return 42\n"


def test_refusals_name_what_stops_them_and_their_twins_pass(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as s:
        with pytest.raises(dispatch.RequestFailed) as err:
            s.restore("c9999-00000000")
        assert err.value.code == "unknown_checkpoint"
        assert str(err.value.message) == f"no such checkpoint: 'c9999-00000000' (session {s.id} has: none)"
        cid = s.checkpoint()

        # A call in flight: refused (checkpoint and restore); once it returned, done.
        running = threading.Thread(target=lambda: shell(s, "touch started && sleep 2"))
        running.start()
        deadline = time.monotonic() + 20
        while not (repo / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for verb, attempt in (("restore", lambda: s.restore(cid)), ("checkpoint", lambda: s.checkpoint())):
            with pytest.raises(dispatch.RequestFailed) as err:
                attempt()
            assert err.value.code == "session_busy"
            assert err.value.message == (f"{verb} refused: session {s.id} has 1 tool call in flight; wait for it "
                                         f"to return (or end it: session.cancel()) and {verb} again")
        running.join()
        assert s.restore(cid)["removed"] == 1  # "started"

        # A background job: a restore is refused, a checkpoint is not; stopped, the restore goes.
        job = ok(shell(s, "sleep 60", background=True)).metadata["job"]
        assert s.checkpoint()
        with pytest.raises(dispatch.RequestFailed) as err:
            s.restore(cid)
        assert err.value.code == "session_busy"
        assert err.value.message.startswith(f"restore refused: session {s.id} has ")
        assert err.value.message.endswith(
            " process(es) running (a background job, or a process a command left); they could write into the "
            "worktree while it is restored: stop them (job_stop) and restore again")
        ok(s.registry.get("job_stop").call({"job": job}))
        s.restore(cid)


def test_over_the_byte_budget_a_checkpoint_is_refused(client: dispatch.Client, repo: Path) -> None:
    (repo / "big.bin").write_bytes(b"x" * 4096)
    with client.open_session(str(repo), policy="tiny") as s:
        with pytest.raises(dispatch.RequestFailed) as err:
            s.checkpoint()
        assert err.value.code == "checkpoint_refused"
        assert err.value.message == ("checkpoint refused: it would copy more than 64 bytes (the policy's "
                                     "[checkpoints] max_bytes; reflink clones and links are not counted)")
        assert s.checkpoints() == []
    with client.open_session(str(repo)) as s:  # the twin: the shipped budget
        assert s.checkpoint()


def test_checkpoint_before_every_write(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo), policy="undo") as s:
        ok(s.registry.get("write_file").call({"path": "a.txt", "content": "one"}))
        ok(shell(s, "echo two > a.txt"))
        assert (repo / "a.txt").read_text() == "two\n"
        listed = s.checkpoints()
        assert [c["label"] for c in listed] == ["before write_file", "before shell_exec"]
        s.restore(listed[1]["id"])
        assert (repo / "a.txt").read_text() == "one"
        s.restore(listed[0]["id"])
        assert not (repo / "a.txt").exists()
    with client.open_session(str(repo), policy="undo-tiny") as s:
        refused = s.registry.get("write_file").call({"path": "a.txt", "content": "one"})
        assert refused.is_failure
        assert refused.error == ("write_file: checkpoint refused: it would copy more than 64 bytes (the policy's "
                                 "[checkpoints] max_bytes; reflink clones and links are not counted) (the policy "
                                 "takes one before every write)")
        assert not (repo / "a.txt").exists()


def test_checkpoints_go_with_their_session(client: dispatch.Client, repo: Path, daemon: Daemon) -> None:
    with client.open_session(str(repo)) as s:
        s.checkpoint()
        sid = s.id
        assert os.listdir(daemon.state / "dispatchd" / "checkpoints" / sid)
    assert not (daemon.state / "dispatchd" / "checkpoints" / sid).exists()


def test_the_cli_and_the_asyncio_client(daemon: Daemon, client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as s:
        out = run(daemon, "session", "checkpoint", s.id, "--label", "from the cli")
        assert out.returncode == 0, out.stderr
        cid = out.stdout.strip()
        listed = run(daemon, "session", "checkpoints", s.id)
        assert listed.returncode == 0 and cid in listed.stdout and "from the cli" in listed.stdout
        (repo / "extra").write_text("x")
        restored = run(daemon, "session", "restore", s.id, cid)
        assert restored.returncode == 0, restored.stderr
        assert restored.stdout.startswith(f"restored {cid}: 1 removed, 0 written")
        assert f", its files kept in {daemon.state / 'dispatchd' / 'before-restore'}/" in restored.stdout
        assert not (repo / "extra").exists()

    async def main() -> None:
        async with dispatch.aio.connect(daemon.socket) as c:
            async with c.open_session(str(repo)) as a:
                first = await a.checkpoint("aio")
                assert [x["label"] for x in await a.checkpoints()] == ["aio"]
                (repo / "extra").write_text("x")
                assert (await a.restore(first))["removed"] == 1

    asyncio.run(main())
    assert not (repo / "extra").exists()


def test_an_asleep_session_is_checkpointed_and_restored_without_waking(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo), policy="sleepy") as s:
        ok(s.registry.get("write_file").call({"path": "a.txt", "content": "one"}))
        wait_until_asleep(client, s.id)
        cid = s.checkpoint()
        (repo / "a.txt").write_text("two")
        s.restore(cid)
        assert is_asleep(client, s.id)  # no process was needed, none was started
        assert ok(s.registry.get("read_file").call({"path": "a.txt"})).output == "0: one"


def test_a_restore_is_a_write_one_writer_per_worktree(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as writer, client.open_session(str(repo)) as other:
        cid = other.checkpoint()  # a checkpoint only reads: taken while another session writes
        ok(writer.registry.get("write_file").call({"path": "a.txt", "content": "mine"}))
        with pytest.raises(dispatch.RequestFailed) as err:
            other.restore(cid)
        assert err.value.code == "write_locked"
        assert err.value.message.startswith(f"restore refused: the worktree {repo} is being written by session "
                                            f"{writer.id} (opened ")
        assert (repo / "a.txt").read_text() == "mine"
        writer.close()
        other.restore(cid)  # the twin: once the writer is gone
        assert not (repo / "a.txt").exists()
        assert other.status()["writes"] is True
    with client.open_session(str(repo), policy="read-only") as reader:
        cid = reader.checkpoint()
        with pytest.raises(dispatch.RequestFailed) as err:
            reader.restore(cid)
        assert err.value.message == (f"restore refused: session {reader.id}'s policy (read-only) keeps the "
                                     "worktree read-only")
