"""A baseline domain in memory (``baselines.Baselines`` keeps them): its
record, its lock, what its checks reported, and the secrets of every session
that joined it, by which those reports are redacted when they are recorded
(``dispatchd/secretbook.py``): a report is shown to every session of the
domain and outlives the session whose code chose the names in it."""

from __future__ import annotations

import threading

from dispatchd.daemon.gitguard.parts import Record
from dispatchd.daemon.gitguard.pending import Durable
from dispatchd.daemon.gitguard.reportlog import Reports
from dispatchd.secretbook import Secrets

__all__ = ["Domain"]


class Domain:
    """``lock`` is held by whoever reads or changes its record or its
    worktrees: a join (its walk), a check; ``claims`` and ``alive`` are the
    store's, read and changed under the store's lock."""

    def __init__(self, record: Record, lock_fd: int, *, wrote: bool = True) -> None:
        self.record = record
        self.wrote = wrote  # a session was granted the write lock, or not known: restore(in_place=)
        self.lock_fd = lock_fd
        self.reports = Reports()  # what its checks did (bounded: reportlog.py)
        self.lock = threading.Lock()
        self.alive = True  # False once merged into another, or ended
        self.claims: list[tuple[str, str]] = []  # (root, common) of joins under way, before their parts exist
        self.pending: Durable | None = None  # its first record, when made durable later (Baselines.durable)
        # Its sessions' secrets, past and present: in memory only (the record
        # on disk names sessions, never values), forgotten when it ends.
        self.secrets = Secrets()

    @property
    def first_root(self) -> str:
        """The worktree its reports name when they name no file: its first part's."""
        return self.record.parts[0].root if self.record.parts else ""

    def end(self) -> None:
        """Gone from the store (ended, merged, never joined): its secrets forgotten."""
        self.alive = False
        self.secrets.end()
