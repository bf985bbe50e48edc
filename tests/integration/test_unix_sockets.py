"""Unix sockets inside a session: what ordinary work needs.

Full mode, network off (the session's root and network namespace are its
own): ``multiprocessing.Manager``, an asyncio Unix server and client, and a
server on a socket in the session's TMPDIR reached by another command all work.
Where the session could reach the host's sockets — degraded mode (no root of
its own), or the host's network namespace (network on: an abstract name the
session listened on would take the user's programs' connections) —
``socket(AF_UNIX)`` stays refused (EPERM), and ``leaves_open`` says so.
"""

from __future__ import annotations

import errno
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, probe, shell

MANAGER = """
import multiprocessing
if __name__ == "__main__":
    with multiprocessing.Manager() as m:
        d = m.dict()
        d["answer"] = 42
        print("manager", d["answer"])
"""

ASYNCIO = """
import asyncio, os
async def handle(reader, writer):
    writer.write(b"echo:" + await reader.readline())
    await writer.drain()
    writer.close()
async def main():
    path = os.path.join(os.environ["TMPDIR"], "aio.sock")
    server = await asyncio.start_unix_server(handle, path)
    async with server:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"hello\\n")
        print((await reader.readline()).decode().strip())
        writer.close()
asyncio.run(main())
"""

SERVER = """
import socket, os
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind(os.path.join(os.environ["TMPDIR"], "srv.sock"))
l.listen(1)
open("srv.ready", "w").close()
c, _ = l.accept()
c.sendall(b"from the worktree server")
c.close()
"""

CLIENT = """
import socket, time, os
for _ in range(100):
    if os.path.exists("srv.ready"):
        break
    time.sleep(0.05)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.path.join(os.environ["TMPDIR"], "srv.sock"))
print(s.recv(100).decode())
"""

ABSTRACT = """
import socket
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind(b"\\0dispatch-own-abstract")
l.listen(1)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(b"\\0dispatch-own-abstract")
a, _ = l.accept()
a.sendall(b"abstract ok")
print(c.recv(100).decode())
"""

REFUSED = f"socket.socket(AF_UNIX): [Errno {errno.EPERM}]"
PLAIN = ("import socket\ntry:\n    socket.socket(socket.AF_UNIX)\n    print('made')\n"
         "except OSError as e:\n    print(f'socket.socket(AF_UNIX): [Errno {e.errno}]')\n")


def _full(client: dispatch.Client) -> None:
    if not client.status()["kernel"]["user_namespaces"]:
        pytest.fail("full mode needs user namespaces; this kernel refuses them", pytrace=False)


@pytest.mark.parametrize(("name", "code", "out"), [
    ("multiprocessing.Manager", MANAGER, "manager 42"),
    ("asyncio Unix server and client", ASYNCIO, "echo:hello"),
    ("an abstract name of its own", ABSTRACT, "abstract ok"),
])
def test_unix_socket_workloads_work_in_full_mode(client: dispatch.Client, worktree: Path, name: str, code: str,
                                                  out: str) -> None:
    _full(client)
    with client.open_session(str(worktree)) as s:
        prot = s.status()["protections"]
        assert (prot["mode"], prot["unix_sockets"]) == (
            "full", "allowed: pathname sockets inside the session's own root, abstract names in its own network "
                    "namespace; made only in the session's scratch, /tmp, /dev/shm (nowhere another session "
                    "reaches: the worktree and read_write paths make none)")
        r = shell(s, f"/usr/bin/python3 -c {shlex.quote(code)}", timeout=60)
        assert r.metadata["stdout"].strip() == out, r.metadata["stderr"]


def test_a_server_on_a_socket_in_tmp_serves_another_command(client: dispatch.Client, worktree: Path) -> None:
    """In the session's own TMPDIR: no other session reaches it (a worktree
    makes no socket: tests/escape/test_ipc.py)."""
    _full(client)
    with client.open_session(str(worktree)) as s:
        r = shell(s, f"/usr/bin/python3 -c {shlex.quote(SERVER)} & "
                     f"/usr/bin/python3 -c {shlex.quote(CLIENT)}; wait", timeout=60)
        assert r.metadata["stdout"].strip() == "from the worktree server", r.metadata["stderr"]
    assert not (worktree / "srv.sock").exists()


def test_with_the_network_on_unix_sockets_stay_refused(client: dispatch.Client, worktree: Path) -> None:
    """Only while the session shares the host's network namespace: once every
    session has one of its own (network on included), they work there too."""
    _full(client)
    with client.open_session(str(worktree), network=True) as s:
        prot = s.status()["protections"]
        if prot["namespaces"]["net"]:
            assert probe(s, PLAIN) == "made"
            return
        assert prot["unix_sockets"] == "refused (seccomp: socket(AF_UNIX) -> EPERM)"
        assert any(g.startswith("Unix sockets are refused (socket(AF_UNIX): EPERM; stream socketpairs work) while "
                                "the session shares the host's network namespace") for g in prot["leaves_open"])
        assert probe(s, PLAIN) == REFUSED
    with client.open_session(str(worktree), network=False) as s:  # the twin
        assert probe(s, PLAIN) == "made"


@pytest.fixture(scope="module")
def degraded_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dispatch.Client]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("degraded"), "--no-user-namespaces")
    try:
        with d.connect() as c:
            yield c
    finally:
        assert d.stop() == 0, d.log()


def test_degraded_mode_refuses_unix_sockets_and_says_so(degraded_client: dispatch.Client, worktree: Path) -> None:
    with degraded_client.open_session(str(worktree)) as s:
        prot = s.status()["protections"]
        assert (prot["mode"], prot["unix_sockets"]) == ("degraded", "refused (seccomp: socket(AF_UNIX) -> EPERM)")
        assert any(g.startswith("Unix sockets are refused") for g in prot["leaves_open"]), prot["leaves_open"]
        assert probe(s, PLAIN) == REFUSED
        r = shell(s, f"/usr/bin/python3 -c {shlex.quote(MANAGER)}", timeout=60)
        assert r.metadata["exit_code"] != 0 and "PermissionError" in r.metadata["stderr"]
        pair = ("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1).decode())")
        assert probe(s, pair) == "x"  # the twin: a stream socketpair still works


def test_a_worktree_in_the_home_directory(client: dispatch.Client) -> None:
    """Where worktrees usually are: below the home directory, beside the
    user's other files. The worktree and git work; its neighbours are absent."""
    import secrets
    import shutil
    import subprocess

    _full(client)
    home = Path.home()
    wt = home / f"dispatch-src-{secrets.token_hex(4)}" / "proj"
    wt.mkdir(parents=True)
    neighbour = wt.parent / "neighbour.txt"
    neighbour.write_text("next door\n")
    dotfile = home / f".dispatch-dotfile-{secrets.token_hex(4)}"
    dotfile.write_text("the user's\n")
    try:
        subprocess.run(["git", "init", "-q", str(wt)], check=True, timeout=30)
        (wt / "f.txt").write_text("mine\n")
        with client.open_session(str(wt)) as s:
            r = shell(s, "cat f.txt && git add f.txt && git -c user.name=s -c user.email=s@invalid commit -qm f "
                         "&& git log --oneline | wc -l", timeout=60)
            assert r.output == "mine\n1\n", r.metadata["stderr"]
            look = ("import os\nfor p in ({n!r}, {h!r}):\n    try:\n        os.stat(p); print('there')\n"
                    "    except OSError as e:\n        print(e.errno)\n").format(n=str(neighbour), h=str(dotfile))
            assert probe(s, look) == f"{errno.ENOENT}\n{errno.ENOENT}"
            assert probe(s, MANAGER) == "manager 42"  # sockets in a root built around a home worktree
        # The twin: the user sees both.
        assert subprocess.run(["python3", "-c", look], capture_output=True, text=True).stdout == "there\nthere\n"
    finally:
        shutil.rmtree(wt.parent)
        dotfile.unlink()


PTY = """
import os, pty
master, slave = pty.openpty()
os.write(slave, b"through a terminal of its own\\n")
print(os.read(master, 100).decode().strip(), os.ttyname(slave).startswith("/dev/pts/"))
"""


@pytest.mark.parametrize("mode", ["full", "degraded"])
def test_a_policy_may_give_pseudo_terminals_of_the_sessions_own(tmp_path_factory: pytest.TempPathFactory,
                                                                 worktree: Path, mode: str) -> None:
    """``filesystem.devices`` listing /dev/pts: full mode mounts a devpts of
    the session's own (Python's ``pty`` works, the host's terminals are not
    there); degraded mode grants nothing (it would be the user's terminals)
    and says so. The twin: the default policy has none."""
    import shutil

    from tests.conftest import REPO

    _refuse_root()
    base = tmp_path_factory.mktemp(f"pts-{mode}")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "tty.toml").write_text('[filesystem]\ndevices = ["/dev/null", "/dev/urandom", "/dev/pts"]\n')
    d = Daemon(base, "--policies", str(policies), *(["--no-user-namespaces"] if mode == "degraded" else []))
    try:
        with d.connect() as c:
            with c.open_session(str(worktree), policy="tty") as s:
                r = shell(s, f"/usr/bin/python3 -c {shlex.quote(PTY)}", timeout=60)
                gaps = s.status()["protections"]["leaves_open"]
                if mode == "full":
                    assert r.output == "through a terminal of its own True\n", r.metadata["stderr"]
                    assert shell(s, "ls /dev/pts | grep -vx ptmx | wc -l").output == "0\n"  # none of the host's
                else:
                    # os.openpty refused (Landlock), then pty's fallback finds no BSD ptys.
                    assert r.metadata["exit_code"] == 1 and "out of pty devices" in r.metadata["stderr"]
                    assert any(g.startswith("no pseudo-terminals") for g in gaps), gaps
            with c.open_session(str(worktree)) as s:
                r = shell(s, f"/usr/bin/python3 -c {shlex.quote(PTY)}", timeout=60)
                assert r.metadata["exit_code"] == 1 and "out of pty devices" in r.metadata["stderr"]
    finally:
        assert d.stop() == 0, d.log()
