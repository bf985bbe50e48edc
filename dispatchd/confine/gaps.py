"""What a session's protections leave open, in words (pure).

``status`` reports these as ``leaves_open``: each a protection the mode
cannot hold and why. They follow from the plans alone (the kernel's
features, the namespaces, the root), so the report cannot claim what is not
applied (``plan.describe_protections``).
"""

from __future__ import annotations

# Said once here; SECURITY.md's known limits say the same.
CHMOD_GAP = ("chmod, chown, utime and xattr changes on files the user owns outside the worktree "
             "(Landlock ABI <= 7 does not check them; only a read-only mount would): chmod can make the user's "
             "files readable to other local users (chmod 644 ~/.ssh/id_ed25519 with chmod 755 ~), never to the "
             "session itself; dispatchd's own state and socket directories are among them, and it sets their "
             "modes back (at its start, when an open of its files is refused, and each second for the socket's)")
PROC_PEEK_GAP = ("the host's /proc: other processes' mountinfo and net/tcp, udp and unix are readable (no ptrace "
                 "check guards them): another session's worktree, scratch path and extra read-only paths, the "
                 "sockets of its private network namespace, and, through the daemon's pid, the host's Unix sockets")


def leaves_open(use_userns: bool, landlock_abi: int, network_off: bool, git_kind: str) -> list[str]:
    """What the sandbox's mode leaves open: without user namespaces, or with
    an older Landlock, each protection it cannot hold, said in words."""
    gaps = []
    if not use_userns and git_kind in ("repository", "linked"):
        gaps.append("git metadata (.git/config, hooks, pointer files) is writable: without a mount namespace "
                    "nothing holds it read-only, and the user's git outside would run what a session wrote there "
                    "while the session is open (when it ends, what changed is moved aside)")
        gaps.append("the repository's packs can be made writable (chmod) and rewritten in place: without a mount "
                    "namespace nothing holds them read-only; the history keeps copies of them, put back at the "
                    "end, within its budget (512 MiB a baseline), and past it shares their inodes")
    if not use_userns:
        gaps += [
            CHMOD_GAP,
            "the host's /proc: the user's other processes and their command lines are visible "
            "(their memory, environment and fds stay refused by Landlock's ptrace rule)",
            PROC_PEEK_GAP,
            "no private /tmp: the host's /tmp is simply not granted (TMPDIR is the session's own)",
        ]
        if network_off and landlock_abi < 4:
            gaps.append("network off is held by seccomp alone (no Landlock TCP rules below ABI 4)")
        if landlock_abi < 3:
            gaps.append("truncate() of files the user owns on read-only paths outside the worktree (an extra "
                        "read-only path, dispatchd's own code): Landlock handles truncation from ABI 3, and "
                        "without user namespaces no read-only mount holds it")
        if landlock_abi < 6:
            gaps.append("signals: the session can signal every process of the user's, the daemon included "
                        "(kill, SIGSTOP): without a pid namespace only Landlock's signal scope (ABI 6) would stop "
                        "it; abstract Unix sockets stay refused (seccomp: socket(AF_UNIX))")
    elif landlock_abi < 6:
        gaps.append("no Landlock scopes (ABI < 6): signals to the user's other processes and "
                    "abstract Unix sockets rely on seccomp and namespaces only")
    return gaps


def filesystem_gaps(minimal_root: bool, unix_sockets: bool, own_net: bool) -> list[str]:
    """What the view of the filesystem leaves open: without a root of its own
    (degraded mode, or root = "host") the rest of the machine is there, only
    refused by Landlock, which does not govern metadata or connect()."""
    gaps = []
    if not minimal_root:
        gaps.append("metadata of files outside the worktree: stat (size, times), readlink, getxattr and "
                    "inotify watches work on paths Landlock refuses to open (only a root of the session's own "
                    "hides them: full mode with root = \"minimal\")")
        gaps.append("Unix sockets are refused (socket(AF_UNIX): EPERM; stream socketpairs work): without a root "
                    "of the session's own, connect() could reach any socket of the user's by path (Landlock ABI "
                    "<= 7 does not check it), so multiprocessing.Manager, Unix-socket servers and the like fail")
    elif not unix_sockets and not own_net:
        gaps.append("Unix sockets are refused (socket(AF_UNIX): EPERM; stream socketpairs work) while the session "
                    "shares the host's network namespace (network on or ports): an abstract name it listened on "
                    "would be connected to by the user's own programs (Landlock's scope stops connecting out, not "
                    "in); with the network off they work")
    return gaps
