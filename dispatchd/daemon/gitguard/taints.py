"""The worktrees a check could not finish on, refused (``Baselines.tainted``),
and what lifts the refusal.

A check that fails leaves the domain's record on disk and refuses new
sessions on its worktrees (and on those inside or around them: their
baseline would take what was left for the user's):

- one with no session of the domain left (the last end's, or a start's
  ``recover``): until a restart's check passes. Nothing else checks that
  worktree again, and a new open would take a baseline of what was left;
- one at an end (or a network switch) while other sessions of the domain
  still run (``final`` False): until the domain's last end checks it whole,
  or a restart's check does. That last end compares every part with the
  same baseline again, with no process of the domain left to race it, and
  tries every move aside and put-back again: when it passes, nothing the
  earlier check could not do is left, and the refusal is lifted (``lift``).
  A session still running beside an end can make that end's put-back fail
  (a loop of ``chmod 555`` on the hooks directory: the write permission the
  end lends it is taken back at once); before, that kept the worktree
  refused until the daemon restarted, even after the last end had put
  everything back. When the last end fails too, its own failures are the
  reason, and the refusal waits for a restart. A daemon killed in between
  loses the refusal with its memory, never the record: the next start runs
  the last end's check on it, and refuses the worktree again if that fails.

What other daemons are told (``claims.release``'s ``unchecked-…`` entry)
follows: a lifted refusal's entry is given back (``take_lifted``).
"""

from __future__ import annotations

import threading
import time

from dispatchd.daemon.gitguard.parts import UNTIL_LAST_END, UNTIL_RESTART, Protected
from dispatchd.inside import overlap

__all__ = ["LIFTED", "Taints"]

LIFTED = ("checked whole at its last session's end: what an earlier end's check could not move aside or put back "
          "is done now, and sessions on it are no longer refused")


class Taints:
    """Safe from many threads. ``why``: worktree -> why it is refused (the
    store's ``tainted``; read by a snapshot of its items, as ``claims`` does)."""

    def __init__(self) -> None:
        self.why: dict[str, str] = {}
        self._live: dict[str, str] = {}  # those a check beside live sessions refused: the reason it gave
        self._lifted: list[str] = []  # lifted, their other daemons' entries not yet given back
        self._lock = threading.Lock()

    def fail(self, roots: list[str], reason: str, *, final: bool) -> None:
        """A check of a domain whose parts are ``roots`` failed for ``reason``;
        ``final``: no session of the domain is left (see the module)."""
        with self._lock:
            for root in roots:
                if not final and root in self.why and root not in self._live:
                    continue  # refused until a restart already: a later pass of this domain's lifts none of it
                self.why[root] = reason
                if final:
                    self._live.pop(root, None)
                else:
                    self._live[root] = reason

    def lift(self, roots: list[str], now_t: float | None = None) -> list[Protected]:
        """The last end of the domain of ``roots`` passed: the refusals its
        earlier checks left (and nothing else's) lifted; returns what to say."""
        with self._lock:
            lifted = [r for r in roots if r in self._live and self.why.get(r) == self._live[r]]
            for root in lifted:
                del self.why[root], self._live[root]
            self._lifted += lifted
        when = time.time() if now_t is None else now_t
        return [Protected(path=root, why=LIFTED, time=when) for root in lifted]

    def take_lifted(self) -> list[str]:
        """The roots lifted since the last call, those not refused again meanwhile."""
        with self._lock:
            taken, self._lifted = self._lifted, []
            return [root for root in taken if root not in self.why]

    def until(self, root: str) -> str:
        """What lifts the refusal of ``root`` (a key of ``why``)."""
        with self._lock:
            return UNTIL_LAST_END if root in self._live else UNTIL_RESTART

    def refusal(self, root: str, *, inside: bool = True) -> str:
        """Why an open of ``root`` is refused ("" if it is not): a worktree
        refused is ``root``, or (``inside``) lies inside or around it."""
        with self._lock:
            found = next(((r, why) for r, why in self.why.items() if (overlap(r, root) if inside else r == root)),
                         None)
            if found is None:
                return ""
            until = UNTIL_LAST_END if found[0] in self._live else UNTIL_RESTART
        return (f"{root}: a session left files here that dispatchd could not move aside ({found[1]}); look at them "
                f"(your own tools would run them); sessions on it are refused {until}")
