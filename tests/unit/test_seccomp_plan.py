"""dispatchd.confine.seccomp: what the plan denies, with which errno; the compiled program.

``verdict`` evaluates a plan the way libseccomp will: a call is denied by the
first rule for its syscall whose argument checks all match (checks within a
rule are ANDed, rules are ORed), and allowed when none does. The tests then
ask about concrete calls, as a sandboxed process would make them.
"""

from __future__ import annotations

import errno
import platform
import socket
import struct

import pytest

from dispatchd.confine import seccomp
from dispatchd.confine.seccomp import ArgCheck, SeccompPlan, SeccompRule, compile_seccomp, plan_seccomp
from dispatchd.errors import ConfinementError

# Pinned in alphabetical order, as one text: the table the plan must deny, read
# against the module's own grouped list rather than copied from it.
DENIED_ALWAYS = frozenset("""
acct add_key bpf chroot delete_module finit_module fsconfig fsmount fsopen fspick
init_module io_uring_enter io_uring_register io_uring_setup kexec_file_load kexec_load
keyctl lookup_dcookie mount mount_setattr move_mount name_to_handle_at open_by_handle_at
open_tree perf_event_open pivot_root process_vm_readv process_vm_writev ptrace quotactl
reboot request_key setns swapoff swapon syslog umount2 unshare userfaultfd vhangup
""".split())
# Linux AIO: one machine-wide budget (fs.aio-max-nr); ENOSYS, as a kernel without it.
KERNEL_AIO = {"io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy"}
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# What glibc passes for fork() and pthread_create(): neither may be refused.
FORK_FLAGS = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
THREAD_FLAGS = 0x003D0F00  # VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID
TIOCSTI, TIOCLINUX, FIONREAD, TIOCGWINSZ = 0x5412, 0x541C, 0x541B, 0x5413
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def _matches(check: ArgCheck, args: tuple[int, ...]) -> bool:
    value = args[check.arg] if check.arg < len(args) else 0
    if check.op == "eq":
        return value == check.value
    if check.op == "ne":
        return value != check.value
    if check.op == "ge":
        return value >= check.value
    if check.op == "masked_eq":
        return value & check.mask == check.value
    raise AssertionError(f"unknown op {check.op!r}")


def verdict(plan: SeccompPlan, syscall: str, *args: int) -> int | None:
    """The errno the filter answers, or None when the call is allowed."""
    for rule in plan.rules:
        if rule.syscall == syscall and all(_matches(c, args) for c in rule.args):
            return rule.errno
    return None


@pytest.fixture(params=[False, True], ids=["no-inet", "inet"])
def any_plan(request: pytest.FixtureRequest) -> SeccompPlan:
    return plan_seccomp(allow_inet=request.param)


NO_INET = plan_seccomp(allow_inet=False)
INET = plan_seccomp(allow_inet=True)


# -- the plan's shape -------------------------------------------------------------


def test_allow_inet_is_recorded():
    assert (NO_INET.allow_inet, INET.allow_inet) == (False, True)


def test_plan_is_pure():
    assert plan_seccomp(allow_inet=False) == NO_INET
    assert plan_seccomp(allow_inet=True) == INET
    assert NO_INET != INET


def test_unconditional_denials_are_exactly_the_list(any_plan: SeccompPlan):
    unconditional = {r.syscall: r.errno for r in any_plan.rules if not r.args}
    assert unconditional == {**{name: errno.EPERM for name in DENIED_ALWAYS}, "clone3": errno.ENOSYS,
                             **{name: errno.ENOSYS for name in KERNEL_AIO}}


def test_only_clone3_and_kernel_aio_answer_enosys(any_plan: SeccompPlan):
    assert {r.syscall for r in any_plan.rules if r.errno != errno.EPERM} == {"clone3", *KERNEL_AIO}
    assert {r.errno for r in any_plan.rules} == {errno.EPERM, errno.ENOSYS}


def test_conditional_rules_touch_only_these_syscalls(any_plan: SeccompPlan):
    assert {r.syscall for r in any_plan.rules if r.args} == {"clone", "ioctl", "socket", "socketpair", "prlimit64",
                                                             "setpriority", "ioprio_set", "sched_setscheduler",
                                                             "sched_setparam", "sched_setattr", "sched_setaffinity"}


def test_the_two_plans_differ_only_in_inet_sockets():
    extra = [r for r in NO_INET.rules if r not in INET.rules]
    assert extra == [SeccompRule("socket", errno.EPERM, [ArgCheck(0, "eq", socket.AF_INET)]),
                     SeccompRule("socket", errno.EPERM, [ArgCheck(0, "eq", socket.AF_INET6)])]
    assert all(r in NO_INET.rules for r in INET.rules)


def test_rule_count():
    # 40 always + 7 clone flags + clone3 + 6 kernel AIO + 2 ioctls + (46 families - allowed) + ge + netlink
    # + 45 socketpair families + socketpair ge + 14 socketpair kinds (all but STREAM and SEQPACKET)
    # + another process's limit, 4 scheduling calls, 2 priority and 2 I/O class rules
    assert len(INET.rules) == 40 + 7 + 1 + 6 + 2 + (46 - 3) + 1 + 1 + 45 + 1 + 14 + 1 + 4 + 2 + 2
    # Without an IPC namespace, the 12 System V calls and 2 POSIX queue calls too.
    assert len(plan_seccomp(allow_inet=True, ipc_namespace=False).rules) == len(INET.rules) + 14
    assert len(NO_INET.rules) == len(INET.rules) + 2


PRLIMIT_SET = 0x7FFE0000  # a new limit's address: set, not only read
SCHED = ("sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity")


@pytest.mark.parametrize("pid_namespace", [False, True], ids=["degraded", "full"])
def test_another_processs_limits_and_priority_are_refused(pid_namespace: bool):
    """Without a pid namespace any pid but 0 (the caller) is refused; with
    one, pid 1 (the tool server), also by a wider value the kernel cuts to
    it. Reading a limit, and a process's own, stay allowed."""
    p = plan_seccomp(allow_inet=True, pid_namespace=pid_namespace)
    other = 1234
    assert verdict(p, "prlimit64", other, 7, PRLIMIT_SET) == (None if pid_namespace else errno.EPERM)
    assert verdict(p, "prlimit64", 1, 7, PRLIMIT_SET) == errno.EPERM
    assert verdict(p, "prlimit64", (1 << 32) | 1, 7, PRLIMIT_SET) == errno.EPERM
    assert verdict(p, "prlimit64", 1, 7, 0, 0x7FFE1000) is None  # read only
    assert verdict(p, "prlimit64", 0, 7, PRLIMIT_SET) is None
    for name in SCHED:
        assert verdict(p, name, 1, 0, 0) == errno.EPERM
        assert verdict(p, name, other, 0, 0) == (None if pid_namespace else errno.EPERM)
        assert verdict(p, name, 0, 0, 0) is None
    for name, process in (("setpriority", 0), ("ioprio_set", 1)):
        assert verdict(p, name, process, 0, 10) is None
        assert verdict(p, name, process, 1, 10) == errno.EPERM
        assert verdict(p, name, process, other, 10) == (None if pid_namespace else errno.EPERM)
        assert verdict(p, name, process + 1, 0, 10) == errno.EPERM  # a process group
        assert verdict(p, name, process + 2, 0, 10) == errno.EPERM  # every process of the user
    for name in ("getpriority", "sched_getaffinity", "ioprio_get", "sched_getscheduler"):
        assert verdict(p, name, 1, 1, 0) is None


@pytest.mark.parametrize("name", sorted(DENIED_ALWAYS))
def test_always_denied_with_eperm(any_plan: SeccompPlan, name: str):
    assert verdict(any_plan, name, 0, 0, 0) == errno.EPERM


@pytest.mark.parametrize("name", ["read", "write", "openat", "execve", "fork", "vfork", "wait4", "kill", "mmap",
                                  "connect", "bind", "chmod", "unlinkat"])
def test_ordinary_syscalls_are_allowed(any_plan: SeccompPlan, name: str):
    assert verdict(any_plan, name, 0, 0, 0) is None


# -- sockets ------------------------------------------------------------------------


def test_unix_sockets_are_denied_unless_allowed(any_plan: SeccompPlan):
    for sock_type in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET,
                      socket.SOCK_STREAM | socket.SOCK_CLOEXEC):
        assert verdict(any_plan, "socket", socket.AF_UNIX, sock_type, 0) == errno.EPERM


def test_allow_unix_opens_socket_af_unix_and_nothing_else():
    """Full mode with a root and a network namespace of its own: the mounts and
    namespaces hold Unix sockets, so seccomp lets socket(AF_UNIX) through; the
    socketpair rules (stream and seqpacket only) and every other family stay."""
    unix = plan_seccomp(allow_inet=True, allow_unix=True)
    for sock_type in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        assert verdict(unix, "socket", socket.AF_UNIX, sock_type, 0) is None
    # High bits in the family stay refused (the ">= AF_MAX" rule compares 64 bits).
    assert verdict(unix, "socket", (1 << 32) | socket.AF_UNIX, socket.SOCK_STREAM, 0) == errno.EPERM
    assert verdict(unix, "socketpair", socket.AF_UNIX, socket.SOCK_DGRAM, 0) == errno.EPERM
    assert verdict(unix, "socket", socket.AF_PACKET, socket.SOCK_RAW, 0) == errno.EPERM
    extra = [r for r in INET.rules if r not in unix.rules]
    assert extra == [SeccompRule("socket", errno.EPERM, [ArgCheck(0, "eq", socket.AF_UNIX)])]
    assert [r for r in unix.rules if r not in INET.rules] == []


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_inet_sockets_follow_allow_inet(family: int):
    for sock_type, proto in ((socket.SOCK_STREAM, 0), (socket.SOCK_DGRAM, 0), (socket.SOCK_DGRAM, 17)):
        assert verdict(INET, "socket", family, sock_type, proto) is None
        assert verdict(NO_INET, "socket", family, sock_type, proto) == errno.EPERM


def test_netlink_only_protocol_zero(any_plan: SeccompPlan):
    assert verdict(any_plan, "socket", socket.AF_NETLINK, socket.SOCK_RAW, 0) is None  # NETLINK_ROUTE
    for proto in (9, 15, 16, 0xFFFFFFFF):  # audit, kobject uevent, generic, garbage
        assert verdict(any_plan, "socket", socket.AF_NETLINK, socket.SOCK_RAW, proto) == errno.EPERM


@pytest.mark.parametrize("family", [socket.AF_PACKET, 3, 4, 5, 9, 29, 38, 40, 44, 45])  # packet, ax25, ipx, ...
def test_other_families_are_denied(any_plan: SeccompPlan, family: int):
    assert verdict(any_plan, "socket", family, socket.SOCK_STREAM, 0) == errno.EPERM


@pytest.mark.parametrize("family", [46, 100, 0xFFFF, 0xFFFFFFFF, 0x1_0000_0002])
def test_families_past_the_known_range_are_denied(any_plan: SeccompPlan, family: int):
    # 0x1_0000_0002: AF_INET with garbage in the upper half of the register.
    assert verdict(any_plan, "socket", family, socket.SOCK_STREAM, 0) == errno.EPERM


def test_af_unspec_is_denied(any_plan: SeccompPlan):
    assert verdict(any_plan, "socket", 0, socket.SOCK_STREAM, 0) == errno.EPERM


def test_socketpair_only_af_unix(any_plan: SeccompPlan):
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_STREAM, 0) is None
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, 0) is None
    # A datagram pair could sendto() any named socket of the user's.
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_DGRAM, 0) == errno.EPERM
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 0) == errno.EPERM
    # On AF_UNIX, SOCK_RAW is a datagram socket by another name.
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_RAW, 0) == errno.EPERM
    assert verdict(any_plan, "socketpair", socket.AF_UNIX, socket.SOCK_SEQPACKET, 0) is None
    for family in (0, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, 45, 46, 1 << 32 | socket.AF_INET):
        assert verdict(any_plan, "socketpair", family, socket.SOCK_STREAM, 0) == errno.EPERM


@pytest.mark.parametrize("name", ["shmget", "shmat", "msgget", "msgsnd", "semget", "semop", "mq_open", "mq_unlink"])
def test_system_v_ipc_is_refused_without_an_ipc_namespace(name: str):
    assert verdict(plan_seccomp(allow_inet=True, ipc_namespace=False), name, 0, 0, 0) == errno.EPERM
    assert verdict(plan_seccomp(allow_inet=True, ipc_namespace=True), name, 0, 0, 0) is None


def test_inet_sockets_need_allow_inet_but_netlink_route_never_does():
    assert verdict(NO_INET, "socket", socket.AF_NETLINK, socket.SOCK_DGRAM, 0) is None


# -- clone, clone3, ioctl -------------------------------------------------------


@pytest.mark.parametrize("flag", sorted(CLONE_NEW.values()), ids=sorted(CLONE_NEW, key=CLONE_NEW.get))
def test_clone_with_a_namespace_flag_is_denied(any_plan: SeccompPlan, flag: int):
    assert verdict(any_plan, "clone", flag) == errno.EPERM
    assert verdict(any_plan, "clone", flag | FORK_FLAGS) == errno.EPERM


def test_clone_with_every_namespace_flag_is_denied(any_plan: SeccompPlan):
    assert verdict(any_plan, "clone", sum(CLONE_NEW.values()) | 17) == errno.EPERM


def test_fork_and_threads_are_allowed(any_plan: SeccompPlan):
    assert verdict(any_plan, "clone", FORK_FLAGS) is None
    assert verdict(any_plan, "clone", THREAD_FLAGS) is None
    assert verdict(any_plan, "clone", 17) is None  # plain SIGCHLD


def test_clone3_answers_enosys_so_libc_falls_back(any_plan: SeccompPlan):
    assert verdict(any_plan, "clone3", 0, 88) == errno.ENOSYS


@pytest.mark.parametrize("request_", [TIOCSTI, TIOCLINUX])
def test_terminal_injection_ioctls_are_denied(any_plan: SeccompPlan, request_: int):
    assert verdict(any_plan, "ioctl", 0, request_) == errno.EPERM
    # The kernel compares the command as a 32-bit int: high bits must not slip past.
    assert verdict(any_plan, "ioctl", 0, request_ | 0xFFFFFFFF_00000000) == errno.EPERM


@pytest.mark.parametrize("request_", [FIONREAD, TIOCGWINSZ, 0x5401])  # 0x5401 TCGETS
def test_other_ioctls_are_allowed(any_plan: SeccompPlan, request_: int):
    assert verdict(any_plan, "ioctl", 1, request_) is None


def test_module_constants():
    assert (seccomp.TIOCSTI, seccomp.TIOCLINUX) == (TIOCSTI, TIOCLINUX)
    assert set(seccomp._DENIED_ALWAYS) == DENIED_ALWAYS
    assert len(seccomp._DENIED_ALWAYS) == len(DENIED_ALWAYS)


# -- the compiled program ---------------------------------------------------------


def _seccomp_status() -> str:
    with open("/proc/self/status", encoding="ascii") as f:
        return "".join(line for line in f if line.startswith("Seccomp"))


@pytest.mark.parametrize("allow_inet", [False, True])
@pytest.mark.process
def test_compile_seccomp_gives_whole_bpf_instructions(allow_inet: bool):
    before = _seccomp_status()
    program = compile_seccomp(plan_seccomp(allow_inet=allow_inet))
    assert _seccomp_status() == before  # compiled only, not installed
    assert isinstance(program, bytes)
    assert len(program) > 0
    assert len(program) % 8 == 0
    # libseccomp starts by loading seccomp_data.arch (BPF_LD|BPF_W|BPF_ABS, k=4)
    # and comparing it with this machine's audit arch (BPF_JMP|BPF_JEQ|BPF_K).
    assert struct.unpack_from("<HBBI", program, 0) == (0x20, 0, 0, 4)
    code, _jt, _jf, k = struct.unpack_from("<HBBI", program, 8)
    assert (code, k) == (0x15, AUDIT_ARCH[platform.machine()])


@pytest.mark.process
def test_compile_seccomp_is_deterministic_and_follows_the_plan():
    assert compile_seccomp(NO_INET) == compile_seccomp(plan_seccomp(allow_inet=False))
    assert compile_seccomp(NO_INET) != compile_seccomp(INET)


def test_a_program_the_kernel_cannot_take_fails_as_the_seccomp_step():
    # Refused before any prctl (not a whole number of 8-byte instructions):
    # nothing is installed on the test process.
    with pytest.raises(ConfinementError) as info:
        seccomp.apply_seccomp(b"\0" * 12)
    assert (info.value.step, info.value.errno) == ("seccomp", errno.EINVAL)
