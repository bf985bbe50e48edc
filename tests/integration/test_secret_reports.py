"""A secret's value in the text the daemon makes itself, against a real daemon:
names a session's code chose (a nested repository the end's check moves
aside, a branch a restore displaces, a host the proxy refuses) come back as
``[secret NAME]`` in the close's reply, in every session's ``status``, in
``dispatch status``, in a restore's reply and in the daemon's log at its
default level; the same names from a plain variable come back as they are."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatchd.policy import default_policy_dir
from tests.conftest import Daemon, shell
from tests.fake_registry import FakeRegistry, domains_daemon
from tests.integration.test_cli import run

TOKEN = "nestedSECRET4242"


class _FileLogDaemon(Daemon):
    """A daemon logging to a file at the default level, as autostart runs it."""

    def __init__(self, base: Path, *extra: str) -> None:
        self.file_log = base / "file.log"
        super().__init__(base, *extra, "--log-level", "info", "--log-file", str(base / "file.log"))

    def log(self) -> str:
        return self.file_log.read_text(errors="replace") if self.file_log.exists() else ""


@pytest.fixture(scope="module")
def fdaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The shipped policies, and 'undo' (a checkpoint before every write)."""
    base = tmp_path_factory.mktemp("secret-reports")
    policies = base / "policies"
    shutil.copytree(default_policy_dir(), policies)
    text = (policies / "default.toml").read_text()
    (policies / "undo.toml").write_text(
        text.replace("before_writes = false", "").replace("[checkpoints]", "[checkpoints]\nbefore_writes = true"))
    d = _FileLogDaemon(base, "--policies", str(policies))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def fclient(fdaemon: Daemon) -> Iterator[dispatch.Client]:
    with fdaemon.connect() as c:
        yield c


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(worktree: Path) -> Path:
    _git(worktree, "init", "-q", "-b", "main")
    _git(worktree, "-c", "user.email=u@example.invalid", "-c", "user.name=u", "commit", "-qm", "first",
         "--allow-empty")
    return worktree


def _plant_nested_repository(s: dispatch.Session) -> None:
    r = shell(s, 'mkdir "n_$TOK" && git -C "n_$TOK" init -q && echo ok')
    assert r.output == "ok\n", (r.output, r.error)


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_a_name_chosen_after_a_secret_is_redacted_in_protected(fdaemon: Daemon, fclient: dispatch.Client,
                                                              worktree: Path, as_secret: bool) -> None:
    """Y, given the secret, plants a repository named after it and ends; X,
    on the same worktree, never given it, and ``dispatch status`` see the
    report redacted. The twin: a plain variable's value is shown as is."""
    given = {"secrets": {"TOK": TOKEN}} if as_secret else {"env": {"TOK": TOKEN}}
    shown = "n_[secret TOK]" if as_secret else f"n_{TOKEN}"
    seen = len(fdaemon.log())  # the module's daemon logs for every test: this one's lines only
    with fdaemon.connect() as other, other.open_session(str(worktree)) as x:
        y = fclient.open_session(str(worktree), **given)  # type: ignore[arg-type]
        _plant_nested_repository(y)
        y.close()
        assert y.protected and any(shown in p["path"] for p in y.protected), y.protected
        assert (TOKEN in json.dumps(y.protected)) is not as_secret
        mine = x.status()["protected"]
        assert any(shown in p["path"] for p in mine), mine
        assert (TOKEN in json.dumps(x.status())) is not as_secret
        out = run(fdaemon, "status")
        assert out.returncode == 0, out.stderr
        assert shown in out.stdout and (TOKEN in out.stdout) is not as_secret
    log = fdaemon.log()[seen:]
    assert f"event=tool_file_quarantined path={worktree}/{shown}/.git/config" in log
    assert (TOKEN in log) is not as_secret


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_refs_named_after_a_secret_are_redacted_in_a_restore(fdaemon: Daemon, fclient: dispatch.Client,
                                                             repo: Path, as_secret: bool) -> None:
    """A branch and a tag named after the secret, displaced by a restore:
    the reply's ``displaced``, the close's ``protected`` (a remote ref made
    after) and the log name them redacted; a checkpoint's label too."""
    given = {"secrets": {"TOK": TOKEN}} if as_secret else {"env": {"TOK": TOKEN}}
    label = "[secret TOK]" if as_secret else TOKEN
    seen = len(fdaemon.log())
    with fclient.open_session(str(repo), **given) as s:  # type: ignore[arg-type]
        cid = s.checkpoint(label=f"before {TOKEN}")
        assert [c["label"] for c in s.checkpoints()] == [f"before {label}"]
        r = shell(s, 'git -c user.email=a@b -c user.name=a commit -q --allow-empty -m m && '
                     'git branch "b-$TOK" && git tag "t-$TOK" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
        done = s.restore(cid)
        heads = [ref for ref in done["displaced"] if "/refs/heads/b-" in ref]
        assert len(heads) == 1 and heads[0].endswith(f"/refs/heads/b-{label}"), done["displaced"]
        assert (TOKEN in json.dumps(done)) is not as_secret
        assert shell(s, 'git update-ref "refs/remotes/origin/x$TOK" HEAD && echo ok').output == "ok\n"
    assert any(p["path"] == f"refs/remotes/origin/x{label}" for p in s.protected), s.protected
    assert (TOKEN in json.dumps(s.protected)) is not as_secret
    log = fdaemon.log()[seen:]
    assert f"/refs/heads/b-{label}" in log and "event=restore_ref_kept" in log
    assert (TOKEN in log) is not as_secret, [line for line in log.splitlines() if TOKEN in line]


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_a_refused_host_named_after_a_secret_is_redacted(tmp_path_factory: pytest.TempPathFactory,
                                                        worktree: Path, as_secret: bool) -> None:
    """Network "domains": a host named after the secret (which the proxy
    lowercases) is refused; ``denied`` in status and the log redact it."""
    token = "MixedCase7Tok31"
    given = {"secrets": {"TOK": token}} if as_secret else {"env": {"TOK": token}}
    shown = "[secret TOK]" if as_secret else token.lower()
    d = domains_daemon(tmp_path_factory.mktemp("secret-denied"), "--log-level", "info")
    try:
        with FakeRegistry() as registry, d.connect() as c:
            listed = f"registry.test:{registry.port}"
            with c.open_session(str(worktree), network="domains", domains=[listed], **given) as s:  # type: ignore[arg-type]
                r = shell(s, f'curl -sS -o /dev/null -w "%{{http_code}}" "http://$TOK.other.test:{registry.port}/"')
                assert r.output.startswith("403\n[network: dispatchd refused "), (r.output, r.error)
                assert (token.lower() in r.output.lower()) is not as_secret, r.output
                denied = s.status()["network"]["denied"]
                assert [x["host"] for x in denied] == [f"{shown}.other.test"]
                everything = json.dumps(c.status())
                assert f"{shown}.other.test" in everything
                assert (token.lower() in everything.lower()) is not as_secret
        log = d.log()
        assert f"host={shown}.other.test" in log
        assert (token.lower() in log.lower()) is not as_secret
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
@pytest.mark.parametrize("mode", ["000", "444"])
def test_a_checkpoint_s_refusal_naming_a_secret_is_redacted_for_every_session(
        fdaemon: Daemon, fclient: dispatch.Client, worktree: Path, as_secret: bool, mode: str) -> None:
    """Y, given the secret, leaves a directory named after it that cannot be
    read (000) or searched (0444), and ends; X, on the same worktree and
    never given the secret, asks for a checkpoint: the refusal names the
    directory redacted, in the client's error and in the CLI's. The twin: a
    plain variable's value is named as is. Either way a clear refusal, never
    an internal error."""
    given = {"secrets": {"TOK": TOKEN}} if as_secret else {"env": {"TOK": TOKEN}}
    shown = "d_[secret TOK]" if as_secret else f"d_{TOKEN}"
    why = ("a directory that cannot be read" if mode == "000" else
           "a directory whose entries cannot be looked at (no search permission; chmod u+x it)")
    with fdaemon.connect() as other, other.open_session(str(worktree)) as x:
        y = fclient.open_session(str(worktree), **given)  # type: ignore[arg-type]
        r = shell(y, f'mkdir "d_$TOK" && touch "d_$TOK/f" && chmod {mode} "d_$TOK" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
        y.close()
        try:
            with pytest.raises(dispatch.DispatchError) as refused:
                x.checkpoint()
            assert refused.value.code == "checkpoint_refused", refused.value
            assert f"checkpoint refused: {shown}: {why}" in str(refused.value)
            assert (TOKEN in str(refused.value)) is not as_secret
            out = run(fdaemon, "session", "checkpoint", x.id)
            assert out.returncode != 0 and f"{shown}: {why}" in out.stderr, (out.stdout, out.stderr)
            assert (TOKEN in out.stdout + out.stderr) is not as_secret
        finally:
            (worktree / f"d_{TOKEN}").chmod(0o755)


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_a_checkpoint_before_a_write_refused_naming_a_secret_is_redacted(
        fdaemon: Daemon, fclient: dispatch.Client, worktree: Path, as_secret: bool) -> None:
    """The same refusal on the way of a write (policy ``before_writes``: the
    daemon answers the tool server, which redacts with its own session's
    secrets only): X's ``write_file`` is refused naming Y's directory
    redacted. The twin: a plain variable's value is named as is."""
    given = {"secrets": {"TOK": TOKEN}} if as_secret else {"env": {"TOK": TOKEN}}
    shown = "d_[secret TOK]" if as_secret else f"d_{TOKEN}"
    with fdaemon.connect() as other, other.open_session(str(worktree), policy="undo") as x:
        y = fclient.open_session(str(worktree), **given)  # type: ignore[arg-type]
        r = shell(y, 'mkdir "d_$TOK" && chmod 000 "d_$TOK" && echo ok')
        assert r.output == "ok\n", (r.output, r.error)
        y.close()
        try:
            wrote = x.registry.call("write_file", {"path": "new.txt", "content": "x\n"})
            assert not wrote.is_success, wrote
            assert f"checkpoint refused: {shown}: a directory that cannot be read" in (wrote.error or ""), wrote
            assert (TOKEN in (wrote.error or "")) is not as_secret
            assert not (worktree / "new.txt").exists()
        finally:
            (worktree / f"d_{TOKEN}").chmod(0o755)
