"""What ``dispatch`` prints for people, and the small helpers of its commands.

Kept apart from ``cli.py`` (argument parsing and dispatch to the client) so
that each is short: status in words and sizes, the tools as a listing, a
call's arguments from argv, stdin or a file, the MCP host snippet, stopping
the daemon.

Every line of ``dispatch status`` and of a close's report goes through
``dispatchd.display.shown``: they carry names a session chose (files moved
aside, refs, hosts refused), and a terminal must act on none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

import msgspec

from dispatchd import paths, protocol
from dispatchd.display import shown
from dispatchd.netmodes import NETWORK_MODES


def size(n: Any) -> str:
    """``1048576`` → ``1 MiB``; ``1536`` → ``1.5 KiB``; not a number: as it is."""
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return str(n)
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".") if unit != "B" else str(int(value))
            return f"{text} {unit}"
        value /= 1024
    return str(n)  # unreachable


def truncation_note(limits: Mapping[str, Any]) -> str:
    cap = limits.get("output_cap_bytes")
    at = f"at {size(cap)} per stream" if cap else "at the policy's cap"
    return (f"dispatch: output truncated {at} (the policy's limits.output_cap_bytes; "
            "a policy of your own with a larger value raises it)")


def call_arguments(text: str, stdin: IO[str]) -> Any:
    """``dispatch call``'s arguments: JSON on the command line, ``-`` for stdin,
    ``@FILE`` for a file. ValueError, saying which, when they are not JSON."""
    where = "the tool's arguments"
    if text == "-":
        where = "the tool's arguments (stdin)"
        try:
            text = stdin.read()
            text.encode("utf-8")  # a stdin read with surrogateescape (the C locale) holds them as surrogates
        except UnicodeError as exc:
            raise ValueError(f"{where} are not UTF-8, which dispatchd cannot carry") from exc
    elif text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the tool's arguments from {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"the tool's arguments ({path}) are not UTF-8 (byte {exc.start}), "
                             "which dispatchd cannot carry") from exc
        where = f"the tool's arguments ({path})"
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} are not valid JSON: {exc}") from exc


def tools_listing(tools: list[dict[str, Any]]) -> str:
    """One block a tool: its name and description, then its parameters."""
    out = []
    for tool in tools:
        out.append(f"{tool['name']}: {tool['description']}\n")
        schema = tool.get("parameters") or {}
        required = set(schema.get("required") or ())
        for name, prop in (schema.get("properties") or {}).items():
            kind = prop.get("type", "any")
            kind = " or ".join(kind) if isinstance(kind, list) else kind
            if kind == "array" and isinstance(prop.get("items"), Mapping) and prop["items"].get("type"):
                kind = f"array of {prop['items']['type']}"
            extra = " (required)" if name in required else (
                f" (default {json.dumps(prop['default'])})" if "default" in prop else "")
            desc = f": {prop['description']}" if prop.get("description") else ""
            out.append(f"    {name} ({kind}){extra}{desc}\n")
        out.append("\n")
    return "".join(out)


_TCP = {
    "denied": "TCP bind and connect denied by Landlock",
    "not handled": "TCP not restricted by Landlock (the network setting below holds it)",
}


def _words(value: Any) -> str:
    """Text from the daemon with its byte counts as sizes (``8589934592 bytes`` → ``8 GiB``)."""
    import re

    return re.sub(r"\b(\d{4,}) (?:bytes|B)\b", lambda m: size(int(m.group(1))), str(value))


def _missing(why: str) -> str:
    """A kernel probe's "" (available) or its reason, for ``dispatch status``."""
    return "yes" if not why else f"no ({why})"


def network_modes_line(k: protocol.KernelFeatures) -> str:
    """Which network modes sessions can have here, and why not the others."""
    unavailable = k.network_unavailable
    available = [m for m in NETWORK_MODES if m not in unavailable]
    line = f"network modes: {', '.join(available) or 'none'}"
    if unavailable:
        line += "; unavailable: " + "; ".join(f"{m} ({why})" for m, why in unavailable.items())
    return line


def before_restore_words(kept: Mapping[str, Any]) -> str:
    """What restores replaced, kept past their sessions (a status report's
    ``before_restore``, a restore's ``kept_total``), and its budget."""
    if not kept["budget"]:
        return f"{kept['budget_why']}"
    over = kept["bytes"] > kept["budget"]
    return (f"{kept['count']} kept there, {size(kept['bytes'])} of at most {size(kept['budget'])} "
            f"({_words(kept['budget_why'])})" + (": over it, a restore keeps nothing more and is refused unless "
                                                 "forced" if over else ""))


def print_status(st: protocol.StatusReply, file: IO[str] | None = None) -> None:
    out = file or sys.stdout
    k = st.kernel

    def say(line: str) -> None:
        print(shown(line), file=out)  # a line at a time: names of a session's choosing in any of them

    say(f"dispatchd {st.daemon_version} (pid {st.pid}) on {st.socket}")
    say(f"kernel {k.release}: Landlock ABI {k.landlock_abi or 'absent'}; "
        f"user namespaces: {'yes' if k.user_namespaces else 'no'} ({k.user_namespaces_note}); "
        f"seccomp: {'yes' if k.seccomp else 'no'}; cgroup v2: {k.cgroup2 or 'not mounted'} "
        f"(per-session cgroups: {k.cgroup_delegation}); "
        f"network stack{f' ({k.network_stack})' if k.network_stack else ''}: {_missing(k.network_stack_missing)}; "
        f"nftables for ports: {_missing(k.nftables_missing)}; "
        f"root held as a detached mount: {_missing(k.host_tree_missing)}"
        + (f"; container hint: {k.container}" if k.container else ""))
    say(network_modes_line(k))
    say(f"kernel budgets: {k.shared_budgets or 'all sessions together not bounded: ' + k.shared_budgets_missing}")
    if k.forced_for_testing:
        say(f"kernel features forced for testing (--force-kernel-for-testing {k.forced_for_testing}): sessions are "
            "planned and confined as on a kernel without them")
    if st.daemon is not None:
        d = st.daemon
        idle = f" ({d.parked} idle, waiting without a thread)" if d.parked else ""
        say(f"daemon: {d.open_files_note}; connections {d.connections} of at most {d.max_connections}{idle}")
        if d.pool:
            say(f"sandboxes made ahead: {d.pool}")
        if d.line_loops:
            say(f"line loops: {d.line_loops}")
        if d.helpers:
            say(f"helpers: {d.helpers}")
        if d.in_use:
            say(("" if d.in_use_shared else "warning: ") + f"worktrees in use recorded in {d.in_use}")
        if d.before_restore is not None:
            b = d.before_restore
            say(("warning: " if b.bytes > b.budget else "") + f"what restores replaced: in {b.path}, "
                f"{before_restore_words(msgspec.structs.asdict(b))}; each kept 7 days, remove old ones by hand "
                "to make room")
    asleep = sum(1 for s in st.sessions if s.asleep)
    say(f"{len(st.sessions)} session(s)" + (f", {asleep} asleep (no process; the next call wakes each)" if asleep else ""))
    if not st.sessions:
        say("  a new session (policy default) would get: " + _would_get(k))
    for s in st.sessions:
        _print_session(s, say)
    for item in st.protected:
        # What this daemon's start did where a daemon that died had sessions:
        # the baselines' checks (moved aside, put back) and cut restores; and
        # the worktrees whose check could not finish (refused until a later check passes).
        if item.why.startswith("NOT checked whole"):
            say(f"refused worktree: {item.path}: {item.why}")
        else:
            # A record is left by a daemon that stopped, or by a check that could not finish.
            say(f"at start, after a daemon that stopped or a check that failed: {item.path}: {item.why}")


def _print_session(s: protocol.SessionInfo, say: Callable[[str], None]) -> None:
    p = s.protections
    ll = p.landlock
    writes = "; holds the worktree's write lock" if s.writes else ""
    ahead = "; sandbox made ahead" if p.made_ahead else ""
    asleep = "; asleep (no process: its next call wakes it)" if s.asleep else ""
    say(f"  {s.id}  {s.worktree}  policy={s.policy}  mode={p.mode}{ahead}{writes}{asleep}")
    say(f"    landlock ABI {ll.abi}: filesystem {ll.filesystem}; scopes: "
        f"{', '.join(ll.scopes) or 'none'}; {_TCP.get(ll.tcp, ll.tcp)}")
    say(f"    seccomp: {p.seccomp}; namespaces: {', '.join(p.namespaces.held()) or 'none'}")
    say(f"    network {p.network.mode}: {p.network.mechanism}")
    if s.network == "domains":
        say(f"    domains: {', '.join(s.domains) or 'none'}")
    if s.denied:
        say("    denied: " + ", ".join(f"{d.host}:{d.port} ({d.count})" for d in s.denied))
    for warning in s.warnings:
        say(f"    warning: {warning}")
    if s.usage.calls:
        say(f"    usage: {s.usage.calls} calls, {s.usage.cpu_s:g} s CPU, largest peak {s.usage.peak_mib:g} MiB")
    lim = p.limits
    where = f" in {lim.cgroup}" if lim.cgroup else ""
    say(f"    limits ({lim.mechanism}{where}): processes {lim.max_processes}; "
        f"memory {_words(lim.memory)}; cpu weight {lim.cpu_weight}; "
        f"file size {size(lim.max_file_bytes)}")
    life = p.lifetime
    if life is not None:
        held = ("detached: lives until closed or idle" if life.detached
                else f"ends {life.orphan_grace_s} s after its last client connection goes")
        mem = life.memory
        say(f"    lifetime: {held}; memory {size(mem.limit_bytes)} held by {mem.mechanism} "
            f"({_words(mem.detail)})")
    if p.unix_sockets:
        say(f"    unix sockets: {p.unix_sockets}")
    for entry in p.root:
        say(f"    visible: {entry.path}: {entry.how}")
    for gap in lim.leaves_open:
        say(f"    budget left open: {gap}")
    for gap in p.leaves_open:
        say(f"    leaves open: {gap}")
    for item in s.protected:
        say(f"    moved aside or put back: {item.path}: {item.why}")


def print_protected(items: list[dict[str, Any]], file: IO[str] | None = None) -> None:
    """What a session's close moved aside or put back, one a line."""
    for item in items:
        print(f"moved aside or put back: {shown(item['path'])}: {shown(item['why'])}", file=file or sys.stdout)


def _would_get(k: protocol.KernelFeatures) -> str:
    parts = [f"filesystem confined by Landlock (ABI {k.landlock_abi})" if k.landlock_abi
             else "nothing: this kernel has no Landlock, sessions are refused"]
    if k.landlock_abi:
        parts.append("a seccomp filter" if k.seccomp else "no seccomp (refused)")
        parts.append("user, mount, pid and network namespaces" if k.user_namespaces
                     else "no namespaces (Landlock and seccomp alone; see leaves open once opened)")
        parts.append("network off unless asked")
    return "; ".join(parts)


def stop_daemon(client: Any, timeout: float = 30.0) -> int:
    """SIGTERM to the daemon on the client's socket (it ends every session),
    then wait until it has exited and its socket is gone."""
    st = client.status()
    pid = int(st["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if _zombie(pid):
            break
        time.sleep(0.05)
    else:
        raise OSError(f"dispatchd (pid {pid}) did not exit within {timeout:.0f} s of SIGTERM")
    print(f"stopped dispatchd (pid {pid}) on {st['socket']}")
    return 0


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def mcp_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``mcpServers`` entry that starts this very ``dispatch mcp`` from a
    host whose PATH knows nothing of our venv: absolute paths throughout."""
    if bool(args.session) == bool(args.worktree):
        raise ValueError("give exactly one of --session ID or --worktree DIR")
    # -P: a host may start us in the project's directory, whose `dispatch`
    # package (one an agent wrote) a plain -m would import, unconfined.
    cmd = ["-P", "-m", "dispatch.cli"]
    cmd += ["--socket", paths.resolve_socket_path(args.socket)]
    cmd += ["mcp"]
    if args.session:
        cmd += ["--session", args.session]
    else:
        cmd += ["--worktree", os.path.abspath(args.worktree)]
        if args.policy != "default":
            cmd += ["--policy", args.policy]
        if args.network:
            cmd += ["--network", args.network]
        if args.ports:
            cmd += ["--ports", ",".join(map(str, args.ports))]
        if args.bind_ports:
            cmd += ["--bind-ports", ",".join(map(str, args.bind_ports))]
        if getattr(args, "domains", None):
            cmd += ["--domains", ",".join(args.domains)]
    return {"mcpServers": {"dispatchd": {"command": os.path.abspath(sys.executable), "args": cmd}}}
