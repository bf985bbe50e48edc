"""Requests on one session that overlap, against a real daemon: a close
racing a network switch that replaces the sandbox, a close racing the wake
of a sleeping session, two closes at once (``daemon/lifecycle.py`` decides
them; the manager holds the session's lock for each change and its action).

The threads start together (a barrier), so which request wins varies from
run to run: each test asserts what every order allows, and its twin outcome
(the request that lost) is asserted exactly when it happens. Whatever the
order, the session is gone afterwards with nothing of it left, and the
daemon logged no illegal transition and no thread that died.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dispatch
from dispatch.errors import RequestFailed
from tests.conftest import REPO, Daemon, _refuse_root, wait_until
from tests.sleeping import daemon_with_policies, is_asleep, wait_until_asleep, with_sleep_after

ROUNDS = 3


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    base = tmp_path_factory.mktemp("overlap")
    default = (REPO / "policies" / "default.toml").read_text()
    d = daemon_with_policies(base, nap=with_sleep_after(default, 0.2))
    yield d
    assert d.stop() == 0, d.log()


def _race(*calls: Callable[[], object]) -> list[BaseException | None]:
    """Run ``calls`` at once, one thread each; what each raised (None: it returned)."""
    barrier = threading.Barrier(len(calls))
    raised: list[BaseException | None] = [None] * len(calls)

    def run(i: int, call: Callable[[], object]) -> None:
        barrier.wait()
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            raised[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request of the race never returned"
    return raised


def _refused_as_ended(exc: BaseException | None, sid: str) -> None:
    """A request that lost to a close: refused, saying the session is closing or gone."""
    assert isinstance(exc, RequestFailed) and exc.code == "unknown_session", repr(exc)
    assert str(exc).startswith(f"no such session: '{sid}'") or f"session {sid} cannot switch: it is closing" \
        in str(exc), str(exc)


def _gone_cleanly(d: Daemon, client: dispatch.Client, sid: str) -> None:
    assert is_asleep(client, sid) is None  # not listed
    assert wait_until(lambda: not (d.state / "dispatchd" / "sessions" / sid).exists())  # after the reply
    log = d.log()
    assert "illegal session transition" not in log and "Exception in thread" not in log, log[-3000:]


def test_a_close_racing_a_switch_that_replaces_the_sandbox(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as one, daemon.connect() as two:
        for _ in range(ROUNDS):
            s = one.open_session(str(worktree))
            switched, closed = _race(lambda: one.set_network(s.id, "domains", domains=["example.com"]),
                                     lambda: two.close_session(s.id))
            assert closed is None, repr(closed)  # a close during a switch waits for it, then closes
            if switched is not None:  # the close came first
                _refused_as_ended(switched, s.id)
            _gone_cleanly(daemon, one, s.id)
            s.detach()  # its channel: the session is closed already
        # The allowed twin: the same switch, alone, replaces the sandbox.
        s = one.open_session(str(worktree))
        assert one.set_network(s.id, "domains", domains=["example.com"])["network"] == "domains"
        two.close_session(s.id)
        _gone_cleanly(daemon, one, s.id)
        s.detach()


def test_a_close_racing_the_wake_of_a_sleeping_session(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as one, daemon.connect() as two:
        for _ in range(ROUNDS):
            s = one.open_session(str(worktree), policy="nap")
            wait_until_asleep(one, s.id, log=daemon.log()[-3000:])
            results: list[dispatch.Result] = []
            woke, closed = _race(lambda: results.append(s.registry.get("read_file").call({"path": "README.md"})),
                                 lambda: two.close_session(s.id))
            assert closed is None and woke is None, (closed, woke)  # a tool call never raises
            if results[0].is_failure:  # the close came first: the call says the session ended, and why
                assert results[0].error.startswith(f"the sandbox of session {s.id} went away during read_file: "
                                                   f"no such session: '{s.id}' (it has ended: it was closed)"), \
                    results[0].error
            else:  # the wake came first: the call was served, then the session closed
                assert results[0].output == "0: hello\n1: world"
            _gone_cleanly(daemon, one, s.id)
            s.detach()


def test_two_closes_at_once_close_once(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as one, daemon.connect() as two:
        for _ in range(ROUNDS):
            s = one.open_session(str(worktree))
            first, second = _race(lambda: one.close_session(s.id), lambda: two.close_session(s.id))
            assert first is None or second is None, (first, second)
            for lost in (first, second):
                if lost is not None:  # the other close had begun: this one finds it gone
                    _refused_as_ended(lost, s.id)
            _gone_cleanly(daemon, one, s.id)
            s.detach()
            assert daemon.log().count(f"event=session_close session={s.id}") == 1 + (first is None and second is None)
