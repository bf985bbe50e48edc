"""A machine that refuses user namespaces, for real: the daemon runs under a
seccomp filter that refuses them (tests/deny_user_namespaces.py), as a
container engine's default profile does and as Ubuntu's AppArmor restriction
leaves the probe. Not ``--no-user-namespaces``: the probe itself meets the
refusal. The daemon chooses degraded mode, says why at start and in
``status``, and the escape core holds in that mode.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root
from tests.escape_core import assert_escape_core


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dispatch.Client]]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("userns-refused"), "--pool", "0",
               prefix=(sys.executable, str(REPO / "tests" / "deny_user_namespaces.py")))
    try:
        with d.connect() as c:
            yield d, c
    finally:
        assert d.stop() == 0, d.log()


def test_the_probe_meets_the_refusal_and_says_so(refused: tuple[Daemon, dispatch.Client]) -> None:
    d, c = refused
    kernel = c.status()["kernel"]
    assert kernel["user_namespaces"] is False
    assert kernel["user_namespaces_note"] == "refused by the kernel: Operation not permitted"
    assert kernel["network_unavailable"] == {"domains": "network 'domains' needs a network namespace of its own "
                                                        "(user namespaces), and sessions have none here"}
    assert ("event=user_namespaces_unavailable note='refused by the kernel: Operation not permitted': sessions "
            "run in degraded mode (docs/support.md)") in d.log()


def test_sessions_run_degraded_and_the_escape_core_holds(refused: tuple[Daemon, dispatch.Client],
                                                         worktree: Path) -> None:
    _, c = refused
    with c.open_session(str(worktree)) as s:
        prot = s.status()["protections"]
        assert prot["mode"] == "degraded"
        assert prot["namespaces"] == {"user": False, "mount": False, "pid": False, "net": False}
        assert_escape_core(s, worktree, full=False)
    with pytest.raises(dispatch.RequestFailed) as exc:
        c.open_session(str(worktree), network="domains", domains=["pypi.org"])
    assert exc.value.message.startswith("cannot apply network: network 'domains' needs a network namespace")
