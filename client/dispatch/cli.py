"""``dispatch``: the command line of the client.

Every failure to do what was asked (no daemon, a refused worktree or policy,
an unknown session) prints one line on stderr and exits 2. ``exec`` exits
with the command's own status (124 when it timed out); ``call`` exits 0 on a
successful Result and 1 on a failed one.

``exec``, ``call`` and ``mcp`` on a one-off session (``--worktree``) say
on stderr what the checks at its end moved aside or put back, and exit 3
when they could not finish (``NOT checked whole``: something the session
left may still be live), whatever the command's own status; so does
``session close``.

``exec`` prints the command's output as it comes. SIGINT, SIGTERM or SIGHUP
cancel the command in the sandbox (it and every process it started end),
close a one-off session, and exit 128 + the signal's number; a second one
stops waiting for the cancel.

What dispatchd says in its own words (status, reports, refs, labels,
warnings, errors) is printed through ``dispatchd.display.shown``: a name a
session chose cannot act on the terminal. A command's own output (``exec``,
``jobs output``, ``call --text``) is passed through as it is, as ssh does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from dispatch import _cli_args, _cli_text
from dispatch._cli_args import parser as _parser
from dispatch._endreport import not_whole
from dispatch.client import Cancellation, Client, Session, connect
from dispatch.errors import DispatchError
from dispatch.tools import Registry
from dispatchd import protocol
from dispatchd.display import shown

EXIT_ERROR = 2
EXIT_UNCHECKED = 3  # the end's check could not finish: look before running git or your tools there
EXIT_SESSION_ENDED = 4  # dispatch mcp: the session ended under it (closed from outside, the daemon gone)
EXIT_TIMEOUT = 124


class UsageError(Exception):
    pass


def _env_of(args: argparse.Namespace) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """``--env`` and ``--secret`` as ``open_session``'s ``env`` and ``secrets``."""
    env = dict(getattr(args, "env", None) or []) or None
    secrets: dict[str, str] = {}
    for name in getattr(args, "secrets", None) or []:
        if name not in os.environ:
            raise UsageError(f"--secret {name}: no {name} in our environment to read its value from")
        secrets[name] = os.environ[name]
    return env, secrets or None


def _warn_about_ports(args: argparse.Namespace) -> None:
    if getattr(args, "network", None) == "ports" and not getattr(args, "ports", None) \
            and not getattr(args, "bind_ports", None):
        print("dispatch: warning: --network ports without --ports: the session may connect only to the ports its "
              "policy lists (network.ports; none in the shipped policies); give them, e.g. --ports 443",
              file=sys.stderr)


@contextlib.contextmanager
def _session_for(client: Client, args: argparse.Namespace) -> Iterator[Session]:
    if bool(args.session) == bool(args.worktree):
        raise UsageError("give exactly one of --session ID or --worktree DIR")
    _warn_about_ports(args)
    env, secrets = _env_of(args)
    if args.session:
        if secrets:
            raise UsageError("--secret is given when a session opens: not with --session")
        with client.session(args.session) as session:
            yield session
    else:
        # A one-off session: it ends with this command, even killed (a grace of
        # 0 once our connection is gone, and SIGTERM/SIGHUP close it at once).
        opened: list[Session] = []
        try:
            with _closed_on_signals(), client.open_session(
                    args.worktree, policy=args.policy, network=args.network, ports=args.ports,
                    bind_ports=args.bind_ports, domains=args.domains, orphan_grace_s=0,
                    read_only=args.read_only, env=env, secrets=secrets) as session:
                opened.append(session)
                _print_warnings(session.info)
                yield session
        finally:
            # Closed now: what its end found is the user's to know, the command's status aside.
            if opened:
                args.closed = opened[0].protected
                _print_end(opened[0].protected)


def _print_end(items: list[dict[str, Any]]) -> None:
    """What a one-off session's end moved aside, put back or could not
    check, on stderr, one a line, escaped (names a session chose: ``shown``)."""
    for item in items:
        print(f"dispatch: at the session's end: {shown(str(item['path']))}: {shown(str(item['why']))}",
              file=sys.stderr)


def _after_close(args: argparse.Namespace, code: int) -> int:
    """``code``, or ``EXIT_UNCHECKED`` when the one-off session's end could not check it whole."""
    return EXIT_UNCHECKED if not_whole(getattr(args, "closed", [])) else code


def _print_warnings(info: dict[str, Any]) -> None:
    """What does not work as the session's mode promises (e.g. DNS), on stderr."""
    for warning in info.get("warnings", []):
        print(f"dispatch: warning: {shown(warning)}", file=sys.stderr)


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




def _run_checkpoint(client: Client, args: argparse.Namespace) -> None:
    if args.action == "checkpoint":
        print(client.checkpoint(args.id, args.label))
    elif args.action == "restore":
        done = client.restore(args.id, args.checkpoint, force=args.force)
        kept = f"checkpoint {done['before']} (restore it to undo)" if done["before"] else "not kept (--force)"
        if done.get("kept"):
            kept += f", its files kept in {done['kept']}"
            total = done.get("kept_total")
            if total:
                kept += f" ({_cli_text.before_restore_words(total)})"
        print(shown(f"restored {done['checkpoint']}: {done['removed']} removed, {done['written']} written, "
                    f"{done['made']} directories made, {done['objects']} git object files put back; "
                    f"what was there before: {kept}"))
        for ref in done.get("displaced", []):  # a ref's name, of the session's choosing
            print(f"a value it moved is kept as {shown(ref)}")
        for why in done.get("not_restored", []):  # a ref it left as it is, and why
            print(f"not restored: {shown(why)}")
    elif args.json:
        print(json.dumps(client.checkpoints(args.id), indent=2))
    else:
        found = client.checkpoints(args.id)
        if not found:
            print("no checkpoints")
        for c in found:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["created"]))
            print(f"{c['id']}  {when}  {c['entries']} entries  {c['copied_bytes']} bytes copied  {shown(c['label'])}")


def _print_sessions(sessions: list[protocol.SessionInfo]) -> None:
    if not sessions:
        print("no sessions")
    for s in sessions:
        prot = s.protections
        writes = ("  writes" if s.writes else "") + ("  asleep" if s.asleep else "")  # write lock; no process
        print(shown(f"{s.id}  network={s.network} ({prot.network.mechanism})  "
                    f"policy={s.policy}  mode={prot.mode}{writes}  {s.worktree}"))


class _Stopped(BaseException):
    """A stop signal that came while no call was running to cancel."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _print_output(stream: str, text: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(text)
    out.flush()  # each piece when it comes, stdout and stderr in the order written


def _exec(client: Client, args: argparse.Namespace) -> int:
    words = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not words:
        raise UsageError("exec needs a command after --")
    params: dict[str, Any] = {"command": shlex.join(words)}
    if args.timeout is not None:
        params["timeout"] = args.timeout
    if args.session and args.env:
        params["env"] = dict(args.env)  # an open session's: for this command only
    cancellation = Cancellation()
    state: dict[str, Any] = {"signum": None, "calling": False}

    def on_signal(signum: int, _frame: object) -> None:
        first = state["signum"] is None
        state["signum"] = signum
        if first and state["calling"]:
            cancellation.cancel()  # the call returns, cancelled; we close and exit after
            return
        raise _Stopped(signum)  # nothing to cancel yet, or a second signal: stop waiting

    previous = {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS}
    try:
        with _session_for(client, args) as session:
            # Ours again during the call (a one-off session's own handlers close
            # it on SIGTERM/SIGHUP): cancel first, then the session closes.
            for sig in _STOP_SIGNALS:
                signal.signal(sig, on_signal)
            if not session.registry.has("shell_exec"):
                raise UsageError(f"policy {args.policy!r} has no shell_exec: this session cannot run commands")
            defn = session.registry.get("shell_exec")
            box: list[Any] = []
            call = threading.Thread(target=lambda: box.append(
                defn.call(params, {"cancellation": cancellation}, on_output=_print_output)), daemon=True)
            state["calling"] = True
            call.start()
            while call.is_alive():
                call.join(0.1)  # in the main thread, so a signal is handled at once
            state["calling"] = False
        result = box[0]
    except _Stopped as stop:
        print(f"dispatch: stopped by {signal.Signals(stop.signum).name}", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    meta = result.metadata
    if state["signum"] is not None:
        signum = int(state["signum"])
        print(f"dispatch: {signal.Signals(signum).name}: the command was cancelled", file=sys.stderr)
        return 128 + signum
    if "exit_code" not in meta:  # the command never ran
        raise DispatchError(result.error or "shell_exec failed")
    if meta.get("truncated"):
        sys.stderr.write(_cli_text.truncation_note(session.info.get("limits", {})) + "\n")
    if meta.get("timed_out"):
        sys.stderr.write(f"dispatch: command timed out after {params.get('timeout', 'the policy timeout')} s\n")
        return EXIT_TIMEOUT
    code = int(meta["exit_code"])
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it



def _jobs(client: Client, args: argparse.Namespace) -> int:
    with client.session(args.session) as session:
        reg = session.registry
        if not reg.has("job_list"):
            raise UsageError(f"session {args.session} has no background jobs (its policy has no shell_exec)")
        if args.action in (None, "list"):
            result = reg.get("job_list").call({})
            print(result.output if result.is_success else result.error)
            return 0 if result.is_success else 1
        if args.action == "stop":
            result = reg.get("job_stop").call({"job": args.job})
            print(result.output if result.is_success else result.error)
            return 0 if result.is_success else 1
        offset = args.offset
        while True:
            result = reg.get("job_output").call({"job": args.job, "offset": offset,
                                                 "wait": 10 if args.follow else args.wait})
            if result.is_failure:
                raise DispatchError(result.error or "job_output failed")
            meta = result.metadata
            # The log's own bytes come first in the text; the notes for a model follow.
            size = meta["next_offset"] - offset
            got = (result.output or "").encode("utf-8", "surrogatepass")[:size].decode("utf-8", "replace")
            sys.stdout.write(got)
            sys.stdout.flush()
            offset = meta["next_offset"]
            if not args.follow or (not meta["running"] and not size):
                break
        print(f"dispatch: job {args.job} {meta['state']}; next offset {offset}", file=sys.stderr)
        return 0


def _mcp(client: Client, args: argparse.Namespace) -> int:
    try:
        from dispatch import mcp
    except ImportError as exc:  # the SDK is a dependency, but a partial install may lack it
        raise UsageError(f"dispatch mcp needs the mcp package (pip install mcp): {exc}") from exc
    # Held back until serve() listens for them, so that a stop at any moment
    # still closes the session (a session is not tied to our connection).
    signal.pthread_sigmask(signal.SIG_BLOCK, mcp.STOP_SIGNALS)
    with _session_for(client, args) as session:
        ended = mcp.serve(session.registry)
    if ended is not None:  # a server with no session would fail every call: the host sees it gone
        print(f"dispatch mcp: stopped serving: session {session.id} has ended: {shown(ended)}", file=sys.stderr)
        return EXIT_SESSION_ENDED
    return 0


def _run(args: argparse.Namespace) -> int:
    client = connect(args.socket, autostart=not args.no_autostart, timeout=args.request_timeout,
                     call_margin=args.request_timeout, host=args.host, host_command=args.host_command)
    if client.started_daemon is not None:  # said once: the next command finds it running
        pid, log = client.started_daemon
        print(f"dispatch: started dispatchd in the background (pid {pid}) on {client.socket_path}; "
              f"its log: {log}; `dispatch daemon stop` ends it", file=sys.stderr)
    with client:
        if args.command == "session":
            if args.action == "open":
                _warn_about_ports(args)
                # Detached: it outlives this command and needs no client holding it.
                env, secrets = _env_of(args)
                session = client.open_session(args.worktree, policy=args.policy, network=args.network,
                                              ports=args.ports, bind_ports=args.bind_ports, domains=args.domains,
                                              detached=True,
                                              read_only=args.read_only, env=env, secrets=secrets)
                session.detach()
                print(session.id)
                _print_warnings(session.info)
            elif args.action == "close":
                report = client.close_session(args.id)
                _cli_text.print_protected(report)
                if not_whole(report):
                    return EXIT_UNCHECKED
            elif args.action == "release":
                client.release_write_lock(args.id)
            elif args.action in ("checkpoint", "checkpoints", "restore"):
                _run_checkpoint(client, args)
            else:
                if args.json:
                    print(json.dumps(client.list_sessions(), indent=2))
                else:
                    _print_sessions(client.session_infos())
            return 0
        if args.command == "network":
            _warn_about_ports(args)
            info = client.set_network(args.id, args.state, ports=args.ports, bind_ports=args.bind_ports,
                                      domains=args.domains)
            print(info["network"])
            if info.get("note"):
                print(f"dispatch: {shown(info['note'])}", file=sys.stderr)
            _print_warnings(info)
            return 0
        if args.command == "exec":
            return _after_close(args, _exec(client, args))
        if args.command == "jobs":
            return _jobs(client, args)
        if args.command == "call":
            params = _cli_text.call_arguments(args.params, sys.stdin)
            with _session_for(client, args) as session:
                if not session.registry.has(args.tool):
                    raise UsageError(f"unknown tool {args.tool!r} (this session has: {', '.join(session.registry.tool_names)})")
                result = session.registry.get(args.tool).call(params)
            if args.text:
                text = str(result)
                sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
            else:
                print(json.dumps(result.to_dict(), indent=2))
            return _after_close(args, 0 if result.is_success else 1)
        if args.command == "tools":
            registry = Registry()
            from dispatch.tools import Definition, Result

            for t in client.tools(args.policy):
                registry.register(Definition(t["name"], t["description"], t["parameters"], lambda p, c: Result.success("")))
            if args.format == "plain":
                sys.stdout.write(_cli_text.tools_listing(registry.to_list()))
            else:
                print(json.dumps(registry.schemas("plain" if args.format == "json" else args.format,
                                                  strict=args.strict), indent=2))
            return 0
        if args.command == "mcp":
            return _after_close(args, _mcp(client, args))
        if args.command == "status":
            if args.json:
                print(json.dumps(client.status(), indent=2))
            else:
                _cli_text.print_status(client.status_reply())
            return 0
        if args.command == "daemon":
            return _cli_text.stop_daemon(client)
    raise UsageError(f"unknown command {args.command}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The command line says a session's end itself (_print_end), not again through
    # the library's logger's last-resort handler.
    said = logging.getLogger("dispatch")
    if not any(isinstance(h, logging.NullHandler) for h in said.handlers):
        said.addHandler(logging.NullHandler())
    try:
        if args.command == "mcp" and args.print_config:  # no daemon needed
            print(json.dumps(_cli_text.mcp_config(args), indent=2))
            return 0
        if args.command == "bridge":
            if args.host_command or (args.host and args.host != os.environ.get("DISPATCH_HOST")):
                raise UsageError("dispatch bridge runs where the daemon is: it takes no --host or --host-command")
            from dispatch import bridge

            return bridge.serve(args.bridge_socket or args.socket,
                                autostart=not (args.no_autostart or args.bridge_no_autostart),
                                timeout=args.request_timeout)
        why = _cli_args.not_utf8(args)
        if why is not None:
            raise UsageError(why)
        if args.command == "daemon" and args.no_autostart is False:
            args.no_autostart = True  # stopping a daemon must not start one
        try:
            code = _run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
            return code
        except ValueError as exc:  # call's @FILE/stdin arguments, and a strict format refused
            raise UsageError(str(exc)) from exc
    except BrokenPipeError:
        # `dispatch tools | head -1`: the reader has gone; no traceback, and
        # nothing more to say on a pipe that is closed (Python's own advice).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a writer killed by it
    except (DispatchError, UsageError, OSError) as exc:  # tool errors are DispatchErrors too
        print(f"dispatch: {shown(str(exc))}", file=sys.stderr)  # an error can name what a session chose
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        return 128 + exc.signum


if __name__ == "__main__":
    raise SystemExit(main())
