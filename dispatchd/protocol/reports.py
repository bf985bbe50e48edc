"""What ``status`` and a session's open report, as typed structs.

Guarantees:
- Each report encodes to exactly the map the daemon sent before it was typed
  (same keys, same order, same values): a key that used to be left out when
  empty is a field whose default is left out (``omit_defaults``), so older
  clients that read these as dicts keep working. ``tests/unit/test_protocol.py``
  compares the bytes.
- Reports are not ``forbid_unknown_fields``, unlike the messages that carry
  them: a client reads a newer daemon's status, one key richer, without failing.

Written by the daemon (``kernel.probe``, ``confine/plan.py``, the session's
lifetime), read by the CLI and by programs through ``Client.status()``.
"""

from __future__ import annotations

import msgspec


class KernelFeatures(msgspec.Struct, frozen=True):
    """What this kernel offers, probed once when the daemon starts (``dispatchd.kernel``)."""

    release: str
    landlock_abi: int  # 0: Landlock absent or disabled
    user_namespaces: bool
    user_namespaces_note: str
    seccomp: bool
    seccomp_actions: list[str]
    cgroup2: str  # where cgroup v2 is mounted, "" if nowhere
    # Whether sessions get cgroups of their own, and why not: filled in by the
    # daemon once it has tried to take its cgroup (confine/cgroups.py).
    cgroup_delegation: str = "not looked for"
    # The user-mode stack sessions reach out through, and nftables for
    # "ports": "" when usable, else why not (confine/netstack.py). Missing,
    # a session of full mode is refused "on" and "ports" (never the host's
    # network instead).
    network_stack_missing: str = "not looked for"
    # Which stack that is (netstack.STACKS: "slirp4netns" or "pasta"), as
    # ``dispatchd --network-stack`` chose it; "" when none can run.
    network_stack: str = ""
    nftables_missing: str = "not looked for"
    # The network modes no session can have here, each with why and what
    # fixes it (``netstack.unavailable``); {}: every mode.
    network_unavailable: dict[str, str] = {}
    # Whether a root of the session's own can hold the host's as a detached
    # copy (Linux 6.15+; mounts.probe_host_tree): "" when it can, else why
    # not (the host's root then waits below the new one; as safe, slower).
    host_tree_missing: str = "not looked for"
    # What all sessions together may hold of the user's inotify and fanotify
    # budgets (confine/ucounts.py, plan_shared), and why that is not bounded
    # ("" when it is; "not looked for" before the fork server has said).
    shared_budgets: str = ""
    shared_budgets_missing: str = "not looked for"
    # The processes all sessions may run together (confine/sharedprocs.py); 0: not bounded.
    shared_processes: int = 0
    # Testing only: what the daemon was told to take away from this probe
    # (``--force-kernel-for-testing``); "" for a real one.
    forced_for_testing: str = ""
    # The container the daemon seems to run in ("" for none seen): a hint
    # for the reader (kernel.container_hint); the probe above decides.
    container: str = ""


class BeforeRestoreReport(msgspec.Struct, frozen=True):
    """What restores replaced, kept past their sessions: all of them, of every
    session (``daemon/checkpoints/keptsize.py``, docs/checkpoints.md)."""

    path: str  # STATE/before-restore
    count: int  # kept ones there (a directory each)
    bytes: int  # what they hold on disk, each inode once at its allocated size, links to checkpoints included
    budget: int  # what they may hold at most: a restore that would take them over keeps nothing and is refused
    budget_why: str  # which bound gave it, in words


class DaemonReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """The daemon's own budgets (``daemon/capacity.py``)."""

    open_files: int  # its descriptor limit (RLIMIT_NOFILE) in force
    open_files_note: str  # raised, already there, or why not
    connections: int  # client connections served now
    max_connections: int  # ... and at most
    parked: int = 0  # of those, idle and waiting without a thread (daemon/parking.py)
    pool: str = ""  # the sandboxes made ahead (daemon/pool.py), in words
    line_loops: str = ""  # the C helper of read_file and search_files (tools/native.py), in words
    helpers: str = ""  # the fork server, the network stacks and the socket path (daemon/helpers.py), in words
    in_use: str = ""  # the table of worktrees in use (daemon/inusedir.py): where, and which daemons see it
    in_use_shared: bool = True  # False: only the daemons on this state directory see it (a weaker mode)
    before_restore: BeforeRestoreReport | None = None  # what restores replaced, kept past the sessions, and its budget


class LandlockReport(msgspec.Struct, frozen=True):
    abi: int
    filesystem: str  # "enforced"
    scopes: list[str]  # "abstract_unix_socket", "signal"
    tcp: str  # "denied" | "not handled"


class NamespacesReport(msgspec.Struct, frozen=True):
    """Which namespaces of its own the session has."""

    user: bool
    mount: bool
    pid: bool
    net: bool

    def held(self) -> list[str]:
        """The names of those it has, in this order."""
        return [name for name in self.__struct_fields__ if getattr(self, name)]


class NetworkReport(msgspec.Struct, frozen=True, omit_defaults=True):
    mode: str  # "off" | "on" | "ports" | "domains"
    mechanism: str  # what holds it, in words
    stack: str = ""  # the user-mode stack carrying it ("pasta"); left out when none
    connect_ports: list[int] | None = None  # under "ports" only
    bind_ports: list[int] | None = None  # under "ports" only


class RootEntry(msgspec.Struct, frozen=True):
    """A path visible in the session, and how."""

    path: str
    how: str


class GitReport(msgspec.Struct, frozen=True, omit_defaults=True):
    kind: str  # gitdirs.GitLayout.kind: "none", "repository", "linked", ...
    read_only: list[str]
    granted: list[str]
    note: str = ""  # left out when empty


class LimitsReport(msgspec.Struct, frozen=True):
    mechanism: str  # "cgroup v2 and rlimits" | "rlimits"
    cgroup: str  # the session's cgroup, "" when none
    cgroups: str  # the daemon's delegation, in words
    max_processes: int | str  # a number, or how it is counted when not simply that
    memory: str
    cpu_weight: int | str  # a number, or why it is not enforced
    max_data_bytes_per_process: int
    max_file_bytes: int
    max_open_files_per_process: int
    kernel_budgets: str
    leaves_open: list[str]  # what a session can still take from budgets shared with the user


class MemoryHold(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What holds a session's memory (``daemon/watchdog.mechanism``)."""

    mechanism: str  # "cgroup" | "watchdog"
    limit_bytes: int
    interval_s: float | None = None  # the watchdog's period; left out under "cgroup"
    detail: str


class LifetimeReport(msgspec.Struct, frozen=True):
    """How long a session outlives its last connection (``daemon/lifetimes.py``)."""

    detached: bool
    orphan_grace_s: float
    memory: MemoryHold


class Protections(msgspec.Struct, frozen=True, omit_defaults=True):
    """The protections in force for one session: planned by ``confine/plan.py``,
    completed by the worker (``absent_paths``, ``root``) and by the daemon
    (``lifetime``)."""

    mode: str  # "full" | "degraded"
    landlock: LandlockReport
    seccomp: str  # "enforced"
    namespaces: NamespacesReport
    network: NetworkReport
    worktree: str  # "read-write" | "read-only"
    root: list[RootEntry]
    unix_sockets: str
    git: GitReport
    hygiene: list[str]
    leaves_open: list[str]  # the sandbox's gaps, in words
    limits: LimitsReport
    # Paths of the plan this machine lacks, skipped by the worker; set once it is ready.
    absent_paths: list[str] | None = None
    lifetime: LifetimeReport | None = None  # set by the daemon once the session is listed
    # The sandbox's shared part was made ahead, before the session (the daemon's pool).
    made_ahead: bool = False
