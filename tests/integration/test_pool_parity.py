"""A sandbox made ahead is the sandbox made at open, for every kind of request.

The pool (dispatchd/daemon/pool.py) promises "a pool can make an open
faster, never different". Each case here opens the same request on a daemon
with a pool (after the pool holds a sandbox of its kind) and on one started
with ``--pool 0``, and compares what the session actually gets, read from
inside and from outside: its mount table (with the propagation fields), its
capabilities, no_new_privs and seccomp state, its signal dispositions, its
rlimits, its cgroup and the cgroup's limits, its network interfaces and
routes, which socket families it may open, its environment, its id maps,
its kernel budgets, what Landlock lets it open, the errno of the system calls
the escape suite tries, and the protections ``status`` reports. Requests that
cannot be served by a sandbox made for the policy's defaults (other ports, a
code path inside the worktree) must be made at open, and still be the same.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dispatch
from tests.conftest import CGROUP_BASE, REPO, Daemon, _refuse_root, open_when_free, probe, wait_for_pool

_FINGERPRINT = r'''
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
def rd(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError as e:
        return "ERR " + errno.errorcode.get(e.errno, str(e.errno))
mi = []
for line in open("/proc/self/mountinfo"):
    head, tail = line.rstrip("\n").split(" - ")
    f = head.split()
    mi.append(" ".join(f[3:]) + " - " + tail)  # root, mount point, options, propagation, fs
out["mountinfo"] = sorted(mi)
keys = ("Cap", "NoNewPrivs", "Seccomp", "Sig", "Umask", "Threads", "Cpus_allowed_list", "Speculation")
for who in ("self", "1"):
    out["status_" + who] = [l for l in rd(f"/proc/{who}/status").splitlines() if l.startswith(keys) and
                            not l.startswith("SigQ")]
    out["limits_" + who] = rd(f"/proc/{who}/limits")
    out["oom_" + who] = rd(f"/proc/{who}/oom_score_adj")
out["comm_1"] = rd("/proc/1/comm")
out["cgroup"] = rd("/proc/self/cgroup")
out["net_dev"] = sorted(l.split(":")[0].strip() for l in rd("/proc/net/dev").splitlines()[2:])
out["route"] = rd("/proc/net/route")
out["fib"] = rd("/proc/net/fib_trie")
out["if_inet6"] = sorted(l.split()[-1] for l in rd("/proc/net/if_inet6").splitlines())
fams = {}
for name in ("AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK", "AF_PACKET", "AF_VSOCK"):
    try:
        socket.socket(getattr(socket, name), socket.SOCK_DGRAM if name != "AF_PACKET" else socket.SOCK_RAW).close()
        fams[name] = "OK"
    except OSError as e:
        fams[name] = errno.errorcode.get(e.errno, str(e.errno))
out["sockets"] = fams
out["env"] = dict(sorted((k, v) for k, v in os.environ.items() if k != "DISPATCH_CALL_ID"))
out["ids"] = [rd("/proc/self/uid_map"), rd("/proc/self/gid_map"), rd("/proc/self/setgroups"),
              os.getuid(), os.getgid(), sorted(os.getgroups())]
out["uname"] = list(os.uname())[:2]
def ls(d):
    try:
        return sorted(os.listdir(d))
    except OSError as e:
        return "ERR " + errno.errorcode.get(e.errno, str(e.errno))
out["ls"] = {d: ls(d) for d in ("/", "/dev", "/tmp", "/proc/sys/user", "/proc/1/fd")}
out["ucounts"] = {n: rd("/proc/sys/user/" + n).strip() for n in ("max_user_namespaces", "max_inotify_instances",
    "max_inotify_watches", "max_fanotify_groups", "max_fanotify_marks", "max_pid_namespaces", "max_mnt_namespaces",
    "max_net_namespaces", "max_ipc_namespaces", "max_uts_namespaces", "max_cgroup_namespaces", "max_time_namespaces")}
out["sched"] = [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0))]
out["cwd"] = os.getcwd()
fds = {}
for fd in sorted(os.listdir("/proc/self/fd")):
    try:
        t = os.readlink("/proc/self/fd/" + fd)
    except OSError as e:
        t = "ERR"
    fds[fd] = t.split("[")[0]
out["fds"] = fds
opened = {}
for p, flags in ((os.environ["DISPATCH_WT"] + "/README.md", os.O_RDONLY), (os.environ["DISPATCH_WT"] + "/new", os.O_WRONLY | os.O_CREAT),
                 ("/etc/hostname", os.O_RDONLY), ("/usr/bin/env", os.O_RDONLY), ("/usr/x", os.O_WRONLY | os.O_CREAT),
                 ("/tmp/x", os.O_WRONLY | os.O_CREAT), ("/proc/1/environ", os.O_RDONLY), ("/proc/1/root/", os.O_RDONLY),
                 ("/proc/1/cwd/", os.O_RDONLY), ("/proc/1/fd/0", os.O_RDONLY), ("/.host", os.O_RDONLY),
                 (os.environ["HOME"], os.O_RDONLY), ("/dev/shm/x", os.O_WRONLY | os.O_CREAT)):
    try:
        os.close(os.open(p, flags, 0o600))
        opened[p.replace(os.environ["DISPATCH_WT"], "<wt>")] = "OK"
    except OSError as e:
        opened[p.replace(os.environ["DISPATCH_WT"], "<wt>")] = errno.errorcode.get(e.errno, str(e.errno))
for p in (os.environ["DISPATCH_WT"] + "/new", "/tmp/x", "/dev/shm/x"):
    try:
        os.unlink(p)
    except OSError:
        pass
out["open"] = opened
# Landlock's rules one by one, where the mounts allow and the rule decides (a
# sandbox made ahead adds most of them with its root, before its session).
import fcntl, termios
rules = {}
def rule(name, f):
    try:
        f()
        rules[name] = "OK"
    except OSError as e:
        rules[name] = errno.errorcode.get(e.errno, str(e.errno))
def ioctl_null():
    fd = os.open("/dev/null", os.O_RDWR)
    try:
        fcntl.ioctl(fd, termios.TCGETS, bytes(64))  # a device's ioctls are not granted
    finally:
        os.close(fd)
rule("ioctl /dev/null", ioctl_null)
rule("truncate /dev/null", lambda: os.truncate("/dev/null", 0))
rule("read /proc/self/status", lambda: os.close(os.open("/proc/self/status", os.O_RDONLY)))
rule("read /usr/bin/env", lambda: os.close(os.open("/usr/bin/env", os.O_RDONLY)))
rule("list /etc", lambda: os.listdir("/etc"))
rule("mkfifo /tmp", lambda: (os.mkfifo("/tmp/ff"), os.unlink("/tmp/ff")))
rule("mkdir /dev/shm", lambda: (os.mkdir("/dev/shm/dd"), os.rmdir("/dev/shm/dd")))
rule("symlink /tmp", lambda: (os.symlink("/etc", "/tmp/ln"), os.unlink("/tmp/ln")))
rule("rename /tmp -> <wt>", lambda: (open("/tmp/mv", "w").close(), os.rename("/tmp/mv", os.environ["DISPATCH_WT"] + "/mv")))
rule("mkdir <home>", lambda: (os.mkdir(os.environ["HOME"] + "/dd"), os.rmdir(os.environ["HOME"] + "/dd")))
for p in ("/tmp/mv", os.environ["DISPATCH_WT"] + "/mv"):
    try:
        os.unlink(p)
    except OSError:
        pass
out["landlock_rules"] = rules
calls = {}
# unshare(0) is harmless; the others are refused outright, or fail on their bad arguments.
for name, nr, args in (("unshare_user", 272, (0x10000000,)), ("unshare_mnt", 272, (0x00020000,)),
                       ("mount", 165, (0, 0, 0, 0, 0)), ("ptrace_traceme_peek", 101, (2, 1, 0, 0)),
                       ("keyctl", 250, (0, 0, 0, 0, 0)), ("bpf", 321, (0, 0, 0)), ("io_uring", 425, (0, 0)),
                       ("userfaultfd", 323, (0,)), ("perf", 298, (0, 0, 0, 0, 0)), ("open_tree", 428, (-100, 0, 0)),
                       ("setns", 308, (-1, 0)), ("pidfd_open1", 434, (1, 0)), ("pidfd_getfd", 438, (-1, 0, 0)),
                       ("chroot", 161, (0,)), ("name_to_handle_at", 303, (-100, 0, 0, 0, 0)),
                       ("clone3", 435, (0, 0)), ("mount_setattr", 442, (-1, 0, 0, 0, 0)),
                       ("move_mount", 429, (-1, 0, -1, 0, 0)), ("fsopen", 430, (0, 0)), ("fspick", 433, (-1, 0, 0)),
                       ("pivot_root", 155, (0, 0)), ("umount2", 166, (0, 0)), ("kill_1", 62, (1, 9)),
                       ("kill_all", 62, (-1, 0)), ("process_vm_readv", 310, (1, 0, 0, 0, 0, 0)),
                       ("socket_unix", 41, (1, 1, 0)), ("setpriority_down", 141, (0, 0, -5))):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    calls[name] = "OK" if r != -1 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
out["syscalls"] = calls
print(json.dumps(out))
'''


def _normalize(text: str, session: dispatch.Session, wt: Path) -> str:
    """The session's own names (its id, its scratch directory, its daemon's
    state and cgroup directories) are the only things allowed to differ."""
    prot = session.status()["protections"]
    scratch = next(r["path"] for r in prot["root"] if "the session's scratch: HOME" in r["how"])
    cgroup = prot["limits"]["cgroup"]
    text = text.replace(scratch, "<scratch>").replace(session.id, "<sid>").replace(str(wt), "<wt>")
    # The daemon's state directory: where the DNS relay's resolv.conf is bound from.
    text = text.replace(os.path.dirname(os.path.dirname(scratch)) + "/", "<state>/")
    if cgroup:
        text = text.replace(os.path.dirname(cgroup), "<cgroups>")
        text = text.replace(os.path.basename(os.path.dirname(cgroup)), "<daemon-cgroup>")
    return text


def fingerprint(session: dispatch.Session, wt: Path) -> dict[str, Any]:
    """What the session gets, inside and out (see the module docstring)."""
    raw = probe(session, f"import os; os.environ['DISPATCH_WT'] = {str(wt)!r}\n" + _FINGERPRINT)
    got: dict[str, Any] = json.loads(_normalize(raw, session, wt))
    status = session.status()
    prot = dict(status["protections"])
    prot.pop("made_ahead", None)
    prot.pop("lifetime", None)
    got["protections"] = json.loads(_normalize(json.dumps(prot, sort_keys=True), session, wt))
    cgroup = status["protections"]["limits"]["cgroup"]
    if cgroup:
        got["cgroup_files"] = {n: Path(cgroup, n).read_text() for n in sorted(os.listdir(cgroup))
                               if n in ("pids.max", "memory.max", "memory.swap.max", "cpu.weight", "memory.high")}
        got["cgroup_procs"] = len(Path(cgroup, "cgroup.procs").read_text().split())
    return got


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """A daemon with a pool and one without, alike in everything else
    (policies, a delegated cgroup each when there is one)."""
    _refuse_root()
    base = tmp_path_factory.mktemp("parity")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    # Another policy: /dev/pts (a devpts of the session's own) and other limits.
    text = (policies / "default.toml").read_text()
    (policies / "tight.toml").write_text(
        text.replace('"/dev/urandom"]', '"/dev/urandom", "/dev/pts"]')
        .replace("[limits]\n", "[limits]\nmax_processes = 77\nmax_open_files = 333\nsession_memory_bytes = 300000000\n"))
    daemons = []
    for name, extra in (("pooled", ()), ("plain", ("--pool", "0"))):
        (base / name).mkdir()
        cg = ("--cgroup", f"{CGROUP_BASE}/parity-{name}-{secrets.token_hex(3)}") if CGROUP_BASE else ("--cgroup", "off")
        daemons.append(Daemon(base / name, "--policies", str(policies), *cg, *extra))
    yield daemons[0], daemons[1]
    for d in daemons:
        assert d.stop() == 0, d.log()


def _open_both(pair: tuple[Daemon, Daemon], wt: Path, *, expect_made_ahead: bool, kind: str,
               **request: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    pooled, plain = pair
    with pooled.connect() as a, plain.connect() as b:
        # The first open of a kind asks the pool for it; the second is served.
        with a.open_session(str(wt), **request):
            pass
        wait_for_pool(a, kind, 1)
        with a.open_session(str(wt), **request) as s:
            assert s.status()["protections"].get("made_ahead", False) is expect_made_ahead, pooled.log()[-3000:]
            ahead = fingerprint(s, wt)
        with open_when_free(b, wt, **request) as s:  # the pooled daemon's gives it back after its close's reply
            assert s.status()["protections"].get("made_ahead", False) is False
            at_open = fingerprint(s, wt)
    return ahead, at_open


def _assert_same(ahead: dict[str, Any], at_open: dict[str, Any]) -> None:
    differ = {k: (ahead.get(k), at_open.get(k)) for k in sorted(set(ahead) | set(at_open)) if ahead.get(k) != at_open.get(k)}
    assert not differ, json.dumps(differ, indent=1)[:6000]


@pytest.mark.parametrize("request_", [
    pytest.param({"kind": "default/off"}, id="default-off"),
    pytest.param({"kind": "default/on", "network": "on"}, id="default-on"),
    pytest.param({"kind": "default/ports", "network": "ports"}, id="default-ports"),
    pytest.param({"kind": "default/domains", "network": "domains", "domains": ["example.com"]}, id="domains"),
    pytest.param({"kind": "tight/off", "policy": "tight"}, id="tight"),
    pytest.param({"kind": "tight/on", "policy": "tight", "network": "on"}, id="tight-on"),
])
def test_a_sandbox_made_ahead_gives_what_one_made_at_open_gives(pair: tuple[Daemon, Daemon], worktree: Path,
                                                               request_: dict[str, Any]) -> None:
    kind = request_.pop("kind")
    ahead, at_open = _open_both(pair, worktree, expect_made_ahead=True, kind=kind, **request_)
    _assert_same(ahead, at_open)


def test_other_ports_than_the_policys_are_made_at_open_and_the_same(pair: tuple[Daemon, Daemon],
                                                                    worktree: Path) -> None:
    """Ports of the call's own: nftables names them, so the pool's sandbox
    (made with the policy's) is not given (pool_key), and the session is what
    a daemon without a pool gives."""
    ahead, at_open = _open_both(pair, worktree, expect_made_ahead=False, kind="default/ports", network="ports",
                                ports=[8443])
    _assert_same(ahead, at_open)
    assert "event=pool_mismatch" in pair[0].log()


def test_a_calls_read_only_paths_reach_a_sandbox_made_ahead(pair: tuple[Daemon, Daemon], worktree: Path,
                                                            tmp_path: Path) -> None:
    """Extra read-only paths are bound at adoption, from the host's root the
    sandbox held since it was made: the same binds as at open, one under the
    private /tmp (pytest's tmp_path) and one in the home directory."""
    under_tmp = tmp_path / "tools"
    under_tmp.mkdir()
    (under_tmp / "tool").write_text("t\n")
    in_home = Path.home() / f".parity-tools-{secrets.token_hex(3)}"
    in_home.mkdir()
    try:
        ahead, at_open = _open_both(pair, worktree, expect_made_ahead=True, kind="default/off",
                                    read_only=[str(under_tmp), str(in_home)])
    finally:
        shutil.rmtree(in_home)
    _assert_same(ahead, at_open)
    assert any(str(in_home) in line for line in ahead["mountinfo"])


def test_a_linked_worktree_in_a_sandbox_made_ahead(pair: tuple[Daemon, Daemon], tmp_path: Path) -> None:
    """A linked worktree: its common git directory (outside it) read-only,
    its own git directory writable, its pointer files read-only inside it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("x\n")
    subprocess.run([*git, "-C", str(repo), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "c"], check=True)
    linked = tmp_path / "linked"
    subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", str(linked)], check=True)
    (linked / "README.md").write_text("hello\n")
    ahead, at_open = _open_both(pair, Path(os.path.realpath(linked)), expect_made_ahead=True, kind="default/off")
    _assert_same(ahead, at_open)
    assert ahead["protections"]["git"]["kind"] == "linked"


def test_a_worktree_in_the_home_directory(pair: tuple[Daemon, Daemon]) -> None:
    wt = Path.home() / f"parity-wt-{secrets.token_hex(3)}"
    wt.mkdir()
    (wt / "README.md").write_text("hello\n")
    try:
        ahead, at_open = _open_both(pair, wt, expect_made_ahead=True, kind="default/off")
    finally:
        shutil.rmtree(wt)
    _assert_same(ahead, at_open)


def test_a_sandbox_planned_for_another_worktree_serves_this_one_as_one_made_at_open(
        pair: tuple[Daemon, Daemon]) -> None:
    """The pool makes a sandbox with the plan of the kind's last open (its
    worktree's); a session on another worktree gets it all the same (the
    same pool key), and sees what a sandbox made at open shows, nothing of
    the worktree it was planned for: neither a mount nor a path."""
    first = Path.home() / f"parity-first-{secrets.token_hex(3)}"
    second = Path.home() / f"parity-second-{secrets.token_hex(3)}"
    for wt in (first, second):
        wt.mkdir()
        (wt / "README.md").write_text("hello\n")
    pooled, plain = pair
    try:
        with pooled.connect() as a, plain.connect() as b:
            with a.open_session(str(first)):
                pass
            wait_for_pool(a, "default/off", 2)  # each planned for a worktree opened before: none for the second
            with a.open_session(str(second)) as s:
                assert s.status()["protections"].get("made_ahead") is True, pooled.log()[-3000:]
                ahead = fingerprint(s, second)
                seen = probe(s, f"import os; print(os.path.exists({str(first)!r}), os.path.exists({str(second)!r}))")
            with open_when_free(b, second) as s:
                at_open = fingerprint(s, second)
    finally:
        shutil.rmtree(first)
        shutil.rmtree(second)
    _assert_same(ahead, at_open)
    assert not any(first.name in line for line in ahead["mountinfo"])
    assert seen.split() == ["False", "True"]  # the twin: its own worktree is there
