"""Escapes through the kernel's own surface: system calls, ioctls, devices, sysfs, socket families.

Seccomp answers EPERM before the kernel looks at the arguments, so each
system call is made with arguments the kernel itself would refuse with
another errno (EFAULT, EINVAL, ENOENT, ENOTTY) or accept: the twin outside
gets that answer, and EPERM inside can only be the filter's.
"""

from __future__ import annotations

import platform

import pytest

import dispatch
from tests.escape.conftest import Sandbox
from tests.conftest import shell
from tests.escape.attempts import (
    EACCES, EAFNOSUPPORT, EFAULT, EINVAL, ENOENT, ENOSYS, ENOTTY, ENXIO, EOPNOTSUPP, EPERM, SYS, X32_SYSCALL_BIT,
    attempt, attempt_outside,
)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the probes use x86_64 system call numbers")

_OK = "OK "  # the call went through (a descriptor, a key serial: any value)
# name: (arguments, what the kernel answers outside)
SYSCALLS = {
    "io_uring_setup": ("0, 0", EFAULT),
    "bpf": ("0, 0, 0", EINVAL),
    "perf_event_open": ("0, 0, -1, -1, 0", EFAULT),
    "keyctl": ("0, -3, 0", _OK),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": ("0, 0, 0, 0, 0", EFAULT),
    "request_key": ("0, 0, 0, 0", EFAULT),
    "userfaultfd": ("1", _OK),  # UFFD_USER_MODE_ONLY: allowed to every user
    "open_tree": ("-100, b'/', 0", _OK),
    "mount": ("b'none', b'/nonexistent-dispatch-escape', b'tmpfs', 0, 0", ENOENT),
    "mount_setattr": ("-100, b'/', 0, 0, 0", EINVAL),
    "chroot": ("b'/nonexistent-dispatch-escape'", ENOENT),
    "name_to_handle_at": ("-100, b'/etc/hostname', handle, ctypes.byref(ctypes.c_int()), 0", _OK),
}
_HANDLE = "handle = ctypes.create_string_buffer((128).to_bytes(4, 'little'), 136)\n"


@pytest.mark.parametrize("name", SYSCALLS)
def test_kernel_interfaces_an_agent_has_no_use_for_are_refused(session: dispatch.Session, name: str) -> None:
    args, outside = SYSCALLS[name]
    body = f"{_HANDLE}result = syscall({SYS[name]}, {args})"
    assert attempt(session, f"result = syscall({SYS['getpid']}) > 0") == "OK True"  # the probe's own path works
    twin = attempt_outside(body)
    assert twin.startswith(_OK) if outside == _OK else twin == outside, twin
    assert attempt(session, body) == EPERM


@pytest.mark.parametrize("request_", [0x5412, (1 << 32) | 0x5412, 0x541C], ids=["TIOCSTI", "TIOCSTI-high-bits", "TIOCLINUX"])
def test_terminal_injection_ioctls_are_refused(session: dispatch.Session, request_: int) -> None:
    """The commands have no terminal (stdin is /dev/null), so outside the
    kernel answers ENOTTY; inside the filter answers first, high bits or not
    (the kernel reads the request as 32 bits)."""
    body = f"result = syscall({SYS['ioctl']}, 0, {request_}, b'x')"
    assert attempt_outside(body) == ENOTTY
    assert attempt(session, body) == EPERM


def test_a_32_bit_abi_system_call_kills_the_process(session: dispatch.Session) -> None:
    """The x32 ABI enters with another numbering the filter does not describe:
    libseccomp's answer to a foreign ABI is to kill (SIGSYS, bash says 159)."""
    body = f"result = syscall({X32_SYSCALL_BIT | 39})"  # getpid, x32 numbering
    assert attempt_outside(body) == ENOSYS  # this kernel has no x32: harmless here, but refused by name
    r = shell(session, f"/usr/bin/python3 -c 'import ctypes; ctypes.CDLL(None).syscall({X32_SYSCALL_BIT | 39})'; echo $?")
    assert r.metadata["stdout"] == "159\n"
    assert "Bad system call" in r.metadata["stderr"]


# Device files beyond the policy's five, and what the kernel says outside.
DEVICES = {
    "/dev/kmsg": EPERM,  # dmesg_restrict (Debian's and Ubuntu's default): the kernel log is root's
    "/dev/ptmx": "OK True",  # a new pseudo-terminal, to push input into
    "/dev/tty": ENXIO,  # no controlling terminal
}


@pytest.mark.parametrize("device", DEVICES)
def test_devices_outside_the_policy_are_refused(sandbox: Sandbox, session: dispatch.Session, device: str) -> None:
    """Full mode: the session's /dev is a fresh tmpfs holding only the
    policy's devices (ENOENT); degraded mode: Landlock (EACCES)."""
    open_it = "result = bool(open({path!r}, 'rb', buffering=0))"
    assert attempt(session, open_it.format(path="/dev/urandom")) == "OK True"
    assert attempt_outside(open_it.format(path=device)) == DEVICES[device]
    assert attempt(session, open_it.format(path=device)) == sandbox.expect(full=ENOENT, degraded=EACCES)


@pytest.mark.parametrize("path", ["/sys/class/net", "/sys/kernel", "/sys/fs/cgroup", "/sys/firmware"])
def test_sysfs_outside_the_cpu_list_is_refused(sandbox: Sandbox, session: dispatch.Session, path: str) -> None:
    """Full mode: only /sys/devices/system/cpu is bound into the root (ENOENT); degraded: Landlock."""
    listing = "result = len(os.listdir({path!r})) > 0"
    assert attempt(session, listing.format(path="/sys/devices/system/cpu")) == "OK True"
    assert attempt_outside(listing.format(path=path)) == "OK True"
    assert attempt(session, listing.format(path=path)) == sandbox.expect(full=ENOENT, degraded=EACCES)


# Socket families nobody needs: (family, type, protocol), all refused by seccomp.
FAMILIES = {
    "netlink-audit": ("socket.AF_NETLINK", "socket.SOCK_RAW", 9),
    "netlink-uevent": ("socket.AF_NETLINK", "socket.SOCK_DGRAM", 15),
    "alg": ("socket.AF_ALG", "socket.SOCK_SEQPACKET", 0),  # the kernel's crypto API
    "tipc": ("30", "socket.SOCK_RDM", 0),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_socket_families_beyond_inet_and_netlink_route_are_refused(session: dispatch.Session, family: str) -> None:
    create = "s = socket.socket({0}, {1}, {2})\ns.close()\nresult = 'created'"
    assert attempt(session, create.format("socket.AF_NETLINK", "socket.SOCK_RAW", 0)) == "OK 'created'"  # route
    outside = attempt_outside(create.format(*FAMILIES[family]))
    assert outside in ("OK 'created'", EAFNOSUPPORT)  # the kernel's answer: anything but EPERM
    assert attempt(session, create.format(*FAMILIES[family])) == EPERM


def test_socketpair_of_another_family_with_high_bits_is_refused(session: dispatch.Session) -> None:
    """The filter refuses socketpair for every family but AF_UNIX, one family
    at a time, and every family from AF_MAX (46) up: the catch-all that makes
    AF_INET | 1 << 32 (which the kernel, reading an int, takes for AF_INET)
    and even AF_UNIX | 1 << 32 refused. The twin outside gets the kernel's own
    answers: AF_INET has no socketpair (EOPNOTSUPP), 46 is no family
    (EAFNOSUPPORT), AF_UNIX | 1 << 32 is AF_UNIX."""
    body = f"fds = (ctypes.c_int * 2)()\nresult = syscall({SYS['socketpair']}, {{family}}, socket.SOCK_STREAM, 0, fds)"
    assert attempt(session, body.format(family="socket.AF_UNIX")) == "OK 0"  # the control: the allowed family
    for family, outside in (("socket.AF_INET", EOPNOTSUPP), ("(1 << 32) | socket.AF_INET", EOPNOTSUPP),
                            ("46", EAFNOSUPPORT), ("(1 << 32) | socket.AF_UNIX", "OK 0")):
        assert attempt_outside(body.format(family=family)) == outside, family
        assert attempt(session, body.format(family=family)) == EPERM, family


# socketpair's type argument: the socket type in its low 4 bits, flags above,
# and the kernel reads an int: a datagram pair is refused whatever surrounds it.
DGRAM_TYPES = {
    "SOCK_DGRAM": "socket.SOCK_DGRAM",
    "SOCK_DGRAM-cloexec-nonblock": "socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK",
    "SOCK_DGRAM-high-bits": "(1 << 32) | socket.SOCK_DGRAM",
}


@pytest.mark.parametrize("type_", DGRAM_TYPES)
def test_a_datagram_socketpair_is_refused_whatever_the_flags(session: dispatch.Session, type_: str) -> None:
    """The control is the same call with the datagram type swapped for the
    stream type, flags and high bits kept: allowed."""
    body = f"fds = (ctypes.c_int * 2)()\nresult = syscall({SYS['socketpair']}, socket.AF_UNIX, {{type}}, 0, fds)"
    datagram = DGRAM_TYPES[type_]
    stream = datagram.replace("socket.SOCK_DGRAM", "socket.SOCK_STREAM")
    assert attempt(session, body.format(type=stream)) == "OK 0"
    assert attempt_outside(body.format(type=datagram)) == "OK 0"
    assert attempt(session, body.format(type=datagram)) == EPERM
