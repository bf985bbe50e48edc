"""``dispatchd``: run the daemon in the foreground until SIGTERM or SIGINT.

Start-up order matters: policies are checked and the kernel probed first (a
broken policy or a kernel without Landlock stops us with a clear message);
the fork server is forked before any thread exists; only then is the socket
bound and served.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import sysconfig
import threading
from pathlib import Path

import msgspec

from dispatchd import __version__, paths, statemodes, support, systemd, units
from dispatchd.daemon.helpers import BoundSocket, HelperWatch
from dispatchd.errors import DispatchdError, PolicyError
from dispatchd.policy import Policy, default_policy_dir, load_all, load_policy

log = logging.getLogger("dispatchd")
TESTING_ROOT_FLAG = "--allow-root-for-testing"
PROXY_HOSTS_FLAG = "--proxy-hosts-for-testing"
TUN_FLAG = "--tun-for-testing"
FORCE_KERNEL_FLAG = "--force-kernel-for-testing"
DNS_RESOLV_FLAG = "--dns-resolv-conf-for-testing"
BASELINE_SYNC_FLAG = "--baseline-sync-delay-for-testing"
PARK_AFTER_FLAG = "--park-after-for-testing"
BEFORE_RESTORE_FLAG = "--before-restore-budget-for-testing"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    """The daemon's options (docs/reference.md lists each; tests/unit/test_reference.py checks)."""
    from dispatchd.confine.stacks import STACK_CHOICES

    p = argparse.ArgumentParser(
        prog="dispatchd", description="Sandboxed execution daemon for AI coding agents. Runs in the foreground "
        "until SIGTERM or SIGINT.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="other commands:\n"
               "  dispatchd install-units [--dry-run]   write systemd user units (dispatchd.socket, .service)\n"
               "                                        for this Python; see docs/operations.md\n"
               "  dispatchd uninstall-units             remove them\n"
               "  dispatchd check [--no-user-namespaces] probe this machine as the daemon would and say\n"
               "                                        which row of docs/support.md it is in\n")
    p.add_argument("--socket", help="listening socket path (default: $DISPATCH_SOCKET, "
                   "$XDG_RUNTIME_DIR/dispatchd/dispatchd.sock, or $XDG_STATE_HOME/dispatchd/run/dispatchd.sock)")
    p.add_argument("--policies", type=Path, help="directory of policy files (default: the installed policies)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info logs sessions and what happens to them; debug adds a line per tool call (default: info)")
    p.add_argument("--log-file", metavar="PATH",
                   help="log to PATH, rotated at 10 MiB with 3 old files kept (default: stderr, which "
                        "journald keeps under systemd)")
    p.add_argument("--no-user-namespaces", action="store_true",
                   help="never use user namespaces: every session runs on Landlock and seccomp alone")
    p.add_argument("--cgroup", default="auto", metavar="auto|off|PATH",
                   help="per-session cgroups: 'auto' uses the daemon's own cgroup when it is delegated and the "
                        "daemon is alone in it (a systemd service with Delegate=yes); PATH names a delegated "
                        "cgroup v2 directory for this daemon alone to manage (an error if it cannot; at start "
                        "it ends what earlier sessions left there); 'off' never")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long calls in flight may go on before their sessions are ended "
                        "(seconds; default: 30)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="client connections served at once; more are answered 'busy' (default: half the "
                        "descriptors the daemon has, at most 4096)")
    # CONTRACT.md keeps an explicit testing flag for root (acceptance suites
    # run as root): listed, never silent, and logged at every start.
    p.add_argument(TESTING_ROOT_FLAG, action="store_true",
                   help="testing only: run as root anyway. Sessions are confined as the user who runs the "
                        "daemon, so root's sessions keep root's reach outside what the kernel confines; "
                        "never use it on a machine you care about")
    # Testing only: NAME=ADDR makes the "domains" proxy resolve NAME to ADDR
    # and relay to it even on the host's loopback (which it never does
    # otherwise), so the tests need a fake registry on 127.0.0.1 and no internet.
    p.add_argument(PROXY_HOSTS_FLAG, action="append", default=[], metavar="NAME=ADDR", help=argparse.SUPPRESS)
    # Testing only: the device the network stack's probe opens instead of
    # /dev/net/tun (a file the user cannot open simulates a machine whose tun
    # device is root's). It can only make the stack unavailable: pasta itself
    # still opens /dev/net/tun.
    p.add_argument(TUN_FLAG, metavar="PATH", help=argparse.SUPPRESS)
    # Testing only: plan and enforce as an older kernel would (kernel.py
    # force_for_testing: landlock=N, user_namespaces=no, detached_mounts=no).
    # It can only take features away, is logged at start and shown by status.
    p.add_argument(FORCE_KERNEL_FLAG, metavar="SPEC", help=argparse.SUPPRESS)
    # Testing only: the DNS relay of network on/ports forwards to the
    # nameservers of this file instead of /etc/resolv.conf's, and reads
    # "nameserver ADDR:PORT" there (a test's resolver cannot listen on 53).
    p.add_argument(DNS_RESOLV_FLAG, metavar="PATH", help=argparse.SUPPRESS)
    # Testing only: a new baseline's record is made durable SECONDS later
    # than it would be (gitguard/pending.py, Durable), so that a test can
    # see what waits for it (a write) and what does not (a read). Logged at start.
    p.add_argument(BASELINE_SYNC_FLAG, type=float, default=0.0, metavar="SECONDS", help=argparse.SUPPRESS)
    # How long a greeted connection may idle before it waits without a thread (daemon/parking.py).
    p.add_argument(PARK_AFTER_FLAG, type=float, default=0.0, metavar="SECONDS", help=argparse.SUPPRESS)
    # Testing only: what restores replaced, kept past their sessions, may hold
    # at most BYTES instead of 8 GiB (daemon/checkpoints/keptsize.py; a quarter
    # of the free space still bounds it), so that a test reaches the budget
    # with small files. Logged at start and named in status.
    p.add_argument(BEFORE_RESTORE_FLAG, type=int, default=0, metavar="BYTES", help=argparse.SUPPRESS)
    p.add_argument("--network-stack", default="auto", choices=list(STACK_CHOICES),
                   help="the user-mode stack network-on sessions go out through: slirp4netns (confined by "
                        "dispatchd), pasta (confines itself), or auto, the first of those installed and usable "
                        "(default: auto)")
    p.add_argument("--pool", type=int, default=2, metavar="N",
                   help="sandboxes made ahead per kind of session (policy and network mode), for the kinds most "
                        "recently opened: an open then takes ~half the time; 0: none (default: 2; docs/performance.md)")
    p.add_argument("--version", action="version", version=f"dispatchd {__version__}")
    return p


def _code_paths() -> list[str]:
    """Where the worker's own Python lives, granted read-only so that a lazy
    import inside a confined worker still works. Only the package directories,
    the interpreter's library paths and its venv, never a whole checkout
    (in full mode, with the system directories, all of the session's root
    beside its own paths)."""
    import dispatchd

    found = {os.path.dirname(os.path.abspath(dispatchd.__file__))}
    if sys.prefix != sys.base_prefix:  # a venv: its interpreter links and packages, whole
        found.add(os.path.realpath(sys.prefix))
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and os.path.isdir(p):
            found.add(os.path.realpath(p))
    return sorted(found)


def _bind(path: str) -> tuple[socket.socket, BoundSocket]:
    """Listen on ``path``, and the inode bound there: the one a stop may unlink."""
    directory, name = os.path.split(path)
    paths.ensure_private_dir(directory)
    # Checked and used by descriptor: the directory we bind in is the one we checked.
    dirfd = paths.open_socket_dir(directory)
    try:
        where = paths.via_fd(dirfd, name)
        if os.path.lexists(where):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(where)
            except OSError:
                os.unlink(name, dir_fd=dirfd)  # a stale socket from a daemon that died
            else:
                raise DispatchdError(f"another dispatchd is already listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            sock.bind(where)
        finally:
            os.umask(old)
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        dst = os.fstat(dirfd)
    finally:
        os.close(dirfd)
    sock.listen(1024)  # bursts of opens (an agent platform starting hundreds) wait in it
    return sock, BoundSocket(path, st.st_dev, st.st_ino, dst.st_dev, dst.st_ino)


def _setup_logging(args: argparse.Namespace) -> None:
    from dispatchd.logtext import install

    install(args.log_file, args.log_level)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in units.COMMANDS:  # install-units, uninstall-units: not the daemon
        return units.main(argv)
    if argv[:1] and argv[0] in support.COMMANDS:  # check: which row of docs/support.md this machine is in
        return support.main(argv)
    args = _parse(argv)
    _setup_logging(args)
    if args.pool < 0:
        print("dispatchd: --pool: a number of sandboxes, 0 or more", file=sys.stderr)
        return 2
    # A stop asked for while starting (the socket may already accept) is
    # honoured as soon as the daemon serves: it ends cleanly, never killed
    # half started by the signal's default action.
    early_stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early_stop.append(signum))
    # Sessions are confined as the user who runs the daemon, and root's
    # sessions would have root's reach (the suites run as an unprivileged
    # user, scripts/test); only the explicit testing flag goes past this.
    if os.geteuid() == 0 and not args.allow_root_for_testing:
        print("dispatchd: refusing to run as root: it confines sessions as the user who runs it. "
              "Start it as your own user (e.g. systemctl --user start dispatchd).", file=sys.stderr)
        return 2
    if os.geteuid() == 0:
        log.warning("event=running_as_root flag=%s: sessions keep root's reach outside what the kernel "
                    "confines (testing only)", TESTING_ROOT_FLAG)
    policy_dir = (args.policies or default_policy_dir()).resolve()
    try:
        policies = load_all(policy_dir)
    except PolicyError as exc:
        print(f"dispatchd: {exc.message}", file=sys.stderr)
        return 2
    if "default" not in policies:
        print(f"dispatchd: no default policy (default.toml) in {policy_dir}", file=sys.stderr)
        return 2

    from dispatchd.daemon import capacity

    # Before anything holds a descriptor: ~1,000 connections or ~340 sessions
    # used up a login's default 1,024 and stopped the daemon.
    open_files = capacity.apply_open_files()
    log.log(logging.WARNING if open_files.limit < open_files.hard else logging.INFO,
            "event=open_files limit=%s hard=%s note=%r", open_files.limit, open_files.hard, open_files.note)

    from dispatchd import kernel as kernel_mod

    if args.tun_for_testing:
        log.warning("event=testing_tun path=%s (the network stack's probe opens it instead of %s)",
                    args.tun_for_testing, kernel_mod.TUN)
    features = kernel_mod.probe(forbid_user_namespaces=args.no_user_namespaces,
                                tun=args.tun_for_testing or kernel_mod.TUN, network_stack=args.network_stack)
    log.info("event=kernel landlock_abi=%s user_namespaces=%s seccomp=%s cgroup2=%s release=%s",
             features.landlock_abi, features.user_namespaces, features.seccomp, features.cgroup2 or "none",
             features.release)
    # Also before any thread (it forks): whether a session's root can hold the
    # host's by descriptor until its own binds (confine/mounts.py _hold_host).
    from dispatchd.confine.mounts import probe_host_tree

    features = msgspec.structs.replace(
        features, host_tree_missing=probe_host_tree() if features.user_namespaces else "no user namespaces")
    if args.force_kernel_for_testing:
        try:
            from dispatchd.confine.stacks import probe_stack

            tun = args.tun_for_testing or kernel_mod.TUN
            features = kernel_mod.force_for_testing(
                features, args.force_kernel_for_testing,
                restack=lambda abi: probe_stack(args.network_stack, tun, landlock_abi=abi))
        except ValueError as exc:
            print(f"dispatchd: {FORCE_KERNEL_FLAG}: {exc}", file=sys.stderr)
            return 2
        log.warning("event=testing_forced_kernel spec=%s landlock_abi=%s user_namespaces=%s (planned and enforced "
                    "as that kernel would)", args.force_kernel_for_testing, features.landlock_abi,
                    features.user_namespaces)
    # What sessions will lack here, said once at start (and by status).
    if not features.user_namespaces and not args.no_user_namespaces:
        log.warning("event=user_namespaces_unavailable note=%r: sessions run in degraded mode (docs/support.md)",
                    features.user_namespaces_note)
    for mode, why in features.network_unavailable.items():
        log.warning("event=network_mode_unavailable mode=%s why=%r", mode, why)
    host_tree_missing = features.host_tree_missing
    log.info("event=host_tree by_descriptor=%s note=%r", not host_tree_missing, host_tree_missing)
    if features.landlock_abi < 1:
        print("dispatchd: this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK, lsm=landlock): "
              "sessions cannot be confined, so none will be opened.", file=sys.stderr)
        return 1

    from dispatchd.confine import cgroups

    # Before the fork server and any thread: all of the daemon moves.
    try:
        delegation = cgroups.delegate(args.cgroup, features.cgroup2)
    except DispatchdError as exc:
        print(f"dispatchd: --cgroup: {exc.message}", file=sys.stderr)
        return 2
    features = msgspec.structs.replace(features, cgroup_delegation=delegation.describe())
    log.info("event=cgroups delegation=%r", delegation.describe())

    try:
        handed = systemd.listen_socket()  # systemd's socket, if it passed one
    except (DispatchdError, OSError) as exc:
        print(f"dispatchd: {exc}", file=sys.stderr)
        return 1
    # A socket systemd passed is where clients connect, whatever --socket says.
    socket_path = handed.getsockname() if handed is not None else paths.resolve_socket_path(args.socket)
    state = paths.state_dir()
    from dispatchd.daemon.gitguard import ournames
    try:
        ournames.use(state)  # the names of our temporaries beside git's files: this directory's, across restarts
    except OSError as exc:
        print(f"dispatchd: the state directory {state} cannot be written ({exc.strerror})", file=sys.stderr)
        return 1
    # How the network stack is started and confined, its files listed by a
    # child process (confine/elfloads.py): before the fork server, so that
    # this process's one child from here on is the fork server, and before
    # the socket listens, so that a client finds the daemon started.
    from dispatchd.confine import stacks as stack_plans

    launch = stack_plans.launch_for(features.network_stack, features.landlock_abi)
    # The fork server first: it must be forked while we have a single thread.
    from dispatchd.daemon.spawn import ForkServerClient
    from dispatchd.worker.fork_server import start_fork_server

    # Sessions' user namespaces below one of the daemon's: together at most half the user's inotify and
    # processes (ucounts.py, sharedprocs.py).
    from dispatchd.confine import sharedprocs, ucounts

    shared = (ucounts.plan_shared(ucounts.read_user_limits(), sharedprocs.read_limits())
              if features.user_namespaces else None)
    fork_server = ForkServerClient(*start_fork_server(shared))
    try:
        shared_missing = fork_server.hello() or ("" if shared is not None else "no user namespaces")
    except DispatchdError as exc:
        print(f"dispatchd: {exc}", file=sys.stderr)
        fork_server.stop()
        return 1
    features = msgspec.structs.replace(
        features, shared_budgets=ucounts.describe_shared(shared) if shared is not None and not shared_missing else "",
        shared_budgets_missing=shared_missing,
        shared_processes=shared.processes if shared is not None and not shared_missing else 0)
    log.info("event=shared_budgets bound=%r missing=%r", features.shared_budgets, shared_missing)

    from dispatchd.daemon import leftovers
    from dispatchd.daemon.server import Server
    from dispatchd.daemon.sessions import SessionManager

    def policy_loader(name: str) -> Policy:
        return load_policy(policy_dir, name)

    runtime = [d for d in {os.environ.get("XDG_RUNTIME_DIR", ""), f"/run/user/{os.getuid()}",
                           os.path.dirname(socket_path)} if d and os.path.isdir(d)]
    try:
        # Modes a session changed (degraded mode: Landlock does not govern
        # chmod) set back before anything reads the state: the daemon's own
        # files, healed parents first, never through a symlink (statemodes.py).
        statemodes.own(state)
        statemodes.heal_tree(state)
        paths.ensure_private_dir(state)
        paths.ensure_private_dir(os.path.join(state, "sessions"))
        paths.ensure_private_dir(os.path.join(state, "session-locks"))  # daemon/leftovers.py
        # Scratch directories of sessions of a daemon that was killed (SIGKILL, OOM):
        # only those no live daemon holds (daemon/leftovers.py).
        stale = leftovers.remove_stale(os.path.join(state, "sessions"))
        if stale:
            log.info("event=stale_scratch_removed count=%d", stale)
        listener = handed
        bound: BoundSocket | None = None  # None: systemd's socket, never ours to unlink
        if listener is None:
            listener, bound = _bind(socket_path)
    except (DispatchdError, paths.UnsafeDirectory, OSError) as exc:
        where = exc.filename if isinstance(exc, PermissionError) and isinstance(exc.filename, str) else ""
        why = paths.unsearchable(where) if where else ""  # the directory that keeps it out, if one does
        print(f"dispatchd: {exc}{'; ' + why if why else ''}", file=sys.stderr)
        fork_server.stop()
        return 1
    from dispatchd.confine.netstack import Stack
    from dispatchd.daemon.proxy import system_resolver

    overrides: dict[str, list[str]] = {}
    try:
        for item in args.proxy_hosts_for_testing:
            name, sep, addr = item.partition("=")
            if not sep or not name or not addr:
                raise ValueError(f"{item!r}: expected NAME=ADDR")
            overrides.setdefault(name, []).append(addr)
        resolver = system_resolver(overrides)
    except ValueError as exc:
        print(f"dispatchd: {PROXY_HOSTS_FLAG}: {exc}", file=sys.stderr)
        fork_server.stop()
        return 2
    if overrides:
        log.warning("event=testing_proxy_hosts hosts=%s (the domains proxy relays to these, loopback included)",
                    ",".join(f"{k}={'/'.join(v)}" for k, v in overrides.items()))
    from dispatchd.daemon.dnsrelay import HOST_RESOLV_CONF, DnsRelay

    if args.dns_resolv_conf_for_testing:
        log.warning("event=testing_dns_resolv_conf path=%s (the DNS relay forwards to its nameservers)",
                    args.dns_resolv_conf_for_testing)
    dns = DnsRelay(args.dns_resolv_conf_for_testing or HOST_RESOLV_CONF, ports=bool(args.dns_resolv_conf_for_testing))
    from dispatchd.daemon import inusedir

    # The table that keeps two daemons' sessions off one worktree: the user's,
    # whatever XDG_STATE_HOME says; this state directory's alone, said, when it cannot be.
    in_use = inusedir.choose(state)
    # Its files' modes set back as the state directory's are (statemodes.py);
    # and the directory holding it (the default state directory, dispatchd's
    # by name): made 000, it would keep every daemon of the user's out.
    statemodes.own(in_use.path)
    statemodes.own(os.path.dirname(in_use.path))
    if in_use.shared:
        log.info("event=inuse_table path=%s shared=yes", in_use.path)
    else:
        log.warning("event=inuse_table path=%s shared=no why=%r", in_use.path, in_use.note)
    manager = SessionManager(
        fork_server=fork_server, kernel=features, load_policy=policy_loader, state_dir=state, in_use_table=in_use,
        protected=[state, os.path.dirname(socket_path), in_use.path], private=[state, in_use.path],
        runtime_dirs=sorted(runtime),
        code_paths=_code_paths(), base_env=dict(os.environ), delegation=delegation, resolver=resolver,
        pool_size=args.pool, host_tree=not host_tree_missing, dns=dns, launch=launch,
    )
    if args.baseline_sync_delay_for_testing > 0:
        log.warning("event=testing_baseline_sync_delay seconds=%s (a new baseline is made durable that much later)",
                    args.baseline_sync_delay_for_testing)
        manager.baselines.settle_delay_s = args.baseline_sync_delay_for_testing
    if args.before_restore_budget_for_testing > 0:
        log.warning("event=testing_before_restore_budget bytes=%s (what restores replaced may hold that much at most)",
                    args.before_restore_budget_for_testing)
        manager.checkpoints.kept_sizes.fixed = args.before_restore_budget_for_testing
        manager.checkpoints.kept_sizes.fixed_why = f"as set by {BEFORE_RESTORE_FLAG}"
    max_connections = capacity.connection_cap(open_files.limit, args.max_connections)
    server = Server(listener, manager, features, socket_path, policy_loader, max_connections=max_connections,
                    open_files=open_files)
    if args.park_after_for_testing > 0:
        server.park_after_s = args.park_after_for_testing
    log.info("event=connections max=%s", max_connections)
    exit_code = 0

    def stop(signum: int, _frame: object) -> None:
        log.info("event=stopping signal=%s", signal.Signals(signum).name)
        manager.accepting = False
        server.stop()

    def exit_with(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        manager.accepting = False
        server.stop()

    def stacks() -> list[tuple[str, Stack]]:
        return [(s.id, stack) for s in manager.sessions() if (stack := s.stack) is not None]

    def end_all(why: str) -> None:
        manager.accepting = False
        for s in manager.sessions():
            manager.end(s.id, "fork_server_died", why)

    watch = HelperWatch(fork_server_pidfd=fork_server.pidfd, fork_server_pid=fork_server.pid,
                        fork_server_death=fork_server.death, stacks=stacks, end_session=manager.end,
                        end_all=end_all, idle=lambda: not manager.sessions() and server.connections == 0,
                        exit=exit_with, socket=bound)
    server.helpers = watch.report

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if early_stop:
        stop(early_stop[0], None)
    # A signal the kernel hands to another thread (any may take it) only sets a
    # flag: the main thread, asleep in poll(), would not run the handler until
    # something else woke it. The wake-up pipe wakes it at once.
    signal.set_wakeup_fd(server.wakeup_fd())
    manager.start_pool()
    watch.start()
    # The history keeps of repositories gone since (daemon/gitguard/keeps.py):
    # after the start's own checks, on a thread of their own, nothing waiting.
    from dispatchd.daemon.gitguard import keeps

    threading.Thread(target=keeps.sweep, args=(manager.baselines.keep_dir, state), daemon=True,
                     name="keep-sweep").start()
    # What the start made (modules, policies, tables) lives as long as the
    # daemon: kept out of the collector's way, a full collection walks only
    # what sessions made since (docs/performance.md, "The collector").
    gc.freeze()
    log.info("event=ready socket=%s pid=%s policies=%s pool=%s", socket_path, os.getpid(), ",".join(sorted(policies)),
             args.pool)
    systemd.notify("READY=1", f"STATUS=serving on {socket_path}")
    try:
        server.serve_forever()
    finally:
        systemd.notify("STOPPING=1", "STATUS=stopping: ending sessions")
        manager.accepting = False
        # Meanwhile new connections are answered at once ("stopping"), not
        # left in the backlog for the whole drain.
        refuser = threading.Thread(target=server.refuse_until_closed, daemon=True)
        refuser.start()
        # Calls in flight may finish (up to the deadline); new ones are refused.
        closer = threading.Thread(target=manager.close_all, kwargs={"drain_s": args.stop_timeout})
        closer.start()
        closer.join(args.stop_timeout + 10)
        server.close()
        refuser.join(5)
        # Before the unlink (a path gone is no reason to exit now) and the
        # fork server's stop (that end is no failure).
        watch.stop()
        # Only the inode we bound: another daemon may have bound the path since.
        if bound is not None and not bound.unlink():
            log.warning("event=socket_not_unlinked path=%s state=%s (not the socket this daemon bound)",
                        socket_path, bound.state())
        listener.close()
        fork_server.stop()
        log.info("event=stopped code=%d", exit_code)
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
