"""The words of ``dispatch``'s command line: its commands, options and their checks.

Guarantees:
- every command and option is defined here, in ``parser()``, and nowhere
  else (``dispatch.cli`` runs what it parses; tests/unit/test_reference.py
  holds docs/reference.md to it);
- a value refused while parsing (a variable name commands may not get, a
  port list that is not one) is argparse's usage error (exit 2), before
  anything reaches the daemon;
- building the parser never fails (the policies' names in ``--policy``'s
  help are best effort).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dispatchd import __version__, envnames
from dispatchd.netmodes import NETWORK_MODES

__all__ = ["parser"]


def parser() -> argparse.ArgumentParser:
    """The whole command line: every command and option (docs/reference.md lists them all)."""
    p = argparse.ArgumentParser(prog="dispatch", description="Client of dispatchd, the sandbox for AI coding agents.")
    p.add_argument("--version", action="version", version=f"dispatch {__version__}")
    p.add_argument("--socket", help="daemon socket (default: $DISPATCH_SOCKET, $XDG_RUNTIME_DIR/dispatchd/dispatchd.sock, "
                   "$XDG_STATE_HOME/dispatchd/run/dispatchd.sock)")
    p.add_argument("--no-autostart", action="store_true",
                   help="do not start a daemon in the background when none answers (default: start one)")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the daemon's answer to each request (default 30); a tool call "
                        "waits its own time limit plus this")
    p.add_argument("--host", default=os.environ.get("DISPATCH_HOST") or None, metavar="ssh://[USER@]HOST[:PORT]",
                   help="the daemon of that user on that host, through `ssh HOST dispatch bridge`; --socket then "
                        "names the socket there (default: $DISPATCH_HOST; docs/remote.md)")
    p.add_argument("--host-command", metavar="CMD",
                   help="run CMD, whose stdin and stdout carry `dispatch bridge` "
                        "(e.g. \"kubectl exec -i POD -- dispatch bridge\")")
    sub = p.add_subparsers(dest="command", required=True)

    session = sub.add_parser("session", help="open, close and list sessions").add_subparsers(dest="action", required=True)
    op = session.add_parser("open", help="open a session; prints its id")
    _session_target(op, worktree_required=True)
    _env_options(op)
    cl = session.add_parser("close", help="close a session, ending every process it started")
    cl.add_argument("id")
    ls = session.add_parser("list", help="list sessions (\"writes\": holds its worktree's write lock; "
                                          "\"asleep\": no process, its next call wakes it)")
    ls.add_argument("--json", action="store_true", help="as JSON")
    rl = session.add_parser("release", help="give back a session's worktree write lock without closing it")
    rl.add_argument("id")
    _checkpoint_parsers(session)  # checkpoint, checkpoints, restore

    net = sub.add_parser("network", help="switch a session's network: in place between off, on and ports in full "
                         "mode (its processes kept); to or from domains, or without user namespaces, the sandbox "
                         "is replaced and its processes are ended (the reply says which)")
    net.add_argument("id")
    net.add_argument("state", choices=NETWORK_MODES)
    _ports_options(net)

    ex = sub.add_parser("exec", help="run a shell command in the sandbox")
    _session_target(ex)
    _env_options(ex)
    ex.add_argument("--timeout", type=float,
                    help="seconds before the command is killed (default: the policy's command_timeout_s, 120 s "
                         "in the shipped policies)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")

    call = sub.add_parser("call", help="run any tool; prints the Result as JSON")
    _session_target(call)
    call.add_argument("tool")
    call.add_argument("params", nargs="?", default="{}",
                      help="the tool's arguments as a JSON object; '-' reads them from stdin, '@FILE' from FILE "
                           "(default: {})")
    call.add_argument("--text", action="store_true",
                      help="print the output (or the error) as a model reads it, instead of the Result as JSON")

    _jobs_parser(sub)

    tools = sub.add_parser("tools", help="print the tool schemas")
    tools.add_argument("--format", default="json",
                       choices=["json", "plain", "openai", "openai-responses", "anthropic", "mcp", "gemini"],
                       help="json: the schemas as JSON; plain: a listing for people; the others: that provider's "
                            "shape (default: json)")
    tools.add_argument("--strict", action="store_true", help="with openai or openai-responses: strict-mode schemas")
    tools.add_argument("--policy", default="default", help=_policy_help())

    mc = sub.add_parser("mcp", help="serve a session's tools over MCP on stdio (the session closes when the client goes)")
    _session_target(mc)
    mc.add_argument("--print-config", action="store_true",
                    help="print the JSON an MCP host's configuration needs to start this server (absolute paths), "
                         "and exit")

    st = sub.add_parser("status", help="daemon, kernel features and the protections of each session")
    st.add_argument("--json", action="store_true", help="as JSON")

    br = sub.add_parser("bridge", help="carry this user's daemon over stdin and stdout (what --host runs on the "
                        "far host; docs/remote.md)")
    br.add_argument("--socket", dest="bridge_socket", help="the daemon's socket (default: as --socket)")
    br.add_argument("--no-autostart", dest="bridge_no_autostart", action="store_true",
                    help="do not start a daemon when none answers")

    dm = sub.add_parser("daemon", help="the background daemon").add_subparsers(dest="action", required=True)
    dm.add_parser("stop", help="stop the daemon on the socket (ending every session), and wait for it to exit")
    return p


def _policy_help() -> str:
    try:
        from dispatchd.policy import default_policy_dir

        names = sorted(p.stem for p in default_policy_dir().glob("*.toml"))
    except Exception:  # a help text must never fail
        names = []
    shipped = f"; shipped: {', '.join(names)}" if names else ""
    return f"policy name, policies/NAME.toml of the daemon (default: default{shipped})"


def _session_target(p: argparse.ArgumentParser, *, worktree_required: bool = False) -> None:
    if not worktree_required:
        p.add_argument("--session", help="an open session's id")
    p.add_argument("--worktree", required=worktree_required, help="open a session on this directory")
    p.add_argument("--policy", default="default", help=_policy_help())
    p.add_argument("--network", choices=NETWORK_MODES,
                   help="off: no network; on: the host's, through pasta; ports: TCP only to --ports; domains: "
                        "only the hosts in --domains (default: the policy's, off in the shipped policies)")
    p.add_argument("--read-only", action="append", default=[], metavar="PATH", dest="read_only",
                   help="an extra path the session may read (a toolchain: ~/.cargo, ~/.rustup); repeatable")
    _ports_options(p)


def _env_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", type=_env_pair,
                   help="a variable for the commands (with --session: for this command only); repeatable")
    p.add_argument("--secret", action="append", default=[], metavar="NAME", dest="secrets",
                   help="a variable whose value is read from our own environment and never shown: each "
                        "occurrence in output reads [secret NAME]; repeatable (not with --session)")


def _env_pair(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    why = envnames.refused_name(name)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return name, value


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


def _jobs_parser(sub: Any) -> None:
    jobs = sub.add_parser("jobs", help="a session's background jobs: list, output, stop")
    jobs.add_argument("--session", required=True, help="an open session's id")
    actions = jobs.add_subparsers(dest="action")
    actions.add_parser("list", help="one job a line: id, state, command (the default)")
    out = actions.add_parser("output", help="print a job's output")
    out.add_argument("job")
    out.add_argument("--offset", type=int, default=0, help="byte offset to start from")
    out.add_argument("--wait", type=float, default=0, help="seconds to wait for new output")
    out.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    stop = actions.add_parser("stop", help="stop a job and every process it started")
    stop.add_argument("job")

def _checkpoint_parsers(session: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    ck = session.add_parser("checkpoint", help="keep a session's worktree (files and git metadata) as it is now; "
                                               "prints the checkpoint's id")
    ck.add_argument("id")
    ck.add_argument("--label", default="", help="a few words to know it by")
    cks = session.add_parser("checkpoints", help="list a session's checkpoints, oldest first")
    cks.add_argument("id")
    cks.add_argument("--json", action="store_true", help="as JSON")
    rs = session.add_parser("restore", help="put a session's worktree back as it was at a checkpoint")
    rs.add_argument("id")
    rs.add_argument("checkpoint")
    rs.add_argument("--force", action="store_true",
                    help="restore even when the worktree as it is cannot be kept first (it is then lost)")


# What the command line sends dispatchd, by ``args``' name, as said in a
# refusal; what it only uses here (--socket, --host, an @FILE's name) is not
# sent, and may be any bytes.
_SENT = {"worktree": ("--worktree", "the path"), "read_only": ("--read-only", "the path"),
         "policy": ("--policy", "the name"), "env": ("--env", "the variable"), "secrets": ("--secret", "the name"),
         "domains": ("--domains", "the host"), "cmd": ("the command", "an argument"),
         "tool": ("the tool", "its name"), "params": ("the tool's arguments", "the text"),
         "session": ("--session", "the id"), "id": ("the session id", "it"), "job": ("the job id", "it"),
         "checkpoint": ("the checkpoint", "its id"), "label": ("--label", "the text")}


def not_utf8(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot be sent: the first argument dispatchd would be
    given that is not UTF-8 (the protocol is JSON, in UTF-8; Python holds an
    argument's bytes that are not as lone surrogates). None when all are."""
    for name, (option, what) in _SENT.items():
        value = getattr(args, name, None)
        if name == "params" and isinstance(value, str) and value.startswith("@"):
            continue  # a file's name, opened here; its content is checked when read
        for text in _strings(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                # As it is: the line is printed through display.shown, which shows a bad byte as \xNN.
                return f"{option}: {what} is not UTF-8 ({text}), which dispatchd cannot carry"
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in _strings(item)]
    return []
