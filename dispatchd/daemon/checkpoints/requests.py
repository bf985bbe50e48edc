"""The daemon's side of checkpoints: a session held still (its tool server
paused, nothing in flight; for a restore, no process running), the
requests answered (``handle``), and a checkpoint before every write when
the policy asks (``before_write``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Protocol

from dispatchd import protocol
from dispatchd.errors import CheckpointError, SessionError
from dispatchd.fsnames import shown
from dispatchd.secretbook import said

from dispatchd.daemon.gitguard import Baselines
from dispatchd.daemon.lifecycle import Op, State, Verdict
from dispatchd.daemon.session import Session, count_session_processes

from dispatchd.daemon.checkpoints.store import Store


class SessionManager(Protocol):
    """What a checkpoint asks of the daemon's sessions (``table.SessionTable``)."""

    @property
    def checkpoints(self) -> Store: ...
    @property
    def baselines(self) -> Baselines: ...
    def get(self, sid: str) -> Session: ...
    def _admit(self, session: Session, op: Op) -> Verdict: ...
    def _grant_write_lock(self, session: Session, rid: int) -> protocol.OkReply | protocol.ErrorReply: ...


# --- the session's side: pause it, check it is quiet, answer requests -------------

_PAUSE_TIMEOUT_S = 10.0


@contextlib.contextmanager
def _quiet(manager: SessionManager, session: Session, verb: str) -> Iterator[None]:
    """The session held still for a checkpoint or a restore (``verb``): its
    lock held (no close, network switch, wake or attach meanwhile), its tool
    server paused (calls that come wait), nothing in flight; for a restore,
    no process of the session either. Refused otherwise, saying what runs."""
    with session.lock:
        manager._admit(session, Op.CHECKPOINT)  # closing or closed: refused, as any request is
        control = session.control
        if session.state is State.ASLEEP or control is None:
            if verb == "restore":
                _take_write_lock(manager, session)
            yield  # asleep: no process of it runs, and none starts while we hold its lock
            return
        rid, done, answer = manager.checkpoints.pauses.ask()
        try:
            with session.send_lock:
                control.send(protocol.Pause(id=rid))
        except OSError as exc:
            manager.checkpoints.pauses.forget(rid)
            raise SessionError(f"session {session.id} has ended", session.id) from exc
        if not done.wait(_PAUSE_TIMEOUT_S):
            manager.checkpoints.pauses.forget(rid)
            raise CheckpointError(f"{verb} refused: session {session.id}'s tool server did not answer within "
                                  f"{_PAUSE_TIMEOUT_S:g} s; try again", "session_busy")
        if answer[0].busy:
            raise CheckpointError(f"{verb} refused: session {session.id} has {answer[0].busy}; wait for it to "
                                  f"return (or end it: session.cancel()) and {verb} again", "session_busy")
        try:
            if verb == "restore":
                _take_write_lock(manager, session)
                running = _processes(session)
                if running:
                    raise CheckpointError(
                        f"restore refused: session {session.id} has {running} process(es) running (a background "
                        "job, or a process a command left); they could write into the worktree while it is "
                        "restored: stop them (job_stop) and restore again", "session_busy")
            yield
        finally:
            try:
                with session.send_lock:
                    control.send(protocol.Resume())
            except OSError:
                pass  # the worker is gone: nothing waits


def _take_write_lock(manager: SessionManager, session: Session) -> None:
    """A restore writes the worktree: only a session that may write it, and
    holds (or now takes) its write lock, one writer per worktree."""
    if session.policy.filesystem.worktree == "read-only":
        raise CheckpointError(f"restore refused: session {session.id}'s policy ({session.policy.name}) keeps the "
                              "worktree read-only", "checkpoint_refused")
    reply = manager._grant_write_lock(session, 0)
    if isinstance(reply, protocol.ErrorReply):
        raise CheckpointError(f"restore refused: {reply.message}", reply.code)


def _processes(session: Session) -> int:
    return count_session_processes(session)


def handle(manager: SessionManager, req: protocol.TakeCheckpoint | protocol.ListCheckpoints
           | protocol.RestoreCheckpoint) -> protocol.CheckpointReply | protocol.CheckpointsReply | protocol.RestoredReply:
    """The daemon's answer to a client's checkpoint request (``server.py``)."""
    session = manager.get(req.session)
    store = manager.checkpoints
    if isinstance(req, protocol.ListCheckpoints):
        return protocol.CheckpointsReply(id=req.id, checkpoints=store.infos(session.id))
    policy = session.policy.checkpoints
    if isinstance(req, protocol.TakeCheckpoint):
        with _quiet(manager, session, "checkpoint"), store.lock(session.id):
            # A label is shown back and kept: one naming a secret is redacted first.
            info = store.take(session.id, session.worktree, policy, session.held.text(req.label),
                              fsync=session.policy.limits.fsync)
        return protocol.CheckpointReply(id=req.id, checkpoint=info)
    store.find(session.id, req.checkpoint)  # an unknown id is refused before anything is paused
    with _quiet(manager, session, "restore"), store.lock(session.id):
        # What the worktree holds now is kept first, so that a restore loses
        # nothing: files the user made beside the session since the
        # checkpoint (an .env, notes, a commit) are what a restore removes.
        # It can be restored in turn (undo). Not kept: not restored.
        # And past the session's end, as plain files (``preimages``): a session's
        # checkpoints go with it, the user's .env must not.
        fsync = session.policy.limits.fsync
        before = kept = ""
        kept_total: protocol.BeforeRestoreReport | None = None  # as admitted: the directory is looked at once
        try:
            before = store.take(session.id, session.worktree, policy, f"before restoring {req.checkpoint}",
                                fsync=fsync, spare=req.checkpoint).id
            kept, kept_total = store.keep_before(session.id, session.worktree, before, req.checkpoint, fsync=fsync)
        except CheckpointError as exc:
            if not req.force:
                raise CheckpointError(f"restore refused: the worktree as it is now could not be kept first, and a "
                                      f"restore would lose it ({exc.message}); nothing was changed (force=True, "
                                      "`dispatch session restore --force`: restore anyway, without keeping it)",
                                      exc.code) from exc
            # The caller chose to lose it (a session can make it unkeepable on purpose);
            # a before taken but not kept past the session is still named, for an undo meanwhile.
        # A shared clone's commits are in the stores its alternates named at the baseline
        # (never a session's): a ref moved along them is moved forward, and not kept.
        borrowed = manager.baselines.borrowed(session.id, os.path.join(session.worktree, ".git"))
        done, displaced, left = store.restore(session.id, session.worktree, req.checkpoint, policy, fsync=fsync, kept=kept,
                                        borrowed=borrowed, before=before)
    # Ref names are the worktree's: any session of its domain may have chosen them (one not UTF-8 as \xNN).
    displaced = [manager.baselines.text_for(session.id, shown(ref)) for ref in displaced]
    left = [manager.baselines.text_for(session.id, shown(why)) for why in left]
    return protocol.RestoredReply(id=req.id, checkpoint=req.checkpoint, before=before, kept=kept,
                                  displaced=displaced, kept_total=kept_total if kept else None,
                                  not_restored=left, **done)


def before_write(manager: SessionManager, session: Session, msg: protocol.AcquireWriteLock,
                 control: protocol.FrameSocket) -> None:
    """Policy ``[checkpoints] before_writes``: the write lock, then a
    checkpoint labelled with the tool, then the answer; on a thread of its own
    (the session's control channel is read meanwhile). A checkpoint refused
    refuses the call: the user asked for none to run without one."""
    def run() -> None:
        reply: protocol.OkReply | protocol.ErrorReply = manager._grant_write_lock(session, msg.id)
        if isinstance(reply, protocol.OkReply):
            try:
                with manager.checkpoints.lock(session.id):
                    manager.checkpoints.take(session.id, session.worktree, session.policy.checkpoints,
                                             f"before {msg.tool}" if msg.tool else "before a write",
                                             fsync=session.policy.limits.fsync)
            except SessionError as exc:  # it ended while this waited: no checkpoint, nor write, for it
                reply = protocol.ErrorReply(id=msg.id, code=exc.code, message=said(str(exc)))
            except (CheckpointError, OSError) as exc:
                why = exc.message if isinstance(exc, CheckpointError) else f"checkpoint failed: {exc}"
                reply = protocol.ErrorReply(id=msg.id, code="checkpoint_refused",
                                            message=said(f"{why} (the policy takes one before every write)"))
        try:
            with session.send_lock:
                control.send(reply)
        except OSError:
            pass  # the session ended meanwhile

    try:
        threading.Thread(target=run, daemon=True, name="checkpoint").start()
    except RuntimeError as exc:  # can't start new thread: the write is refused, the session's reader goes on
        try:
            with session.send_lock:
                control.send(protocol.ErrorReply(id=msg.id, code="checkpoint_refused", message=said(
                    f"the checkpoint before this write could not be taken: the daemon cannot start a thread "
                    f"({exc}); retry once commands end (the policy takes one before every write)")))
        except OSError:
            pass
