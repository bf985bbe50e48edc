"""One trusted baseline per worktree, on disk, whatever the sessions and
the daemon do: what the user's git and other tools would run, as the user
left it, checked at every session's end and after a daemon that died.

A *domain* is the set of worktrees whose sessions can change what another
one's user would run: worktrees that overlap, share a repository (linked
ones) or hold another's (``inside.worktrees_relate``). Its baseline is taken
when the first session of the domain opens (no session of it runs then: the
state is the user's) and kept, unchanged, until the last one ends:

- a session opening while others of the domain run never takes a baseline
  of what they may have planted: a worktree inside one already covered adds
  nothing; a new one (a sibling, or one around those covered) adds a *part*
  of its own, which leaves out the parts it contains, and every part stays
  checked until the domain ends. The oldest part's record is always there;
- every session's end (and a network switch that replaces its sandbox)
  checks every part against its baseline and moves aside what differs
  (``redirects``, ``snapshots``, ``runnables``); the last end runs with
  no process of the domain left, so nothing can race it, and also puts back
  the repository's history (``history``); then the record goes (by
  ``later``: the daemon removes it just after the close's reply, the
  record on disk and its lock held until then), and the user's next changes
  are the next baseline;
- the record (``STATE/baselines/ID.json``) is written atomically (a
  temporary file, fsync, rename, fsync of the directory), and a daemon
  holds ``ID.lock`` (flock) while the domain lives; both are opened and
  read by ``recordfiles``, as every other look at them. The first record of a
  domain may be made durable later (``join(defer=True)``; ``pending``):
  nothing that can change the worktree runs before ``durable`` has returned
  None. Every later write of a domain's record waits for the deferred one,
  and is durable before it returns. A daemon that starts finds every record
  whose lock it can take (its daemon died: SIGKILL, the OOM killer) and runs
  the last end's check for it before it serves anyone (``recover``), then
  removes what a ref's write cut short left (``reftemp``); ``status`` says
  what it did;
- a check that cannot finish (something it cannot move, a walk over its
  bounds) leaves the record on disk and the worktree refused until a
  restart's check passes; one beside live sessions of the domain, until
  the domain's last end passes, or a restart's (``taints``);
- the joins and checks of one domain take turns on the domain's own lock (a
  join claims its worktree before it walks: an overlapping or linked one
  waits, and joins the same baseline); unrelated domains run side by side.
The baseline is the daemon's: degraded mode (no mount namespace) keeps it.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import msgspec

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import history, noroom, recordfiles, reftemp, reportlog, snapshots
from dispatchd.daemon.gitguard.domain import Domain
from dispatchd.daemon.gitguard.parts import (Part, Protected, Record, add_history, baseline_tree, merged, check_part,
                                             UNTIL_LAST_END, common_of, drop_replaced, failures_said, ident_of,
                                             keep_outside, renew, unchecked)
from dispatchd.daemon.gitguard.pending import remove_strays
from dispatchd.daemon.gitguard.taints import Taints
from dispatchd.errors import WorktreeError
from dispatchd.durable import fsync_directory
from dispatchd.fsnames import shown
from dispatchd.inside import is_within, worktrees_relate
from dispatchd.logtext import Bounded
from dispatchd.secretbook import scrubbed

log = logging.getLogger("dispatchd.baselines")


class Baselines:
    """The daemon's domains; every method is safe from many threads. The
    store's lock is held only to look up and change which domains there are;
    each domain's own lock is held through a join's walk and a check, so the
    opens and ends of one domain serialize, and those of unrelated domains
    run side by side. Where two locks are held, a domain's comes first."""

    def __init__(self, state_dir: str, home: str = "") -> None:
        self.dir = os.path.join(state_dir, "baselines")
        self.keep_dir = os.path.join(state_dir, "keep")
        self.home = home
        self._lock = threading.RLock()
        self._domains: dict[str, Domain] = {}
        self._by_session: dict[str, Domain] = {}
        self._joined_at: dict[str, int] = {}  # a session's first report of its domain's list
        self.taints = Taints()
        self.tainted = self.taints.why  # worktree -> why (refused until a check passes: taints.py)
        self.recovered: list[Protected] = []  # what the start's checks did
        # How a record's removal is made durable, and when the last end's removal is done: at once,
        # or by the daemon after the close's reply (daemon/afterwards.py): its unlink waits behind
        # the disk's journal, 0.3-40 ms on a loaded machine (docs/performance.md).
        self.sync_dir: Callable[[str], None] = fsync_directory
        self.later: Callable[[Callable[[], None]], None] = lambda job: job()  # at once
        self.settle_delay_s = 0.0  # testing only: see pending.Durable

    # --- on disk ---------------------------------------------------------

    def _write(self, domain: Domain, *, defer: bool = False) -> None:
        """``domain``'s record on disk, durable when this returns; with
        ``defer`` (its first record only), written to its temporary file,
        and made durable by ``domain.pending.settle()`` (``recordfiles.write``)."""
        self._settle(domain)  # a deferred rename must never land over a newer record
        recordfiles.write(self.dir, domain, defer=defer, settle_delay_s=self.settle_delay_s)

    @staticmethod
    def _settle(domain: Domain) -> str | None:
        return domain.pending.settle() if domain.pending is not None else None

    def durable(self, sid: str) -> str | None:
        """None once the record ``sid``'s join wrote is on disk (made durable
        here if it is not yet: its fsyncs, a few milliseconds); else why
        not. Call before anything that can change the session's worktree."""
        with self._lock:
            domain = self._by_session.get(sid)
        return self._settle(domain) if domain is not None else None

    def writing(self, sid: str) -> None:
        """``sid`` was granted its worktree's write lock (see ``Domain.wrote``)."""
        with self._lock:
            if sid in self._by_session:
                self._by_session[sid].wrote = True

    def _drop(self, domain: Domain, sync: Callable[[str], None] | None = None) -> None:
        """The domain's record and lock removed; it has no session left."""
        if domain.pending is not None:  # abandoned first: a rename after the removal would bring the record back
            domain.pending.abandon()
        did, lock_fd = domain.record.id, domain.lock_fd
        for name in (f"{did}.json", f"{did}.lock"):
            try:
                os.unlink(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        (sync or self.sync_dir)(self.dir)
        if lock_fd >= 0:
            os.close(lock_fd)

    def _drop_later(self, domain: Domain) -> None:
        """The last end's drop, by ``later``: the domain is gone from memory
        already (a new open takes a new baseline); its record stays on disk,
        its lock held, until then. A daemon that dies meanwhile leaves the
        record, and the next start checks against it (moved aside, never
        deleted; history only put back)."""
        self.later(lambda: self._drop(domain, sync=fsync_directory))

    # --- start -------------------------------------------------------------

    def recover(self, related: Callable[[list[str], list[str]], bool] | None = None) -> list[Protected]:
        """Finish the checks a daemon that died left (see the module): at
        start; at an open, those ``related(roots, commons)`` to its worktree."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        remove_strays(self.dir, names)  # killed daemons' temporary records and lone locks; no live daemon's
        reach = recordfiles.reach_of_all(self.dir, names)  # all that sessions could write: parts.drop_replaced
        for name in names:
            if not name.endswith(".json"):
                continue
            did = name[:-5]
            fd = recordfiles.lock(self.dir, did)
            if fd is None:
                continue  # a live daemon holds it
            try:
                record = recordfiles.read(os.path.join(self.dir, name))
            except (OSError, msgspec.DecodeError) as exc:
                log.error("event=baseline_unreadable file=%s error=%r", name, str(exc))
                os.close(fd)
                continue
            if related is not None and not related([p.root for p in record.parts],
                                                   [p.related_common for p in record.parts if p.common]):
                os.close(fd)
                continue
            domain = Domain(record, fd)
            log.warning("event=baseline_recover domain=%s sessions=%s roots=%s", did, ",".join(record.sessions),
                        ",".join(p.root for p in record.parts))
            self.recovered += drop_replaced(record, time.time(), reach)  # a re-clone at its path: not its baseline
            failed, found = self._check(domain, final=True) if record.parts else ([], [])
            for kept in record.histories:
                reftemp.sweep(kept.common, [*kept.refs, "HEAD"])
            self.recovered += found
            if failed:
                self._taint(domain, failed, final=True)  # bounded (failures_said), as an end's: one status at most
                os.close(fd)  # the record stays: the next start checks again
            else:
                self._drop(domain)
        return self.recovered

    # --- open --------------------------------------------------------------

    def join(self, sid: str, root: str, layout: GitLayout, snapshot: snapshots.GitSnapshot,
             redirects: list[str], names: tuple[str, ...], *, defer: bool = False, writable: bool = True,
             reach: tuple[str, ...] = (), secrets: Mapping[str, str] | None = None) -> None:
        """Make ``sid`` a session of the domain of ``root`` (see the module); raises WorktreeError when the
        worktree cannot be recorded (a walk over its bounds). Call before the session's sandbox starts. Waits
        only for joins and checks of the same domain. ``defer``: a new domain's record is made durable by
        ``durable(sid)`` (a join into a domain that has one rewrites it durably: a rename not yet synced must
        never stand over a record other sessions rely on). ``writable``: False when the kernel holds the
        session's worktree read-only (``Record.writable``); ``reach``: what it can write (``Record.reach``);
        ``secrets``: the session's, by which the domain's reports are redacted from now on (``domain.py``).
        What of the repository's history is not kept is the session's first report."""
        common = common_of(root, layout)
        noroom.ensure()  # the room an end's renames need, made again if one used it
        try:
            domain = self._enter(root, common)
        except OSError as exc:  # the merged record of related domains not written: each is as it was
            raise WorktreeError(f"{root}: its baseline cannot be recorded in {self.dir} ({exc.strerror}); "
                                "no session opened", root) from exc
        record = domain.record
        # What the join changes in the record, as it was: a join that fails
        # before its record is written leaves none of it (its part counted as
        # covering the root, a flag it flipped, would outlive it).
        before = (list(record.parts), list(record.histories), record.writable, record.reach)
        written = False
        try:
            domain.secrets.add(secrets or {})  # before any check can report what its code named
            history.own_unheld_packs(record.histories, layout.read_only)  # before anything of it is recorded
            covered, unkept = any(is_within(root, p.root) for p in record.parts), ""
            if not covered:
                excluded = [p.root for p in record.parts if is_within(p.root, root)]
                tree = baseline_tree(root, names, excluded, layout, self.home)
                if record.sessions:  # sessions of the domain run: what they could write is no one's to put back
                    snapshot = keep_outside(snapshot, root, record.reach)
                    tree = keep_outside(tree, root, record.reach)
                part = Part(root=root, layout=layout, git=snapshot, redirects=redirects, tree=tree,
                            names=list(names), excluded=excluded, home=self.home, resolved_common=common,
                            unwritten=not (record.writable or writable), ident=ident_of(root))
                record.parts.append(part)
                unkept = add_history(record, part, self.keep_dir)
            if (writable or record.writable) and any(p.unwritten for p in record.parts):
                renew(record, self.keep_dir)  # no session of those parts could write: what is there is the user's
            record.sessions.append(sid)
            record.writable = record.writable or writable
            if record.reach is not None:
                record.reach = sorted(set(record.reach) | set(reach))
            try:
                self._write(domain, defer=defer and len(record.sessions) == 1 and len(record.parts) == 1
                            and domain.pending is None)
            except Exception as exc:  # a full disk; or a bug, content not foreseen: refused, and said
                if not isinstance(exc, OSError):
                    log.exception("event=baseline_unrecorded root=%s", root)
                why = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {shown(str(exc))}"
                raise WorktreeError(f"{root}: its baseline cannot be recorded in {self.dir} ({why}); "
                                    "no session opened", root) from exc
            written = True
            with self._lock:
                self._by_session[sid] = domain
                self._joined_at[sid] = domain.reports.end
                if unkept:  # told to the session and in `dispatch status`, not only logged
                    domain.reports.add([Protected(path=shown(common), why=unkept, time=time.time())])
        except BaseException:
            # Whatever failed, the session never joined (a domain keeping its id failed every later open).
            if sid in domain.record.sessions:
                domain.record.sessions.remove(sid)
            if not written:
                record.parts, record.histories, record.writable, record.reach = before
            self._discard_if_empty(domain)
            raise
        finally:
            with self._lock:
                domain.claims.remove((root, common))
            domain.lock.release()

    def _enter(self, root: str, common: str) -> Domain:
        """The domain ``root`` belongs to, its lock held and ``root`` claimed
        in it (so that a join of an overlapping worktree meanwhile finds it):
        a new one, or the one the related domains are merged into. Waits for
        the related domains' joins and checks, never for others'."""
        while True:
            with self._lock:
                refused = self.taints.refusal(root, inside=False)
                if refused:
                    raise WorktreeError(refused, root)
                related = self._related(root, common)
                if not related:
                    did = secrets.token_hex(8)
                    domain = Domain(Record(id=did, created=time.time(), writable=False, reach=[]),
                                    recordfiles.lock(self.dir, did, blocking=True) or -1, wrote=False)
                    domain.lock.acquire()  # new: nobody else holds it
                    domain.claims.append((root, common))
                    self._domains[did] = domain
                    return domain
            # One lock at a time would deadlock two joins that merge the
            # same domains: always taken in the order of the domains' ids.
            for d in related:
                d.lock.acquire()
            with self._lock:
                if all(d.alive for d in related) and self._related(root, common) == related:
                    into, merged = related[0], 1
                    try:
                        for other in related[1:]:
                            self._merge(into, other)
                            other.lock.release()
                            merged += 1
                    except BaseException:  # a record not written (a full disk): every lock still held let go
                        for d in [into, *related[merged:]]:
                            d.lock.release()
                        raise
                    into.claims.append((root, common))
                    return into
            for d in related:  # merged, ended or joined by another meanwhile: look again
                d.lock.release()

    def _related(self, root: str, common: str) -> list[Domain]:
        """The live domains ``root`` relates to (``worktrees_relate``), by
        their parts and the roots their joins under way claim."""
        def relates(other_root: str, other_common: str) -> bool:
            return worktrees_relate(root, common, other_root, other_common)
        return sorted((d for d in self._domains.values()
                       if any(relates(p.root, p.related_common) for p in d.record.parts)
                       or any(relates(r, c) for r, c in d.claims)), key=lambda d: d.record.id)

    def _merge(self, into: Domain, other: Domain) -> None:
        """Both domains' locks and the store's held. The merged record is
        written before anything in memory changes: a write that fails (a full
        disk) leaves both domains as they were, in memory and on disk."""
        record = into.record
        self._settle(other)  # its record stays until ``into``'s, durable, holds its parts
        into.record = merged(record, other.record)
        try:
            self._write(into)
        except BaseException:
            into.record = record
            raise
        moved = into.reports.take(other.reports, other.first_root)
        for sid in other.record.sessions:
            if sid in self._joined_at:
                self._joined_at[sid] = moved(self._joined_at[sid])
        into.secrets.add(other.secrets.pairs())
        into.wrote |= other.wrote
        for sid in other.record.sessions:
            self._by_session[sid] = into
        self._domains.pop(other.record.id, None)
        other.end()
        self._drop(other)

    def _discard_if_empty(self, domain: Domain) -> None:
        """A join that failed: a domain no session has joined (the one this
        join made) goes, and its files with it."""
        with self._lock:
            if domain.record.sessions or not domain.alive:
                return
            self._domains.pop(domain.record.id, None)
            domain.end()
            if domain.lock_fd >= 0:
                self._drop(domain)

    # --- checks ------------------------------------------------------------

    def _locked(self, sid: str) -> Domain | None:
        """``sid``'s domain with its lock held (None: no such session)."""
        while True:
            with self._lock:
                domain = self._by_session.get(sid)
            if domain is None:
                return None
            domain.lock.acquire()
            with self._lock:
                if self._by_session.get(sid) is domain:
                    return domain
            domain.lock.release()  # merged into another meanwhile

    def check(self, sid: str) -> list[Protected]:
        """A sandbox of ``sid`` ended (a network switch): check its domain
        against the baseline; returns what this check moved aside."""
        domain = self._locked(sid)
        if domain is None:
            return []
        try:
            # Its index reviewed only where no other session of the domain runs.
            failed, found = self._check(domain, final=False, index=len(domain.record.sessions) <= 1)
            self._taint(domain, failed, final=False)
            return found
        finally:
            domain.lock.release()

    def leave(self, sid: str) -> list[Protected]:
        """``sid`` ended, its processes gone: check its domain; the last
        session's end also restores history and drops the record."""
        domain = self._locked(sid)
        if domain is None:
            with self._lock:
                self._joined_at.pop(sid, None)
            return []
        try:
            record = domain.record
            with self._lock:
                self._by_session.pop(sid, None)
                self._joined_at.pop(sid, None)
                if sid in record.sessions:
                    record.sessions.remove(sid)
            final = not record.sessions
            failed, found = self._check(domain, final=final)
            self._taint(domain, failed, final=final)
            if final and not failed:  # what earlier ends beside live sessions could not do is done now
                found = found + self.taints.lift([p.root for p in record.parts])
            if final:
                with self._lock:
                    # A join waiting for this lock finds the domain gone and
                    # takes a new baseline, of the tree as this check left it.
                    self._domains.pop(record.id, None)
                    domain.alive = False  # its secrets kept until its last reports are made (below)
                if failed:
                    self._settle(domain)
                    if domain.lock_fd >= 0:
                        os.close(domain.lock_fd)  # kept on disk: the next start checks again
                else:
                    self._drop_later(domain)
            else:
                try:
                    self._write(domain)
                except OSError as exc:  # a full disk: this end's check is done all the same, and said
                    path = os.path.join(self.dir, f"{record.id}.json")
                    log.error("event=baseline_not_rewritten domain=%s session=%s error=%r", record.id, sid, str(exc))
                    found = found + [reportlog.unrewritten(path, exc)]
            return found
        finally:
            if not domain.alive:
                domain.end()
            domain.lock.release()

    def borrowed(self, sid: str, common: str) -> list[str]:
        """The object stores the alternates of the repository at ``common``
        named at the baseline of ``sid``'s domain (``history.borrowed``);
        none when it has no history of it (a repository made since)."""
        with self._lock:
            domain = self._by_session.get(sid)
            kept = list(domain.record.histories) if domain is not None else []
        real = os.path.realpath(common)
        return next((history.borrowed(h) for h in kept if os.path.realpath(h.common) == real), [])

    def text_for(self, sid: str, text: str) -> str:
        """``text`` (names its worktree holds) redacted by ``sid``'s domain's secrets."""
        with self._lock:
            domain = self._by_session.get(sid)
        return domain.secrets.text(text) if domain is not None else text

    def reports_for(self, sid: str) -> list[Protected]:
        """What the checks of ``sid``'s domain did since it joined."""
        with self._lock:
            domain = self._by_session.get(sid)
            if domain is None:
                return []
            return domain.reports.since(self._joined_at.get(sid, 0), domain.first_root)

    def _taint(self, domain: Domain, failed: list[str], *, final: bool) -> None:
        if failed:
            reason = domain.secrets.text(failures_said(failed))
            self.taints.fail([part.root for part in domain.record.parts], reason, final=final)
            log.error("event=git_check_failed domain=%s what=%r", domain.record.id, reason)

    def _check(self, domain: Domain, *, final: bool, index: bool | None = None) -> tuple[list[str], list[Protected]]:
        """Check the domain (see the module): what could not be done, and what was moved aside or
        put back (readable and bounded: ``reportlog``), added to the domain's reports."""
        if not domain.record.writable:
            return [], []  # no session could write any of it: what changed is the user's
        failed: list[str] = []
        found: list[Protected] = []
        now_t = time.time()
        covered: set[str] = set()  # the first part's baseline is the user's: a later one's may not be
        said = Bounded()  # a session leaving thousands of files floods neither the log nor its rotation away
        until = () if final else (UNTIL_LAST_END,)  # what lifts the refusal a failure leaves (taints.py)
        for part in domain.record.parts:
            try:
                bad = check_part(part, found, now_t, covered, said, index=final if index is None else index,
                                 wrote=domain.wrote)
            except Exception as exc:  # a bug, or content not foreseen: fail closed
                bad = [f"{part.root}: the check itself failed: {type(exc).__name__}: {exc}"]
            bad = [shown(b) for b in bad]  # names in them, as in the reports (fsnames.py)
            failed += bad
            found += [unchecked(part.root, bad, now_t, *until)] if bad else []  # said at the close, not only logged
        if final:
            for kept in domain.record.histories:
                try:
                    done, bad = history.restore(kept, in_place=domain.wrote)
                except Exception as exc:
                    done, bad = [], [f"{kept.common}: restoring history failed: {type(exc).__name__}: {exc}"]
                bad = [shown(b) for b in bad]
                failed += bad
                found += [unchecked(kept.common, bad, now_t, *until)] if bad else []
                for path, why in ((shown(path), shown(why)) for path, why in done):
                    said.say(log, "event=git_history_restored path=%s why=%r", path, why)
                    found.append(Protected(path=path, why=why, time=now_t))
        said.end(log, "moved aside or put back by this check, not logged one by one; the close's reply and "
                      "`dispatch status` list them")
        found = reportlog.bounded(reportlog.readable(found), domain.first_root, now_t)
        found = scrubbed(found, domain.secrets)  # kept, and shown to every session of the domain: redacted now
        with self._lock:
            domain.reports.add(found)
        return failed, found
