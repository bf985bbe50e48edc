"""The daemon's table of sessions: open, close, switch network, attach.

``SessionManager`` is built in layers, one module each (``table.py`` lists
them); where a session is in its life is one state (``lifecycle.py``),
changed under the session's lock by the layer doing the work.

Guarantees:
- a session is in the table only once its worker has reported that every
  step of its confinement is in force (``WorkerReady``); a step that fails
  refuses the open with the worker's own step, errno and path;
- closing a session, switching its network, or the daemon stopping ends every
  process the session started (see ``dispatchd.worker.session_init``), and the
  session's scratch directory is removed afterwards;
- a session whose worker ends on its own (idle timeout, crash) leaves the table;
- a session that sleeps (``sleep_after_s``, ``dispatchd.worker.wake``) has no
  process: the daemon holds its channels (``sleepers``) and its wake kit,
  and wakes it, confined as at its start, at the first byte a client
  writes; a channel attached meanwhile waits with the others; it still
  ends at its idle timeout, and closes like any other;
- one writer per worktree: the first session to run a mutating tool on a
  worktree holds its write lock until it ends; others get a failure naming it;
- the daemon opens the worktree itself once, by descriptor
  (``open_worktree``: no symlink of the user's followed), checks that
  descriptor, holds it for the session's life and hands it to every worker
  of the session, which binds and grants exactly it;
- extra read-only paths (the policy's and the call's) are resolved and
  checked against the credential deny-list at each open;
- the daemon runs nothing in a worktree (not even ``git``) and opens there
  only git's metadata, as hostile content (``gitguard.fs``: ``O_NOFOLLOW``,
  regular files only, bounded reads): at open ``gitguard.layouts`` walks ``.git``
  by name, each step ``lstat``-checked, and ``gitguard.snapshots`` walks every git
  directory and what an index names by ``O_PATH | O_NOFOLLOW`` descriptors
  from the worktree; an index is opened by its path;
- the one thing it creates there is an empty ``hooks`` in a git directory
  that has none (``gitguard.layouts``, at open: so that it can be held read-only);
- once a session's processes are gone (close, network switch, end) it
  renames aside, within its own directory, what the session changed there
  that the user's own git would run (``gitguard.redirects``, ``gitguard.snapshots``),
  making a directory the session made read-only writable for its owner
  first, or refuses the worktree until restart if it cannot;
- the daemon removes in a worktree only the temporary files of writes a
  session's end cut short (``tempfiles.py``: our exact names, regular
  files, by descriptor, no symlink followed), once the session that held the
  write lock has no process left and before the lock passes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from dispatchd.confine import cgroups, stacks
from dispatchd.daemon import afterwards, checkpoints, claims, gitguard, inusedir, leftovers, lifetimes, watchdog
from dispatchd.daemon.dnsrelay import DnsRelay
from dispatchd.daemon.gitguard import noroom
from dispatchd.daemon.pool import SandboxPool
from dispatchd.daemon.proxy import Resolver, system_resolver
from dispatchd.daemon.session import Session
from dispatchd.daemon.sessionnet import SessionNetworks
from dispatchd.daemon.sleepers import Sleepers
from dispatchd.daemon.spawn import ForkServerClient
from dispatchd.daemon.switching import Switching
from dispatchd.daemon.writelock import WriteLocks
from dispatchd.daemon.inuse import InUse
from dispatchd.fsnames import shown
from dispatchd.kernel import KernelFeatures
from dispatchd.logtext import Bounded
from dispatchd.policy import Policy

__all__ = ["Session", "SessionManager"]

log = logging.getLogger("dispatchd.sessions")


class SessionManager(Switching):
    """The daemon's sessions. Its public methods: ``open``, ``attach``,
    ``set_network``, ``release_write_lock``, ``close``, ``end``, ``close_all``,
    ``get``, ``sessions``, ``start_pool``, ``send_command_env``; each layer it
    is built of is a module of its own (``table.py`` draws them)."""

    def __init__(
        self,
        *,
        fork_server: ForkServerClient,
        kernel: KernelFeatures,
        load_policy: Callable[[str], Policy],
        state_dir: str,
        protected: list[str],
        private: list[str],
        runtime_dirs: list[str],
        code_paths: list[str],
        base_env: dict[str, str],
        delegation: cgroups.Delegation = cgroups.Delegation(note="not looked for"),
        resolver: Resolver | None = None,
        pool_size: int = 0,
        host_tree: bool = False,
        dns: DnsRelay | None = None,
        launch: stacks.Launch | None = None,
        in_use_table: inusedir.Table | None = None,
    ) -> None:
        self.fork_server = fork_server
        self.dns = dns  # network on/ports: the DNS relay, and the resolv.conf sessions read (daemon/dnsrelay.py)
        # For the proxies of "domains" sessions, too.
        # ``launch``: the daemon's, planned before its fork server and socket
        # (cli.py: the stack's files listed by a child process it waits for).
        self.networks = SessionNetworks(fork_server, dns, resolver or system_resolver(),
                                        launch or stacks.launch_for(kernel.network_stack, kernel.landlock_abi))
        self.dns_resolv = ""  # the relay's resolv.conf, which sessions bind; "": the host's
        if dns is not None and not kernel.network_stack_missing:
            try:
                self.dns_resolv = dns.session_file(state_dir)
            except OSError as exc:  # sessions read the host's: names resolve as before the relay, or not
                log.warning("event=dns_resolv_conf_failed error=%s", exc)
        self.host_tree = host_tree  # plan_session's: the host's root held by descriptor (mounts._hold_host)
        self._last_inputs = {}
        # What every plan is made of beside the session's own (planahead.py).
        self.kernel, self.load_policy, self.base_env, self.delegation = kernel, load_policy, base_env, delegation
        self.state_dir = state_dir
        self.sessions_dir = os.path.join(state_dir, "sessions")
        # What a worktree or an extra read-only path may not be, nor hold (worktree.py).
        self.protected, self.private = protected, private
        # What every session's root binds beside its worktree.
        self.runtime_dirs, self.code_paths = runtime_dirs, code_paths
        self.uid, self.gid = os.getuid(), os.getgid()
        self.home = os.path.expanduser("~")
        self._sessions = {}
        self.write_locks = WriteLocks()  # one writer per worktree
        # The worktrees this daemon's sessions use, for the user's other daemons (claims.py): in one
        # table of the user's whatever the state directory, or this one's alone (said: inusedir.py).
        self.in_use_table = in_use_table or inusedir.choose(state_dir)
        self.in_use: InUse | None = InUse(self.in_use_table.path, state=os.path.realpath(state_dir))
        try:  # noted before what they left is finished below: forgotten after, those finished only
            dead = self.in_use.dead()
        except OSError as exc:
            log.warning("event=inuse_unreadable error=%s", exc)
            dead = []
        # A restore a killed daemon cut half way is finished first: the worktree as
        # the checkpoint had it before its baseline is re-checked (daemon/checkpoints/journal.py).
        # What became of each is shown by status, beside what the baselines' checks did.
        self.restores_at_start = [gitguard.Protected(path=shown(path), why=shown(why), time=time.time())
                                  for path, why in checkpoints.finish_restores(state_dir, self.in_use,
                                                                               gitguard.unheld_roots(state_dir))]
        # Room kept for the checks' renames, should a session fill the disk
        # (gitguard/noroom.py): made before the first check runs.
        noroom.use(noroom.Ballast(os.path.join(state_dir, "ballast")))
        # One trusted baseline per worktree, on disk (gitguard/baselines.py); the
        # checks a daemon that died left are finished before anything opens.
        self.baselines = gitguard.Baselines(state_dir, self.home)
        self.baselines.sync_dir = afterwards.fsync_dir  # a record's removal made durable after the reply
        self.baselines.later = afterwards.later  # the last end's record removed after the reply
        said = Bounded()  # each was logged by its check already: the first few again, then a count
        for found in self.baselines.recover():
            said.say(log, "event=recovered path=%s why=%r", found.path, found.why)
        said.end(log, "what the checks left by a daemon that died did, not logged one by one; `dispatch status` "
                      "lists it")
        try:
            self.in_use.forget_dead(claims.finished(dead, self.baselines, state_dir))
            self.in_use.prepare()  # the spare entries an open's claim writes in place
        except OSError as exc:  # each claim then makes its own, or refuses its open
            log.warning("event=inuse_unwritable error=%s", exc)
        # Checkpoints of sessions' worktrees, their objects in the baselines' keep (daemon/checkpoints/).
        self.checkpoints = checkpoints.Store(state_dir, self.baselines.keep_dir)
        self.checkpoints.later = afterwards.later  # a done restore's record removal made durable after the reply
        self._lock = threading.Lock()
        self.accepting = True
        # Opens in flight: close_all waits for them (a session they register
        # while the daemon stops is ended by close_all or by its own open).
        self._opening = 0
        self._opens_done = threading.Condition(self._lock)
        # Sessions whose every connection has gone end after their grace (lifetimes.py).
        self.holders = lifetimes.Holders(self._end_orphan)
        self._ended = leftovers.EndedSessions()  # why recent sessions ended, for their clients
        self._scratch_locks = leftovers.ScratchLocks(self.sessions_dir)
        self.watchdog = watchdog.MemoryWatchdog(self._watched, self._end_over_memory, lambda: bool(self._sessions))
        # Sandboxes made ahead, per kind of session (pool.py); started by start_pool.
        self.pool = SandboxPool(size=pool_size, make=self._make_ahead, let_go=self._let_go)
        # Sessions asleep: their channels watched by one thread (sleepers.py).
        self.sleepers = Sleepers(self._wake, self._channel_gone, self._expire_asleep)

