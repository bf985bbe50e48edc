"""What the session's mounts will be, as data: pure, shared by the daemon
(which plans) and the worker (which applies, ``mounts``).

``plan_mounts`` keeps a path listed twice in its first, most writable, role,
drops a read-only path already inside a read-only one, orders binds parents
first, and never hides a directory that holds a path the session needs;
``MountPlan.split_binds`` separates what every session of a policy shares
(bound with the root, possibly ahead of the session) from the session's own.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dispatchd.inside import Tops, is_within
from dispatchd.protocol.reports import RootEntry

WORKTREE_FD = "@worktree"  # a bind's source: the daemon's descriptor of the worktree
WORKTREE_STEP = "mounts: worktree"  # the step that refuses a worktree swapped since the daemon's check
PTS = "/dev/pts"  # in the plan's devices: a devpts of the session's own


class Bind(msgspec.Struct, frozen=True, array_like=True):
    path: str  # where it appears, the same path as on the host
    how: Literal["ro", "rw", "ro-over"]  # ro-over: read-only over a path inside a writable bind (git)
    source: str = ""  # "" = path itself; WORKTREE_FD; or another host path (the private /tmp)


class MountPlan(msgspec.Struct, frozen=True):
    root: Literal["minimal", "host"]
    binds: list[Bind]  # parents before children
    devices: list[str]  # device nodes bound into the fresh /dev (minimal root)
    hide: list[str] = []  # host root only: covered by an empty tmpfs (the user's runtime directories)
    # The policy's system paths and the daemon's code: the same for every
    # session of the policy, so bound with the root (see ``split_binds``).
    system: list[str] = []
    # Bound with the root too: the session id's own directories (its scratch,
    # the private /tmp), made before the session is known.
    ahead: list[str] = []
    # The host's root kept, until the session's own binds, as a detached copy
    # held by descriptor rather than a mount below the session's root (see
    # ``_hold_host``): where the kernel binds from one (6.15+; probe_host_tree, at the daemon's start).
    host_by_fd: bool = False

    def writable(self) -> list[str]:
        return [b.path for b in self.binds if b.how == "rw"]

    def split_binds(self) -> tuple[list[Bind], list[Bind]]:
        """Pure. ``(root, session)``: the binds known before the session (plain
        read-only system paths, and the ``ahead`` ones: the session id's
        scratch and private ``/tmp``), with no session bind above them, made
        with the root by ``apply_root``, possibly ahead of the session; and
        the rest (the worktree, git, extra paths), made by
        ``apply_session_mounts``. Each keeps its parents before it."""
        session = [b for b in self.binds
                   if not ((b.how == "ro" and not b.source and b.path in self.system) or b.path in self.ahead)]
        late = {b.path for b in session}
        below_late = Tops(late)
        shared = [b for b in self.binds if b.path not in late and not below_late.holds_below(b.path)]
        kept = {b.path for b in shared}
        return shared, [b for b in self.binds if b.path not in kept]

    def root_part(self) -> MountPlan:
        """What ``apply_root`` applies: the same for every session it can serve."""
        return MountPlan(root=self.root, binds=self.split_binds()[0], devices=list(self.devices),
                         hide=list(self.hide), system=list(self.system), ahead=list(self.ahead),
                         host_by_fd=self.host_by_fd)


def _depth_order(b: Bind) -> tuple[str, ...]:
    return tuple(p for p in b.path.split("/") if p)


def plan_mounts(*, root: Literal["minimal", "host"], worktree: str, worktree_rw: bool, private_tmp: str,
                read_write: list[str], read_only: list[str], over: list[str] | None = None,
                devices: list[str] | None = None, hide: list[str] | None = None,
                system: list[str] | None = None, ahead: list[str] | None = None,
                host_by_fd: bool = False, files: list[tuple[str, str]] | None = None) -> MountPlan:
    """Pure. ``read_write`` and ``read_only`` are host paths bound at the same
    place; ``over`` is bound read-only over itself inside a writable bind. A
    path listed twice keeps its first, most writable, role; binds come out
    parents first, so a path under ``/tmp`` lands in the private ``/tmp``.
    ``system`` names the read-only paths that are the same for every session
    of the policy, ``ahead`` those known before the session (its scratch,
    ``/tmp``): see ``MountPlan.split_binds``."""
    binds: dict[str, Bind] = {}
    for b in ([Bind("/tmp", "rw", private_tmp), Bind(worktree, "rw" if worktree_rw else "ro", WORKTREE_FD)]
              + [Bind(p, "ro", src) for p, src in files or []]
              + [Bind(p, "rw") for p in read_write] + [Bind(p, "ro") for p in read_only]
              + [Bind(p, "ro-over") for p in over or []]):
        binds.setdefault(b.path, b)
    # A read-only path inside another read-only one (the interpreter's
    # library under /usr) is there already: one mount fewer per open.
    plain_ro = Tops(b.path for b in binds.values() if b.how == "ro" and not b.source)
    ordered = sorted((b for b in binds.values() if not (b.how == "ro" and not b.source and plain_ro.holds_below(b.path))),
                     key=_depth_order)
    keep = [b.path for b in ordered]
    # Hiding a directory that holds a path the session needs would hide that path too.
    hidden = [h for h in hide or [] if not any(is_within(k, h) for k in keep + [private_tmp])]
    return MountPlan(root=root, binds=ordered, devices=list(devices or []), hide=hidden if root == "host" else [],
                     system=[b.path for b in ordered if b.path in set(system or [])],
                     ahead=[b.path for b in ordered if b.path in set(ahead or [])],
                     host_by_fd=host_by_fd and root == "minimal")


def describe_root(plan: MountPlan, labels: dict[str, str]) -> list[RootEntry]:
    """What ``status`` shows: every path visible in the session and how."""
    how = {"ro": "read-only", "rw": "read-write", "ro-over": "read-only (inside a writable path)"}
    rows: list[RootEntry] = []
    if plan.root == "host":
        rows.append(RootEntry(path="/", how="the host's root, read-only; Landlock refuses what the rules do not grant"))
    for b in plan.binds:
        label = labels.get(b.path, "")
        if b.path == "/tmp":
            label = "private: the session's scratch tmp"
        elif b.source == WORKTREE_FD:
            label = "the worktree, bound from the descriptor the daemon checked"
        rows.append(RootEntry(path=b.path, how=how[b.how] + (f" ({label})" if label else "")))
    if plan.root == "minimal":
        rows.append(RootEntry(path="/dev", how="fresh, read-only: " + ", ".join(plan.devices)
                     + "; fd, stdin, stdout, stderr links"))
    rows += [RootEntry(path="/dev/shm", how="read-write (private tmpfs)"),
             RootEntry(path="/proc", how="fresh procfs of the session's pid namespace")]
    rows += [RootEntry(path=h, how="covered by an empty tmpfs") for h in plan.hide]
    return rows
