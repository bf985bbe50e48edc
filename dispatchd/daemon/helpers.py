"""The daemon's helper processes and its socket path, watched: it heals or it exits.

Guarantees, once ``HelperWatch.start`` has run:
- the fork server (the parent of every session's worker, of every sandbox
  made ahead and of every network stack) is held by a pidfd and watched
  without delay (``poll``); when it exits, every session ends with that cause
  (what its client is told: "dispatchd's fork server (pid N) was killed by
  signal 9 ..."), new opens are refused, and after ``TELL_WHY_S`` (for
  clients to learn why) the daemon stops and exits with ``HELPER_DIED_EXIT``. It is not started again in place: it must be forked
  from a process with a single thread (``worker/fork_server.py``), which the
  daemon no longer is. A whole new daemon is what systemd's
  ``Restart=on-failure`` and the client's autostart give;
- a session's network stack (slirp4netns or pasta) that exits while the
  session lives ends that session, with that cause, within ``CHECK_S``: a
  session whose way out is gone would fail every connection with no word why;
- the listening socket's path: the daemon knows the inode it bound
  (``BoundSocket``) and unlinks that one only, never a socket another daemon
  bound at the same path since; when the path is gone or holds another file,
  new clients cannot reach this daemon: it logs it once, keeps serving the
  connections and sessions it has, and exits once it holds none (status 0
  when another daemon's socket is there, ``SOCKET_GONE_EXIT`` when nothing
  is, so that a service manager starts one again);
- the modes of the socket's directory and of the socket are set back to
  those the daemon gave them (0700, 0600) when they changed (a degraded
  session can chmod them: Landlock does not govern chmod), looked at every
  ``CHECK_S`` before the path (two ``lstat``s while they are as made), the
  directory only while it is the one the daemon bound in (its device and
  inode read from the descriptor that is changed), never through a
  symlink (``statemodes.heal_held``, ``heal_at``): 0777
  would make every client refuse it, 000 would read as the path lost; a
  directory above the socket's is changed only when it lies in the state
  directory (the socket in ``STATE/run``): ``$XDG_RUNTIME_DIR`` is the
  system's (logind makes it, other programs keep sockets there), so one
  made unsearchable is said (``event=socket_unreachable``, naming it) and
  waited out: the daemon keeps serving what it holds and does not exit;
- ``report()`` says each helper's state for ``status``.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dispatchd import fdwait, paths, statemodes

if TYPE_CHECKING:
    from dispatchd.confine.netstack import Stack

log = logging.getLogger("dispatchd.helpers")

CHECK_S = 1.0  # how often the network stacks and the socket path are looked at
HELPER_DIED_EXIT = 1  # a helper died: systemd (Restart=on-failure) or autostart start a new daemon
SOCKET_GONE_EXIT = 3
SOCKET_MODE = 0o600  # what the daemon binds it with (cli.py: umask 0177)
TELL_WHY_S = 3.0  # after a helper died, how long the daemon still answers (a client asks why its session ended)  # our socket path was removed and nothing replaced it


@dataclass(frozen=True)
class BoundSocket:
    """The socket file a daemon bound: its path and the inode it made there."""

    path: str
    dev: int
    ino: int
    dir_dev: int = 0  # the directory it was bound in (0: not known, never healed)
    dir_ino: int = 0

    def state(self) -> str:
        """"ours", "gone", "replaced" (another file, maybe another daemon's
        socket), or "unreachable" (a directory on its way cannot be searched:
        the socket may be there still, and is again once its mode is back)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "gone"
        except PermissionError:
            return "unreachable"
        except OSError:
            return "replaced"  # cannot even look: not ours to rely on
        if (st.st_dev, st.st_ino) == (self.dev, self.ino) and stat.S_ISSOCK(st.st_mode):
            return "ours"
        return "replaced"

    def heal(self) -> list[statemodes.Repair]:
        """The modes of its directory (0700) and of the socket (0600) set
        back, if they changed, while the directory is the one it was bound
        in (a directory put in its place is not ours to change). Called
        every ``CHECK_S``: two ``lstat``s while both are as made; the
        repair (``_repair``) only when one shows otherwise."""
        directory = os.path.dirname(os.path.abspath(self.path))
        repairs: list[statemodes.Repair] = []
        try:
            st = os.lstat(directory)
        except PermissionError:
            if not statemodes.owned(directory):
                return []  # above it the user's ($XDG_RUNTIME_DIR): never changed, said (_check_socket)
            repairs = statemodes.heal(directory, None)  # from the state directory down (its ``run``)
            st = os.lstat(directory)
        except OSError:
            return []
        if not self.dir_ino or (st.st_dev, st.st_ino) != (self.dir_dev, self.dir_ino):
            return []
        if statemodes.as_made(st, None) and self._socket_as_made():
            return repairs
        return repairs + self._repair(directory)

    def _socket_as_made(self) -> bool:
        """Whether the socket's path needs no heal (one ``lstat``): gone is
        nothing to set back (``state`` says it); one that cannot be looked
        at goes to the repair, which says why."""
        try:
            return statemodes.as_made(os.lstat(self.path), SOCKET_MODE)
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _repair(self, directory: str) -> list[statemodes.Repair]:
        """The directory opened once (``O_PATH``, never through a symlink)
        and changed only when that descriptor is the directory bound in (a
        directory swapped in between the look and here is never changed);
        then the socket below that same descriptor."""
        try:
            fd = os.open(directory, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self.dir_dev, self.dir_ino):
                return []
            repairs = statemodes.heal_held(fd, directory)
            try:
                return repairs + statemodes.heal_at(fd, os.path.basename(self.path), directory, SOCKET_MODE)
            except FileNotFoundError:
                return repairs  # gone: nothing to set back
        finally:
            os.close(fd)

    def unlink(self) -> bool:
        """Unlink the path if it is still the inode we bound; True if it was.
        The socket directory is the daemon's private one (0700): no other user
        can swap it between the look and the unlink."""
        if self.state() != "ours":
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True


class HelperWatch:
    """One thread: the fork server by pidfd, the sessions' stacks and the
    socket path every ``CHECK_S``.

    ``fork_server_death(wait_s)`` says how the fork server ended ("" while it
    runs); ``fork_server_pidfd`` is polled. ``stacks()`` lists the live
    sessions' stacks as ``(session id, stack)``; ``end_session(sid, word,
    why)`` ends one; ``end_all(why)`` ends them all; ``idle()`` says whether
    the daemon holds no session and no connection; ``exit(code)`` stops the
    daemon with that exit status."""

    def __init__(self, *, fork_server_pidfd: int, fork_server_pid: int,
                 fork_server_death: Callable[[float], str],
                 stacks: Callable[[], list[tuple[str, Stack]]],
                 end_session: Callable[[str, str, str], None], end_all: Callable[[str], None],
                 idle: Callable[[], bool], exit: Callable[[int], None],
                 socket: BoundSocket | None, check_s: float = CHECK_S) -> None:
        self._fs_pidfd = fork_server_pidfd
        self._fs_pid = fork_server_pid
        self._fs_death = fork_server_death
        self._stacks = stacks
        self._end_session = end_session
        self._end_all = end_all
        self._idle = idle
        self._exit = exit
        self.socket = socket
        self._check_s = check_s
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread: threading.Thread | None = None
        self._socket_state = "ours" if socket is not None else "systemd's"
        self._stacks_ended = 0
        self._ending: set[str] = set()  # sessions ended for their stack, until they are gone
        self.fork_server_died = ""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="helpers")
        self._thread.start()

    def stop(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def report(self) -> str:
        died = self.fork_server_died
        fork_server = f"fork server pid {self._fs_pid}: " + (f"gone ({died})" if died else "running")
        stacks = self._stacks()
        return (f"{fork_server}; network stacks: {len(stacks)} running, {self._stacks_ended} ended a session "
                f"by exiting; socket: {self._socket_state}")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fs_pidfd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll(self._check_s * 1000)}
            if self._stop_r in ready:
                return
            if self._fs_pidfd in ready:
                self._fork_server_gone()
                return
            try:
                self._check_stacks()
                if self._check_socket():
                    return
            except Exception:  # a bug: say so, and keep watching the fork server
                log.exception("event=helper_watch_error")

    def _fork_server_gone(self) -> None:
        died = self._fs_death(0.0) or f"dispatchd's fork server (pid {self._fs_pid}) has exited"
        self.fork_server_died = died
        log.error("event=helper_died helper=fork_server detail=%r: every session ends; dispatchd exits "
                  "with status %d to be started again", died, HELPER_DIED_EXIT)
        self._end_all(f"{died}; dispatchd exits so that a new one is started (systemd, or the next "
                      "client's autostart): open the session again")
        # Clients whose calls broke ask why: answered a while before the exit.
        fdwait.readable(self._stop_r, TELL_WHY_S)  # poll: select refuses descriptors over 1,023
        self._exit(HELPER_DIED_EXIT)

    def _check_stacks(self) -> None:
        self._ending &= {sid for sid, _ in self._stacks()}
        for sid, stack in self._stacks():
            if stack.exited() and sid not in self._ending:
                self._ending.add(sid)
                self._stacks_ended += 1
                log.error("event=helper_died helper=network_stack session=%s pid=%s", sid, stack.pid)
                try:
                    self._end_session(sid, "network_stack_died",
                                      f"its network stack ({stack.name}, pid {stack.pid}) exited: "
                                      "the session had no way out any more; open it again")
                except Exception:  # noqa: BLE001  # not ended: looked at again at the next round
                    log.exception("event=stack_end_failed session=%s", sid)
                    self._ending.discard(sid)

    def _check_socket(self) -> bool:
        """True once the daemon has been told to exit (its path lost, and idle)."""
        if self.socket is None:
            return False
        try:
            self.socket.heal()  # logged by statemodes: event=state_mode_repaired
        except OSError as exc:
            log.warning("event=state_mode_not_repaired path=%s why=%r", self.socket.path, str(exc))
        now = self.socket.state()
        if now != self._socket_state and now == "unreachable":
            # Not the daemon's to change (the runtime directory is the system's): said, and waited out.
            log.error("event=socket_unreachable path=%s why=%r: new clients cannot reach this daemon until "
                      "then; it serves the connections and sessions it has, and goes on", self.socket.path,
                      paths.unsearchable(self.socket.path) or "permission denied")
        elif now != self._socket_state and now != "ours":
            log.warning("event=socket_path_lost path=%s state=%s: new clients cannot reach this daemon; it "
                        "serves the connections and sessions it has and exits once it holds none",
                        self.socket.path, now)
        self._socket_state = now
        if now not in ("ours", "unreachable") and self._idle():
            log.warning("event=stopping reason=socket_%s path=%s", now, self.socket.path)
            self._exit(0 if now == "replaced" else SOCKET_GONE_EXIT)
            return True
        return False
