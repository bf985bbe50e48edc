"""``dispatch``: the command line of the client.

Every failure to do what was asked (no daemon, a refused worktree or policy,
an unknown session) prints one line on stderr and exits 2. ``exec`` exits
with the command's own status (124 when it timed out); ``call`` exits 0 on a
successful Result and 1 on a failed one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from dispatch.client import Client, Session, connect
from dispatch.errors import DispatchError
from dispatch.tools import Error as ToolsError
from dispatch.tools import Registry

EXIT_ERROR = 2
EXIT_TIMEOUT = 124


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dispatch", description="Client of dispatchd, the sandbox for AI coding agents.")
    p.add_argument("--socket", help="daemon socket (default: $DISPATCH_SOCKET, $XDG_RUNTIME_DIR/dispatchd/dispatchd.sock, "
                   "$XDG_STATE_HOME/dispatchd/run/dispatchd.sock)")
    p.add_argument("--no-autostart", action="store_true", help="do not start a daemon when none answers")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the daemon's answer to each request (default 30); a tool call "
                        "waits its own time limit plus this")
    sub = p.add_subparsers(dest="command", required=True)

    session = sub.add_parser("session", help="open, close and list sessions").add_subparsers(dest="action", required=True)
    op = session.add_parser("open", help="open a session; prints its id")
    _session_target(op, worktree_required=True)
    cl = session.add_parser("close", help="close a session, ending every process it started")
    cl.add_argument("id")
    ls = session.add_parser("list", help="list sessions")
    ls.add_argument("--json", action="store_true")

    net = sub.add_parser("network", help="switch a session's network (its processes are ended)")
    net.add_argument("id")
    net.add_argument("state", choices=["on", "off", "ports", "domains"])
    _ports_options(net)

    ex = sub.add_parser("exec", help="run a shell command in the sandbox")
    _session_target(ex)
    ex.add_argument("--timeout", type=float, help="seconds before the command is killed")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")

    call = sub.add_parser("call", help="run any tool; prints the Result as JSON")
    _session_target(call)
    call.add_argument("tool")
    call.add_argument("params", nargs="?", default="{}", help="the tool's arguments as a JSON object")

    tools = sub.add_parser("tools", help="print the tool schemas")
    tools.add_argument("--format", default="json", choices=["json", "plain", "openai", "openai-responses", "anthropic", "mcp"])
    tools.add_argument("--policy", default="default")

    mc = sub.add_parser("mcp", help="serve a session's tools over MCP on stdio (the session closes when the client goes)")
    _session_target(mc)

    st = sub.add_parser("status", help="daemon, kernel features and the protections of each session")
    st.add_argument("--json", action="store_true")
    return p


def _session_target(p: argparse.ArgumentParser, *, worktree_required: bool = False) -> None:
    if not worktree_required:
        p.add_argument("--session", help="an open session's id")
    p.add_argument("--worktree", required=worktree_required, help="open a session on this directory")
    p.add_argument("--policy", default="default")
    p.add_argument("--network", choices=["on", "off", "ports", "domains"])
    _ports_options(p)


def _port_list(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ports: {text!r}") from None


def _ports_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ports", type=_port_list, help="with --network ports: TCP ports to connect to, e.g. 80,443")
    p.add_argument("--bind-ports", type=_port_list, help="with --network ports: TCP ports the session may bind")
    p.add_argument("--domains", type=_domain_list, help="with --network domains: the hosts it may reach through "
                   "the daemon's proxy, e.g. pypi.org,*.pythonhosted.org ('*.' for subdomains, ':PORT' for a port "
                   "other than 80 and 443)")


def _domain_list(text: str) -> list[str]:
    return [d.strip() for d in text.split(",") if d.strip()]


@contextlib.contextmanager
def _session_for(client: Client, args: argparse.Namespace) -> Iterator[Session]:
    if bool(args.session) == bool(args.worktree):
        raise UsageError("give exactly one of --session ID or --worktree DIR")
    if args.session:
        with client.session(args.session) as session:
            yield session
    else:
        # A one-off session: it ends with this command, even killed (a grace of
        # 0 once our connection is gone, and SIGTERM/SIGHUP close it at once).
        with _closed_on_signals(), client.open_session(
                args.worktree, policy=args.policy, network=args.network, ports=args.ports,
                bind_ports=args.bind_ports, domains=args.domains, orphan_grace_s=0) as session:
            yield session


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwind, closing the one-off session on the way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _closed_on_signals() -> Iterator[None]:
    def raise_terminated(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _print_sessions(sessions: list[dict[str, Any]]) -> None:
    if not sessions:
        print("no sessions")
    for s in sessions:
        prot = s.get("protections", {})
        print(f"{s['id']}  network={s['network']} ({prot.get('network', {}).get('mechanism', '?')})  "
              f"policy={s['policy']}  mode={prot.get('mode', '?')}  {s['worktree']}")


def _missing(why: str) -> str:
    """A kernel probe's "" (available) or its reason, for ``dispatch status``."""
    return "yes" if not why else f"no, on/ports use the host's network ({why})"


def _print_status(st: dict[str, Any]) -> None:
    k = st["kernel"]
    print(f"dispatchd {st['daemon_version']} (pid {st['pid']}) on {st['socket']}")
    print(f"kernel {k['release']}: Landlock ABI {k['landlock_abi'] or 'absent'}; "
          f"user namespaces: {'yes' if k['user_namespaces'] else 'no'} ({k['user_namespaces_note']}); "
          f"seccomp: {'yes' if k['seccomp'] else 'no'}; cgroup v2: {k['cgroup2'] or 'not mounted'} "
          f"(per-session cgroups: {k.get('cgroup_delegation', '?')}); "
          f"network stack (pasta): {_missing(k.get('network_stack_missing', '?'))}; "
          f"nftables for ports: {_missing(k.get('nftables_missing', '?'))}")
    d = st.get("daemon") or {}
    if d:
        print(f"daemon: {d.get('open_files_note', '?')}; connections {d.get('connections')} "
              f"of at most {d.get('max_connections')}")
    print(f"{len(st['sessions'])} session(s)")
    for s in st["sessions"]:
        p = s["protections"]
        ns = ", ".join(n for n, on in p.get("namespaces", {}).items() if on) or "none"
        ll = p.get("landlock", {})
        print(f"  {s['id']}  {s['worktree']}  policy={s['policy']}  mode={p.get('mode')}")
        print(f"    landlock ABI {ll.get('abi')}: filesystem {ll.get('filesystem')}, scopes: "
              f"{', '.join(ll.get('scopes', [])) or 'none'}, tcp: {ll.get('tcp')}")
        print(f"    seccomp: {p.get('seccomp')}; namespaces: {ns}")
        print(f"    network {p.get('network', {}).get('mode')}: {p.get('network', {}).get('mechanism')}")
        if s.get("network") == "domains":
            print(f"    domains: {', '.join(s.get('domains', [])) or 'none'}")
        if s.get("denied"):
            print("    denied: " + ", ".join(f"{d['host']}:{d['port']} ({d['count']})" for d in s["denied"]))
        lim = p.get("limits", {})
        if lim:
            where = f" in {lim['cgroup']}" if lim.get("cgroup") else ""
            print(f"    limits ({lim.get('mechanism')}{where}): processes {lim.get('max_processes')}; "
                  f"memory {lim.get('memory')}; cpu weight {lim.get('cpu_weight')}; "
                  f"file size {lim.get('max_file_bytes')} B")
        life = p.get("lifetime", {})
        if life:
            held = ("detached: lives until closed or idle" if life.get("detached")
                    else f"ends {life.get('orphan_grace_s')} s after its last client connection goes")
            mem = life.get("memory", {})
            print(f"    lifetime: {held}; memory {mem.get('limit_bytes')} B held by {mem.get('mechanism')} "
                  f"({mem.get('detail')})")
        for gap in lim.get("leaves_open", []):
            print(f"    budget left open: {gap}")
        for gap in p.get("leaves_open", []):
            print(f"    leaves open: {gap}")


def _exec(client: Client, args: argparse.Namespace) -> int:
    words = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not words:
        raise UsageError("exec needs a command after --")
    params: dict[str, Any] = {"command": shlex.join(words)}
    if args.timeout is not None:
        params["timeout"] = args.timeout
    with _session_for(client, args) as session:
        if not session.registry.has("shell_exec"):
            raise UsageError(f"policy {args.policy!r} has no shell_exec: this session cannot run commands")
        result = session.registry.get("shell_exec").call(params)
    meta = result.metadata
    if "exit_code" not in meta:  # the command never ran
        raise DispatchError(result.error or "shell_exec failed")
    sys.stdout.write(meta.get("stdout", ""))
    sys.stdout.flush()
    sys.stderr.write(meta.get("stderr", ""))
    if meta.get("truncated"):
        sys.stderr.write("dispatch: output truncated at the policy's cap\n")
    if meta.get("timed_out"):
        sys.stderr.write(f"dispatch: command timed out after {params.get('timeout', 'the policy timeout')} s\n")
        return EXIT_TIMEOUT
    code = int(meta["exit_code"])
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def _mcp(client: Client, args: argparse.Namespace) -> int:
    try:
        from dispatch import mcp
    except ImportError as exc:  # the SDK is a dependency, but a partial install may lack it
        raise UsageError(f"dispatch mcp needs the mcp package (pip install mcp): {exc}") from exc
    # Held back until serve() listens for them, so that a stop at any moment
    # still closes the session (a session is not tied to our connection).
    signal.pthread_sigmask(signal.SIG_BLOCK, mcp.STOP_SIGNALS)
    with _session_for(client, args) as session:
        mcp.serve(session.registry)
    return 0


def _run(args: argparse.Namespace) -> int:
    client = connect(args.socket, autostart=not args.no_autostart, timeout=args.request_timeout,
                     call_margin=args.request_timeout)
    with client:
        if args.command == "session":
            if args.action == "open":
                # Detached: it outlives this command and needs no client holding it.
                session = client.open_session(args.worktree, policy=args.policy, network=args.network,
                                              ports=args.ports, bind_ports=args.bind_ports, domains=args.domains,
                                              detached=True)
                session.detach()
                print(session.id)
            elif args.action == "close":
                client.close_session(args.id)
            else:
                sessions = client.list_sessions()
                print(json.dumps(sessions, indent=2)) if args.json else _print_sessions(sessions)
            return 0
        if args.command == "network":
            info = client.set_network(args.id, args.state, ports=args.ports, bind_ports=args.bind_ports,
                                      domains=args.domains)
            print(info["network"])
            if info.get("note"):
                print(f"dispatch: {info['note']}", file=sys.stderr)
            return 0
        if args.command == "exec":
            return _exec(client, args)
        if args.command == "call":
            try:
                params = json.loads(args.params)
            except json.JSONDecodeError as exc:
                raise UsageError(f"the tool's arguments are not valid JSON: {exc}") from exc
            with _session_for(client, args) as session:
                if not session.registry.has(args.tool):
                    raise UsageError(f"unknown tool {args.tool!r} (this session has: {', '.join(session.registry.tool_names)})")
                result = session.registry.get(args.tool).call(params)
            print(json.dumps(result.to_dict(), indent=2))
            return 0 if result.is_success else 1
        if args.command == "tools":
            registry = Registry()
            from dispatch.tools import Definition, Result

            for t in client.tools(args.policy):
                registry.register(Definition(t["name"], t["description"], t["parameters"], lambda p, c: Result.success("")))
            print(json.dumps(registry.schemas("plain" if args.format == "json" else args.format), indent=2))
            return 0
        if args.command == "mcp":
            return _mcp(client, args)
        if args.command == "status":
            st = client.status()
            print(json.dumps(st, indent=2)) if args.json else _print_status(st)
            return 0
    raise UsageError(f"unknown command {args.command}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (DispatchError, UsageError, OSError, ToolsError) as exc:
        print(f"dispatch: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        return 128 + exc.signum


if __name__ == "__main__":
    raise SystemExit(main())
