"""dispatchd.confine.stacks: which user-mode stack runs, how it is started and
confined. Pure parts only: the probe with a stand-in ``which`` and device,
the command lines, the confinement plans (the seccomp verdicts read as
tests/unit/test_seccomp_plan.py reads them). The confinement applied to a
real process is in tests/escape/test_stack_confinement.py."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path

import msgspec
import pytest

from dispatchd.confine import landlock, stacks
from dispatchd.confine.seccomp import plan_seccomp
from dispatchd.confine.stacks import plan_stack_seccomp
from dispatchd.errors import ConfinementError
from dispatchd.kernel import force_for_testing
from dispatchd.protocol.reports import KernelFeatures
from tests.unit.test_seccomp_plan import verdict

BOTH = {"slirp4netns": "/usr/bin/slirp4netns", "pasta": "/usr/bin/pasta"}


def which_of(installed: dict[str, str]):
    return lambda name: installed.get(name)


@pytest.fixture
def tun(tmp_path: Path) -> str:
    """A device stand-in the probe can open read-write."""
    path = tmp_path / "tun"
    path.write_bytes(b"")
    return str(path)


# -- which stack ------------------------------------------------------------------


def test_auto_takes_slirp4netns_where_both_are_installed(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of(BOTH)) == ("slirp4netns", "")


def test_auto_takes_pasta_where_slirp4netns_is_missing(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of({"pasta": "/usr/bin/pasta"})) == ("pasta", "")


def test_auto_takes_pasta_where_landlock_cannot_confine_slirp4netns(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=0, which=which_of(BOTH)) == ("pasta", "")


def test_auto_without_landlock_or_pasta_says_both(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=0, which=which_of({"slirp4netns": "/x"})) == (
        "", "slirp4netns runs confined by Landlock, which this kernel does not offer, and pasta is not installed "
            "(install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")


def test_an_explicit_choice_is_kept_even_where_the_other_is_lighter(tun: str) -> None:
    assert stacks.probe_stack("pasta", tun, landlock_abi=7, which=which_of(BOTH)) == ("pasta", "")


def test_an_explicit_slirp4netns_without_landlock_is_refused_naming_the_way_out(tun: str) -> None:
    assert stacks.probe_stack("slirp4netns", tun, landlock_abi=0, which=which_of(BOTH)) == (
        "", "slirp4netns runs confined by Landlock, which this kernel does not offer "
            "(use --network-stack pasta, which confines itself)")


def test_an_explicit_choice_not_installed_says_what_installs_it(tun: str) -> None:
    assert stacks.probe_stack("pasta", tun, landlock_abi=7, which=which_of({"slirp4netns": "/x"})) == (
        "", "pasta is not installed (install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")


def test_neither_installed_names_both_and_their_packages(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of({})) == (
        "", "neither slirp4netns nor pasta is installed (install one: sudo apt install slirp4netns; Fedora, "
            "RHEL: sudo dnf install slirp4netns; or sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")


def test_a_tun_device_the_user_cannot_open_names_the_stack_that_needs_it(tmp_path: Path) -> None:
    device = tmp_path / "tun"
    device.write_bytes(b"")
    device.chmod(0)
    if os.geteuid() == 0:
        pytest.skip("root opens a file of mode 0: the tests run as the unprivileged user")
    assert stacks.probe_stack("auto", str(device), landlock_abi=7, which=which_of(BOTH)) == (
        "", "/dev/net/tun cannot be opened by this user (Permission denied; allow it: sudo chmod 0666 "
            "/dev/net/tun); slirp4netns needs it")


def test_a_missing_tun_device_says_which_module_to_load(tmp_path: Path) -> None:
    assert stacks.probe_stack("auto", str(tmp_path / "absent"), landlock_abi=7, which=which_of(BOTH)) == (
        "", "/dev/net/tun does not exist (load the tun module: sudo modprobe tun); slirp4netns needs it")


OLD = ["enable-seccomp", "netns-type", "userns-path"]  # what slirp4netns 0.3 lacks


def lacking(missing: list[str]):
    return lambda path: missing if path == BOTH["slirp4netns"] else []


def test_auto_passes_over_a_slirp4netns_without_the_options_it_is_started_with(tun: str) -> None:
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of(BOTH), lacks=lacking(OLD)) == ("pasta", "")
    # The twin: one that has them all is taken.
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of(BOTH), lacks=lacking([])) == (
        "slirp4netns", "")


def test_slirp4netns_asked_for_by_name_and_too_old_says_what_it_lacks(tun: str) -> None:
    assert stacks.probe_stack("slirp4netns", tun, landlock_abi=7, which=which_of(BOTH), lacks=lacking(OLD)) == (
        "", "slirp4netns (/usr/bin/slirp4netns) lacks --enable-seccomp, --netns-type, --userns-path, which "
            "dispatchd starts it with (slirp4netns 0.4.0 and later have them: upgrade it, or use --network-stack "
            "pasta)")


def test_a_too_old_slirp4netns_without_pasta_names_both_fixes(tun: str) -> None:
    only = {"slirp4netns": BOTH["slirp4netns"]}
    assert stacks.probe_stack("auto", tun, landlock_abi=7, which=which_of(only), lacks=lacking(OLD)) == (
        "", "slirp4netns (/usr/bin/slirp4netns) lacks --enable-seccomp, --netns-type, --userns-path, which "
            "dispatchd starts it with (slirp4netns 0.4.0 and later have them: upgrade it), and pasta is not "
            "installed (install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")


def test_the_options_are_read_from_the_executable_never_run(tmp_path: Path) -> None:
    """Each long option's name is a string of its own in the executable (as
    in 0.3.3's, which lacks three, and 0.4.3's to 1.2.0's, which have all)."""
    names = b"".join(n.encode() + b"\0" for n in stacks.SLIRP4NETNS_OPTIONS if n not in OLD)
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_bytes(b"\x7fELF" + b"\0" * 60 + names + b"--enable-seccomp  enable seccomp\n")
    new.write_bytes(b"\x7fELF" + b"\0" * 60 + names + b"userns-path\0--netns-type\0enable-seccomp\0")
    assert stacks.slirp4netns_lacks(str(old)) == OLD
    assert stacks.slirp4netns_lacks(str(new)) == []
    link = tmp_path / "link"
    link.symlink_to(old)
    assert stacks.slirp4netns_lacks(str(link)) == OLD  # the file executed: the link's target
    # Not judged: a wrapper script (the program it runs is not this file),
    # a file this user cannot read, none at all.
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexec /usr/lib/slirp4netns/slirp4netns \"$@\"\n")
    assert stacks.slirp4netns_lacks(str(script)) == []
    assert stacks.slirp4netns_lacks(str(tmp_path / "absent")) == []
    if os.geteuid() != 0:  # root reads a file of mode 0
        old.chmod(0o111)
        assert stacks.slirp4netns_lacks(str(old)) == []


def _features(**changes: object) -> KernelFeatures:
    base = KernelFeatures(release="6.18", landlock_abi=7, user_namespaces=True, user_namespaces_note="",
                          seccomp=True, seccomp_actions=["errno"], cgroup2="", network_stack_missing="",
                          nftables_missing="", network_stack="slirp4netns")
    return msgspec.structs.replace(base, **changes)


def _restack(installed: dict[str, str]):
    """``probe_stack`` of the daemon's default choice, for the forced ABI."""
    return lambda abi: stacks.probe_stack("auto", "/dev/null", landlock_abi=abi, which=which_of(installed))


def test_a_kernel_forced_without_landlock_chooses_its_stack_as_that_kernel_would() -> None:
    # slirp4netns is confined by Landlock: without it, pasta where installed, else none (and why).
    forced = force_for_testing(_features(), "landlock=0", restack=_restack(BOTH))
    assert (forced.network_stack, forced.network_stack_missing) == ("pasta", "")
    assert "on" not in forced.network_unavailable
    alone = force_for_testing(_features(), "landlock=0", restack=_restack({"slirp4netns": "/usr/bin/slirp4netns"}))
    assert (alone.network_stack, alone.network_stack_missing) == (
        "", "slirp4netns runs confined by Landlock, which this kernel does not offer, and pasta is not installed "
            "(install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")
    assert "on" in alone.network_unavailable


def test_a_kernel_forced_to_an_older_landlock_keeps_slirp4netns() -> None:
    forced = force_for_testing(_features(), "landlock=3", restack=_restack(BOTH))
    assert (forced.network_stack, forced.network_stack_missing) == ("slirp4netns", "")
    assert force_for_testing(_features(), "landlock=0").network_stack == "slirp4netns"  # nothing to choose with


# -- how it is started ----------------------------------------------------------------


def test_slirp4netns_is_attached_by_descriptor_without_its_own_sandbox() -> None:
    argv = stacks.stack_argv("slirp4netns", userns_fd=5, netns_fd=6, ready_fd=7)
    assert argv == ["slirp4netns", "--configure", "--mtu=65520", "--enable-seccomp",
                    "--ready-fd=7", "--netns-type=path", "--userns-path=/proc/self/fd/5", "/proc/self/fd/6", "eth0"]
    assert "--enable-sandbox" not in argv  # it would bind the host's /etc and /run
    assert not any(a.startswith(("--api-socket", "-a")) for a in argv)  # nothing forwarded in


def test_pasta_is_attached_by_descriptor_forwarding_nothing_in() -> None:
    argv = stacks.stack_argv("pasta", userns_fd=5, netns_fd=6, ready_fd=7)
    assert argv[:5] == ["pasta", "--foreground", "--quiet", "--config-net", "--ipv4-only"]
    for flag in ("-t", "-u", "-T", "-U"):
        assert argv[argv.index(flag) + 1] == "none"
    assert argv[-6:] == ["--pid", "/proc/self/fd/7", "--userns", "/proc/self/fd/5", "--netns", "/proc/self/fd/6"]


def test_a_closed_host_loopback_is_each_stacks_own_flag() -> None:
    """``[network] host_loopback = false``: slirp4netns's
    --disable-host-loopback (0.3.0 and later), pasta's --no-map-gw; the
    twin: neither by default (the two tests above)."""
    slirp = stacks.stack_argv("slirp4netns", userns_fd=5, netns_fd=6, ready_fd=7, host_loopback=False)
    pasta = stacks.stack_argv("pasta", userns_fd=5, netns_fd=6, ready_fd=7, host_loopback=False)
    assert "--disable-host-loopback" in slirp and "--no-map-gw" in pasta
    assert [a for a in slirp if a != "--disable-host-loopback"] == stacks.stack_argv(
        "slirp4netns", userns_fd=5, netns_fd=6, ready_fd=7)
    assert [a for a in pasta if a != "--no-map-gw"] == stacks.stack_argv("pasta", userns_fd=5, netns_fd=6, ready_fd=7)


# -- how it is confined ---------------------------------------------------------------


def test_pasta_confines_itself_and_gets_no_plan() -> None:
    assert stacks.plan_stack_confinement("pasta", landlock_abi=7, executable="/usr/bin/pasta") is None


def test_slirp4netns_without_landlock_is_refused_not_run_unconfined() -> None:
    with pytest.raises(ConfinementError, match="Landlock is not available"):
        stacks.plan_stack_confinement("slirp4netns", landlock_abi=0, executable="/usr/bin/slirp4netns")


def test_slirp4netns_may_read_and_run_only_system_code_and_open_the_tun_device() -> None:
    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=7, executable="/opt/s/bin/slirp4netns")
    assert plan is not None
    rules = {r.path: r.access for r in plan.landlock.paths}
    read_run = landlock.EXECUTE | landlock.READ_FILE | landlock.READ_DIR
    assert rules == {**{p: read_run for p in stacks.SYSTEM_READ},
                     "/opt/s/bin/slirp4netns": landlock.EXECUTE | landlock.READ_FILE,  # that file alone
                     "/dev/net/tun": landlock.READ_FILE | landlock.WRITE_FILE | landlock.IOCTL_DEV}
    assert plan.landlock.handled_fs == landlock.fs_rights_for_abi(7)  # everything else denied, writes included
    assert plan.landlock.scoped == landlock.SCOPE_SIGNAL | landlock.SCOPE_ABSTRACT_UNIX_SOCKET
    # TCP binds handled with no port granted: it serves nothing on the host's network.
    assert (plan.landlock.handled_net, plan.landlock.tcp_ports) == (landlock.NET_BIND_TCP, [])
    assert (plan.file_size, plan.data) == (1 << 20, 1 << 30)
    assert not any(p.startswith(("/home", "/run", "/tmp", "/proc", "/etc/")) and p != "/etc/ld.so.cache"
                   for p in rules)


def test_slirp4netns_on_an_older_landlock_is_granted_only_rights_that_kernel_knows() -> None:
    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=3, executable="/usr/bin/slirp4netns")
    assert plan is not None
    assert {r.path: r.access for r in plan.landlock.paths}["/dev/net/tun"] == landlock.READ_FILE | landlock.WRITE_FILE
    assert plan.landlock.scoped == 0  # seccomp holds signals and Unix sockets there (below)
    assert plan.landlock.handled_net == 0  # no TCP rules before ABI 4: listen stays seccomp's


STACK = plan_stack_seccomp()


@pytest.mark.parametrize("family", [socket.AF_UNIX, socket.AF_NETLINK, socket.AF_PACKET, 46, 200])
def test_the_stack_makes_no_socket_but_ipv4_and_ipv6(family: int) -> None:
    assert verdict(STACK, "socket", family, socket.SOCK_STREAM, 0) == errno.EPERM
    assert verdict(STACK, "socket", family, socket.SOCK_DGRAM, 0) == errno.EPERM


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_stack_makes_ipv4_and_ipv6_sockets(family: int) -> None:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        assert verdict(STACK, "socket", family, kind, 0) is None


def test_the_stack_keeps_a_stream_pair_for_its_tap_descriptor() -> None:
    assert verdict(STACK, "socketpair", socket.AF_UNIX, socket.SOCK_STREAM, 0) is None  # its child sends the tap
    assert verdict(STACK, "socketpair", socket.AF_UNIX, socket.SOCK_DGRAM, 0) == errno.EPERM


@pytest.mark.parametrize("syscall", ["kill", "tkill", "tgkill", "rt_sigqueueinfo", "pidfd_send_signal", "pidfd_open",
                                     "pidfd_getfd", "ptrace", "process_vm_readv", "mount", "unshare",
                                     "io_uring_setup", "bpf", "shmget", "msgget"])
def test_the_stack_signals_traces_and_mounts_nothing(syscall: str) -> None:
    assert verdict(STACK, syscall) == errno.EPERM


@pytest.mark.parametrize("syscall", ["chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat",
                                     "setxattr", "fsetxattr", "removexattr", "utime", "utimensat", "truncate",
                                     "inotify_init1", "fanotify_init", "getxattr", "listxattr", "listen",
                                     "setpriority", "sched_setscheduler", "sched_setaffinity", "ioprio_set"])
def test_the_stack_changes_no_metadata_priority_or_listener_that_landlock_does_not_see(syscall: str) -> None:
    assert verdict(STACK, syscall) == errno.EPERM
    own = (1, 0, 0) if syscall == "ioprio_set" else ()  # IOPRIO_WHO_PROCESS, itself
    assert verdict(plan_seccomp(allow_inet=True), syscall, *own) is None  # a session may, on its own processes


def test_the_stack_sets_its_own_limits_only() -> None:
    assert verdict(STACK, "prlimit64", 0, 7) is None  # setrlimit: its own
    assert verdict(STACK, "prlimit64", 4242, 7) == errno.EPERM


@pytest.mark.parametrize("cmd", [8, 10, 15])  # F_SETOWN, F_SETSIG, F_SETOWN_EX
def test_the_stack_steers_no_sigio_to_another_process(cmd: int) -> None:
    assert verdict(STACK, "fcntl", 3, cmd) == errno.EPERM
    assert verdict(STACK, "fcntl", 3, 4) is None  # F_SETFL: O_NONBLOCK, which it uses
    assert verdict(STACK, "ioctl", 3, 0x8901) == verdict(STACK, "ioctl", 3, 0x8902) == errno.EPERM


def test_the_stack_may_join_a_namespace_and_the_session_may_not() -> None:
    assert verdict(STACK, "setns") is None  # its child joins the session's, by the descriptors it was given
    assert verdict(plan_seccomp(allow_inet=True), "setns") == errno.EPERM


def test_the_stack_makes_no_namespace_of_its_own() -> None:
    assert verdict(STACK, "clone", 0x10000000) == errno.EPERM  # CLONE_NEWUSER
    assert verdict(STACK, "clone", 0x01200011) is None  # fork


def test_the_daemons_launch_carries_the_plan_for_the_fork_server() -> None:
    asked: list[tuple[str, dict[str, str]]] = []

    def loads(path: str, env: dict[str, str]) -> tuple[list[str], str]:
        asked.append((path, dict(env)))
        return ["/opt/libslirp/lib/libslirp.so.0", "/lib/x86_64-linux-gnu/libc.so.6"], ""

    launch = stacks.launch_for("slirp4netns", 7, loads=loads)
    got = msgspec.msgpack.decode(launch.confinement, type=stacks.StackConfinement)
    assert launch.stack == "slirp4netns" and got.seccomp == STACK
    assert launch.executable == os.path.realpath(shutil.which("slirp4netns") or "slirp4netns")
    assert asked == [(launch.executable, stacks.STACK_ENV)]  # listed as it is started: the same search
    assert landlock.PathRule("/opt/libslirp/lib/libslirp.so.0", landlock.READ_FILE | landlock.EXECUTE,
                             file_only=True) in got.landlock.paths
    pasta = stacks.launch_for("pasta", 7, loads=loads)
    assert (pasta.stack, pasta.confinement) == ("pasta", b"")  # it confines itself
    assert len(asked) == 1  # and loads what it needs before it does: nothing to list
    assert stacks.launch_for("", 7) == stacks.Launch("pasta")  # none can run: never started


def test_a_stack_installed_outside_the_system_reads_its_own_files_and_nothing_beside() -> None:
    """slirp4netns built into /opt or a home directory, with its libraries
    there (its RUNPATH) and its own loader: each file it loads gets a rule
    of its own, and no directory holding them does; files in the system's
    directories add none (already read)."""
    loads = ["/opt/slirp/lib/ld-linux-x86-64.so.2", "/home/u/.local/lib/libslirp.so.0",
             "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0", "/home/u/.local/lib/libslirp.so.0"]
    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=7, executable="/home/u/.local/bin/slirp4netns",
                                         loads=loads).landlock
    granted = [rule for rule in plan.paths if rule.path not in stacks.SYSTEM_READ and rule.path != stacks.TUN]
    assert [rule.path for rule in granted] == ["/home/u/.local/bin/slirp4netns", "/opt/slirp/lib/ld-linux-x86-64.so.2",
                                               "/home/u/.local/lib/libslirp.so.0"]
    assert all(rule.file_only and rule.access == landlock.READ_FILE | landlock.EXECUTE for rule in granted)
    # The twin: a packaged one needs nothing beyond the system's directories.
    packaged = stacks.plan_stack_confinement("slirp4netns", landlock_abi=7, executable="/usr/bin/slirp4netns",
                                             loads=loads[2:3]).landlock
    assert [rule.path for rule in packaged.paths] == [*stacks.SYSTEM_READ, stacks.TUN]


def test_the_fork_server_starts_no_stack_but_pasta_without_a_confinement() -> None:
    from dispatchd.worker import stackstart

    with pytest.raises(ValueError, match="slirp4netns needs the daemon's confinement, and none was sent"):
        stackstart._stack_confinement("slirp4netns", b"")
    assert stackstart._stack_confinement("pasta", b"") == (None, b"")  # pasta confines itself
