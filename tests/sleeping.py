"""Sessions that sleep, as the integration and escape suites meet them.

In full mode a session whose tool server has had no call for the policy's
``limits.sleep_after_s`` hands its channels to the daemon and exits: it is
"asleep" (``list_sessions()`` and ``status()`` say ``asleep``), and the next
byte a client writes wakes it in a new tool server that joins the session's
namespaces. What the tests here need of that:

- ``is_asleep`` / ``wait_until_asleep`` / ``stays_awake`` / ``stays_asleep``: the session's
  state read from ``list_sessions()``, polled against a deadline (never a
  fixed sleep that asserts a timing);
- ``with_sleep_after`` / ``sleepy_policies``: a policy's text, or every
  policy of a directory, with ``[limits] sleep_after_s`` set;
- ``daemon_with_policies``: a daemon with the repository's policies and
  some of a test's own;
- ``WokenClient``: a client whose ``open_session`` returns only once the
  session is asleep, so that every call a test makes runs in a woken
  session (the escape suite's ``woken`` mode).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import dispatch

# What the escape suite's woken mode gives every policy: short enough that a
# test's own pauses (a probe outside, a listener's wait) put the session to
# sleep again, so it wakes more than once.
SLEEP_AFTER_S = 0.1
_LIMITS = re.compile(r"(?m)^\[limits\][ \t]*$")
_KEY = re.compile(r"(?m)^sleep_after_s[ \t]*=.*$")  # only [limits] has it


def is_asleep(client: dispatch.Client, sid: str) -> bool | None:
    """What ``list_sessions()`` says of session ``sid``: asleep or not; None
    when it is not listed (closed)."""
    for entry in client.list_sessions():
        if entry["id"] == sid:
            return bool(entry["asleep"])
    return None


def wait_until_asleep(client: dispatch.Client, sid: str, timeout: float = 10.0, log: str = "") -> None:
    """Until session ``sid`` is asleep; fails after ``timeout`` s (``log``: what
    to show then, e.g. the tail of the daemon's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_asleep(client, sid):
            return
        time.sleep(0.02)
    raise AssertionError(f"session {sid} did not fall asleep within {timeout} s "
                         f"(listed: {[e for e in client.list_sessions() if e['id'] == sid]})\n{log}")


def stays_awake(client: dispatch.Client, sid: str, seconds: float) -> bool:
    """True if session ``sid`` is never seen asleep for ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if is_asleep(client, sid):
            return False
        time.sleep(0.02)
    return True


def stays_asleep(client: dispatch.Client, sid: str, seconds: float) -> bool:
    """True if session ``sid`` is seen asleep at every look for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not is_asleep(client, sid):
            return False
        time.sleep(0.02)
    return True


def daemon_with_policies(tmp_path: Path, **policies: str) -> Any:
    """A daemon (``tests.conftest.Daemon``) under ``tmp_path`` whose policies
    are the repository's and ``policies`` (name: TOML text)."""
    import shutil

    from tests.conftest import REPO, Daemon

    directory = tmp_path / "policies"
    shutil.copytree(REPO / "policies", directory)
    for name, text in policies.items():
        (directory / f"{name}.toml").write_text(text)
    (tmp_path / "d").mkdir()
    return Daemon(tmp_path / "d", "--policies", str(directory))


def with_sleep_after(text: str, after_s: float) -> str:
    """A policy's TOML text with ``[limits] sleep_after_s = after_s`` (in
    place of the value it sets, if it sets one)."""
    line = f"sleep_after_s = {after_s}"
    if _KEY.search(text):
        return _KEY.sub(line, text, count=1)
    if _LIMITS.search(text):
        return _LIMITS.sub(f"[limits]\n{line}", text, count=1)
    return text.rstrip("\n") + f"\n\n[limits]\n{line}\n"


def sleepy_policies(directory: Path, after_s: float = SLEEP_AFTER_S) -> None:
    """Every policy in ``directory`` (``*.toml``) gets ``sleep_after_s``."""
    for path in directory.glob("*.toml"):
        path.write_text(with_sleep_after(path.read_text(), after_s))


class WokenClient(dispatch.Client):
    """A client of a daemon whose sessions sleep: every session it opens is
    handed over asleep, so the first call made through it wakes it (and a
    session that cannot sleep fails the open, with the reason).
    ``awake_policies``: policies whose sessions never sleep by design (the
    caller says why); theirs are checked to stay awake instead."""

    def __init__(self, socket_path: str, *, awake_policies: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(socket_path, **kwargs)
        self.awake_policies = frozenset(awake_policies)

    def open_session(self, *args: Any, **kwargs: Any) -> dispatch.Session:
        session = super().open_session(*args, **kwargs)
        policy = kwargs.get("policy", args[1] if len(args) > 1 else "default")
        try:
            if policy in self.awake_policies:
                assert stays_awake(self, session.id, 5 * SLEEP_AFTER_S), f"a session of {policy} fell asleep"
            else:
                wait_until_asleep(self, session.id)
        except BaseException:
            session.close()
            raise
        return session
