"""Refs a session made where the user's git takes them for the upstream's,
for notes or for a stash: taken out at the end.

A new branch or tag is a session's work, and stays. But a new
remote-tracking branch (``refs/remotes/origin/feature``) is what the user's
``git checkout feature`` makes a branch from, taking it for the remote's;
new notes (``refs/notes/commits``) show under the user's commits in ``git
log``; a new ``refs/stash`` is what ``git stash pop`` applies. Each such
ref the baseline did not have is taken out: its value kept as
``refs/dispatchd/displaced/TIME/NAME`` (nothing is lost), its loose file
removed, its ``packed-refs`` record taken out (kept in a file beside:
``replacerefs.drop_packed``). Changed ones the baseline had are put back by
``history.restore`` with the branches and tags.
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard import objectstore, reflock, refvalues, reftemp
from dispatchd.daemon.gitguard.replacerefs import drop_named, packed_names

TAKEN = ("refs/remotes/", "refs/notes/", "refs/stash")


def clear(common: str, now: dict[str, str], baseline: dict[str, str], stamp: str,
          store: objectstore.Store | None = None, known: dict[str, str] | None = None
          ) -> tuple[list[tuple[str, str]], list[str]]:
    """Take out each ref of ``now`` under ``TAKEN`` that ``baseline`` has
    not; ``store``: the repository's objects (a value naming none is not kept)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    new = sorted(n for n in now if n.startswith(TAKEN) and n not in baseline)
    if not new:
        return done, failed
    why = "made by a session where your git takes it for the upstream's, for notes or for a stash"
    for name in new:
        value = now[name]
        kept = ""
        try:
            path = os.path.join(common, name)
            if os.path.lexists(path) and not os.path.isdir(path):
                # Under git's lock, as git deletes a ref: the value kept is
                # the one the file holds then (a fetch of the user's may have
                # written it since the read), and no git writes it meanwhile.
                with reflock.held(common, name, move_left=False) as lock:
                    read = refvalues.read_text(path)
                    value = read.strip() if read is not None else value
                    if refvalues.writable(value):  # an id, or a symbolic ref: kept as it was
                        kept = reftemp.keep_displaced(common, stamp, name, value, store, known)
                    lock.remove()
            elif refvalues.writable(value):  # packed only: taken out below, its value kept first
                kept = reftemp.keep_displaced(common, stamp, name, value, store, known)
        except OSError as exc:
            failed.append(f"{name}: {why}, cannot be taken out ({exc.strerror})")
            continue
        done.append((name, f"{why}; taken out (its value kept as {kept})" if kept else
                     f"{why}; taken out (its value {value[:60]} names no object here: not kept)"))
    problem = drop_named(common, set(new), "refs a session made there")
    if problem:  # those still packed were not taken out: said as failed, not as done
        failed.append(problem)
        still = set(packed_names(common).values())
        done = [(name, said) for name, said in done if name not in still]
    return done, failed
