"""Each layer of full mode holds the user's files alone.

Full mode keeps a home file out twice: the session's root does not hold it
(ENOENT), and Landlock grants nothing outside its rules (EACCES). Two test
policies take one layer away each:

- ``host-root`` (``filesystem.root = "host"``): the host's ``/`` read-only,
  as before the minimal root; the file is there, and Landlock alone refuses
  it (EACCES);
- ``root-only`` (``filesystem.landlock_grants_root = true``): Landlock lets
  the session read the whole of its root; only the root's contents keep the
  file out (ENOENT).

The allowed twin, in each: the same probe reads a worktree file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import _refuse_root
from tests.escape.attempts import EACCES, ENOENT, attempt, attempt_outside
from tests.escape.conftest import connect, mode_daemon

POLICIES = {
    "host-root": '[filesystem]\nroot = "host"\n',
    "root-only": "[filesystem]\nlandlock_grants_root = true\n",
}


@pytest.fixture(scope="module", params=["full", "woken"])
def layers_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dispatch.Client]:
    """Full mode; woken: every session opened asleep (tests/escape/conftest.py),
    but host-root's, which never sleeps."""
    _refuse_root()
    base = tmp_path_factory.mktemp(f"layers-{request.param}")
    d = mode_daemon(base, request.param, policies=POLICIES)
    try:
        # host-root sessions never sleep: a session sleeps only on a root of
        # its own (plan.can_sleep), so theirs stay awake, checked, in woken mode.
        with connect(d, request.param, awake_policies={"host-root"}) as c:
            if not c.status()["kernel"]["user_namespaces"]:
                pytest.fail("full mode needs user namespaces; this kernel refuses them", pytrace=False)
            yield c
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize(("policy", "verdict", "leaves_open"), [
    ("default", ENOENT, []),
    ("host-root", EACCES, ["metadata of files outside the worktree", "Unix sockets are refused"]),
    ("root-only", ENOENT, ["filesystem.landlock_grants_root (a layer test)"]),
])
def test_each_layer_keeps_a_home_file_out_alone(
    layers_client: dispatch.Client, worktree: Path, own_file: Path, home_secret: Path, policy: str, verdict: str,
    leaves_open: list[str],
) -> None:
    read = "result = open({path!r}).read()"
    listing = "result = sorted(os.listdir('/'))"
    assert attempt_outside(read.format(path=str(home_secret))) == f"OK {home_secret.read_text()!r}"
    with layers_client.open_session(str(worktree), policy=policy) as s:
        prot = s.status()["protections"]
        assert prot["mode"] == "full"
        # This suite's worktrees lie below /tmp: that one gap is the layout's (test_ipc.py).
        said = leaves_open + [f"Unix sockets can be made in {worktree}: it lies below"]
        assert [g for g in prot["leaves_open"] if not any(g.startswith(p) for p in said)] == []
        assert attempt(s, read.format(path=str(own_file))) == f"OK {own_file.read_text()!r}"  # the twin
        assert attempt(s, read.format(path=str(home_secret))) == verdict
        if policy == "root-only":
            # Landlock reads everything there is: the root's own few entries.
            top = attempt(s, listing)
            assert top.startswith("OK [") and "'usr'" in top and "'root'" not in top and "'var'" not in top
