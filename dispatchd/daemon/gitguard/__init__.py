"""The git protection: what of a worktree the user's own git and tools
would run stays as the user left it, whatever a session writes.

At open the daemon finds what to hold read-only (``inspect_git``,
``with_gitdirs``), lists the redirect files present (``redirects_present``),
records every git directory by content (``take``, a ``GitSnapshot``; over
``MAX_GITDIRS`` the open is refused) and joins the worktree's trusted
baseline (``Baselines``; what the session can write: ``session_reach``),
which checks it at every session's end and after a daemon that died, and
reports what it moved aside (``Protected``). The
user's git identity is read for the session (``read_identity``,
``identity_env``). A checkpoint keeps a repository's object files in the
same keep as the baseline's history (``keep_for``, ``keep_more``), and a
restore's ref moves are kept as the end keeps a session's
(``read_all_refs``, ``keep_moved_refs``, under a ``displaced_stamp``).
Everything else here is the package's own.
"""

from dispatchd.daemon.gitguard.baselines import Baselines
from dispatchd.daemon.gitguard.history import keep_for, keep_more
from dispatchd.daemon.gitguard.identity import identity_env, read_identity
from dispatchd.daemon.gitguard.layouts import inspect_git, with_gitdirs
from dispatchd.daemon.gitguard.parts import Protected, session_reach
from dispatchd.daemon.gitguard.recordfiles import unheld_roots
from dispatchd.daemon.gitguard.redirects import redirects_present
from dispatchd.daemon.gitguard.refsback import keep_moved as keep_moved_refs
from dispatchd.daemon.gitguard.refsback import read_all as read_all_refs
from dispatchd.daemon.gitguard.reftemp import stamp as displaced_stamp
from dispatchd.daemon.gitguard.snapshots import MAX_GITDIRS, GitSnapshot, gitdir_paths, take

__all__ = ["MAX_GITDIRS", "Baselines", "GitSnapshot", "Protected", "displaced_stamp", "gitdir_paths", "identity_env", "inspect_git",
           "keep_for", "keep_more", "keep_moved_refs", "read_all_refs", "read_identity", "redirects_present",
           "session_reach", "take", "unheld_roots", "with_gitdirs"]
