"""Sandboxes made ahead (``pool.py``): made on the pool's thread with the
shared part of a kind of session's plan, adopted by an open whose plan has
that very shared part, or let go.

Guarantees:
- a sandbox made ahead comes with its scratch directory, its cgroup and its
  network set up; one that cannot be made leaves none of them behind;
- a sandbox let go is killed, and everything the daemon held for it freed
  (its stack, namespaces, cgroup, and its scratch directory unless a
  session took it);
- an adoption that fails (a plan it was not made for, an error on the way)
  is logged and let go: the open makes a sandbox of its own, which repeats
  every check.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable

from dispatchd import protocol
from dispatchd.confine import cgroups
from dispatchd.confine.plan import SessionPaths, SessionPlan, plan_session, pool_key
from dispatchd.daemon import leftovers
from dispatchd.daemon.dnsrelay import session_resolv_binds
from dispatchd.daemon.napping import Napping
from dispatchd.daemon.planahead import Planned, plan_ahead
from dispatchd.daemon.pool import Kind, Made
from dispatchd.daemon.session import READY_TIMEOUT_S, Session
from dispatchd.daemon.sessionnet import drop_door, ports_of, take_door, take_namespaces
from dispatchd.daemon.spawn import Worker, adopt
from dispatchd.errors import DispatchdError, Stopping
from dispatchd.policy import Policy
from dispatchd.statemodes import retried

log = logging.getLogger("dispatchd.sessions")


class Pooling(Napping):
    def _make_scratch(self, sid: str, scratch: str) -> None:
        """A session's scratch directory (its /tmp and home), marked ours first."""
        self._scratch_locks.take(sid)  # before the directory: a later start knows it is ours
        try:
            # sessions/'s mode set back, if changed (statemodes.py)
            retried(lambda: os.makedirs(scratch + "/tmp", mode=0o700), scratch, None)
            os.makedirs(scratch + "/home", mode=0o700)
        except BaseException:
            leftovers.remove_tree(scratch)
            self._scratch_locks.release(sid)
            raise

    def start_pool(self) -> None:
        """Start making sandboxes ahead, first for the default policy's default
        network (when it loads: a broken policy only fails its own opens)."""
        try:
            policy = self.load_policy("default")
            first: Kind | None = ("default", policy.network.default)
        except Exception:
            first = None
        self.pool.start(first)

    def _make_ahead(self, kind: Kind) -> Made | None:
        """One sandbox of ``kind`` made ahead (on the pool's thread): its shared
        part applied, its cgroup made, its network set up. None when sessions
        of that kind are never made ahead (no ``pool_key``)."""
        if not self.accepting:
            raise Stopping("the daemon is stopping")
        cpu0 = time.thread_time()  # the make's share of the daemon's CPU, for the debug log (the bench's --steps)
        policy_name, network = kind
        policy = self.load_policy(policy_name)
        sid = secrets.token_hex(6)
        scratch = os.path.join(self.sessions_dir, sid)
        # Made with the plan of its likely session: the last open of the
        # kind's, as this session (planahead.py). The sandbox applies only its
        # shared part (pool_key), which depends on the policy, the network and
        # this machine: the same as a plan of the kind's own would have, and a
        # session whose plan has that key is given it (checked at adoption by
        # both sides, as always). That plan's bytes are the session's at its
        # adoption most often, then neither planned nor decoded again.
        planned = self._plan_likely(kind, sid, scratch, policy)
        if planned is not None:
            plan, key = planned.plan, planned.key
        else:
            # None opened yet (or its plan has no key): a plan of the kind,
            # the session's own parts placeholders, replaced by the session's
            # plan at adoption.
            paths = SessionPaths(worktree=os.path.join(scratch, "worktree"), scratch=scratch,
                                 runtime_dirs=self.runtime_dirs, code=self.code_paths,
                                 resolv=session_resolv_binds(self.dns_resolv))
            ports = ports_of(policy)  # as a session's: sorted, each once
            plan = plan_session(policy, self.kernel, session=sid, paths=paths, network=network, uid=self.uid,
                                gid=self.gid, base_env=self.base_env, ports=ports, delegation=self.delegation,
                                host_tree=self.host_tree, dns_door=self.dns is not None)
            key = pool_key(plan)
        if key is None:
            return None
        self._make_scratch(sid, scratch)  # the session's, made ahead with it
        cgroup = ""
        box: list[Made] = []  # the sandbox, once it has a process

        def with_namespaces(worker: Worker, control: protocol.FrameSocket,
                            msg: protocol.WorkerNamespaces | None) -> None:
            box.append(Made(kind=kind, sid=sid, key=key, worker=worker, control=control, cgroup=cgroup,
                            scratch=scratch, planned=planned))
            if msg is not None:
                box[0].ns_fds = take_namespaces(plan, msg, control)
                box[0].door = take_door(msg, control)
            # Sent as soon as they were made: the stack starts while the
            # sandbox builds its root (a network-on make no longer waits
            # for the one, then the other).
            self.networks.apply(box[0], plan.net)

        try:
            if plan.cgroup is not None:
                cgroups.create(plan.cgroup)
                cgroup = plan.cgroup.path
            worker, control, msg = self.fork_server.make_ahead(plan, READY_TIMEOUT_S, with_namespaces,
                                                               planned.encoded if planned is not None else None)
            if not box:  # no namespaces of its own: none sent early
                with_namespaces(worker, control, None)
        except BaseException:
            if box:
                self._let_go(box[0])
            else:
                self._remove_cgroup_path(cgroup, sid)
                leftovers.remove_tree(scratch)
                self._scratch_locks.release(sid)
            raise
        made = box[0]
        log.debug("event=pool_made kind=%s/%s session=%s pid=%s steps_ms=%s,daemon_cpu:%.2f", policy_name, network, sid,
                  worker.pid, ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()),
                  (time.thread_time() - cpu0) * 1e3)
        return made

    def _plan_likely(self, kind: Kind, sid: str, scratch: str, policy: Policy) -> Planned | None:
        """The plan of session ``sid`` if it opens as the kind's last open
        did, or None: no open of the kind yet, a plan that cannot be made (an
        open like it is then refused as always) or has no pool key."""
        last = self._last_inputs.get(kind)
        if last is None:
            return None
        try:
            planned = plan_ahead(last, session=sid, scratch=scratch, policy=policy)
        except Exception as exc:  # noqa: BLE001 - then planned at open, where the same error refuses that open
            log.debug("event=plan_ahead_failed session=%s error=%s", sid, exc)
            return None
        return planned if planned.key is not None else None

    def _adopt(self, session: Session, plan: SessionPlan, key: bytes | None,
               made: Made, meanwhile: Callable[[], None] | None = None,
               channel_fd: int = -1) -> protocol.WorkerReady | None:
        """Give ``made`` its session (its report), or let it go and return None (the caller
        makes a sandbox at open instead): a plan it was not made for (the
        policy was edited since), or a failure on the way (logged; a fresh
        sandbox repeats every check and fails for itself if it must).
        ``meanwhile`` runs while the worker applies the session (spawn.adopt);
        it must not raise. ``channel_fd``: the opener's channel, sent with the
        session (-1: none)."""
        made.scratch = ""  # the session's from here: it goes with the session (_discard)
        if key != made.key:
            log.info("event=pool_mismatch session=%s", session.id)
            self._let_go(made)
            return None
        try:
            ready = adopt(made.worker, made.control, plan, session.worktree_dir.fd, session.worktree,
                          READY_TIMEOUT_S, made.planned.encoded if made.planned and plan is made.planned.plan else None,
                          meanwhile, channel_fd)
        except DispatchdError as exc:
            log.warning("event=pool_adopt_failed session=%s error=%s", session.id, exc)
            self._let_go(made)
            return None
        session.cgroup = made.cgroup
        self.pool.served_one()
        return ready

    def _let_go(self, made: Made) -> None:
        """A sandbox made ahead that serves no session: killed, and what the
        daemon holds for it freed (its stack, namespaces, cgroup)."""
        made.worker.kill()
        made.control.close()
        if made.stack is not None:
            made.stack.stop()
            made.stack = None
        for fd in made.ns_fds or ():
            os.close(fd)
        made.ns_fds = None
        drop_door(made)
        self._remove_cgroup_path(made.cgroup, made.sid)
        made.cgroup = ""
        if made.scratch:  # never given to a session
            leftovers.remove_tree(made.scratch)
            self._scratch_locks.release(made.sid)
            made.scratch = ""
