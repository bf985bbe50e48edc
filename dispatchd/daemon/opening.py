"""Opening a session: the request checked, the worktree opened and its git
inspected, the plan made, and a worker started (or a sandbox made ahead
adopted); and the pool's sandboxes made ahead and let go.

Guarantees:
- a session is in the table only once its worker has reported that every
  step of its confinement is in force (``WorkerReady``): it is ``opening``
  until then, under its lock (its watch waits for the open's end), and
  ``ready`` from then; a step that fails refuses the open with the worker's
  own step, errno and path, and what the open made goes (``open_failed``:
  its worker, if one started, stopped first);
- the daemon opens the worktree itself once, by descriptor
  (``open_worktree``: no symlink of the user's followed), checks that
  descriptor, holds it for the session's life and hands it to every worker
  of the session; extra read-only paths are resolved and checked against
  the credential deny-list at each open;
- the worktree's git metadata is read as hostile content (``gitguard.layouts``,
  ``gitguard.snapshots``); what cannot be inspected refuses the open;
- a sandbox made ahead serves a session only if its plan's shared part is
  the one it was made for (``pool_key``); otherwise it is let go, and all
  the daemon held for it is freed.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from dispatchd import envnames, protocol, threads
from dispatchd import domains
from dispatchd.confine import cgroups
from dispatchd.confine.plan import GitLayout, SessionPaths, SessionPlan
from dispatchd.daemon import claims, gitguard, lifetimes, watchdog
from dispatchd.daemon.gitguard.layouts import without_packs
from dispatchd.daemon.beside import Beside  # the baseline taken while the sandbox starts
from dispatchd.daemon.dnsrelay import session_resolv_binds
from dispatchd.daemon.lifecycle import Event
from dispatchd.daemon.pooling import Pooling
from dispatchd.daemon.planahead import PlanInputs, make_plan, plan_for
from dispatchd.daemon.pool import Made
from dispatchd.daemon.session import READY_TIMEOUT_S, Session
from dispatchd.daemon.sessionnet import check_network, domains_for, ports_of, stop_network, take_door, take_namespaces
from dispatchd.daemon.worktree import Worktree, check_read_only_path, credential_dirs, open_worktree
from dispatchd.errors import ConfinementError, DispatchdError, Stopping, WorktreeError
from dispatchd.inside import is_below, is_within, overlap
from dispatchd.netmodes import NetworkMode
from dispatchd.policy import Policy

log = logging.getLogger("dispatchd.sessions")


class Opening(Pooling):
    def open(self, worktree: str, policy_name: str, network: NetworkMode | None,
             ports: list[int] | None = None, bind_ports: list[int] | None = None, *,
             detached: bool = False, orphan_grace_s: float | None = None, holder: int | None = None,
             domain_list: list[str] | None = None, read_only: list[str] | None = None,
             env: dict[str, str] | None = None, secrets: dict[str, str] | None = None,
             attach: bool = False) -> Session:
        """``attach``: the opener attaches next (``OpenSession.attach``), and
        its channel may be sent to the sandbox with the session (``attach``
        then hands it over)."""
        try:
            user_env = envnames.check_env(env)
            hidden = envnames.check_secrets(secrets, user_env)
        except envnames.EnvError as exc:
            raise DispatchdError(str(exc)) from None
        with self._lock:
            if not self.accepting:
                raise Stopping("the daemon is stopping and opens no new sessions")
            self._opening += 1
        try:
            return self._open(worktree, policy_name, network, ports, bind_ports, detached=detached,
                              orphan_grace_s=orphan_grace_s, holder=holder, domain_list=domain_list,
                              read_only=read_only, user_env={**user_env, **hidden}, secret_names=sorted(hidden),
                              attach=attach)
        finally:
            with self._lock:
                self._opening -= 1
                self._opens_done.notify_all()

    def _open(self, worktree: str, policy_name: str, network: NetworkMode | None, ports: list[int] | None,
              bind_ports: list[int] | None, *, detached: bool, orphan_grace_s: float | None, holder: int | None,
              domain_list: list[str] | None, read_only: list[str] | None,
              user_env: dict[str, str], secret_names: list[str], attach: bool = False) -> Session:
        t0 = time.perf_counter()
        policy = self.load_policy(policy_name)  # re-read: a broken edit refuses the open
        network = network or policy.network.default
        rules = check_network(network, ports, bind_ports, domain_list)
        extra = self._read_only_paths(policy, read_only or [])
        t1 = time.perf_counter()
        held = open_worktree(worktree, uid=self.uid, home=self.home, protected=self.protected, private=self.private)
        # Milliseconds per step of the open, for the debug log (bench/openprofile.py reads them).
        steps = {"policy": (t1 - t0) * 1e3, "worktree": (time.perf_counter() - t1) * 1e3}
        try:
            return self._open_held(held, policy, network, ports, bind_ports, extra, rules, detached=detached,
                                   orphan_grace_s=orphan_grace_s, holder=holder, steps=steps,
                                   user_env=user_env, secret_names=secret_names, attach=attach)
        except BaseException:
            held.close()
            raise

    def _read_only_paths(self, policy: Policy, asked: list[str]) -> list[str]:
        """The policy's and the call's extra read-only paths, resolved; one that
        is or holds credentials, the home directory or our own files refuses the open."""
        found: list[str] = []
        for where, paths in (("filesystem.extra_read_only", policy.filesystem.extra_read_only),
                             ("read_only", asked)):
            for path in paths:
                resolved = check_read_only_path(os.path.expanduser(path), home=self.home,
                                                protected=self.protected + self.private, where=where)
                if resolved not in found:
                    found.append(resolved)
        return found

    def _open_held(self, held: Worktree, policy: Policy, network: NetworkMode, ports: list[int] | None,
                   bind_ports: list[int] | None, extra: list[str], rules: tuple[domains.Rule, ...] | None, *,
                   detached: bool, orphan_grace_s: float | None,
                   holder: int | None, steps: dict[str, float],
                   user_env: dict[str, str] | None = None, secret_names: list[str] | None = None,
                   attach: bool = False) -> Session:
        resolved = held.path
        if "memory" not in self.delegation.controllers:
            self.watchdog.start()  # before anything is made: a session it cannot watch is refused
        # Inside or around one too: its baseline would take what was left there for the user's.
        refused = self.baselines.taints.refusal(resolved)
        if refused:
            raise WorktreeError(refused, resolved)
        session = Session("", held, policy, "")  # its id once its sandbox is chosen, below
        session.read_only = extra
        session.user_env, session.secret_names = user_env or {}, secret_names or []
        session.ports = ports_of(session.policy, ports, bind_ports)
        session.domains = domains_for(session, rules)
        t = time.perf_counter()
        try:
            self._inspect_git(session)
        except BaseException as exc:
            if isinstance(exc, WorktreeError) or not isinstance(exc, Exception):
                raise
            # Hostile content we did not foresee: refuse, loudly.
            raise WorktreeError(f"{resolved}: its git metadata cannot be inspected "
                                f"({type(exc).__name__}: {exc}); no session opened", resolved) from exc
        steps["git"] = (time.perf_counter() - t) * 1e3
        # A sandbox made ahead for this kind of session, if one is ready: the
        # session takes the id it was made for (its cgroup's name). Taken only
        # now: an open refused above costs none, and the host's mounts are
        # looked at (pool.take) as close to the adoption as can be.
        made = self.pool.take((policy.name, network))
        session.id = made.sid if made is not None else secrets.token_hex(6)
        session.scratch = os.path.join(self.sessions_dir, session.id)
        sid = session.id
        # Held until it is in the table: its watch, should its worker end
        # meanwhile, sees it ready (and ends it) or closed (and leaves it).
        with session.lock:
            # The opener's channel goes with the session, not with an
            # environment of the caller's: the tool server must have it
            # (SetCommandEnv: secrets turn read_file's C lane off) before any
            # channel of the session's is read.
            self._open_locked(session, network, made, steps, channel_ahead=attach and not session.user_env)
            grace = lifetimes.effective_grace(policy.limits.orphan_grace_s, orphan_grace_s)
            cgroup_memory = bool(session.cgroup) and "memory" in self.delegation.controllers
            session.lifetime = protocol.LifetimeReport(
                detached=detached, orphan_grace_s=grace,
                memory=watchdog.mechanism(cgroup_memory, policy.limits.session_memory_bytes))
            session.move(Event.OPENED)
            with self._lock:
                self._sessions[sid] = session
        if not self.accepting:
            # The daemon began to stop while this open ran: close_all may have
            # looked at the table already; end it here (once: _finish is idempotent).
            self._finish(session, "dispatchd stopped", Event.DAEMON_STOP)
            raise Stopping("the daemon is stopping and opens no new sessions")
        self.holders.track(sid, detached=detached, grace_s=grace, holder=holder)
        if not cgroup_memory:
            self.watchdog.ensure_running()
        log.info("event=session_open session=%s policy=%s network=%s mode=%s made_ahead=%d worktree=%s",
                 sid, policy.name, network, session.protections.mode if session.protections else None,
                 bool(session.protections and session.protections.made_ahead), resolved)
        log.debug("event=open_steps session=%s steps_ms=%s", sid, ",".join(f"{k}:{v:.3f}" for k, v in steps.items()))
        return session

    def _open_locked(self, session: Session, network: NetworkMode, made: Made | None,
                     steps: dict[str, float], *, channel_ahead: bool = False) -> None:
        """The opening session's scratch directory, baseline and worker; on
        failure, all of it goes (``open_failed``)."""
        policy, sid = session.policy, session.id
        t = time.perf_counter()
        if made is None:  # one made ahead comes with its scratch directory
            self._make_scratch(sid, session.scratch)
        try:
            session.held.add({n: session.user_env[n] for n in session.secret_names})  # until _discard
            steps["scratch"] = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            # The worktree's trusted baseline (taken now if no session of its
            # domain runs), taken while the sandbox is given its session: on
            # this thread while the worker made ahead (another process)
            # applies it, or beside a sandbox made now (_start_worker); then
            # made durable on a thread of its own, after the reply: nothing
            # that can change the worktree runs before it is (the write
            # lock's grant waits for it; docs/git-protection.md, "When the
            # baseline is on disk"). Refused: the except below stops the
            # sandbox, which ran no call.
            recovered, record = claims.claim(self.in_use, self.baselines, session, self.state_dir,
                                             self.restores_at_start)
            if recovered:
                self._inspect_git(session)  # the worktree as the dead daemon's remains were left
            steps["claim"] = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            joining = _Once(claims.then(record, functools.partial(
                self.baselines.join, sid, session.worktree, session.git, session.git_before,
                session.redirects_before, tuple(policy.protect.paths), defer=True,
                writable=policy.filesystem.worktree == "read-write" or bool(policy.filesystem.read_write),
                reach=gitguard.session_reach(session.worktree, session.git.writable, policy.filesystem.read_write,
                                             policy.filesystem.worktree == "read-write"),
                secrets=dict(session.held.pairs()))),
                then=functools.partial(self.baselines.durable, sid))
            # Run by now, to its end, whenever the sandbox is ready (and when
            # not, it has either not begun or ended: nothing of it is left
            # running for a failure's _discard to race).
            self._start_worker(session, network, made, steps, joining, channel_ahead=channel_ahead)
            steps["worker"] = (time.perf_counter() - t) * 1e3
            if not joining.ran:  # cannot be: the sandbox is ready only once it has run; refused loudly
                raise WorktreeError(f"{session.worktree}: its baseline was not taken; no session opened",
                                    session.worktree)
            if joining.error is not None:
                raise joining.error
            session.reports = functools.partial(self.baselines.reports_for, sid)
            steps["baseline"] = joining.ms
        except BaseException:
            if made is not None and made.scratch:  # refused before its start took it (_adopt, _start_worker)
                made.scratch = ""  # the session's: it goes with the session
                self._let_go(made)
            try:
                self._stop_worker(session)  # one that started and was not told its environment
            finally:
                session.move(Event.OPEN_FAILED)
                self._discard(session)  # closes the worktree's descriptor too (open()'s close is then a no-op)
            raise
        finally:
            if session.poolable:
                self.pool.want((policy.name, network))  # refilled now that this open is done

    def _inspect_git(self, session: Session) -> None:
        resolved = session.worktree
        session.git = gitguard.inspect_git(resolved, uid=self.uid)
        if session.git.kind == "linked" and not self._points_back(session.git, resolved):
            # The worktree's path was swapped for a symlink to another
            # repository's linked worktree while git was inspected (the
            # descriptor the daemon holds is the checked directory, the
            # inspection went by name): its common directory is not granted.
            session.git = GitLayout("refused", read_only=[p for p in session.git.read_only
                                                                  if is_below(p, resolved)],
                                            note=f"the linked worktree's git directory does not point back at "
                                                 f"{resolved}/.git; not granted")
        for granted in session.git.readable + session.git.writable:
            home_inside = is_within(self.home, granted)
            mine = self.protected + credential_dirs(self.home)
            if home_inside or any(overlap(granted, p) for p in mine):
                # A common directory that holds the daemon's files, the user's
                # credentials, or the whole home directory, is no repository a session needs.
                session.git = GitLayout("refused", read_only=[p for p in session.git.read_only
                                                                      if is_below(p, resolved)],
                                                note=f"{granted} holds the daemon's files, credentials or the "
                                                     "whole home directory; not granted")
                break
        session.git_before = gitguard.take(resolved, session.git, self.home, keep=True)
        if not session.git_before.complete:
            raise WorktreeError(f"{resolved}: more git directories than dispatchd checks "
                                f"({gitguard.MAX_GITDIRS}); no session opened", resolved)
        if session.git_before.unfollowed:
            raise WorktreeError(f"{resolved}: its git configuration has {session.git_before.unfollowed}; no session "
                                "opened", resolved)
        # Git directories only the recursive walk finds (submodules of
        # submodules kept in place) are held read-only too.
        session.git = gitguard.with_gitdirs(session.git, resolved,
                                            gitguard.gitdir_paths(resolved, session.git_before))
        session.redirects_before = gitguard.redirects_present(session.git, resolved)
        if session.policy.sandbox.user_namespaces == "never" or not self.kernel.user_namespaces:
            session.git = without_packs(session.git)  # no mount namespace: no pack held (the keep copies)

    @staticmethod
    def _points_back(git: GitLayout, worktree: str) -> bool:
        """Whether the linked worktree's git directory names, literally, the
        ``.git`` of the path the daemon walked and checked."""
        try:
            fd = os.open(os.path.join(git.gitdirs[0], "gitdir"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, IndexError):
            return False
        try:
            back = os.read(fd, 4096).decode("utf-8", "replace").strip()
        except OSError:
            return False
        finally:
            os.close(fd)
        return os.path.normpath(back) == worktree + "/.git"

    def _plan_inputs(self, session: Session, network: NetworkMode) -> PlanInputs:
        paths = SessionPaths(worktree=session.worktree, scratch=session.scratch,
                             runtime_dirs=self.runtime_dirs, code=self.code_paths, git=session.git,
                             read_only=session.read_only, resolv=session_resolv_binds(self.dns_resolv))
        # Read at each worker start (open, network switch): a few µs, no git run.
        identity = gitguard.identity_env(gitguard.read_identity(self.home, self.base_env))
        return PlanInputs(session=session.id, policy=session.policy, network=network, paths=paths,
                          ports=session.ports, git_identity=identity, kernel=self.kernel, uid=self.uid,
                          gid=self.gid, base_env=self.base_env, delegation=self.delegation,
                          host_tree=self.host_tree, dns_door=self.dns is not None)

    def _plan(self, session: Session, network: NetworkMode) -> SessionPlan:
        return make_plan(self._plan_inputs(session, network))

    def _plan_and_key(self, session: Session, network: NetworkMode,
                      made: Made | None) -> tuple[SessionPlan, bytes | None]:
        """The session's plan and its pool key at a worker's start: the one made
        ahead with ``made`` when made of equal inputs (planahead.py), else made now."""
        inputs = self._plan_inputs(session, network)
        # What the pool's next sandbox of this kind plans for (the next open is most often alike).
        self._last_inputs[(session.policy.name, network)] = inputs
        return plan_for(inputs, made.planned if made is not None else None)

    def _start_worker(self, session: Session, network: NetworkMode, made: Made | None = None,
                      steps: dict[str, float] | None = None, meanwhile: _Once | None = None, *,
                      channel_ahead: bool = False) -> None:
        """The session's sandbox, confined and ready: ``made`` (one made ahead,
        taken from the pool) when its plan is the one it was made for, or a
        new one. ``steps``: the open's, given its parts' milliseconds.
        ``meanwhile`` runs while the sandbox applies the session: on this
        thread for one made ahead (between the session sent and its report
        read), beside a new one on a thread of its own. ``channel_ahead``
        (an open's, to be attached): a sandbox made ahead is sent the
        opener's channel with the session (``Session.first_channel``)."""
        started = time.perf_counter()
        try:
            plan, key = self._plan_and_key(session, network, made)
        except BaseException:
            if made is not None:
                made.scratch = ""  # the session's: it goes with the session
                self._let_go(made)
            raise
        session.poolable = key is not None
        planned = time.perf_counter()
        dns = self.networks.begin_dns_check(plan)
        ready = None
        if made is not None:
            # The opener's channel goes with the session made ahead: its tool
            # server then serves it from its start, where an attach after the
            # reply found it setting up (a channel's thread started, a control
            # message read) while the first call waited.
            pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if channel_ahead else None
            try:
                ready = self._adopt(session, plan, key, made, meanwhile, pair[1].fileno() if pair else -1)
            except BaseException:
                if pair is not None:
                    pair[0].close()
                raise
            finally:
                if pair is not None:
                    pair[1].close()  # the worker has its own (or the sandbox is gone)
            if pair is not None:
                if ready is None:
                    pair[0].close()  # a sandbox made now instead: attach makes its channel
                else:
                    session.first_channel = (made.control, pair[0])  # _discard closes it on a failure below
        if made is not None and ready is not None:
            worker, control, msg = made.worker, made.control, ready
            ns_fds, stack, net = made.ns_fds, made.stack, made.net
            door = None  # made ahead: its door served with its stack already
        else:
            if plan.cgroup is not None and not session.cgroup:
                cgroups.create(plan.cgroup)  # limits in force before the first process joins
                session.cgroup = plan.cgroup.path
            # Beside a new sandbox (its start is one request, answered once ready): on a thread.
            beside = Beside(meanwhile) if meanwhile is not None and not meanwhile.ran else None
            try:
                worker, control, msg = self.fork_server.start_worker(plan, session.worktree_dir.fd,
                                                                     session.worktree, READY_TIMEOUT_S)
            finally:
                if beside is not None:
                    beside.wait()
            stack, net = None, None
            try:
                ns_fds = take_namespaces(plan, msg, control)
                try:
                    door = take_door(msg, control)
                except BaseException:
                    for fd in ns_fds or ():
                        os.close(fd)
                    raise
            except BaseException:
                worker.kill()
                control.close()
                raise
        kit: list[int] = []
        try:
            self.networks.start_proxy(session, plan, msg, control)
            kit = self._take_kit(msg, control)
        except BaseException:  # whatever failed, the worker and what it sent go
            for fd in [*(ns_fds or ()), *kit]:
                os.close(fd)
            for sock in door or ():
                sock.close()
            if stack is not None:
                stack.stop()
            worker.kill()
            control.close()
            raise
        ready_at = time.perf_counter()
        if steps is not None:
            steps["sandbox_plan"] = (planned - started) * 1e3
            steps["sandbox_ready"] = (ready_at - planned) * 1e3
        log.debug("event=worker_ready session=%s pid=%s made_ahead=%d channel_ahead=%d steps_ms=%s", session.id,
                  worker.pid, ready is not None, session.first_channel is not None,
                  ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()))
        session.worker = worker
        session.ns_fds, session.stack, session.net, session.door = ns_fds, stack, net, door
        try:
            self.networks.apply(session, plan.net)  # nothing left to do for one made ahead
            self.networks.check_dns(session, dns)
        except BaseException:
            stop_network(session)
            session.worker = None
            worker.kill()
            control.close()
            raise
        session.control = control
        if session.first_channel is not None:  # sent with AdoptSession, to this control's tool server
            session.added = 1  # counted as the worker counts it
        session.network = network
        session.protections = msg.protections
        session.plan, session.kit = plan, kit
        session.env_set, session.env_unset = {}, set()
        session.ended = threading.Event()
        if steps is not None:
            steps["sandbox_network"] = (time.perf_counter() - ready_at) * 1e3
        log.debug("event=worker_started session=%s total_ms=%.2f planned_ahead=%d", session.id,
                  (time.perf_counter() - started) * 1e3, made is not None and made.planned is not None
                  and plan is made.planned.plan)
        # Not waited for (threads.py): nothing of the open needs it running
        # yet; what the worker sends meanwhile waits in the channel.
        threads.Thread(target=self._watch, args=(session, control, session.ended),
                       daemon=True, name=f"watch-{session.id}").start()
        if session.user_env:  # before any call can reach this tool server: attach comes after
            self.send_command_env(session, session.user_env, [])
        if steps is not None:
            steps["sandbox_rest"] = (time.perf_counter() - ready_at) * 1e3 - steps["sandbox_network"]

    @staticmethod
    def _take_kit(msg: protocol.WorkerReady, control: protocol.FrameSocket) -> list[int]:
        """The wake kit the worker sent with ``WorkerReady`` (last of its fds)."""
        kit: list[int] = []
        try:
            for _ in range(msg.wake_kit):
                kit.append(control.take_fd())
        except protocol.ProtocolError as exc:
            for fd in kit:
                os.close(fd)
            raise ConfinementError("sleep: wake kit", detail=str(exc)) from exc
        return kit


class _Once:
    """``fn`` run once, by whoever calls first, on that caller's thread;
    never raises: what ``fn`` raised is kept in ``error`` for the open to
    raise once its sandbox is in hand (to stop it). ``then`` runs after a
    ``fn`` that returned, on a thread of its own that nobody waits for (the
    baseline record's fsyncs: what needs them, the write lock's grant,
    waits for them itself)."""

    def __init__(self, fn: Callable[[], None], then: Callable[[], object]) -> None:
        self._fn, self._then = fn, then
        self._lock = threading.Lock()
        self.ran = False
        self.error: BaseException | None = None
        self.ms = 0.0  # how long ``fn`` took

    def __call__(self) -> None:
        with self._lock:  # a second caller waits for the first's run
            if self.ran:
                return
            self.ran = True
            started = time.perf_counter()
            try:
                self._fn()
            except BaseException as exc:  # noqa: BLE001 - raised by the open (see the class)
                self.error = exc
                return
            finally:
                self.ms = (time.perf_counter() - started) * 1e3
        try:
            threads.Thread(target=self._then, daemon=True, name="durable").start()
        except RuntimeError:  # no thread to be had: the grant makes it durable when asked
            pass

