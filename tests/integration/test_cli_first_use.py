"""What a first-time user meets on the ``dispatch`` and ``dispatchd`` command lines
(arguments from stdin, help texts, errors that say what to do), run as subprocesses
against a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import dispatch
import dispatchd
from tests.conftest import Daemon
from tests.integration.test_cli import _alive, _env, _stop, assert_error, dispatch_cli, run, sid  # noqa: F401


def test_version() -> None:
    out = dispatch_cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"dispatch {dispatchd.__version__}\n", "")


def test_options_say_their_defaults() -> None:
    text = dispatch_cli("exec", "--help").stdout
    flat = " ".join(text.split())
    assert "shipped: default, read-only" in flat
    assert "default: the policy's command_timeout_s, 120 s in the shipped policies" in flat
    assert "default: the policy's, off in the shipped policies" in flat


def test_tools_plain_is_a_listing_for_people(daemon: Daemon) -> None:
    plain = run(daemon, "tools", "--format", "plain")
    as_json = run(daemon, "tools", "--format", "json")
    assert plain.returncode == 0 and plain.stdout != as_json.stdout
    assert plain.stdout.startswith("read_file: ")
    assert "    path (string) (required): " in plain.stdout
    assert "    recursive (boolean) (default true)" in plain.stdout or "    recursive (boolean)" in plain.stdout


def test_tools_strict_and_gemini(daemon: Daemon) -> None:
    strict = json.loads(run(daemon, "tools", "--format", "openai", "--strict").stdout)
    read = strict[0]["function"]
    assert read["strict"] is True and read["parameters"]["required"] == list(read["parameters"]["properties"])
    gemini = json.loads(run(daemon, "tools", "--format", "gemini").stdout)
    assert gemini[0]["name"] == "read_file" and "additionalProperties" not in gemini[0]["parameters"]
    assert_error(run(daemon, "tools", "--format", "mcp", "--strict"), "strict=True is for openai")


def test_tools_into_a_closed_pipe_exits_quietly(daemon: Daemon) -> None:
    cmd = (f"{sys.executable} -m dispatch.cli --socket {daemon.socket} --no-autostart tools --format openai "
           "| head -1")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=_env(),
                         timeout=60)
    assert out.stdout == "[\n"
    assert out.stderr == ""  # no BrokenPipeError traceback
    assert out.returncode in (0, 141)


def test_call_reads_arguments_from_stdin_and_files_and_prints_text(daemon: Daemon, sid: str, tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_text('{"path": "README.md", "end_line": 0}')
    from_file = run(daemon, "call", "--session", sid, "read_file", f"@{args}")
    assert from_file.returncode == 0 and json.loads(from_file.stdout)["output"] == "0: hello"
    piped = subprocess.run([sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart",
                            "call", "--session", sid, "read_file", "-", "--text"],
                           input='{"path": "README.md", "end_line": 0}', capture_output=True, text=True,
                           env=_env(), timeout=60)
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, "0: hello\n", "")
    failed = run(daemon, "call", "--session", sid, "read_file", '{"path": "nope"}', "--text")
    assert (failed.returncode, failed.stdout) == (1, "file not found: nope\n")
    assert_error(run(daemon, "call", "--session", sid, "read_file", f"@{tmp_path / 'missing.json'}"),
                 f"cannot read the tool's arguments from {tmp_path / 'missing.json'}: No such file or directory")
    args.write_text("{not json")
    assert_error(run(daemon, "call", "--session", sid, "read_file", f"@{args}"),
                 f"the tool's arguments ({args}) are not valid JSON")


def test_mcp_print_config_has_absolute_paths(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--socket", str(tmp_path / "d.sock"), "mcp",
                          "--worktree", "wt", "--network", "off", "--print-config"], capture_output=True,
                         text=True, env=_env(), timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    server = json.loads(out.stdout)["mcpServers"]["dispatchd"]
    assert server == {"command": sys.executable, "args": [
        "-P", "-m", "dispatch.cli", "--socket", str(tmp_path / "d.sock"), "mcp", "--worktree", str(wt),
        "--network", "off"]}
    assert os.path.isabs(server["command"]) and os.access(server["command"], os.X_OK)


def test_status_with_no_session_says_what_a_new_one_would_get(daemon: Daemon, client: dispatch.Client) -> None:
    assert client.list_sessions() == []
    out = run(daemon, "status")
    lines = out.stdout.splitlines()
    n = lines.index("0 session(s)")
    assert lines[n + 1].startswith("  a new session (policy default) would get: filesystem confined by Landlock (ABI ")
    assert "a seccomp filter" in lines[n + 1] and "network off unless asked" in lines[n + 1]


def test_session_list_and_release_show_the_write_lock(daemon: Daemon, client: dispatch.Client, sid: str) -> None:
    assert run(daemon, "call", "--session", sid, "write_file", '{"path": "x", "content": "y"}').returncode == 0
    listed = [line for line in run(daemon, "session", "list").stdout.splitlines() if line.startswith(sid)]
    assert "  writes  " in listed[0]
    assert any(line.endswith("holds the worktree's write lock") for line in run(daemon, "status").stdout.splitlines())
    out = run(daemon, "session", "release", sid)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert [s["writes"] for s in client.list_sessions() if s["id"] == sid] == [False]
    listed = [line for line in run(daemon, "session", "list").stdout.splitlines() if line.startswith(sid)]
    assert "  writes  " not in listed[0]


def test_network_ports_without_ports_warns(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "session", "open", "--worktree", str(worktree), "--network", "ports")
    try:
        assert out.returncode == 0
        assert out.stderr == ("dispatch: warning: --network ports without --ports: the session may connect only to "
                              "the ports its policy lists (network.ports; none in the shipped policies); give them, "
                              "e.g. --ports 443\n")
    finally:
        client.close_session(out.stdout.strip())
    quiet = run(daemon, "session", "open", "--worktree", str(worktree), "--network", "ports", "--ports", "443")
    client.close_session(quiet.stdout.strip())
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_socket_errors_say_what_to_do(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    out = dispatch_cli("--socket", str(blocked / "d.sock"), "status", env=_env(XDG_STATE_HOME=str(tmp_path / "s")))
    assert_error(out, "Not a directory", "name a socket in a directory you own or may create, e.g. --socket /")
    out = subprocess.run([sys.executable, "-m", "dispatchd", "--socket", "/tmp/d.sock"], capture_output=True,
                         text=True, env=_env(XDG_STATE_HOME=str(tmp_path / "s")), timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith(
        f"dispatchd: /tmp belongs to uid 0, not to us ({os.getuid()}); dispatchd keeps its socket in a private "
        "directory of its own")


def test_autostart_says_so_once_and_daemon_stop_ends_it(tmp_path: Path) -> None:
    base = tempfile.mkdtemp(prefix="dsp-")
    sock = os.path.join(base, "run", "dispatchd.sock")
    env = _env(XDG_STATE_HOME=str(tmp_path / "state"))
    pid = None
    try:
        first = dispatch_cli("--socket", sock, "session", "list", env=env)
        assert first.returncode == 0 and first.stdout == "no sessions\n"
        lines = first.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dispatch: started dispatchd in the background (pid ")
        assert lines[0].endswith("`dispatch daemon stop` ends it") and f"on {sock};" in lines[0]
        pid = int(lines[0].split("(pid ")[1].split(")")[0])
        again = dispatch_cli("--socket", sock, "session", "list", env=env)
        assert (again.returncode, again.stderr) == (0, "")  # once
        stop = dispatch_cli("--socket", sock, "daemon", "stop", env=env)
        assert (stop.returncode, stop.stdout, stop.stderr) == (0, f"stopped dispatchd (pid {pid}) on {sock}\n", "")
        assert not _alive(pid)
        # Stopping starts nothing: no daemon is an error, not a new daemon.
        assert_error(dispatch_cli("--socket", sock, "daemon", "stop", env=env), "no dispatchd is listening")
    finally:
        if pid is not None and _alive(pid):
            _stop(pid)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("args", [("--help",), ("exec", "--help")])
def test_help_exits_0(args: tuple[str, ...]) -> None:
    assert dispatch_cli(*args).returncode == 0


def test_the_printed_mcp_config_starts_a_working_server_from_a_hostile_directory(daemon: Daemon, tmp_path: Path) -> None:
    """What --print-config prints, run from a directory holding a `dispatch`
    package (as an agent could write one), serves our tools, not that package."""
    wt = tmp_path / "wt"
    (wt / "dispatch").mkdir(parents=True)
    (wt / "dispatch" / "__init__.py").write_text("raise SystemExit('the worktree package was imported')\n")
    (wt / "dispatch" / "cli.py").write_text("raise SystemExit('the worktree package was imported')\n")
    out = dispatch_cli("--socket", daemon.socket, "mcp", "--worktree", str(wt), "--print-config")
    server = json.loads(out.stdout)["mcpServers"]["dispatchd"]
    init = ('{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", '
            '"capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}\n')
    proc = subprocess.run([server["command"], *server["args"]], input=init, capture_output=True, text=True,
                          cwd=wt, env=_env(), timeout=60)
    assert "the worktree package was imported" not in proc.stderr
    assert '"serverInfo"' in proc.stdout and '"dispatchd"' in proc.stdout, proc.stderr
    # The twin: the same command without -P does import the worktree's package.
    plain = subprocess.run([server["command"], *[a for a in server["args"] if a != "-P"]], input=init,
                           capture_output=True, text=True, cwd=wt, env=_env(), timeout=60)
    assert "the worktree package was imported" in plain.stderr
