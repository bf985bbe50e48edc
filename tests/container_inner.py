"""Run inside a container (not a test module itself), printing JSON.

- With no arguments (tests/integration/test_container.py): start a daemon,
  open a session, and print the mode it got, the probe's note, and what the
  escape core's attempts gave.
- ``--escape-core SOCKET WORKTREE TESTS_ROOT PYTEST_SITE``
  (tests/integration/test_image.py): connect to the daemon the container
  runs, open a session on WORKTREE and run tests/escape_core.py's
  assertions in it (TESTS_ROOT holds the ``tests`` package, PYTEST_SITE
  the test venv's site-packages for pytest, looked in after the image's own
  packages, so the client is the image's); print the mode, whether it held,
  and what a session with the network on (pasta) reached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import dispatch


def _accepts(path: str) -> bool:
    """tests/conftest.py's ``listening``: that module brings pytest, which this container has not."""
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def main() -> None:
    home = os.environ["HOME"]
    tmp = tempfile.mkdtemp(dir=home)
    sock = os.path.join(tmp, "run", "d.sock")
    log = open(os.path.join(tmp, "d.log"), "wb")  # noqa: SIM115 (lives as long as the daemon)
    daemon = subprocess.Popen([sys.executable, "-m", "dispatchd", "--socket", sock, "--pool", "0"],
                              stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, XDG_STATE_HOME=os.path.join(tmp, "state")))
    out: dict[str, object] = {}
    try:
        # As tests/conftest.py's Daemon: up to 60 s (a loaded machine starts
        # a daemon in a container slower; 10 s was seen to pass first).
        # Until it accepts, not until its socket exists: bound, it may not
        # listen yet (its start's last steps come between).
        for _ in range(2400):
            if _accepts(sock) or daemon.poll() is not None:
                break
            time.sleep(0.025)
        wt = os.path.join(tmp, "wt")
        os.makedirs(wt)
        with open(os.path.join(wt, "README.md"), "w") as f:
            f.write("hello\n")
        secret = os.path.join(home, "secret.txt")
        with open(secret, "w") as f:
            f.write("kept out\n")
        with dispatch.connect(sock) as client:
            kernel = client.status()["kernel"]
            out["user_namespaces_note"] = kernel["user_namespaces_note"]
            out["container"] = kernel.get("container", "")
            with client.open_session(wt) as session:
                out["mode"] = session.status()["protections"]["mode"]
                shell = session.registry.get("shell_exec")

                def run(command: str) -> str:
                    r = shell.call({"command": command})
                    return str(r.metadata.get("stdout", "")) + str(r.metadata.get("stderr", ""))

                out["worktree"] = run("cat README.md && echo ok > written.txt && cat written.txt")
                out["home"] = run(f"cat {secret}")
                out["outside"] = run(f"echo x > {home}/planted")
                out["planted"] = os.path.exists(os.path.join(home, "planted"))
                out["network"] = run("python3 -c \"import socket\ntry:\n socket.create_connection(('192.0.2.1', 9), "
                                     "timeout=2)\nexcept OSError as e:\n print('errno', e.errno)\"")
    except Exception as exc:  # noqa: BLE001 (reported to the test, with the daemon's log)
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        daemon.terminate()
        daemon.wait(15)
        log.close()
        if "error" in out:
            with open(os.path.join(tmp, "d.log"), errors="replace") as f:
                out["log"] = f.read()[-3000:]
    print(json.dumps(out))


def escape_core(sock: str, worktree: str, tests_root: str, pytest_site: str) -> None:
    import traceback
    from pathlib import Path

    sys.path.insert(0, tests_root)
    sys.path.append(pytest_site)
    out: dict[str, object] = {}
    try:
        from tests.escape_core import assert_escape_core

        out["client"] = dispatch.__file__
        with dispatch.connect(sock) as client, client.open_session(worktree) as session:
            out["mode"] = session.status()["protections"]["mode"]
            assert_escape_core(session, Path(worktree), full=out["mode"] == "full")
            out["escape_core"] = "held"
        out["network_on"] = _network_on(sock, worktree)
    except BaseException:  # noqa: BLE001 (an assertion of the core included: reported to the test)
        out["error"] = traceback.format_exc()[-3000:]
    print(json.dumps(out))


def _network_on(sock: str, worktree: str) -> str:
    """A session with the network on (the image's stack, slirp4netns,
    through the container's /dev/net/tun) reaching a listener on the
    container's loopback at the gateway address: what the probe printed,
    after the stack's name."""
    import socket

    from tests.conftest import probe

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    code = ("import socket\ntry:\n"
            f"    socket.create_connection(('10.0.2.2', {listener.getsockname()[1]}), timeout=5); print('connected')\n"
            "except OSError as e:\n    print('error', e.errno)\n")
    try:
        with dispatch.connect(sock) as client, client.open_session(worktree, network=True) as session:
            stack = session.status()["protections"]["network"]["stack"]
            return f"{stack} {probe(session, code)}"
    finally:
        listener.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--escape-core"]:
        escape_core(*sys.argv[2:6])
    else:
        main()
