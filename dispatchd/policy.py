"""Policies: one frozen, typed ``Policy`` per ``policies/NAME.toml``.

Guarantees:
- A policy file is decoded strictly: an unknown key, a wrong type or a bad
  value is a ``PolicyError`` that names the file and the key.
- The ``Policy`` is immutable (its lists are tuples) and is the only input the confinement and the
  tools take; no mechanism reads files or the environment on its own.
- Policies are checked when the daemon starts and again when a session opens
  (a file edited in between is re-read, and a broken one refuses the open).
- Reading one never blocks and never fails with a traceback: a policy file
  is opened without waiting (``O_NONBLOCK``: a FIFO named ``X.toml`` does not
  hang the daemon), must be a regular file of at most ``MAX_POLICY_BYTES``,
  and text that is not UTF-8 or nests deeper than the parser goes is "not
  valid TOML", naming the file, as any other broken policy (exit 2 at start,
  ``bad_policy`` at an open). A symlink is followed (a policy may live in the
  user's dotfiles); what it leads to is held to the same rules.
- The structs' defaults below are the one source of every default: a key a
  policy file leaves out takes them. policies/default.toml writes them out
  for its readers and differs only in its description and in
  ``filesystem.read_only`` (tests/unit/test_policy.py holds it to that).
"""

from __future__ import annotations

import math
import os
import re
import stat
import threading
import tomllib
import types
from pathlib import Path
from typing import Literal

import msgspec

from dispatchd.catalogue import SPECS
from dispatchd.domains import BadHost, parse_domains
from dispatchd.errors import PolicyError
from dispatchd.inside import is_below
from dispatchd.netmodes import NetworkMode

ALL_TOOLS = tuple(SPECS)
# Background jobs are started by shell_exec: a policy offering shell_exec
# offers these too (listed or not), and one without it cannot offer them.
JOB_TOOLS = ("job_output", "job_stop", "job_list")
# The tools that may change the worktree, so need it writable (and its write
# lock, worker/tool_server.py): every one whose risk is not "read" but the job
# tools, which only act on jobs shell_exec started (and took the lock for).
MUTATING_TOOLS = frozenset(name for name, spec in SPECS.items() if spec.risk != "read" and name not in JOB_TOOLS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# The largest policy file read: the shipped ones are under 8 KiB; a bound
# keeps a runaway file (or /dev/zero behind a link: refused as not regular
# anyway) from being read into the daemon whole at every open.
MAX_POLICY_BYTES = 1024 * 1024


class Filesystem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # System paths the sandbox may read and execute (absent ones are skipped).
    read_only: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
    # Extra paths the sandbox may read and write, beyond the worktree.
    read_write: tuple[str, ...] = ()
    # Device files the sandbox may read and write.
    devices: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
    # "read-write", or "read-only" for policies that only read and search.
    worktree: Literal["read-write", "read-only"] = "read-write"
    # Read-only paths beyond the system (toolchains: ~/.cargo, ~/.rustup, a
    # pyenv root), bound into the session's root; checked at each open
    # against the credential deny-list (~/.ssh, ~/.gnupg, ~/.aws, ~/.config...).
    extra_read_only: tuple[str, ...] = ()
    # Full mode: "minimal" builds the session a root of its own holding only
    # the paths above (everything else absent: ENOENT); "host" is the host's
    # "/" bound read-only, Landlock alone keeping the rest out (the release
    # before; kept as the benchmark's baseline and for the layer tests).
    root: Literal["minimal", "host"] = "minimal"
    # For testing the layers only: Landlock also grants reading the whole
    # (minimal) root, so the root alone keeps the rest out. Refused with
    # root = "host", where it would grant the machine.
    landlock_grants_root: bool = False


class Network(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The network a session gets when the caller does not say: "off", "on",
    # "ports" (the host's network, TCP only to/on the ports below), or
    # "domains" (only the hosts below, through the daemon's filtering proxy).
    default: NetworkMode = "off"
    # Under "ports": TCP ports the session may connect to, and bind.
    connect_ports: tuple[int, ...] = ()
    bind_ports: tuple[int, ...] = ()
    # Under "domains": the hosts a session may reach through the proxy when the
    # caller names none ("pypi.org", "*.pythonhosted.org" for subdomains only,
    # "host:8443" for another port than 80 and 443); see dispatchd/domains.py.
    domains: tuple[str, ...] = ()
    # Under "on" and "ports": whether the host's loopback (its 127.0.0.1:
    # databases, dev servers, a local model server) answers at the gateway
    # (10.0.2.2). False closes it (the stack's --disable-host-loopback,
    # --no-map-gw); a mode that cannot hold that (degraded mode, which is
    # the host's network) is then refused.
    host_loopback: bool = True


class Sandbox(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # "required": refuse to open a session without user namespaces.
    # "auto": use them where the kernel allows; otherwise Landlock + seccomp
    #         alone, a weaker mode that status shows with what it leaves open.
    # "never": do not use them (the fallback, chosen on purpose).
    user_namespaces: Literal["required", "auto", "never"] = "auto"
    # Refuse sessions unless the kernel offers at least this Landlock ABI.
    min_landlock_abi: int = 1


MAX_CHANNELS = 256  # client channels of one session at once, at most (see max_channels)


def max_channels(max_processes: int, max_open_files: int) -> int:
    """Channels one session may hold: each is a thread and a descriptor of the
    tool server, so a quarter of the process budget and half the descriptors
    at most (the rest is the session's commands'), and ``MAX_CHANNELS``.
    The tool server refuses one more; so does the daemon while the session
    sleeps (it holds the channels then)."""
    return max(4, min(MAX_CHANNELS, max_processes // 4, max_open_files // 2))


def too_many_channels(limit: int) -> str:
    """What a channel over ``max_channels`` is told (``ErrorReply``, code ``too_many_channels``)."""
    return (f"this session has {limit} channels open, its limit (each attach opens one): "
            "close some (Session.close or detach)")


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    command_timeout_s: float = 120.0
    max_command_timeout_s: float = 3600.0
    output_cap_bytes: int = 1024 * 1024  # per stream, for shell_exec
    file_size_cap_bytes: int = 16 * 1024 * 1024  # read_file, write_file, edit_file
    idle_timeout_s: float = 3600.0  # a session with no call for this long closes
    # A session with no call (nor job, nor process of its own) for this long
    # lets its processes go and is woken by its next call (docs/architecture.md,
    # "Sessions that sleep"); 0: never. Only with user namespaces.
    sleep_after_s: float = 30.0
    # Each wake adds a rule to the session's kept Landlock ruleset (its fresh
    # /proc), which the kernel cannot take back: past this many wakes the
    # session stays awake, so what it holds in the kernel stays bounded.
    max_wakes: int = 1000
    # A session whose every client connection has gone ends after this long,
    # unless it was opened detached (daemon/lifetimes.py); 0 ends it at once.
    orphan_grace_s: float = 60.0
    search_max_results: int = 100
    list_max_entries: int = 10000
    fsync: bool = True  # completed writes reach the disk before the reply
    # A tool result longer than this reaches a model as head and tail with a
    # marker; the whole of it stays retrievable in the session (retrieve_output).
    model_output_bytes: int = 16384
    # Resource limits of every process of a session (see confine/limits.py).
    max_processes: int = 1024  # the session's processes and threads together
    max_data_bytes: int = 8 * 1024**3  # per process (RLIMIT_DATA)
    max_file_bytes: int = 8 * 1024**3  # no file larger (RLIMIT_FSIZE)
    max_open_files: int = 4096  # per process
    # Over the whole session, where the daemon has a delegated cgroup v2
    # subtree with the memory and cpu controllers (confine/cgroups.py);
    # max_processes is then the session's pids.max too.
    session_memory_bytes: int = 8 * 1024**3  # memory.max (and no swap); without it, the daemon's watchdog
    cpu_weight: int = 100  # cpu.weight: 1-10000, 100 is the default share
    # Per-user kernel budgets a session may take, bounded in its own user
    # namespace (confine/ucounts.py); the user keeps the rest (128 inotify
    # instances by default in all).
    max_inotify_instances: int = 32
    max_pending_signals: int = 4096  # RLIMIT_SIGPENDING
    max_msgqueue_bytes: int = 204800  # RLIMIT_MSGQUEUE
    max_inotify_watches: int = 65536
    max_fanotify_groups: int = 16
    max_fanotify_marks: int = 65536


class Env(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Variables of the daemon's environment passed to commands (names only).
    pass_through: tuple[str, ...] = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
    # Variables set for commands.
    set: dict[str, str] = {}
    # Give commands the user's git identity (user.name and user.email of their
    # global git config, read by the daemon at open) as GIT_AUTHOR_* and
    # GIT_COMMITTER_*; ``set`` above still wins over it.
    git_identity: bool = True


# What the user's editors, agents and shells run or act on when they open a
# folder: VS Code's tasks and settings, JetBrains' run configurations, Claude
# Code's and Codex's settings and hooks, MCP servers an agent starts, direnv,
# Vim's and Neovim's per-folder start-up files (with ``exrc`` set), shell
# start-up files, git's per-repository files; and, for a worktree that is a
# home directory's dotfiles, ``.ssh`` (its ``config`` runs ``ProxyCommand``
# at the user's next ssh, its ``authorized_keys`` lets others in). Matched by
# name at any depth of a worktree (daemon/gitguard/runnables.py).
DEFAULT_PROTECTED = (
    ".vscode", ".idea", ".claude", ".codex", ".cursor", ".devcontainer", ".mcp.json", ".envrc",
    ".exrc", ".nvim.lua", ".nvimrc", ".vimrc", ".gvimrc",
    ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".bash_aliases", ".profile",
    ".zshrc", ".zshenv", ".zprofile", ".zlogin", ".zlogout",
    ".gitconfig", ".gitconfig.local", ".gitmodules", ".ripgreprc", ".ssh", ".tmux.conf",
    ".husky", ".helix", ".zed", ".gemini", "opencode.json", ".devcontainer.json",
    ".opencode", "crush.json", ".amazonq", ".kiro", ".continue", ".qwen",
    "mise.toml", ".mise.toml", "mise.local.toml", ".mise.local.toml",
)


class Protect(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Names of files and directories a session may create or change only to
    # have them moved aside at its end (``NAME.quarantined-by-dispatchd-...``):
    # the user's tools run them. Take a name out to let sessions write it.
    paths: tuple[str, ...] = DEFAULT_PROTECTED


class Checkpoints(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Take a checkpoint before every writing call (write_file, edit_file,
    # create_file, shell_exec); one that cannot be taken refuses the call.
    before_writes: bool = False
    keep: int = 20  # checkpoints kept per session; the oldest goes first
    max_files: int = 200_000  # entries of the worktree a checkpoint may list (files, directories, links)
    max_bytes: int = 4 * 1024**3  # bytes one checkpoint may copy (not counting reflinks and links)
    max_depth: int = 256  # directory levels (dispatchd/treewalk.py's MAX_DEPTH)


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "default"
    description: str = ""
    tools: tuple[str, ...] = ALL_TOOLS
    filesystem: Filesystem = Filesystem()
    network: Network = Network()
    sandbox: Sandbox = Sandbox()
    limits: Limits = Limits()
    env: Env = Env()
    protect: Protect = Protect()
    checkpoints: Checkpoints = Checkpoints()


def _check(policy: Policy, where: str) -> None:
    def bad(key: str, why: str) -> PolicyError:
        return PolicyError(f"{where}: {key}: {why}", key=key)

    for tool in policy.tools:
        if tool not in ALL_TOOLS:
            raise bad("tools", f"unknown tool {tool!r} (known: {', '.join(ALL_TOOLS)})")
    if len(set(policy.tools)) != len(policy.tools):
        raise bad("tools", "a tool is listed twice")
    if "shell_exec" not in policy.tools:
        orphans = [t for t in policy.tools if t in JOB_TOOLS]
        if orphans:
            raise bad("tools", f"{', '.join(orphans)} come with shell_exec, which this policy does not offer")
    if policy.filesystem.worktree == "read-only":
        writers = sorted(MUTATING_TOOLS & set(policy.tools))
        if writers:
            raise bad("tools", f"a read-only worktree cannot offer {', '.join(writers)}")
    fs = policy.filesystem
    for key, paths in (
        ("filesystem.read_only", fs.read_only),
        ("filesystem.read_write", fs.read_write),
        ("filesystem.devices", fs.devices),
        ("filesystem.extra_read_only", fs.extra_read_only),
    ):
        for p in paths:
            # normpath keeps a leading "//" (POSIX allows it a meaning), yet on
            # Linux "//" is "/": refuse it, or "//" would grant the whole machine.
            if not os.path.isabs(p) or os.path.normpath(p) != p or p.startswith("//"):
                raise bad(key, f"{p!r} must be an absolute, normalised path")
            if p == "/" and key != "filesystem.devices":
                raise bad(key, "granting the whole filesystem defeats the sandbox")
    if fs.landlock_grants_root and fs.root != "minimal":
        raise bad("filesystem.landlock_grants_root", "only with root = \"minimal\": on the host's root it "
                  "would grant reading the whole machine")
    for p in fs.devices:
        if not is_below(p, "/dev"):
            raise bad("filesystem.devices", f"{p!r} is not under /dev")
    lim = policy.limits
    for key in ("command_timeout_s", "max_command_timeout_s", "idle_timeout_s"):
        value = getattr(lim, key)
        if not (math.isfinite(value) and value > 0):  # NaN compares false with everything
            raise bad(f"limits.{key}", "must be a positive number of seconds")
    if not (math.isfinite(lim.orphan_grace_s) and lim.orphan_grace_s >= 0):
        raise bad("limits.orphan_grace_s", "must be a number of seconds, 0 or more")
    if not (math.isfinite(lim.sleep_after_s) and lim.sleep_after_s >= 0):
        raise bad("limits.sleep_after_s", "must be a number of seconds, 0 (never sleep) or more")
    if lim.command_timeout_s > lim.max_command_timeout_s:
        raise bad("limits.command_timeout_s", "exceeds limits.max_command_timeout_s")
    for key in ("output_cap_bytes", "file_size_cap_bytes", "search_max_results", "list_max_entries",
                "model_output_bytes", "max_processes", "max_data_bytes", "max_file_bytes", "max_open_files",
                "session_memory_bytes", "max_inotify_instances", "max_inotify_watches", "max_fanotify_groups",
                "max_fanotify_marks", "max_pending_signals", "max_msgqueue_bytes", "max_wakes"):
        if getattr(lim, key) < 1:
            raise bad(f"limits.{key}", "must be at least 1")
    for key in ("keep", "max_files", "max_bytes", "max_depth"):
        if getattr(policy.checkpoints, key) < 1:
            raise bad(f"checkpoints.{key}", "must be at least 1")
    if not 1 <= lim.cpu_weight <= 10000:
        raise bad("limits.cpu_weight", "must be between 1 and 10000 (cgroup v2 cpu.weight)")
    for key, ports in (("network.connect_ports", policy.network.connect_ports),
                       ("network.bind_ports", policy.network.bind_ports)):
        for port in ports:
            if not 1 <= port <= 65535:
                raise bad(key, f"{port} is not a TCP port (1-65535)")
    try:
        parse_domains(policy.network.domains)
    except BadHost as exc:
        raise bad("network.domains", str(exc)) from None
    for name in policy.protect.paths:
        if not name or "/" in name or name in (".", ".."):
            raise bad("protect.paths", f"{name!r}: a file or directory name, without a slash")
    if not 1 <= policy.sandbox.min_landlock_abi <= 64:
        raise bad("sandbox.min_landlock_abi", "must be between 1 and 64")


def parse_policy(name: str, text: str, where: str = "<policy>") -> Policy:
    """Decode and check one policy's TOML text. Raises ``PolicyError``."""
    try:
        raw = tomllib.loads(text)
    except RecursionError:
        # tomllib recurses once per nested array or inline table; a file
        # nested thousands deep is no policy, and a traceback of thousands
        # of lines in the log (at every open) tells its owner nothing.
        raise PolicyError(f"{where}: not valid TOML: nested too deeply (arrays or inline tables "
                          f"within each other, past what the parser reads)") from None
    except ValueError as exc:  # TOMLDecodeError, and the few value errors tomllib lets through
        raise PolicyError(f"{where}: not valid TOML: {exc}") from exc
    if "name" in raw and raw["name"] != name:
        raise PolicyError(f"{where}: name: {raw['name']!r} does not match the file name {name!r}", key="name")
    raw["name"] = name
    try:
        policy = msgspec.convert(raw, Policy)
    except msgspec.ValidationError as exc:
        # msgspec names the key: "Object contains unknown field `x` - at `$.limits`".
        raise PolicyError(f"{where}: {exc}", key=_key_of(str(exc))) from exc
    except RecursionError:  # nested just short of tomllib's limit, then deeper than msgspec's
        raise PolicyError(f"{where}: nested too deeply for a policy") from None
    _check(policy, where)
    if "shell_exec" in policy.tools:
        missing = tuple(t for t in JOB_TOOLS if t not in policy.tools)
        policy = msgspec.structs.replace(policy, tools=policy.tools + missing)
    # The one mutable field, frozen too: a Policy is shared by all its sessions.
    env = msgspec.structs.replace(policy.env, set=types.MappingProxyType(dict(policy.env.set)))
    return msgspec.structs.replace(policy, env=env)


def _key_of(message: str) -> str:
    """The dotted key a msgspec validation message points at."""
    where = re.search(r"at `\$\.?([^`]*)`", message)
    key = where.group(1) if where else ""
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
    return key


def default_policy_dir() -> Path:
    return Path(__file__).resolve().parent / "policies"


def load_policy(directory: Path, name: str) -> Policy:
    if not _NAME.match(name):
        raise PolicyError(f"{name!r} is not a policy name (letters, digits, '.', '_', '-')", key="name")
    path = directory / f"{name}.toml"
    try:
        text = read_policy_file(path)
    except FileNotFoundError:
        known = ", ".join(sorted(list_policies(directory))) or "none"
        raise PolicyError(f"no policy named {name!r} in {directory} (known: {known})", key="name") from None
    except OSError as exc:
        raise PolicyError(f"cannot read {path}: {exc.strerror}") from exc
    # Read at every open (an edit applies to the next session), parsed only
    # when the text changed: the text itself is the key, not a timestamp.
    key = (str(path), text)
    with _PARSED_LOCK:
        cached = _PARSED.get(key)
    if cached is not None:
        return cached
    policy = parse_policy(name, text, str(path))
    with _PARSED_LOCK:
        if len(_PARSED) >= 64:
            _PARSED.clear()
        _PARSED[key] = policy
    return policy


def read_policy_file(path: Path) -> str:
    """The text of the policy file at ``path``: opened without blocking and
    without becoming a controlling terminal, a regular file only, at most
    ``MAX_POLICY_BYTES``, UTF-8. Raises ``PolicyError`` naming the file, or
    ``OSError`` from the open (``FileNotFoundError`` for an absent one)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PolicyError(f"{path}: not a regular file ({_kind(st.st_mode)}): a policy is a TOML file")
        if st.st_size > MAX_POLICY_BYTES:
            raise PolicyError(f"{path}: {st.st_size} bytes, over the {MAX_POLICY_BYTES}-byte limit for a policy file")
        chunks, size = [], 0
        while size <= MAX_POLICY_BYTES:  # the file may grow while it is read: one byte over is enough to say so
            chunk = os.read(fd, MAX_POLICY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_POLICY_BYTES:
            raise PolicyError(f"{path}: over the {MAX_POLICY_BYTES}-byte limit for a policy file")
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: not valid TOML: not UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start})") from None


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"mode {mode:o}"


# The last parse of each policy file's text (Policy is frozen: safe to share).
_PARSED: dict[tuple[str, str], Policy] = {}
_PARSED_LOCK = threading.Lock()


def list_policies(directory: Path) -> list[str]:
    try:
        return sorted(p.stem for p in directory.glob("*.toml"))
    except OSError:
        return []


def load_all(directory: Path) -> dict[str, Policy]:
    """Every policy in the directory, checked; the first broken one raises."""
    return {name: load_policy(directory, name) for name in list_policies(directory)}
