"""The worktree a session gets is the one the daemon checked.

A session on ``mono/`` swaps ``mono/proj`` for a symlink to a directory of
secrets in the home directory, in a tight loop (``renameat2(RENAME_EXCHANGE)``),
while sessions are opened on ``mono/proj``. Before: the daemon checked
``realpath`` and the worker bound the path by name, so some opens got the
secret directory (or the whole home) read-write, and others an internal
error. Now the daemon opens the worktree once without following a symlink of
the user's, checks that descriptor, and the worker binds only a directory
proven to be the same inode: every open gets the real ``proj`` or a clean
refusal (``bad_worktree``), never the secrets. The allowed twin: the same
opens on a directory nobody swaps all succeed. Both modes.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatch.errors import RequestFailed
from tests.conftest import credential_dir
from tests.escape.attempts import background
from tests.escape.conftest import Sandbox

_SWAP = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
os.symlink({secret!r}, "swap")
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    libc.syscall(316, -100, b"proj", -100, b"swap", 2)  # renameat2(RENAME_EXCHANGE)
"""


@pytest.fixture
def secret_dir() -> Iterator[Path]:
    """A directory of the user's that stands for ~/.ssh (under another name:
    the deny-list is not what must stop it)."""
    d = Path.home() / f"dispatch-escape-keys-{secrets.token_hex(4)}"
    d.mkdir()
    (d / "id_ed25519").write_text("PRIVATE KEY\n")
    yield d
    shutil.rmtree(d)


def _outcome(client: dispatch.Client, path: Path, marker: str, sandbox: Sandbox) -> str:
    mode = sandbox.mode
    try:
        with client.open_session(str(path)) as s:
            listing = s.registry.get("list_files").call({"path": ".", "recursive": False})
            if not listing.is_success:
                # Degraded mode has no root of its own: the tools reach the
                # worktree by name, which the swap may have moved since; Landlock
                # grants only the directory checked, so they are refused there.
                assert mode == "degraded" and "id_ed25519" not in listing.error, listing.error
                return "real"
            assert "id_ed25519" not in listing.output, f"a session got the secrets as its worktree: {listing.output}"
            assert marker in listing.output.split(), listing.output
            return "real"
    except RequestFailed as exc:
        assert exc.code == "bad_worktree", f"{exc.code}: {exc.message}\n{sandbox.daemon.log()[-4000:]}"
        return "refused"


def test_a_swapped_worktree_is_the_real_one_or_refused(
    sandbox: Sandbox, client: dispatch.Client, tmp_path: Path, secret_dir: Path,
) -> None:
    mono = tmp_path / "mono"
    (mono / "proj").mkdir(parents=True)
    marker = f"REAL-{secrets.token_hex(4)}"
    (mono / "proj" / marker).write_text("the real project\n")
    plain = tmp_path / "plain" / "proj"
    plain.mkdir(parents=True)
    (plain / marker).write_text("the real project\n")
    with client.open_session(str(mono)) as attacker:
        background(attacker, _SWAP.format(secret=str(secret_dir), seconds=12), 15)
        deadline = time.monotonic() + 20
        while not (mono / "swap").is_symlink() and not (mono / "proj").is_symlink() and time.monotonic() < deadline:
            time.sleep(0.05)
        outcomes: dict[str, int] = {"real": 0, "refused": 0}
        end = time.monotonic() + 6
        while time.monotonic() < end:
            outcomes[_outcome(client, mono / "proj", marker, sandbox)] += 1
        # Both sides of the race were seen.
        assert outcomes["refused"] > 0 and outcomes["real"] > 0, outcomes
    # The twin: the same opens on a directory nobody swaps all get it.
    assert {_outcome(client, plain, marker, sandbox) for _ in range(5)} == {"real"}
    assert sorted(p.name for p in secret_dir.iterdir()) == ["id_ed25519"]  # nothing written there


@pytest.mark.parametrize("name", [".ssh", ".gnupg", ".aws", ".config"])
def test_credential_directories_are_never_a_worktree(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, name: str,
) -> None:
    cred = credential_dir(name)
    with pytest.raises(RequestFailed) as info:
        client.open_session(str(cred))
    assert info.value.code == "bad_worktree"
    assert info.value.message == f"worktree {cred} is or holds your credentials ({cred}): refused"
    with client.open_session(str(worktree)) as s:  # the twin: an ordinary directory opens
        assert s.status()["protections"]["mode"] == sandbox.mode
