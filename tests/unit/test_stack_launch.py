"""The fork server's launch of a network stack (worker/stackstart.py), both
ways: by vfork, confined before the exec by the C helper
(tools/_confined.c), and by a fork that confines itself in Python (where
the helper is not built). Each starts a stand-in for slirp4netns - a
script, granted by the stack's own Landlock rules as a stack built
elsewhere would be - which reports, from inside, what it was started with:
its limits, no_new_privs, its descriptors, its signals. The same request
gives the same stack either way; a launch that cannot confine says which
step failed, and nothing runs.

Run in a fresh interpreter each (the fork path forks the process that asks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, _refuse_root

pytestmark = pytest.mark.process  # each starts an interpreter, which starts a stack

# The stand-in: reports, on its stderr (the file the daemon reads), then says
# ready on the descriptor its --ready-fd names, as slirp4netns does.
_STACK = textwrap.dedent("""\
    #!/usr/bin/python3 -I
    import ctypes, json, os, resource, signal, sys
    libc = ctypes.CDLL(None, use_errno=True)
    ready = int(next(a for a in sys.argv if a.startswith("--ready-fd=")).split("=")[1])
    open_fds = []
    for fd in range(3, 64):
        try:
            os.fstat(fd)
            open_fds.append(fd)
        except OSError:
            pass
    try:  # a file beside it, in the directory its own file is granted in alone
        open(os.path.join(os.path.dirname(sys.argv[0]), "secret"), "rb").close()
        beside = "read"
    except OSError as exc:
        beside = exc.errno
    report = {
        "limits": [resource.getrlimit(r)[1] for r in (resource.RLIMIT_FSIZE, resource.RLIMIT_DATA,
                                                      resource.RLIMIT_CORE)],
        "no_new_privs": libc.prctl(39, 0, 0, 0, 0),  # PR_GET_NO_NEW_PRIVS
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "fds": open_fds, "argv_fds": [int(a.rsplit("/", 1)[1]) for a in sys.argv if a.startswith("--userns-path=")]
                                    + [int(sys.argv[-2].rsplit("/", 1)[1]), ready],
        "beside": beside, "env": sorted(os.environ),
    }
    sys.stderr.write(json.dumps(report))
    sys.stderr.flush()
    os.write(ready, b"1")
""")

_LAUNCH = textwrap.dedent("""\
    import json, os, signal, sys, tempfile
    sys.path.insert(0, {repo!r})
    import msgspec
    from dispatchd import protocol
    from dispatchd.confine import landlock, stacks
    from dispatchd.tools import native
    from dispatchd.worker import stackstart

    how, executable, cgroup = sys.argv[1], sys.argv[2], sys.argv[3]
    if how == "fork":
        native.lines = None  # the launch without the C helper
    elif native.lines is None:
        sys.exit("the C helper is not built")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the fork server: the stack must not inherit it

    class Frames:  # the four descriptors a StartStack comes with
        def __init__(self, fds): self.fds = list(fds)
        def take_fd(self): return self.fds.pop(0)

    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=landlock.landlock_abi(), executable=executable)
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    err = tempfile.TemporaryFile()
    namespaces = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(2)]  # the stand-in opens neither
    req = protocol.StartStack(id=7, stack="slirp4netns", executable=executable,
                              confinement=msgspec.msgpack.encode(plan), cgroup=cgroup)
    reply, pidfd = stackstart.start_stack(req, Frames([*namespaces, ready_w, os.dup(err.fileno())]), set())
    out = {{"reply": type(reply).__name__, "message": getattr(reply, "message", "")}}
    if pidfd >= 0:
        pid = reply.pid
        out["ready"] = os.read(ready_r, 1).decode()
        _, status = os.waitpid(pid, 0)
        out["status"] = os.waitstatus_to_exitcode(status)
    else:
        for fd in namespaces + [ready_w]:
            try:
                os.fstat(fd)
                out.setdefault("left_open", []).append(fd)
            except OSError:
                pass
    err.seek(0)
    out["stderr"] = err.read().decode(errors="replace")
    print(json.dumps(out))
""")


def _launch(how: str, executable: Path, cgroup: str = "") -> dict[str, object]:
    _refuse_root()
    out = subprocess.run([sys.executable, "-c", _LAUNCH.format(repo=str(REPO)), how, str(executable), cgroup],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    result["fork_server_stderr"] = out.stderr
    return result


@pytest.fixture()
def stand_in(tmp_path: Path) -> Path:
    (tmp_path / "secret").write_text("SECRET")
    path = tmp_path / "slirp4netns"
    path.write_text(_STACK)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("how", ["vfork", "fork"])
def test_a_stack_starts_confined_with_its_descriptors_and_nothing_else(stand_in: Path, how: str) -> None:
    """Either launch: the stack's limits (1 MiB a file, 1 GiB of heap, no
    core), no_new_privs, SIGINT at its default though the fork server ignores
    it, the two namespaces and the readiness pipe as its only descriptors
    beyond stdio, and only its own environment; Landlock keeps a file beside
    it from it (EACCES) while its own file, outside the system's
    directories, ran."""
    result = _launch(how, stand_in)
    assert (result["reply"], result["ready"], result["status"]) == ("Spawned", "1", 0), result
    report = json.loads(str(result["stderr"]))
    assert report["limits"] == [1 << 20, 1 << 30, 0]
    assert (report["no_new_privs"], report["sigint_default"]) == (1, True)
    assert report["fds"] == sorted(report["argv_fds"]) and len(report["fds"]) == 3
    assert report["beside"] == 13  # EACCES
    assert report["env"] == ["LC_ALL", "PATH"]


def test_the_twin_unconfined_reads_the_file_beside(stand_in: Path) -> None:
    """The stand-in's own probe works: run bare, it reads the file beside it,
    and no_new_privs is not set."""
    ready_r, ready_w = os.pipe()
    try:
        out = subprocess.run([str(stand_in), f"--ready-fd={ready_w}", "--userns-path=/proc/self/fd/0",
                              "/proc/self/fd/0", "eth0"], capture_output=True, text=True, timeout=30,
                             pass_fds=[ready_w])
    finally:
        os.close(ready_w)
        os.close(ready_r)
    report = json.loads(out.stderr)
    assert (report["beside"], report["no_new_privs"]) == ("read", 0)


@pytest.mark.parametrize("how", ["vfork", "fork"])
def test_a_stack_that_cannot_join_its_cgroup_does_not_start(stand_in: Path, tmp_path: Path, how: str) -> None:
    """A cgroup that is gone: no stack runs outside it, and the words say
    why. By vfork they are the reply; by fork the child writes them on the
    fork server's stderr (the daemon's log: it fails before its stdio is the
    stack's) and exits before its exec. The twin is the test above (no
    cgroup asked)."""
    said = (f"cannot start slirp4netns: cannot apply cgroup ({tmp_path}/gone/cgroup.procs): ENOENT: "
            "No such file or directory")
    result = _launch(how, stand_in, cgroup=str(tmp_path / "gone"))
    if how == "vfork":
        assert (result["reply"], result["message"], result.get("left_open")) == ("ErrorReply", said, None), result
        assert result["stderr"] == ""
    else:
        assert (result["reply"], result["status"], result["ready"]) == ("Spawned", 127, ""), result
        assert said in str(result["fork_server_stderr"]), result
