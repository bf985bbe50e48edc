"""dispatchd.confine.plan.plan_session (and plan_namespaces): whole plans by equality.

The kernel is described by hand (``KernelFeatures``), so every mode is
planned here whatever the machine running the tests offers: full (user
namespaces, Landlock ABI 7), degraded (no user namespaces), old ABIs, and
each refusal. Masks are numbers from the kernel uapi, not the module's
constants: 13 read+execute, 0xF7BF read-write, 6 device read+write.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dispatchd.confine.landlock import LandlockPlan, PathRule
from dispatchd.confine.mountplan import WORKTREE_FD, Bind, MountPlan
from dispatchd.confine.namespaces import NamespacePlan, plan_namespaces
from dispatchd.confine.netstack import NetworkPlan, nft_rules, switch_in_place
from dispatchd.confine.plan import NetworkPorts, SessionPaths, SessionPlan, can_sleep, plan_session
from dispatchd.confine.seccomp import plan_seccomp
from dispatchd.errors import ConfinementError
from dispatchd.kernel import KernelFeatures
from dispatchd.policy import Env, Filesystem, Limits, Network, Policy, Sandbox, parse_policy

WT = "/home/u/src/wt"
SCRATCH = "/home/u/.local/state/dispatchd/sessions/s1"
RUNTIME = "/run/user/1000"
CODE = "/opt/dispatchd"
SYSTEM = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt"]
DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
PATHS = SessionPaths(worktree=WT, scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE])
RO, RW, DEV = 13, 0xF7BF, 6
SHARED = RW & ~(1 << 9)  # read-write, but no Unix socket made: another session may reach the path
UID, GID = 1000, 1001
CHMOD_GAP = ("chmod, chown, utime and xattr changes on files the user owns outside the worktree "
             "(Landlock ABI <= 7 does not check them; only a read-only mount would): chmod can make the user's "
             "files readable to other local users (chmod 644 ~/.ssh/id_ed25519 with chmod 755 ~), never to the "
             "session itself; dispatchd's own state and socket directories are among them, and it sets their "
             "modes back (at its start, when an open of its files is refused, and each second for the socket's)")
PROC_PEEK_GAP = ("the host's /proc: other processes' mountinfo and net/tcp, udp and unix are readable (no ptrace "
                 "check guards them): another session's worktree, scratch path and extra read-only paths, the "
                 "sockets of its private network namespace, and, through the daemon's pid, the host's Unix sockets")
PROC_GAP = ("the host's /proc: the user's other processes and their command lines are visible "
            "(their memory, environment and fds stay refused by Landlock's ptrace rule)")
TMP_GAP = "no private /tmp: the host's /tmp is simply not granted (TMPDIR is the session's own)"
SECCOMP_NET_GAP = "network off is held by seccomp alone (no Landlock TCP rules below ABI 4)"
SCOPES_GAP = ("no Landlock scopes (ABI < 6): signals to the user's other processes and "
              "abstract Unix sockets rely on seccomp and namespaces only")
SIGNALS_GAP = ("signals: the session can signal every process of the user's, the daemon included "
               "(kill, SIGSTOP): without a pid namespace only Landlock's signal scope (ABI 6) would stop "
               "it; abstract Unix sockets stay refused (seccomp: socket(AF_UNIX))")
TRUNCATE_GAP = ("truncate() of files the user owns on read-only paths outside the worktree (an extra "
                "read-only path, dispatchd's own code): Landlock handles truncation from ABI 3, and "
                "without user namespaces no read-only mount holds it")
ABSTRACT_GAP = ("abstract Unix socket names of the host can be taken (bind) by the session: a program "
                "of the user's that binds the same name then fails (nothing can be connected to or "
                "received through them)")
META_GAP = ("metadata of files outside the worktree: stat (size, times), readlink, getxattr and "
            "inotify watches work on paths Landlock refuses to open (only a root of the session's own "
            "hides them: full mode with root = \"minimal\")")
UNIX_GAP = ("Unix sockets are refused (socket(AF_UNIX): EPERM; stream socketpairs work): without a root "
            "of the session's own, connect() could reach any socket of the user's by path (Landlock ABI "
            "<= 7 does not check it), so multiprocessing.Manager, Unix-socket servers and the like fail")
UNIX_NET_GAP = ("Unix sockets are refused (socket(AF_UNIX): EPERM; stream socketpairs work) while the session "
                "shares the host's network namespace (network on or ports): an abstract name it listened on "
                "would be connected to by the user's own programs (Landlock's scope stops connecting out, not "
                "in); with the network off they work")
PORTS_GAP = ("network 'ports' restricts TCP only: UDP (DNS included) and ICMP reach the host's "
             "network (Landlock has no rules for them)")
PORTS_GAP = ("network 'ports' restricts TCP only (Landlock): UDP (DNS included) and ICMP reach the "
             "host's network, and an MPTCP socket or a TCP Fast Open sendto connects to any port")
SWITCH_GAP = ("switching the network off without user namespaces: a socket the session set up while on "
              "outlives the switch (a sendfile queue in FIN-WAIT keeps sending page-cache pages the off "
              "session rewrites afterwards); only a network namespace of its own closes that")
NO_STACK = "pasta is not installed (install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)"
NO_NFT = "libnftables is not installed (install it: sudo apt install nftables; Fedora, RHEL: sudo dnf install nftables)"


VIA_PASTA = "own network namespace, out through pasta (the host's loopback is 10.0.2.2)"
IN_PASTA = ("nftables in it: in only the replies to what the session sent; its UDP source ports moved into the "
            "host's ephemeral range")
HYGIENE = ["no_new_privs", "new session, no terminal", "fds closed", "environment allowlist",
           "dies with its parent", "not dumpable"]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def kernel(abi: int = 7, userns: bool = True, seccomp: bool = True, stack: bool = True,
           nft: bool = True) -> KernelFeatures:
    return KernelFeatures(
        release="6.8.0-test",
        landlock_abi=abi,
        user_namespaces=userns,
        user_namespaces_note="available" if userns else "refused by the kernel: Permission denied",
        seccomp=seccomp,
        seccomp_actions=["kill_process", "kill_thread", "trap", "errno", "user_notif", "trace", "log", "allow"]
        if seccomp else [],
        cgroup2="/sys/fs/cgroup",
        cgroup_delegation="no: controllers pids, memory are not available in /sys/fs/cgroup (it has: none)",
        network_stack_missing="" if stack else NO_STACK,
        network_stack="pasta" if stack else "",
        nftables_missing="" if nft else NO_NFT,
    )


def plan(policy: Policy | None = None, k: KernelFeatures | None = None, network: str = "off",
         base_env: dict[str, str] | None = None, ports: NetworkPorts | None = None,
         paths: SessionPaths = PATHS) -> SessionPlan:
    return plan_session(policy or Policy(), k or kernel(), session="s1", paths=paths, network=network,
                        uid=UID, gid=GID, base_env=base_env if base_env is not None else {}, ports=ports)


def report(got: SessionPlan) -> Any:
    """The plan's protections as status sends them (a dict, as clients read it)."""
    return msgspec.to_builtins(got.protections)


def refused(policy: Policy | None = None, k: KernelFeatures | None = None, network: str = "off") -> ConfinementError:
    with pytest.raises(ConfinementError) as info:
        plan(policy, k, network)
    return info.value


def read_only_policy() -> Policy:
    return Policy(name="read-only", tools=("read_file", "list_files", "search_files"),
                  filesystem=Filesystem(worktree="read-only"))


def root_binds(*, worktree_rw: bool = True) -> list[Bind]:
    """The default policy's minimal root for PATHS, parents first."""
    return [Bind("/bin", "ro"), Bind("/etc", "ro"), Bind(SCRATCH, "rw"), Bind(WT, "rw" if worktree_rw else "ro", WORKTREE_FD),
            Bind("/lib", "ro"), Bind("/lib32", "ro"), Bind("/lib64", "ro"), Bind("/libx32", "ro"), Bind("/opt", "ro"),
            Bind("/sbin", "ro"), Bind("/tmp", "rw", SCRATCH + "/tmp"), Bind("/usr", "ro")]


# The system paths as bound (the daemon's code is under /opt already), in the binds' order.
SYSTEM_BOUND = ["/bin", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/sbin", "/usr"]


def landlock_paths(*, userns: bool, worktree_rw: bool = True) -> list[PathRule]:
    ro = SYSTEM + ["/proc", CODE]
    rw = [SCRATCH] + (["/tmp", "/dev/shm"] if userns else [])
    shared = [WT] if worktree_rw else []
    if not worktree_rw:
        ro.insert(0, WT)
    return [PathRule(p, RO) for p in ro] + [PathRule(p, RW) for p in rw] + [PathRule(p, SHARED) for p in shared] \
        + [PathRule(p, DEV) for p in DEVICES]


# -- full mode -----------------------------------------------------------------


def test_full_mode_network_off():
    got = plan()
    assert got.session == "s1"
    assert got.policy == "default"
    assert got.network == "off"
    assert got.paths == PATHS
    assert got.namespaces == NamespacePlan(user=True, mount=True, pid=True, net=True, uid=UID, gid=GID)
    assert got.loopback is True
    # CODE (/opt/dispatchd) is inside /opt: bound with it.
    assert got.mounts == MountPlan(root="minimal", binds=root_binds(), devices=DEVICES, hide=[], system=SYSTEM_BOUND,
                                   ahead=[SCRATCH, "/tmp"])
    # The network namespace holds "off": Landlock does not handle TCP, seccomp allows inet;
    # the root and the network namespace are the session's own: Unix sockets too.
    # Every rule but the session's own paths' (worktree, scratch) is added with the root.
    assert got.landlock == LandlockPlan(abi=7, handled_fs=0xFFFF, handled_net=0, scoped=3,
                                        paths=landlock_paths(userns=True), tcp_ports=[],
                                        ahead=SYSTEM + ["/proc", CODE, "/tmp", "/dev/shm"] + DEVICES)
    assert got.seccomp == plan_seccomp(allow_inet=True, allow_unix=True)
    assert got.writable is True
    assert got.tools == ["read_file", "write_file", "edit_file", "create_file", "list_files", "search_files",
                         "shell_exec", "job_output", "job_stop", "job_list"]
    assert got.limits == Policy().limits


def test_full_mode_protections():
    prot = report(plan())
    assert prot["mode"] == "full"
    assert prot["leaves_open"] == []
    assert prot["landlock"] == {"abi": 7, "filesystem": "enforced", "scopes": ["abstract_unix_socket", "signal"],
                                "tcp": "not handled"}
    assert prot["seccomp"] == "enforced"
    assert prot["namespaces"] == {"user": True, "mount": True, "pid": True, "net": True}
    assert prot["network"] == {"mode": "off", "mechanism": "network namespace with loopback only"}
    assert prot["worktree"] == "read-write"
    assert prot["hygiene"] == HYGIENE + ["no capabilities"]
    assert prot["unix_sockets"] == ("allowed: pathname sockets inside the session's own root, abstract names in "
                                    "its own network namespace; made only in the session's scratch, /tmp, /dev/shm "
                                    "(nowhere another session reaches: the worktree and read_write paths make none)")
    assert prot["root"][3] == {"path": WT, "how": "read-write (the worktree, bound from the descriptor the daemon "  # type: ignore[index]
                                                  "checked)"}
    assert [r["path"] for r in prot["root"]] == [b.path for b in root_binds()] + ["/dev", "/dev/shm", "/proc"]  # type: ignore[attr-defined]


def test_tmp_and_dev_shm_are_granted_only_with_a_mount_namespace():
    full = [r.path for r in plan().landlock.paths if r.access == RW]
    degraded = [r.path for r in plan(k=kernel(userns=False)).landlock.paths if r.access == RW]
    assert full == [SCRATCH, "/tmp", "/dev/shm"]
    assert degraded == [SCRATCH]


def test_a_worktree_below_tmp_can_hold_the_session_s_sockets_and_status_says_so():
    """Landlock's rule for the private /tmp holds below it, across the
    worktree's bind: the one layout where a socket can be made in the
    worktree, stated in leaves_open (only with Unix sockets allowed)."""
    gap = "Unix sockets can be made in /tmp/agent/wt: it lies below the session's private /tmp"
    below = plan(paths=msgspec.structs.replace(PATHS, worktree="/tmp/agent/wt"))
    assert any(g.startswith(gap) for g in report(below)["leaves_open"]), report(below)["leaves_open"]
    assert not [g for g in report(plan())["leaves_open"] if g.startswith("Unix sockets can be made")]
    degraded = plan(k=kernel(userns=False), paths=msgspec.structs.replace(PATHS, worktree="/tmp/agent/wt"))
    assert not [g for g in report(degraded)["leaves_open"] if g.startswith("Unix sockets can be made")]


def test_a_unix_socket_is_made_only_where_no_other_session_reaches():
    """The worktree and the policy's read_write paths may be another
    session's too (its worktree given read-only, one path in two policies):
    a socket there is a rendezvous, and descriptors pass through it."""
    policy = Policy(filesystem=Filesystem(read_write=("/home/u/.cache",)))
    for k in (kernel(), kernel(userns=False)):
        rules = {r.path: r.access for r in plan(policy, k).landlock.paths}
        assert rules[WT] == rules["/home/u/.cache"] == SHARED and rules[SCRATCH] == RW, rules
        assert [p for p, a in rules.items() if a & (1 << 9)] == [SCRATCH] + (["/tmp", "/dev/shm"] if k.user_namespaces
                                                                             else [])


def test_full_mode_network_on():
    got = plan(network="on")
    # A namespace of its own, as with "off": the same sandbox, so a switch keeps its processes.
    assert got.namespaces == NamespacePlan(user=True, mount=True, pid=True, net=True, uid=UID, gid=GID)
    assert got.loopback is True
    assert got.landlock == plan().landlock
    assert got.seccomp == plan_seccomp(allow_inet=True, allow_unix=True)  # its own namespace: Unix sockets too
    assert got.mounts is not None
    assert got.net == NetworkPlan("on", namespace=True, stack=True, rules=nft_rules("on", NetworkPorts([]), "pasta"),
                                  landlock_tcp=False, seccomp_inet=True, mechanism=f"{VIA_PASTA}; {IN_PASTA}")
    assert report(got)["network"] == {"mode": "on", "mechanism": f"{VIA_PASTA}; {IN_PASTA}", "stack": "pasta"}
    assert report(got)["landlock"]["tcp"] == "not handled"
    assert report(got)["mode"] == "full"
    assert report(got)["leaves_open"] == []


@pytest.mark.parametrize("network", ["on", "ports"])
def test_full_mode_on_and_ports_without_a_stack_are_refused_naming_the_fix(network: str):
    err = refused(k=kernel(stack=False), network=network)
    assert err.step == "network"
    assert err.message == (f"cannot apply network: network {network!r} needs a user-mode network stack, "
                           f"which cannot run here: {NO_STACK}; network 'off' and 'domains' work without it")


def test_full_mode_off_and_domains_need_no_stack():
    assert plan(k=kernel(stack=False), network="domains").net == plan(network="domains").net
    # "off" needs no stack: unchanged, but for the room left for pasta's namespaces.
    without = plan(k=kernel(stack=False))
    assert msgspec.structs.replace(without, ucounts=plan().ucounts) == plan()
    # The sandbox's own detached mounts (the host's root held, a woken /proc), and pasta's.
    assert without.ucounts.maxima["max_mnt_namespaces"] == 2
    assert plan().ucounts.maxima["max_mnt_namespaces"] == 6  # pasta joins the session's user namespace
    assert plan().ucounts.maxima["max_user_namespaces"] == 0 and plan().ucounts.maxima["max_net_namespaces"] == 0


def test_full_mode_below_abi_6_is_degraded_for_want_of_scopes():
    got = plan(k=kernel(abi=5))
    assert got.landlock.scoped == 0
    assert got.landlock.handled_fs == 0xFFFF
    assert report(got)["mode"] == "degraded"
    assert report(got)["leaves_open"] == [SCOPES_GAP]
    assert report(got)["landlock"]["scopes"] == []


@pytest.mark.parametrize("abi", [6, 7])
def test_full_mode_needs_abi_6(abi: int):
    assert report(plan(k=kernel(abi=abi)))["mode"] == "full"


def test_read_only_worktree():
    got = plan(read_only_policy())
    assert got.writable is False
    assert got.tools == ["read_file", "list_files", "search_files"]
    assert got.landlock.paths == landlock_paths(userns=True, worktree_rw=False)
    assert got.landlock.paths[0] == PathRule(WT, RO)
    assert got.mounts == MountPlan(root="minimal", binds=root_binds(worktree_rw=False), devices=DEVICES, hide=[],
                                   system=SYSTEM_BOUND,
                                   ahead=[SCRATCH, "/tmp"])
    assert report(got)["worktree"] == "read-only"


def test_read_only_worktree_degraded():
    got = plan(read_only_policy(), kernel(userns=False))
    assert got.landlock.paths == landlock_paths(userns=False, worktree_rw=False)
    assert got.mounts is None


def test_policy_paths_reach_landlock_and_mounts():
    policy = Policy(filesystem=Filesystem(read_only=("/usr",), read_write=("/home/u/.cache",), devices=("/dev/tty",)))
    got = plan(policy)
    assert got.landlock.paths == [
        PathRule("/usr", RO), PathRule("/proc", RO), PathRule(CODE, RO),
        PathRule(SCRATCH, RW), PathRule("/tmp", RW), PathRule("/dev/shm", RW),
        PathRule(WT, SHARED), PathRule("/home/u/.cache", SHARED), PathRule("/dev/tty", DEV),
    ]
    assert got.mounts is not None
    assert got.mounts.writable() == ["/home/u/.cache", SCRATCH, WT, "/tmp"]
    assert got.mounts.devices == ["/dev/tty"]


def test_the_hosts_root_as_the_policy_may_ask():
    paths = SessionPaths(worktree=RUNTIME + "/wt", scratch=SCRATCH, runtime_dirs=[RUNTIME, "/run/user/1000x"],
                         code=[CODE])
    got = plan(Policy(filesystem=Filesystem(root="host")), paths=paths)
    assert got.mounts is not None
    assert got.mounts.root == "host"
    assert got.mounts.hide == ["/run/user/1000x"]  # the one holding the worktree stays visible
    # No root of its own: the user's sockets would be there to connect to.
    assert got.seccomp == plan_seccomp(allow_inet=True, allow_unix=False)
    assert report(got)["mode"] == "full"
    assert report(got)["leaves_open"] == [META_GAP, UNIX_GAP]
    assert report(got)["root"][0]["path"] == "/"


def test_extra_read_only_paths_reach_the_root_and_landlock():
    paths = msgspec.structs.replace(PATHS, read_only=["/home/u/.cargo", "/home/u/.rustup"])
    got = plan(paths=paths)
    assert got.mounts is not None
    assert [b for b in got.mounts.binds if b.path.startswith("/home/u/.")] == [
        Bind("/home/u/.cargo", "ro"), Bind(SCRATCH, "rw"), Bind("/home/u/.rustup", "ro")]
    assert [r for r in got.landlock.paths if r.path.startswith("/home/u/.") and r.access == RO] == [
        PathRule("/home/u/.cargo", RO), PathRule("/home/u/.rustup", RO)]
    assert {"path": "/home/u/.cargo", "how": "read-only (extra read-only path)"} in report(got)["root"]


def test_the_layer_test_lets_landlock_read_the_whole_root():
    got = plan(Policy(filesystem=Filesystem(landlock_grants_root=True)))
    assert got.landlock.paths[0] == PathRule("/", RO)
    assert report(got)["mode"] == "full"
    assert report(got)["leaves_open"] == [
        "filesystem.landlock_grants_root (a layer test): Landlock lets the session read the whole of its root; "
        "only the root's contents keep the rest out"]
    # Never on the host's root (the policy refuses the pair; the plan would not grant it either).
    assert PathRule("/", RO) not in plan(Policy(filesystem=Filesystem(landlock_grants_root=True)),
                                         kernel(userns=False)).landlock.paths


# -- degraded mode (no user namespaces) -----------------------------------------


def test_degraded_mode_network_off():
    got = plan(k=kernel(userns=False))
    assert got.namespaces == NamespacePlan(user=False, mount=False, pid=False, net=False, uid=UID, gid=GID)
    assert got.loopback is False
    assert got.mounts is None
    # No network namespace: seccomp refuses inet sockets and Landlock every TCP bind/connect.
    assert got.seccomp == plan_seccomp(allow_inet=False, ipc_namespace=False, pid_namespace=False)
    assert got.landlock == LandlockPlan(abi=7, handled_fs=0xFFFF, handled_net=3, scoped=3,
                                        paths=landlock_paths(userns=False), tcp_ports=[])
    prot = report(got)
    assert prot["mode"] == "degraded"
    assert prot["leaves_open"] == [CHMOD_GAP, PROC_GAP, PROC_PEEK_GAP, TMP_GAP, META_GAP, UNIX_GAP, ABSTRACT_GAP, SWITCH_GAP]
    assert prot["unix_sockets"] == "refused (seccomp: socket(AF_UNIX) -> EPERM)"
    assert "chmod" in prot["leaves_open"][0]  # type: ignore[index]
    assert prot["namespaces"] == {"user": False, "mount": False, "pid": False, "net": False}
    assert prot["network"] == {"mode": "off",
                               "mechanism": "seccomp: no IPv4/IPv6 sockets, Landlock: no TCP bind/connect"}
    assert prot["landlock"] == {"abi": 7, "filesystem": "enforced", "scopes": ["abstract_unix_socket", "signal"],
                                "tcp": "denied"}
    assert prot["hygiene"] == HYGIENE


def test_degraded_mode_network_on():
    got = plan(k=kernel(userns=False), network="on")
    assert got.seccomp == plan_seccomp(allow_inet=True, ipc_namespace=False, pid_namespace=False)
    assert got.landlock.handled_net == 0
    assert report(got)["network"] == {"mode": "on", "mechanism": "host network"}
    assert report(got)["leaves_open"] == [CHMOD_GAP, PROC_GAP, PROC_PEEK_GAP, TMP_GAP, META_GAP, UNIX_GAP, ABSTRACT_GAP, SWITCH_GAP]


def test_degraded_mode_on_abi_3_holds_network_off_by_seccomp_alone():
    got = plan(k=kernel(abi=3, userns=False))
    assert got.seccomp == plan_seccomp(allow_inet=False, ipc_namespace=False, pid_namespace=False)
    assert got.landlock.handled_net == 0
    assert got.landlock.handled_fs == 0x7FFF
    assert got.landlock.scoped == 0
    assert report(got)["network"] == {"mode": "off", "mechanism": "seccomp: no IPv4/IPv6 sockets"}
    assert report(got)["leaves_open"] == [CHMOD_GAP, PROC_GAP, PROC_PEEK_GAP, TMP_GAP, SECCOMP_NET_GAP, SIGNALS_GAP, META_GAP,
                                              UNIX_GAP, ABSTRACT_GAP, SWITCH_GAP]
    assert report(got)["landlock"]["tcp"] == "not handled"


def test_degraded_mode_on_abi_1():
    got = plan(k=kernel(abi=1, userns=False))
    assert got.landlock.handled_fs == 0x1FFF
    assert report(got)["leaves_open"][4:7] == [SECCOMP_NET_GAP, TRUNCATE_GAP, SIGNALS_GAP]
    assert got.landlock.paths[len(SYSTEM) + 3] == PathRule(WT, SHARED & 0x1FFF)


# -- the policy's user_namespaces choice -----------------------------------------


def test_required_without_user_namespaces_is_refused():
    err = refused(Policy(sandbox=Sandbox(user_namespaces="required")), kernel(userns=False))
    assert err.step == "namespaces"
    assert err.errno == 0
    assert err.message == ("cannot apply namespaces: policy 'default' requires user namespaces: "
                           "refused by the kernel: Permission denied")
    assert err.code == "confinement_failed"


def test_required_with_user_namespaces_is_full():
    got = plan(Policy(sandbox=Sandbox(user_namespaces="required")))
    assert got.namespaces.user is True
    assert report(got)["mode"] == "full"


def test_never_is_degraded_even_where_available():
    got = plan(Policy(sandbox=Sandbox(user_namespaces="never")), kernel(userns=True))
    assert got.namespaces == NamespacePlan(user=False, mount=False, pid=False, net=False, uid=UID, gid=GID)
    assert got.mounts is None
    assert got.seccomp.allow_inet is False
    assert got.landlock.handled_net == 3
    assert got == plan(k=kernel(userns=False))  # exactly the kernel-refused plan


def test_auto_follows_the_kernel():
    assert plan(Policy(sandbox=Sandbox(user_namespaces="auto")), kernel(userns=True)).namespaces.user is True
    assert plan(Policy(sandbox=Sandbox(user_namespaces="auto")), kernel(userns=False)).namespaces.user is False


# -- refusals ---------------------------------------------------------------------


def test_no_landlock_is_refused():
    err = refused(k=kernel(abi=0))
    assert err.step == "landlock"
    assert err.message == ("cannot apply landlock: policy 'default' needs Landlock ABI >= 1; "
                           "this kernel offers: Landlock is not enabled in this kernel")


def test_min_landlock_abi_above_the_kernels_is_refused():
    err = refused(Policy(sandbox=Sandbox(min_landlock_abi=5)), kernel(abi=4))
    assert err.step == "landlock"
    assert err.message == "cannot apply landlock: policy 'default' needs Landlock ABI >= 5; this kernel offers: ABI 4"


def test_min_landlock_abi_equal_to_the_kernels_is_accepted():
    assert plan(Policy(sandbox=Sandbox(min_landlock_abi=4)), kernel(abi=4)).landlock.abi == 4


def test_no_seccomp_is_refused():
    err = refused(k=kernel(seccomp=False))
    assert err.step == "seccomp"
    assert err.message == "cannot apply seccomp: this kernel offers no seccomp filters with errno actions"


@pytest.mark.parametrize("network", ["maybe", "", "OFF", "none", "true"])
def test_unknown_network_mode_is_refused(network: str):
    err = refused(network=network)
    assert err.step == "network"
    assert err.message == f"cannot apply network: network must be one of off, on, ports, domains, not {network!r}"


# -- network "domains" ---------------------------------------------------------------


def test_domains_in_full_mode_is_off_plus_the_proxy_listener():
    got, off = plan(network="domains"), plan(network="off")
    # The same confinement as "off": a namespace with only loopback ...
    assert (got.namespaces, got.loopback, got.landlock, got.seccomp, got.mounts) == (
        off.namespaces, off.loopback, off.landlock, off.seccomp, off.mounts)
    assert got.namespaces.net is True
    # ... with the proxy's door in it, and the variables that point every command there.
    assert (got.proxy_port, off.proxy_port) == (3128, 0)
    url = "http://127.0.0.1:3128"
    assert {k: v for k, v in got.env.items() if k not in off.env} == {
        "HTTP_PROXY": url, "http_proxy": url, "HTTPS_PROXY": url, "https_proxy": url, "ALL_PROXY": url,
        "all_proxy": url, "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1"}
    assert report(got)["network"] == {"mode": "domains", "mechanism": (
        "network namespace with loopback only; the daemon's filtering proxy (127.0.0.1:3128, HTTP CONNECT "
        "and plain HTTP to the listed hosts) is the only way out")}
    assert report(got)["mode"] == "full"
    assert report(got)["leaves_open"] == [
        "network 'domains' checks the host each request names, not what a tunnel carries: a listed name served "
        "by a shared CDN can be fronted for other hosts (SNI, ECH), and a listed host that accepts uploads is a "
        "way out for data"]


def test_domains_proxy_variables_win_over_the_policys():
    got = plan(Policy(env=Env(set={"HTTPS_PROXY": "http://elsewhere:8080"})), network="domains")
    assert got.env["HTTPS_PROXY"] == "http://127.0.0.1:3128"


@pytest.mark.parametrize("k, policy", [(kernel(userns=False), Policy()),
                                       (kernel(), Policy(sandbox=Sandbox(user_namespaces="never")))],
                         ids=["no-user-namespaces", "policy-never"])
def test_domains_without_a_network_namespace_is_refused(k: KernelFeatures, policy: Policy):
    err = refused(policy, k, network="domains")
    assert err.step == "network"
    assert err.message.startswith("cannot apply network: network 'domains' needs a network namespace of its own "
                                  "(user namespaces), and this session has none (user namespaces: ")
    assert err.message.endswith("without one the host's network would be reachable directly, not only "
                                "through the filtering proxy")


# -- network "ports" -----------------------------------------------------------------


def test_ports_needs_landlock_abi_4_where_landlock_holds_it():
    assert plan(k=kernel(abi=6), network="ports").net.rules  # nftables holds it in the namespace
    err = refused(k=kernel(abi=3, userns=False), network="ports")
    assert err.step == "network"
    assert err.message == ("cannot apply network: network 'ports' needs Landlock TCP rules (ABI 4); "
                           "this kernel offers ABI 3")


def test_ports_in_full_mode():
    got = plan(network="ports", ports=NetworkPorts(connect=[443, 80], bind=[8080]))
    assert got.namespaces.net is True
    assert got.landlock == plan().landlock and got.seccomp == plan().seccomp  # the same sandbox as off and on
    assert got.net is not None and got.net.stack and not got.net.landlock_tcp
    assert got.net.rules == nft_rules("ports", NetworkPorts(connect=[443, 80], bind=[8080]), "pasta")
    mechanism = (f"{VIA_PASTA}; nftables in it: TCP, MPTCP and UDP out only to 443, 80, in only the replies to "
                 "what the session sent; its UDP source ports moved into the host's ephemeral range; "
                 "listening on any port, reachable from inside the session only; DNS through the daemon's relay "
                 "(127.0.0.53, on its loopback) to the host's resolvers, whatever the ports")
    assert report(got)["network"] == {"mode": "ports", "mechanism": mechanism, "stack": "pasta",
                                          "connect_ports": [443, 80], "bind_ports": [8080]}
    assert report(got)["mode"] == "full"
    assert report(got)["leaves_open"] == []


INPUT = ("    chain input {\n"
         "        type filter hook input priority 0; policy drop;\n"
         '        iif "lo" accept\n'
         "        ct state established,related accept\n"
         "    }\n"
         "    chain untracked_out {\n"
         "        type filter hook output priority raw; policy accept;\n"
         '        oif "lo" notrack\n'
         "    }\n"
         "    chain untracked_in {\n"
         "        type filter hook prerouting priority raw; policy accept;\n"
         '        iif "lo" notrack\n'
         "    }\n")


def test_nft_rules():
    reset = "add table inet dispatchd\ndelete table inet dispatchd\n"
    # No stack, no table: "off" has only its loopback, "domains" the proxy's listener on it.
    assert nft_rules("off", NetworkPorts(connect=[1])) == nft_rules("domains", NetworkPorts(connect=[1])) == reset
    # Every mode with a stack: in, only the loopback and the replies to the session's own flows.
    assert nft_rules("on", NetworkPorts(connect=[1]), "slirp4netns") == reset + "table inet dispatchd {\n" + INPUT + "}\n"
    assert nft_rules("ports", NetworkPorts(connect=[443, 53]), "slirp4netns") == (
        reset + "table inet dispatchd {\n" + INPUT +
        "    chain output {\n"
        "        type filter hook output priority 0; policy accept;\n"
        '        oif "lo" accept\n'
        "        meta l4proto { tcp, udp } th dport { 443, 53 } accept\n"
        "        reject with icmpx admin-prohibited\n"
        "    }\n"
        "}\n")
    assert "th dport" not in nft_rules("ports", NetworkPorts(connect=[]))


@pytest.mark.parametrize("mode", ["on", "ports"])
def test_under_pasta_a_session_s_udp_source_ports_are_moved_into_the_ephemeral_range(mode: str):
    """pasta binds the host's port of the session's source port number: moved,
    the session cannot pick it. slirp4netns binds one the host's kernel picks."""
    moved = ("    chain postrouting {\n"
             "        type nat hook postrouting priority 100; policy accept;\n"
             '        oifname "eth0" meta l4proto udp masquerade to :32768-60999 random\n'
             "    }\n}\n")
    pasta = nft_rules(mode, NetworkPorts(connect=[443]), "pasta")
    assert pasta == nft_rules(mode, NetworkPorts(connect=[443]), "slirp4netns")[:-2] + moved
    assert "masquerade" not in nft_rules(mode, NetworkPorts(connect=[443]), "slirp4netns")
    assert plan(network=mode, ports=NetworkPorts(connect=[443])).net.rules == pasta  # type: ignore[union-attr]


@pytest.mark.parametrize(("old", "new", "in_place"), [
    ("off", "on", True), ("on", "off", True), ("on", "ports", True), ("ports", "off", True),
])
def test_switches_in_place_within_the_namespace(old: str, new: str, in_place: bool):
    a, b = plan(network=old).net, plan(network=new).net
    assert a is not None and b is not None
    assert switch_in_place(a, b) is in_place
    a, b = plan(k=kernel(userns=False), network=old).net, plan(k=kernel(userns=False), network=new).net
    assert a is not None and b is not None and switch_in_place(a, b) is False


def test_ports_without_nftables_is_refused_naming_the_fix():
    err = refused(k=kernel(nft=False), network="ports")
    assert err.message == ("cannot apply network: network 'ports' needs nftables in the session's own network "
                           f"namespace: {NO_NFT}")



def test_on_without_nftables_runs_saying_what_comes_in():
    """The internet, as asked; what the stack hands in is said open, never said held."""
    got = plan(k=kernel(nft=False), network="on")
    assert got.net is not None and got.net.rules == "" and got.net.mechanism == VIA_PASTA
    assert report(got)["leaves_open"] == [
        "network 'on' without nftables in the session's namespace: whatever any sender sends to a port the stack "
        "holds on the host for the session's UDP flows comes in, and the session picks that port (pasta binds the "
        f"number of its source port) ({NO_NFT})"]
    # The twin: with nftables, nothing of it is left open.
    assert report(plan(network="on"))["leaves_open"] == []


def test_ports_default_to_the_policys():
    policy = Policy(network=Network(default="ports", connect_ports=(22,), bind_ports=()))
    got = plan(policy, k=kernel(userns=False), network="ports")
    assert got.landlock.tcp_ports == [(22, 2)]
    assert "th dport { 22 }" in plan(policy, network="ports").net.rules  # type: ignore[union-attr]
    assert report(got)["network"]["mechanism"] == "host network; Landlock TCP: connect to 22, bind none"


def test_ports_in_degraded_mode():
    got = plan(k=kernel(userns=False), network="ports", ports=NetworkPorts(connect=[], bind=[]))
    assert got.seccomp == plan_seccomp(allow_inet=True, ipc_namespace=False, pid_namespace=False)
    assert got.landlock.handled_net == 3
    assert got.landlock.tcp_ports == []
    assert report(got)["leaves_open"] == [CHMOD_GAP, PROC_GAP, PROC_PEEK_GAP, TMP_GAP, META_GAP, UNIX_GAP, ABSTRACT_GAP, PORTS_GAP,
                                              SWITCH_GAP]


def test_ports_are_ignored_unless_network_is_ports():
    got = plan(network="on", ports=NetworkPorts(connect=[443], bind=[80]))
    assert got.landlock.tcp_ports == []
    assert "connect_ports" not in report(got)["network"]


# -- the environment -------------------------------------------------------------------

DAEMON_ENV = {
    "PATH": "/home/u/bin:/usr/bin",
    "HOME": "/home/u",
    "TMPDIR": "/run/user/1000",
    "SHELL": "/usr/bin/zsh",
    "TERM": "xterm-256color",
    "LANG": "de_DE.UTF-8",
    "TZ": "Europe/Berlin",
    "USER": "u",
    "LOGNAME": "u",
    "SSH_AUTH_SOCK": "/run/user/1000/ssh-agent",
    "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus",
    "XDG_RUNTIME_DIR": "/run/user/1000",
    "AWS_SECRET_ACCESS_KEY": "hunter2",
    "LD_PRELOAD": "/home/u/evil.so",
    "PYTHONPATH": "/home/u/lib",
    "DISPATCH_SOCKET": "/run/user/1000/dispatchd/dispatchd.sock",
    "DISPATCH_SESSION": "spoofed",
}


def test_env_is_an_allowlist():
    assert plan(base_env=DAEMON_ENV).env == {
        "PATH": DEFAULT_PATH,
        "HOME": SCRATCH + "/home",
        "TMPDIR": "/tmp",  # the private one, in the session's own root
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        "LANG": "de_DE.UTF-8",  # pass_through
        "TZ": "Europe/Berlin",  # pass_through
        "USER": "u",
        "LOGNAME": "u",
        "DISPATCH_SESSION": "s1",
    }


def test_env_without_a_daemon_env():
    assert plan(base_env={}).env == {
        "PATH": DEFAULT_PATH, "HOME": SCRATCH + "/home", "TMPDIR": "/tmp", "SHELL": "/bin/bash",
        "TERM": "dumb", "LANG": "C.UTF-8", "DISPATCH_SESSION": "s1",
    }
    # Without a root of its own, the scratch directory's own tmp.
    assert plan(base_env={}, k=kernel(userns=False)).env["TMPDIR"] == SCRATCH + "/tmp"


def test_env_pass_through_takes_only_the_listed_names():
    policy = Policy(env=Env(pass_through=("PYTHONPATH", "NOT_SET")))
    env = plan(policy, base_env=DAEMON_ENV).env
    assert env["PYTHONPATH"] == "/home/u/lib"
    assert "NOT_SET" not in env
    assert env["LANG"] == "C.UTF-8"  # no longer passed through
    assert "TZ" not in env
    leaked = set(env) & (set(DAEMON_ENV) - {"PATH", "HOME", "TMPDIR", "SHELL", "TERM", "LANG", "USER", "LOGNAME",
                                             "DISPATCH_SESSION", "PYTHONPATH"})
    assert leaked == set()


def test_env_set_overrides_everything():
    policy = Policy(env=Env(set={"PATH": "/opt/tools/bin:/usr/bin", "CI": "1", "LANG": "C", "USER": "agent"}))
    env = plan(policy, base_env=DAEMON_ENV).env
    assert (env["PATH"], env["CI"], env["LANG"], env["USER"]) == ("/opt/tools/bin:/usr/bin", "1", "C", "agent")
    assert env["HOME"] == SCRATCH + "/home"


def test_env_does_not_change_the_callers_dict():
    base = dict(DAEMON_ENV)
    plan(base_env=base)
    assert base == DAEMON_ENV


def test_dispatch_session_names_the_session():
    got = plan_session(Policy(), kernel(), session="abc123", paths=PATHS, network="off", uid=UID, gid=GID,
                       base_env={"DISPATCH_SESSION": "x"})
    assert got.env["DISPATCH_SESSION"] == "abc123"
    assert got.session == "abc123"


# -- the plan as data ----------------------------------------------------------------


@pytest.mark.parametrize("userns", [True, False])
@pytest.mark.parametrize("network", ["off", "on", "ports"])
def test_plan_is_pure(userns: bool, network: str):
    a = plan(k=kernel(userns=userns), network=network, base_env=dict(DAEMON_ENV))
    b = plan(k=kernel(userns=userns), network=network, base_env=dict(DAEMON_ENV))
    assert a == b


@pytest.mark.parametrize("userns", [True, False])
def test_plan_survives_the_trip_to_the_fork_server(userns: bool):
    # The daemon sends the plan msgpack-encoded; the fork_server decodes it typed.
    got = plan(parse_policy("default", ""), kernel(userns=userns), "ports", dict(DAEMON_ENV),
               NetworkPorts(connect=[443], bind=[8000]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(got), type=SessionPlan)
    assert back == got


def test_the_plan_is_frozen():
    got = plan()
    with pytest.raises(AttributeError):
        got.network = "on"  # type: ignore[misc]


# -- plan_namespaces -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("use_userns", "network_off", "expected"),
    [
        (True, True, (True, True, True, True)),
        (True, False, (True, True, True, False)),
        (False, True, (False, False, False, False)),
        (False, False, (False, False, False, False)),
    ],
)
def test_plan_namespaces(use_userns: bool, network_off: bool, expected: tuple[bool, bool, bool, bool]):
    got = plan_namespaces(use_userns=use_userns, network_off=network_off, uid=1234, gid=5678)
    assert got == NamespacePlan(*expected, uid=1234, gid=5678)



def test_limits_without_a_cgroup_are_rlimits_and_say_why() -> None:
    got = plan(paths=PATHS)
    assert got.cgroup is None
    lim = report(got)["limits"]
    assert lim["mechanism"] == "rlimits" and lim["cgroup"] == ""
    assert lim["cgroups"] == "no: not looked for"
    assert lim["max_processes"] == 1024
    assert lim["memory"] == (f"{8 * 2**30} bytes over the session (the daemon's memory watchdog); "
                             f"{8 * 2**30} bytes of data per process (RLIMIT_DATA)")
    assert lim["cpu_weight"] == "not enforced (no cpu controller)"


def test_limits_with_a_delegated_cgroup_hold_over_the_session() -> None:
    from dispatchd.confine.cgroups import Delegation, SessionCgroup

    delegation = Delegation(path="/sys/fs/cgroup/svc", controllers=("pids", "memory", "cpu"))
    got = plan_session(Policy(), kernel(), session="s1", paths=PATHS, network="off", uid=UID, gid=GID,
                       base_env={}, delegation=delegation)
    assert got.cgroup == SessionCgroup(path="/sys/fs/cgroup/svc/session-s1", settings={
        "pids.max": "1024", "memory.max": str(8 * 2**30), "memory.swap.max": "0", "cpu.weight": "100"})
    lim = report(got)["limits"]
    assert lim["mechanism"] == "cgroup v2 and rlimits" and lim["cgroup"] == "/sys/fs/cgroup/svc/session-s1"
    assert lim["max_processes"] == "1024 (pids.max over the session)"
    assert lim["memory"] == f"{8 * 2**30} bytes over the session (memory.max, no swap)"
    assert lim["cpu_weight"] == 100
    assert got.limits_plan.max_processes == 1024  # the rlimits stay as well


def test_pseudo_terminals_of_the_sessions_own_only_in_its_own_root():
    policy = Policy(filesystem=Filesystem(devices=("/dev/null", "/dev/pts")))
    full = plan(policy)
    # read, write, list, and the terminal ioctls (0x8000: IOCTL_DEV, ABI 5); TIOCSTI stays refused by seccomp.
    assert full.landlock.paths[-2:] == [PathRule("/dev/null", DEV), PathRule("/dev/pts", 0x800E)]
    assert full.mounts is not None and full.mounts.devices == ["/dev/null", "/dev/pts"]
    assert report(full)["leaves_open"] == []
    degraded = plan(policy, kernel(userns=False))
    assert [r.path for r in degraded.landlock.paths if r.path.startswith("/dev/")] == ["/dev/null"]
    assert ("no pseudo-terminals (filesystem.devices lists /dev/pts): without a root of the session's own, "
            "/dev/pts would be the host's, the user's terminals; not granted") in report(degraded)["leaves_open"]


def test_a_session_sleeps_only_in_namespaces_of_its_own_on_a_root_of_its_own() -> None:
    assert can_sleep(plan())  # the default: full mode, a minimal root, sleep_after_s 30
    assert plan().limits.sleep_after_s == 30.0
    assert not can_sleep(plan(k=kernel(userns=False)))  # degraded: nothing outlives its processes
    assert not can_sleep(plan(Policy(filesystem=Filesystem(root="host"))))  # the weaker root
    assert not can_sleep(plan(Policy(limits=Limits(sleep_after_s=0))))  # never, by choice


@pytest.mark.parametrize("network", ["off", "on", "ports", "domains"])
def test_the_dns_relays_resolv_conf_is_bound_in_every_mode_where_a_stack_runs(network: str):
    """Bound whatever the mode (the mode switches in place, the root stays):
    with the stack off, the relay's address is the session's own loopback,
    where nothing answers."""
    at = "/run/NetworkManager/resolv.conf"  # where the host's /etc/resolv.conf leads (not a policy path)
    paths = msgspec.structs.replace(PATHS, resolv=[at, "/state/dns-resolv.conf"])
    got = plan(network=network, paths=paths)
    assert got.mounts is not None
    assert Bind(at, "ro", "/state/dns-resolv.conf") in got.mounts.split_binds()[1]  # the session's part
    assert at in [r.path for r in got.landlock.paths]
    # No stack on this machine, degraded mode, or no resolv.conf to bind over: the host's file.
    for k, p in ((kernel(stack=False), paths), (kernel(userns=False), paths), (kernel(), PATHS)):
        mode = network if k.user_namespaces or network != "domains" else "on"
        if k is not None and k.network_stack_missing and k.user_namespaces and mode in ("on", "ports"):
            with pytest.raises(ConfinementError, match="needs a user-mode network stack"):
                plan(network=mode, k=k, paths=p)  # refused where no stack can run (docs/support.md)
            continue
        other = plan(network=mode, k=k, paths=p)
        assert other.mounts is None or all(b.source != "/state/dns-resolv.conf" for b in other.mounts.binds)
        assert at not in [r.path for r in other.landlock.paths]


def test_a_session_budget_above_all_sessions_bound_is_said_with_that_bound() -> None:
    """The user's limit low (sharedprocs.py): the session could never run its
    1,024, and its report says what holds."""
    capped = report(plan(k=msgspec.structs.replace(kernel(), shared_processes=600)))["limits"]
    assert capped["max_processes"] == "1024, but all sessions together at most 600"
    roomy = report(plan(k=msgspec.structs.replace(kernel(), shared_processes=16384)))["limits"]
    assert roomy["max_processes"] == 1024
