"""The whole confinement of one session, as data: ``plan_session`` is pure.

The daemon builds a ``SessionPlan`` from the policy, the kernel probe and the
session's paths, and hands it to the fork server; the worker applies it step
by step (``dispatchd.worker.session_init.confine``). Everything the worker will do
is visible here, and the unit tests compare plans by equality.

Fail closed: a protection the policy requires but the kernel lacks raises
``ConfinementError`` here, before anything is forked.
"""

from __future__ import annotations

import msgspec
import msgspec.structs

from dispatchd import domains as domains_mod
from dispatchd.confine import hygiene, sharedprocs
from dispatchd.confine.cgroups import Delegation, SessionCgroup, plan_session_cgroup
from dispatchd.confine.gaps import filesystem_gaps, leaves_open
from dispatchd.confine.limits import FD_PASSING_RESERVE, LimitsPlan, plan_limits
from dispatchd.confine.ucounts import UcountsPlan, budget_gaps, plan_ucounts
from dispatchd.confine.ucounts import describe as describe_ucounts
from dispatchd.confine.landlock import MAKE_REG, MAKE_SOCK, NET_BIND_TCP, NET_CONNECT_TCP, PTS, LandlockPlan, plan_landlock
from dispatchd.confine.mountplan import MountPlan, describe_root, plan_mounts
from dispatchd.confine.namespaces import NamespacePlan, plan_namespaces
from dispatchd.confine.netstack import NetworkPlan, NetworkPorts, plan_network
from dispatchd.confine.seccomp import SeccompPlan, plan_seccomp
from dispatchd.errors import ConfinementError
from dispatchd.inside import Tops, is_within
from dispatchd.netmodes import NETWORK_MODES, NetworkMode
from dispatchd.policy import Limits, Policy
from dispatchd.protocol.reports import (
    GitReport,
    KernelFeatures,
    LandlockReport,
    LimitsReport,
    NamespacesReport,
    NetworkReport,
    Protections,
    RootEntry,
)


class GitLayout(msgspec.Struct, frozen=True):
    """A worktree's git metadata, as the daemon found it at open
    (``dispatchd.daemon.gitguard.inspect_git``): what the plan holds
    read-only, grants, and makes mount points."""

    kind: str  # "none", "repository", "linked", "refused"
    index: str = ""  # the index git uses for this worktree (its submodules are checked at the end)
    read_only: list[str] = []  # bound read-only over themselves (must exist)
    gitdirs: list[str] = []  # git directories whose new redirect files are moved aside at the end
    readable: list[str] = []  # outside the worktree: Landlock read-only
    writable: list[str] = []  # outside the worktree: Landlock read-write, bound writable
    note: str = ""
    # Inside the worktree, bound writable over themselves: a mount point cannot
    # be renamed (EBUSY), so the read-only binds inside stay where git reads
    # them (.git/modules, .git/worktrees, every git directory of a submodule,
    # and each directory on the way to one under .git/modules).
    mount_points: list[str] = []


class SessionPaths(msgspec.Struct, frozen=True):
    worktree: str  # resolved
    scratch: str  # the session's private directory, made by the daemon
    runtime_dirs: list[str]  # the user's runtime directories, hidden from the session
    code: list[str]  # where the worker's own Python code lives (read-only)
    git: GitLayout = GitLayout("none")  # the worktree's git metadata (daemon/gitguard/layouts.py)
    # Extra read-only paths (the policy's filesystem.extra_read_only and the
    # call's read_only), resolved and checked against the credential
    # deny-list by the daemon (daemon/worktree.py).
    read_only: list[str] = []
    # ``[where, source]``: the DNS relay's resolv.conf (``source``, the
    # daemon's) bound over the host's at ``where`` (daemon/dnsrelay.py);
    # empty: the session reads the host's own.
    resolv: list[str] = []

    @property
    def tmp(self) -> str:
        return self.scratch + "/tmp"

    @property
    def home(self) -> str:
        return self.scratch + "/home"


class SessionPlan(msgspec.Struct, frozen=True):
    session: str
    policy: str
    network: NetworkMode
    paths: SessionPaths
    namespaces: NamespacePlan
    mounts: MountPlan | None
    loopback: bool
    landlock: LandlockPlan
    seccomp: SeccompPlan
    limits_plan: LimitsPlan
    ucounts: UcountsPlan  # kernel budgets bounded in the session's user namespace
    cgroup: SessionCgroup | None  # made by the daemon, joined first by the worker
    env: dict[str, str]
    tools: list[str]
    writable: bool
    limits: Limits
    protections: Protections  # what status reports (with the worker's and the daemon's additions)
    net: NetworkPlan | None = None  # how the network mode is held (netstack.plan_network)
    # "domains": the port of the listener the worker makes on its own loopback
    # and hands to the daemon's proxy (dispatchd.domains); 0: none.
    proxy_port: int = 0
    checkpoint_writes: bool = False  # policy [checkpoints] before_writes (daemon/checkpoints/)
    # The sandbox makes the DNS relay's door on its loopback while it holds its
    # namespace's capabilities, and hands it over with its namespaces: a
    # stack runs, the daemon has a relay (no child of the fork server then).
    dns_door: bool = False


def can_sleep(plan: SessionPlan) -> bool:
    """Whether the session's processes may go when it idles (``sleep_after_s``)
    and be made again, confined alike: only in namespaces of its own that
    outlive its processes (user, mount, IPC), a pid namespace to remake, and
    a root of its own (the host's root, the weaker mode, would have the
    budget held open below it refuse its read-only remount)."""
    ns = plan.namespaces
    return (plan.limits.sleep_after_s > 0 and ns.user and ns.mount and ns.pid
            and plan.mounts is not None and plan.mounts.root == "minimal")


class PoolKey(msgspec.Struct, frozen=True):
    """Everything a sandbox made ahead has applied before it knows its
    session (``session_init.confine_shared``), and what the daemon set up for
    it (its network, its cgroup): two plans with equal keys are served alike
    by the same sandbox."""

    namespaces: NamespacePlan
    ucounts: UcountsPlan
    root: MountPlan
    landlock: LandlockPlan  # the ruleset begun: its handled rights, scopes, and the rules added ahead
    loopback: bool
    seccomp: SeccompPlan  # compiled by the fork server when the sandbox was made
    cgroup: SessionCgroup | None  # born in it, limits written
    net: NetworkPlan | None  # rules committed (those of "ports" name its ports), stack started
    dns_door: bool = False  # the relay's door made, handed over with the namespaces


def pool_key(plan: SessionPlan) -> bytes | None:
    """Pure. The key of the sandboxes made ahead that can serve ``plan`` (see
    ``PoolKey``), or None when none can: only a session with user, mount and
    pid namespaces and a root of its own is made in two stages."""
    ns, mounts = plan.namespaces, plan.mounts
    if not (ns.user and ns.mount and ns.pid) or mounts is None or mounts.root != "minimal":
        return None
    return msgspec.msgpack.encode(PoolKey(namespaces=ns, ucounts=plan.ucounts, root=mounts.root_part(),
                                          landlock=plan.landlock.ahead_part(), loopback=plan.loopback, seccomp=plan.seccomp, cgroup=plan.cgroup,
                                          net=plan.net, dns_door=plan.dns_door))


def encode_plan(plan: SessionPlan) -> bytes:
    """A plan as the fork server's messages carry it (``SpawnWorker.plan``,
    ``AdoptSession.plan``): the protocol holds it as bytes, so that a client
    importing ``dispatchd.protocol`` never loads the confinement code."""
    return msgspec.msgpack.encode(plan)


_plan_decoder = msgspec.msgpack.Decoder(SessionPlan)


def decode_plan(payload: bytes) -> SessionPlan:
    """The plan ``encode_plan`` encoded. Raises msgspec's errors on a bad one
    (the fork server answers those ``spawn_failed``). After
    ``leave_seccomp_encoded`` its ``seccomp`` is the part's bytes."""
    return _plan_decoder.decode(payload)


def _seccomp_left_encoded() -> type:
    """``SessionPlan`` with its ``seccomp`` field a ``msgspec.Raw``: the same
    fields, names, defaults and checks, the syscall rules not decoded."""
    fields = []
    for f in msgspec.structs.fields(SessionPlan):
        kind = msgspec.Raw if f.name == "seccomp" else f.type
        fields.append((f.name, kind) if f.required else (f.name, kind, f.default))
    return msgspec.defstruct("SessionPlan", fields, frozen=True, module=__name__)


def leave_seccomp_encoded() -> None:
    """From now on, in this process and the processes it forks, ``decode_plan``
    leaves a plan's ``seccomp`` part as the bytes the daemon encoded
    (``msgspec.Raw``; ``seccomp_of`` decodes it). For the fork server: a worker
    needs its syscall rules only compiled (the fork server's ``programs``) and
    compared (``pool_key``, which encodes the bytes unchanged); decoded, they
    were some 400 objects scattered over the heap's free blocks, whose pages
    every worker ended up owning (about 0.1 MiB of each idle session)."""
    global _plan_decoder
    _plan_decoder = msgspec.msgpack.Decoder(_seccomp_left_encoded())


def seccomp_of(plan: SessionPlan) -> SeccompPlan:
    """The plan's seccomp part, decoded where ``leave_seccomp_encoded`` left it
    encoded. Raises msgspec's errors on a bad one."""
    part: object = plan.seccomp
    if isinstance(part, msgspec.Raw):
        return msgspec.msgpack.decode(part, type=SeccompPlan)
    assert isinstance(part, SeccompPlan)
    return part


def _landlock_ahead(landlock: LandlockPlan, mounts: MountPlan, candidates: list[str]) -> list[str]:
    """The paths whose Landlock rules can be added with the root, before the
    session's own binds: a rule binds to the inode its path leads to, and
    these lead to the same one then and once the session's paths are bound
    (the root's own system binds, /proc, /dev's nodes, the private /tmp and
    /dev/shm), unless a bind of the session's lands at or above one (a
    worktree or an extra path over a system path): that one waits."""
    own = mounts.split_binds()[1]
    late, late_paths = Tops(b.path for b in own), {b.path for b in own}
    wanted = set(candidates)
    ahead: list[str] = []
    for rule in landlock.paths:
        path = rule.path
        if path in wanted and path not in ahead and path not in late_paths and not late.holds_below(path):
            ahead.append(path)
    return ahead


def plan_session(
    policy: Policy,
    kernel: KernelFeatures,
    *,
    session: str,
    paths: SessionPaths,
    network: NetworkMode,
    uid: int,
    gid: int,
    base_env: dict[str, str],
    ports: NetworkPorts | None = None,
    delegation: Delegation = Delegation(note="not looked for"),
    git_identity: dict[str, str] | None = None,
    host_tree: bool = False,
    dns_door: bool = False,
) -> SessionPlan:
    """``host_tree``: the kernel binds from a detached copy of a mount tree
    (``mounts.probe_host_tree``, probed once at start), so a root of the
    session's own holds the host's by descriptor until the session's binds.
    ``dns_door``: the daemon runs the DNS relay (its door is made by the
    sandbox when a stack runs in namespaces of its own)."""
    if network not in NETWORK_MODES:
        raise ConfinementError("network", detail=f"network must be one of {', '.join(NETWORK_MODES)}, not {network!r}")
    ports = ports or NetworkPorts(connect=list(policy.network.connect_ports), bind=list(policy.network.bind_ports))
    if kernel.landlock_abi < max(1, policy.sandbox.min_landlock_abi):
        have = f"ABI {kernel.landlock_abi}" if kernel.landlock_abi else "Landlock is not enabled in this kernel"
        raise ConfinementError("landlock", detail=f"policy {policy.name!r} needs Landlock ABI >= "
                               f"{max(1, policy.sandbox.min_landlock_abi)}; this kernel offers: {have}")
    if not kernel.seccomp:
        raise ConfinementError("seccomp", detail="this kernel offers no seccomp filters with errno actions")
    userns_setting = policy.sandbox.user_namespaces
    if userns_setting == "required" and not kernel.user_namespaces:
        raise ConfinementError("namespaces", detail=f"policy {policy.name!r} requires user namespaces: "
                               f"{kernel.user_namespaces_note}")
    use_userns = userns_setting != "never" and kernel.user_namespaces
    # After the kernel's own refusals: a network mode this machine cannot hold
    # (no pasta, no usable /dev/net/tun, no nftables) is refused here too.
    net = plan_network(network, use_userns=use_userns, stack_missing=kernel.network_stack_missing,
                       nft_missing=kernel.nftables_missing, landlock_abi=kernel.landlock_abi, ports=ports,
                       stack=kernel.network_stack, host_loopback=policy.network.host_loopback)
    if network == "ports" and net.landlock_tcp and kernel.landlock_abi < 4:
        raise ConfinementError("network", detail=f"network 'ports' needs Landlock TCP rules (ABI 4); "
                               f"this kernel offers ABI {kernel.landlock_abi}")
    network_off = network == "off"
    if network == "domains" and not use_userns:
        # Without a namespace of its own the session shares the host's network:
        # the proxy would be one way out among all the others.
        raise ConfinementError("network", detail="network 'domains' needs a network namespace of its own "
                               f"(user namespaces), and this session has none (user namespaces: "
                               f"{kernel.user_namespaces_note}; policy user_namespaces = "
                               f"{policy.sandbox.user_namespaces!r}): without one the host's network would be "
                               "reachable directly, not only through the filtering proxy")

    fs = policy.filesystem
    worktree_rw = fs.worktree == "read-write"
    git = paths.git
    minimal_root = use_userns and fs.root == "minimal"
    namespaces = plan_namespaces(use_userns=use_userns, network_off=network_off, uid=uid, gid=gid,
                                 own_network=net.namespace)
    # Unix sockets only where no socket of the host's is reachable and none of
    # the session's can pose as one: pathname sockets in a root of its own,
    # abstract names in a network namespace of its own. Landlock's scope (ABI
    # 6) stops connecting out to the host's abstract names, not the user's
    # programs connecting in to a name the session listens on, so a shared
    # network namespace keeps them refused.
    unix_sockets = minimal_root and namespaces.net
    # The relay's resolv.conf, where a root of the session's own can bind it
    # and a stack runs in some mode (the relay's door opens with it).
    resolv = paths.resolv if minimal_root and not kernel.network_stack_missing and len(paths.resolv) == 2 else []
    read_only = (list(fs.read_only) + ["/proc"] + list(paths.code) + list(git.readable) + list(paths.read_only)
                 + resolv[:1])
    if fs.landlock_grants_root and minimal_root:
        read_only.insert(0, "/")  # the layer test: the root alone keeps the rest out
    # The session's own (its scratch; /tmp and /dev/shm below) and what another
    # session may reach as well (no Unix socket made there: landlock.SHARED).
    read_write = [paths.scratch]
    shared = list(fs.read_write) + (list(git.writable) if worktree_rw else [])
    (shared if worktree_rw else read_only).insert(0, paths.worktree)
    # /dev/pts is a devpts of the session's own, mounted in its root; without
    # one it would be the host's, the user's terminals: never granted then.
    devices = [d for d in fs.devices if d != PTS or minimal_root]
    if use_userns:
        # A private /tmp and /dev/shm exist only in the session's mount namespace.
        read_write += ["/tmp", "/dev/shm"]
    landlock = plan_landlock(
        abi=kernel.landlock_abi,
        read_only=read_only,
        read_write=read_write,
        shared=shared,
        devices=devices,
        # Without a network namespace, "off" is held by seccomp and Landlock TCP rules; "ports" by Landlock's in every mode.
        deny_tcp=net.landlock_tcp,
        connect_ports=ports.connect if net.landlock_tcp and network == "ports" else None,
        bind_ports=ports.bind if net.landlock_tcp and network == "ports" else None,
    )
    seccomp = plan_seccomp(allow_inet=net.seccomp_inet, ipc_namespace=use_userns, allow_unix=unix_sockets,
                           pid_namespace=namespaces.pid)
    mounts = None
    labels: dict[str, str] = {}
    if use_userns:
        writable = []
        if worktree_rw and git.kind == "repository":
            # .git a mount point of its own: it cannot be renamed aside (EBUSY)
            # with its read-only config and hooks, and a new one planted.
            writable.append(paths.worktree + "/.git")
            # The same for .git/modules, .git/worktrees and every submodule's
            # git directory (parents first): renaming one away, its read-only
            # binds with it, to build another in its place fails (EBUSY).
            writable += list(git.mount_points)
        writable += [paths.scratch] + list(fs.read_write) + (list(git.writable) if worktree_rw else [])
        mounts = plan_mounts(root=fs.root, worktree=paths.worktree, worktree_rw=worktree_rw, private_tmp=paths.tmp,
                             read_write=writable,
                             read_only=list(fs.read_only) + list(paths.code) + list(git.readable) + list(paths.read_only),
                             over=list(git.read_only) if worktree_rw else [], devices=devices,
                             files=[(resolv[0], resolv[1])] if resolv else [],
                             hide=list(paths.runtime_dirs), system=list(fs.read_only) + list(paths.code),
                             # The session id's own: a sandbox made ahead for it binds them early.
                             ahead=[paths.scratch, "/tmp"],
                             host_by_fd=host_tree)
        if mounts.root == "minimal":
            landlock = msgspec.structs.replace(landlock, ahead=_landlock_ahead(
                landlock, mounts, [*fs.read_only, "/proc", *paths.code, *devices, "/tmp", "/dev/shm",
                                   *(["/"] if fs.landlock_grants_root else [])]))
        labels = {paths.scratch: "the session's scratch: HOME, TMPDIR",
                  **{p: "system" for p in fs.read_only}, **{p: "dispatchd's code" for p in paths.code},
                  **{p: "git" for p in [*git.readable, *git.writable, *git.read_only]},
                  **{p: "extra read-only path" for p in paths.read_only},
                  **{p: "the DNS relay's resolv.conf (network on, ports)" for p in resolv[:1]},
                  **{p: "policy read_write" for p in fs.read_write}}

    env = hygiene.session_env(
        base_env, session=session, home=paths.home,
        # In a root of its own the private /tmp is short and the same
        # directory: a socket path under it stays within AF_UNIX's 108 bytes.
        tmpdir="/tmp" if minimal_root else paths.tmp,
        pass_through=policy.env.pass_through, set_env=policy.env.set,
        # The user's name on the session's commits (GIT_AUTHOR_*, GIT_COMMITTER_*):
        # the repository's .git/config is read-only inside, and HOME is the session's.
        git_identity=git_identity if policy.env.git_identity else None,
        # After the policy's: the proxy is the only way out anyway.
        proxy=domains_mod.proxy_env() if network == "domains" else None)

    lim = policy.limits
    limits_plan = plan_limits(max_processes=lim.max_processes, max_data_bytes=lim.max_data_bytes,
                              max_file_bytes=lim.max_file_bytes, max_open_files=lim.max_open_files,
                              user_namespace=use_userns, max_pending_signals=lim.max_pending_signals,
                              max_msgqueue_bytes=lim.max_msgqueue_bytes)
    cgroup = plan_session_cgroup(delegation, session, max_processes=lim.max_processes,
                                 memory_bytes=lim.session_memory_bytes, cpu_weight=lim.cpu_weight)
    ucounts = plan_ucounts(user_namespace=use_userns, inotify_instances=lim.max_inotify_instances,
                           inotify_watches=lim.max_inotify_watches, fanotify_groups=lim.max_fanotify_groups,
                           fanotify_marks=lim.max_fanotify_marks,
                           # pasta may join it at any switch: room for its own namespaces
                           network_stack=use_userns and not kernel.network_stack_missing)
    protections = describe_protections(
        policy, kernel, network=network, ports=ports, net=net, use_userns=use_userns, git=git,
        minimal_root=minimal_root, unix_sockets=unix_sockets, namespaces=namespaces, landlock=landlock,
        mounts=mounts, labels=labels, cgroup=cgroup, delegation=delegation, ucounts=ucounts)
    return SessionPlan(
        session=session,
        policy=policy.name,
        network=network,
        paths=paths,
        namespaces=namespaces,
        mounts=mounts,
        loopback=namespaces.net,
        landlock=landlock,
        seccomp=seccomp,
        limits_plan=limits_plan,
        ucounts=ucounts,
        cgroup=cgroup,
        env=env,
        tools=list(policy.tools),
        writable=worktree_rw,
        limits=policy.limits,
        checkpoint_writes=policy.checkpoints.before_writes,
        protections=protections,
        net=net,
        proxy_port=domains_mod.PROXY_PORT if network == "domains" else 0,
        dns_door=dns_door and net.stack and namespaces.user and namespaces.net,
    )


def describe_protections(policy: Policy, kernel: KernelFeatures, *, network: NetworkMode, ports: NetworkPorts,
                         net: NetworkPlan, use_userns: bool, git: GitLayout, minimal_root: bool,
                         unix_sockets: bool, namespaces: NamespacePlan, landlock: LandlockPlan,
                         mounts: MountPlan | None, labels: dict[str, str], cgroup: SessionCgroup | None,
                         delegation: Delegation, ucounts: UcountsPlan) -> Protections:
    """What ``status`` reports of a planned session: each protection, how it
    is held, and what the session's mode leaves open (``leaves_open``). Pure,
    from the plans themselves, so the report cannot claim what is not applied."""
    fs = policy.filesystem
    network_off = network == "off"
    net_mechanism = net.mechanism
    gaps = leaves_open(use_userns, kernel.landlock_abi, network_off, git.kind)
    mode = "full" if not gaps else "degraded"  # of the sandbox; the view's and the network's own caveats follow
    gaps += filesystem_gaps(minimal_root, unix_sockets, namespaces.net)
    if PTS in fs.devices and not minimal_root:
        gaps.append("no pseudo-terminals (filesystem.devices lists /dev/pts): without a root of the session's "
                    "own, /dev/pts would be the host's, the user's terminals; not granted")
    if fs.landlock_grants_root and minimal_root:
        gaps.append("filesystem.landlock_grants_root (a layer test): Landlock lets the session read the whole of "
                    "its root; only the root's contents keep the rest out")
    if not net.namespace:
        # Abstract names live in the network namespace: only a private one hides the host's.
        gaps.append("abstract Unix socket names of the host can be taken (bind) by the session: a program "
                    "of the user's that binds the same name then fails (nothing can be connected to or "
                    "received through them)")
    gaps += net.caveats
    if not use_userns:
        gaps.append("switching the network off without user namespaces: a socket the session set up while on "
                    "outlives the switch (a sendfile queue in FIN-WAIT keeps sending page-cache pages the off "
                    "session rewrites afterwards); only a network namespace of its own closes that")
    landlock_report = LandlockReport(
        abi=kernel.landlock_abi,
        filesystem="enforced",
        scopes=[s for s, bit in (("abstract_unix_socket", 1), ("signal", 2)) if landlock.scoped & bit],
        tcp="denied" if landlock.handled_net & (NET_BIND_TCP | NET_CONNECT_TCP) else "not handled",
    )
    network_report = NetworkReport(
        mode=network, mechanism=net_mechanism, stack=kernel.network_stack if net.stack else "",
        connect_ports=ports.connect if network == "ports" else None,
        bind_ports=ports.bind if network == "ports" else None)
    # Every path visible in the session, and how (full mode); the host's root otherwise.
    root = describe_root(mounts, labels) if mounts is not None else [
        RootEntry(path="/", how="the host's root (no mount namespace); Landlock refuses what the rules do not "
                                "grant: " + ", ".join(r.path for r in landlock.paths))]
    made = [labels.get(r.path, r.path).split(":")[0] if r.path not in ("/tmp", "/dev/shm") else r.path
            for r in landlock.paths if r.access & MAKE_SOCK]
    # A rule holds below its path across mounts: a worktree bound below the
    # private /tmp gets /tmp's right to make sockets (Landlock cannot take it away).
    socketable = [r.path for r in landlock.paths if r.access & MAKE_SOCK]
    covered = [r.path for r in landlock.paths if r.access & MAKE_REG and not r.access & MAKE_SOCK
               and any(is_within(r.path, p) for p in socketable)]
    if unix_sockets and covered:
        gaps.append(f"Unix sockets can be made in {', '.join(covered)}: it lies below the session's private "
                    f"/tmp or /dev/shm, whose right to make them holds below (Landlock); another session given "
                    f"this path could connect to one and be handed descriptors (keep worktrees out of /tmp)")
    unix_report = ("allowed: pathname sockets inside the session's own root, abstract names in its own "
                   f"network namespace; made only in {', '.join(made)} (nowhere another session reaches: "
                   "the worktree and read_write paths make none)" if unix_sockets
                   else "refused (seccomp: socket(AF_UNIX) -> EPERM)")
    git_report = GitReport(kind=git.kind, read_only=list(git.read_only) if use_userns else [],
                           granted=list(git.writable), note=git.note)
    hygiene_report = ["no_new_privs", "new session, no terminal", "fds closed", "environment allowlist",
                      "dies with its parent", "not dumpable"] + (["no capabilities"] if use_userns else [])
    lim = policy.limits
    held = set(cgroup.settings) if cgroup else set()
    rlimit_processes = sharedprocs.said(lim.max_processes, use_userns, kernel.shared_processes)
    limits_report = LimitsReport(
        # rlimits hold in every mode; a cgroup adds limits over the whole session.
        mechanism=("cgroup v2 and rlimits" if cgroup else "rlimits"),
        cgroup=cgroup.path if cgroup else "",
        cgroups=delegation.describe(),
        max_processes=(f"{lim.max_processes} (pids.max over the session)" if "pids.max" in held
                       else rlimit_processes),
        memory=(f"{lim.session_memory_bytes} bytes over the session (memory.max, no swap)" if "memory.max" in held
                else f"{lim.session_memory_bytes} bytes over the session (the daemon's memory watchdog); "
                     f"{lim.max_data_bytes} bytes of data per process (RLIMIT_DATA)"),
        cpu_weight=lim.cpu_weight if "cpu.weight" in held else "not enforced (no cpu controller)",
        max_data_bytes_per_process=lim.max_data_bytes,
        max_file_bytes=lim.max_file_bytes,
        max_open_files_per_process=lim.max_open_files,
        kernel_budgets=describe_ucounts(ucounts, kernel.shared_budgets),
        # What a session can still take from budgets it shares with the user (the
        # sandbox's own gaps are the top-level leaves_open).
        leaves_open=budget_gaps(user_namespace=use_userns, cgroup_controllers=tuple(
            c for c, key in (("memory", "memory.max"), ("cpu", "cpu.weight")) if key in held),
            max_open_files=lim.max_open_files, max_processes=lim.max_processes,
            fd_passing_reserve=FD_PASSING_RESERVE, shared_missing=kernel.shared_budgets_missing),
    )
    return Protections(
        mode=mode, landlock=landlock_report, seccomp="enforced",
        namespaces=NamespacesReport(user=namespaces.user, mount=namespaces.mount, pid=namespaces.pid,
                                    net=namespaces.net),
        network=network_report, worktree=fs.worktree, root=root, unix_sockets=unix_report, git=git_report,
        hygiene=hygiene_report, leaves_open=gaps, limits=limits_report)
