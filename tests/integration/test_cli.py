"""The ``dispatch`` command line, run as a subprocess against a real daemon.

Exit statuses and what goes to stdout and stderr are the contract here: ids
alone on a line, the command's own status from ``exec`` (124 on a timeout),
0/1 from ``call``, and 2 with exactly one line on stderr for every error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
import dispatchd
from dispatchd.daemon import inusedir
from tests.conftest import Daemon, credential_dir, listening

ALL_TOOLS = ["read_file", "write_file", "edit_file", "create_file", "list_files", "search_files", "shell_exec",
             "job_output", "job_stop", "job_list"]
SESSION_ID = re.compile(r"[0-9a-f]{12}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def dispatch_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dispatch.cli", *args],
        capture_output=True, text=True, env=env or _env(), timeout=timeout, stdin=subprocess.DEVNULL,
    )


def run(daemon: Daemon, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return dispatch_cli("--socket", daemon.socket, "--no-autostart", *args, timeout=timeout)


def assert_error(out: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr that says why."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and out.stderr.endswith("\n"), out.stderr
    assert lines[0].startswith("dispatch: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def sessions_on(client: dispatch.Client, worktree: Path) -> list[str]:
    return [s["id"] for s in client.list_sessions() if s["worktree"] == str(worktree)]


@pytest.fixture
def sid(daemon: Daemon, client: dispatch.Client, worktree: Path) -> Iterator[str]:
    """A session opened by the CLI, closed afterwards whatever the test did."""
    out = run(daemon, "session", "open", "--worktree", str(worktree))
    assert out.returncode == 0, out.stderr
    session_id = out.stdout.strip()
    yield session_id
    with contextlib.suppress(dispatch.RequestFailed):
        client.close_session(session_id)


def test_module_entry_point_runs_main() -> None:
    out = dispatch_cli("--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: dispatch ")


# ----------------------------------------------------------------- session


def test_session_open_prints_the_id_alone(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "session", "open", "--worktree", str(worktree))
    try:
        assert out.returncode == 0, out.stderr
        assert SESSION_ID.fullmatch(out.stdout.removesuffix("\n")), repr(out.stdout)
        assert out.stdout.count("\n") == 1 and out.stderr == ""
        session_id = out.stdout.strip()
        # It outlives the command that opened it.
        assert sessions_on(client, worktree) == [session_id]
    finally:
        for s in sessions_on(client, worktree):
            client.close_session(s)


def test_session_open_with_policy_and_network(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "session", "open", "--worktree", str(worktree), "--policy", "read-only", "--network", "off")
    assert out.returncode == 0, out.stderr
    session_id = out.stdout.strip()
    try:
        info = [s for s in client.list_sessions() if s["id"] == session_id][0]
        assert info["policy"] == "read-only" and info["network"] == "off"
    finally:
        client.close_session(session_id)


def test_session_list_when_there_are_none(daemon: Daemon, client: dispatch.Client) -> None:
    assert client.list_sessions() == []  # every other test closed what it opened
    out = run(daemon, "session", "list")
    assert (out.returncode, out.stdout, out.stderr) == (0, "no sessions\n", "")
    out = run(daemon, "session", "list", "--json")
    assert (out.returncode, json.loads(out.stdout)) == (0, [])


def test_session_list(daemon: Daemon, sid: str, worktree: Path) -> None:
    out = run(daemon, "session", "list")
    assert out.returncode == 0 and out.stderr == ""
    mine = [line for line in out.stdout.splitlines() if line.startswith(sid)]
    assert len(mine) == 1
    assert "network=off" in mine[0] and "policy=default" in mine[0] and mine[0].endswith(str(worktree))


def test_session_list_json(daemon: Daemon, sid: str, worktree: Path) -> None:
    out = run(daemon, "session", "list", "--json")
    assert out.returncode == 0 and out.stderr == ""
    sessions = json.loads(out.stdout)
    mine = [s for s in sessions if s["id"] == sid]
    assert len(mine) == 1
    assert mine[0]["worktree"] == str(worktree)
    assert mine[0]["policy"] == "default" and mine[0]["network"] == "off"
    assert mine[0]["protections"]["landlock"]["filesystem"] == "enforced"
    assert mine[0]["protections"]["seccomp"] == "enforced"


def test_session_close(daemon: Daemon, client: dispatch.Client, sid: str, worktree: Path) -> None:
    out = run(daemon, "session", "close", sid)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert sessions_on(client, worktree) == []
    # Closing it again: it is unknown now.
    assert_error(run(daemon, "session", "close", sid), f"no such session: '{sid}'")


# ----------------------------------------------------------------- exec


def test_exec_words_are_shell_quoted(daemon: Daemon, sid: str, worktree: Path) -> None:
    (worktree / "a b").write_text("spaced\n")
    out = run(daemon, "exec", "--session", sid, "--", "ls", "-la", "a b")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n").endswith(" a b")
    assert out.stderr == ""
    out = run(daemon, "exec", "--session", sid, "--", "cat", "a b")
    assert (out.returncode, out.stdout) == (0, "spaced\n")
    # Quoted, not interpreted: no expansion, no globbing.
    out = run(daemon, "exec", "--session", sid, "--", "echo", "$HOME", "*", "a;b")
    assert (out.returncode, out.stdout) == (0, "$HOME * a;b\n")
    # The twin: "a" alone does not exist, and ls says so on our stderr.
    out = run(daemon, "exec", "--session", sid, "--", "ls", "a")
    assert out.returncode == 2 and out.stdout == ""
    assert "cannot access 'a'" in out.stderr


def test_exec_runs_in_the_worktree_root(daemon: Daemon, sid: str, worktree: Path) -> None:
    out = run(daemon, "exec", "--session", sid, "--", "pwd")
    assert (out.returncode, out.stdout) == (0, f"{worktree}\n")


def test_exec_exit_status_is_the_commands(daemon: Daemon, sid: str) -> None:
    assert run(daemon, "exec", "--session", sid, "--", "exit", "3").returncode == 3
    assert run(daemon, "exec", "--session", sid, "--", "true").returncode == 0
    assert run(daemon, "exec", "--session", sid, "--", "false").returncode == 1
    # Killed by a signal: reported as a shell would, 128 + the signal.
    assert run(daemon, "exec", "--session", sid, "--", "bash", "-c", "kill -KILL $$").returncode == 137


def test_exec_stdout_and_stderr_go_to_ours(daemon: Daemon, sid: str) -> None:
    out = run(daemon, "exec", "--session", sid, "--", "bash", "-c", "echo out; echo err >&2; exit 4")
    assert (out.returncode, out.stdout, out.stderr) == (4, "out\n", "err\n")


def test_exec_timeout_exits_124(daemon: Daemon, sid: str) -> None:
    started = time.monotonic()
    out = run(daemon, "exec", "--session", sid, "--timeout", "0.5", "--", "sleep", "120")
    assert out.returncode == 124
    # Cut, not waited out: far below the command's 120 s, whatever the machine's load.
    assert time.monotonic() - started < 60
    assert out.stdout == ""
    assert out.stderr == "dispatch: command timed out after 0.5 s\n"
    # The twin: in time, not cut.
    out = run(daemon, "exec", "--session", sid, "--timeout", "5", "--", "echo", "in time")
    assert (out.returncode, out.stdout) == (0, "in time\n")


def test_exec_output_over_the_cap_is_cut_and_said(daemon: Daemon, sid: str) -> None:
    cap = 1024 * 1024
    out = run(daemon, "exec", "--session", sid, "--", "head", "-c", str(cap + 1000), "/dev/zero")
    assert out.returncode == 0
    assert out.stdout == "\0" * cap
    assert out.stderr == ("dispatch: output truncated at 1 MiB per stream (the policy's limits.output_cap_bytes; "
                          "a policy of your own with a larger value raises it)\n")
    out = run(daemon, "exec", "--session", sid, "--", "head", "-c", str(cap), "/dev/zero")
    assert (out.returncode, len(out.stdout), out.stderr) == (0, cap, "")


def test_exec_one_off_session_on_a_worktree(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "exec", "--worktree", str(worktree), "--", "echo", "hi")
    assert (out.returncode, out.stdout, out.stderr) == (0, "hi\n", "")
    assert sessions_on(client, worktree) == []
    # Also when the command fails.
    out = run(daemon, "exec", "--worktree", str(worktree), "--", "exit", "5")
    assert out.returncode == 5
    assert sessions_on(client, worktree) == []


def test_exec_usage_errors(daemon: Daemon, sid: str, worktree: Path) -> None:
    assert_error(run(daemon, "exec", "--session", sid, "--"), "exec needs a command after --")
    assert_error(run(daemon, "exec", "--session", sid, "--worktree", str(worktree), "--", "true"),
                 "give exactly one of --session ID or --worktree DIR")
    assert_error(run(daemon, "exec", "--", "true"), "give exactly one of --session ID or --worktree DIR")
    assert_error(run(daemon, "exec", "--session", sid, "--timeout", "-1", "--", "true"), "timeout")


def test_exec_under_a_policy_without_shell_exec(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    """A policy that offers no commands: a refusal, so one line on stderr and exit 2,
    not a traceback."""
    out = run(daemon, "exec", "--worktree", str(worktree), "--policy", "read-only", "--", "true")
    assert_error(out, "shell_exec")
    assert sessions_on(client, worktree) == []


# ----------------------------------------------------------------- call


def test_call_prints_the_result_as_json(daemon: Daemon, sid: str) -> None:
    out = run(daemon, "call", "--session", sid, "read_file", '{"path": "README.md"}')
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    result = json.loads(out.stdout)
    assert set(result["metadata"].pop("usage")) == {"cpu_s", "peak_mib"}  # what the call used (varies)
    assert result == {
        "success": True,
        "output": "0: hello\n1: world",
        "error": None,
        "metadata": {"path": "README.md", "total_lines": 2, "start_line": 0, "end_line": 1},
    }


def test_call_failure_exits_1(daemon: Daemon, sid: str) -> None:
    out = run(daemon, "call", "--session", sid, "read_file", '{"path": "missing.txt"}')
    assert out.returncode == 1
    failed = json.loads(out.stdout)
    failed["metadata"].pop("usage", None)  # the call's CPU time: varies
    assert failed == {"success": False, "output": None, "error": "file not found: missing.txt", "metadata": {}}
    out = run(daemon, "call", "--session", sid, "shell_exec", '{"command": "echo x; exit 3"}')
    assert out.returncode == 1
    result = json.loads(out.stdout)
    assert result["error"] == "command exited with status 3\nx\n"
    assert result["metadata"]["exit_code"] == 3 and result["metadata"]["stdout"] == "x\n"
    # Arguments the schema refuses are a failed Result too.
    out = run(daemon, "call", "--session", sid, "read_file", '{"path": 1}')
    assert out.returncode == 1
    assert json.loads(out.stdout)["error"] == "read_file: invalid arguments: $.path: 1 is not of type 'string'"


def test_call_default_arguments_and_one_off_session(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "call", "--worktree", str(worktree), "list_files")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output"] == "README.md\nsrc/main.py"
    assert sessions_on(client, worktree) == []


def test_call_bad_json_exits_2(daemon: Daemon, sid: str) -> None:
    assert_error(run(daemon, "call", "--session", sid, "read_file", '{"path": '),
                 "the tool's arguments are not valid JSON")


def test_call_unknown_tool_exits_2(daemon: Daemon, sid: str) -> None:
    assert_error(run(daemon, "call", "--session", sid, "nope", "{}"),
                 "unknown tool 'nope' (this session has: " + ", ".join(ALL_TOOLS))


def test_call_a_tool_the_policy_does_not_offer_exits_2(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    out = run(daemon, "call", "--worktree", str(worktree), "--policy", "read-only", "write_file",
              '{"path": "x.txt", "content": "x"}')
    assert_error(out, "unknown tool 'write_file' (this session has: read_file, list_files, search_files")
    assert not (worktree / "x.txt").exists()
    assert sessions_on(client, worktree) == []


# ----------------------------------------------------------------- network


def test_network_prints_the_new_state(daemon: Daemon, client: dispatch.Client, sid: str) -> None:
    out = run(daemon, "network", sid, "on")
    assert (out.returncode, out.stdout) == (0, "on\n")
    # The switch happens in place (the session's own namespace, pasta started); a note on stderr, one line, says so.
    assert out.stderr.startswith("dispatch: network on: switched in place") and out.stderr.count("\n") == 1
    assert [s["network"] for s in client.list_sessions() if s["id"] == sid] == ["on"]
    out = run(daemon, "network", sid, "off")
    assert (out.returncode, out.stdout) == (0, "off\n")
    assert [s["network"] for s in client.list_sessions() if s["id"] == sid] == ["off"]
    # The session still runs commands after the switches.
    assert run(daemon, "exec", "--session", sid, "--", "echo", "ok").stdout == "ok\n"


# ----------------------------------------------------------------- tools


def test_tools_json_is_the_plain_schemas(daemon: Daemon, client: dispatch.Client) -> None:
    out = run(daemon, "tools")
    assert out.returncode == 0 and out.stderr == ""
    tools = json.loads(out.stdout)
    assert [t["name"] for t in tools] == ALL_TOOLS
    assert all(set(t) == {"name", "description", "parameters"} for t in tools)
    assert tools == client.tools()
    assert json.loads(run(daemon, "tools", "--format", "json").stdout) == tools


def test_tools_openai_and_anthropic_shapes(daemon: Daemon, client: dispatch.Client) -> None:
    plain = client.tools()
    openai = json.loads(run(daemon, "tools", "--format", "openai").stdout)
    assert openai == [{"type": "function", "function": t} for t in plain]
    anthropic = json.loads(run(daemon, "tools", "--format", "anthropic").stdout)
    assert anthropic == [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in plain
    ]
    responses = json.loads(run(daemon, "tools", "--format", "openai-responses").stdout)
    assert responses == [{"type": "function", **t, "strict": False} for t in plain]
    mcp = json.loads(run(daemon, "tools", "--format", "mcp").stdout)
    assert mcp == [{"name": t["name"], "description": t["description"], "inputSchema": t["parameters"]} for t in plain]


def test_tools_of_another_policy(daemon: Daemon) -> None:
    out = run(daemon, "tools", "--policy", "read-only")
    assert out.returncode == 0
    assert [t["name"] for t in json.loads(out.stdout)] == ["read_file", "list_files", "search_files"]
    assert_error(run(daemon, "tools", "--policy", "nope"), "no policy named 'nope'")


# ----------------------------------------------------------------- status


def test_status_text(daemon: Daemon, sid: str, worktree: Path) -> None:
    out = run(daemon, "status")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[0] == f"dispatchd {dispatchd.__version__} (pid {daemon.proc.pid}) on {daemon.socket}"
    assert lines[1].startswith("kernel ") and "Landlock ABI" in lines[1] and "user namespaces:" in lines[1]
    assert "seccomp: yes" in lines[1] and "cgroup v2:" in lines[1]
    assert lines[2] == "network modes: off, on, ports, domains"
    del lines[2]
    assert re.fullmatch(r"kernel budgets: all sessions together at most [\d,]+ inotify instances, .* "
                        r"\(half of the user's\); [\d,]+ processes and threads \(half of the lowest limit they "
                        r"meet, .* [\d,]+\)", lines[2]), lines[2]
    del lines[2]
    assert re.fullmatch(r"daemon: \d+ descriptors \((raised from \d+|already the hard limit)\); "
                        r"connections \d+ of at most \d+( \(\d+ idle, waiting without a thread\))?", lines[2]), lines[2]
    assert re.fullmatch(r"sandboxes made ahead: 2 per kind of session \(policy/network\), for the 4 kinds most "
                        r"recently opened, each at most 30 s old; \d+ of \d+ opens so far served by one; "
                        r"default/off: \d ready.*", lines[3]), lines[3]
    assert lines[4] == ("line loops: read_file and search_files number and find lines in C, and read_file's "
                        "usual call is answered there whole (dispatchd.tools._lines)")
    assert re.fullmatch(r"helpers: fork server pid \d+: running; network stacks: \d+ running, 0 ended a session "
                        r"by exiting; socket: ours", lines[5]), lines[5]
    assert lines[6] == (f"worktrees in use recorded in {inusedir.shared_path(os.getuid())}, shared by every "
                        "dispatchd of yours whatever its state directory")
    kept = re.escape(str(daemon.state / "dispatchd" / "before-restore"))
    assert re.fullmatch(rf"what restores replaced: in {kept}, \d+ kept there, [\d.]+ [KMG]?i?B of at most [\d.]+ "
                        r"[KMG]iB \((dispatchd's fixed bound|a quarter of the [\d.]+ [KMGT]iB free on its file "
                        r"system)\); each kept 7 days, remove old ones by hand to make room", lines[7]), lines[7]
    assert re.fullmatch(r"\d+ session\(s\)", lines[8])
    mine = [i for i, line in enumerate(lines) if line.strip().startswith(sid)]
    assert len(mine) == 1
    block = "\n".join(lines[mine[0]:mine[0] + 4])
    assert str(worktree) in block and "filesystem enforced" in block and "seccomp: enforced" in block
    limits = [line.strip() for line in lines[mine[0]:] if line.strip().startswith("limits (")][0]
    assert limits == ("limits (rlimits): processes 1024; memory 8 GiB over the session (the daemon's "
                      "memory watchdog); 8 GiB of data per process (RLIMIT_DATA); cpu weight not enforced "
                      "(no cpu controller); file size 8 GiB")
    assert "tcp: not handled" not in out.stdout and "not handled" not in out.stdout
    assert "(per-session cgroups: no: " in lines[1]
    assert "network stack (slirp4netns): yes; nftables for ports: yes" in lines[1]


def test_status_json(daemon: Daemon, sid: str) -> None:
    out = run(daemon, "status", "--json")
    assert out.returncode == 0 and out.stderr == ""
    st = json.loads(out.stdout)
    assert "op" not in st and "id" not in st  # the protocol's fields are not the status
    assert st["daemon_version"] == dispatchd.__version__
    assert st["pid"] == daemon.proc.pid and st["socket"] == daemon.socket
    assert st["daemon"]["line_loops"].startswith("read_file and search_files number and find lines in C")
    kept = st["daemon"]["before_restore"]  # what restores replaced, kept past their sessions (docs/checkpoints.md)
    assert sorted(kept) == ["budget", "budget_why", "bytes", "count", "path"]
    assert kept["path"] == str(daemon.state / "dispatchd" / "before-restore") and 0 < kept["budget"] <= 8 << 30
    assert kept["budget_why"] == "dispatchd's fixed bound" if kept["budget"] == 8 << 30 else \
        kept["budget_why"].startswith("a quarter of the ")
    kernel = st["kernel"]
    assert kernel["landlock_abi"] >= 1 and kernel["seccomp"] is True
    assert isinstance(kernel["user_namespaces"], bool) and "cgroup2" in kernel
    mine = [s for s in st["sessions"] if s["id"] == sid]
    assert len(mine) == 1
    prot = mine[0]["protections"]
    assert prot["landlock"]["filesystem"] == "enforced"
    assert prot["seccomp"] == "enforced"
    assert prot["network"]["mode"] == "off"


# ----------------------------------------------------------------- errors: exit 2, one line


def test_unknown_session_errors(daemon: Daemon) -> None:
    gone = "000000000000"
    for args in (
        ("session", "close", gone),
        ("exec", "--session", gone, "--", "true"),
        ("call", "--session", gone, "read_file", '{"path": "README.md"}'),
        ("network", gone, "on"),
    ):
        assert_error(run(daemon, *args), f"no such session: '{gone}'")


def test_bad_worktree_errors(daemon: Daemon, worktree: Path) -> None:
    missing = str(worktree / "missing")
    assert_error(run(daemon, "session", "open", "--worktree", missing), "worktree does not exist")
    assert_error(run(daemon, "exec", "--worktree", missing, "--", "true"), "worktree does not exist")
    assert_error(run(daemon, "call", "--worktree", missing, "list_files"), "worktree does not exist")
    assert_error(run(daemon, "session", "open", "--worktree", str(worktree / "README.md")), "worktree is not a directory")


def test_refused_policy_errors(daemon: Daemon, worktree: Path) -> None:
    assert_error(run(daemon, "session", "open", "--worktree", str(worktree), "--policy", "nope"),
                 "no policy named 'nope'")


def test_no_daemon(tmp_path: Path) -> None:
    for args in (("status",), ("session", "list"), ("exec", "--worktree", str(tmp_path), "--", "true")):
        out = dispatch_cli("--socket", "/nonexistent/x.sock", "--no-autostart", *args)
        line = assert_error(out, "no dispatchd is listening on /nonexistent/x.sock")
        # The hint names the --socket it was given.
        assert line == ("dispatch: no dispatchd is listening on /nonexistent/x.sock (start it with "
                        "`dispatchd --socket /nonexistent/x.sock`, or leave out --no-autostart)")


# ----------------------------------------------------------------- autostart


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_autostart_starts_a_daemon(tmp_path: Path) -> None:
    base = tempfile.mkdtemp(prefix="dsp-")  # short: socket paths are limited to 107 bytes
    sock = os.path.join(base, "run", "dispatchd.sock")
    env = _env(XDG_STATE_HOME=str(tmp_path / "state"))
    pid = None
    try:
        out = dispatch_cli("--socket", sock, "status", "--json", env=env)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        pid = st["pid"]
        assert st["socket"] == sock
        assert _alive(pid) and listening(sock)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"dispatchd" in cmdline and sock.encode() in cmdline
        # Its own log, named by its socket (not the default one's: two daemons would rotate one file).
        log = f"dispatchd-{hashlib.sha256(sock.encode()).hexdigest()[:8]}.log"
        assert sorted(p.name for p in (tmp_path / "state" / "dispatchd").glob("*.log")) == [log]
        assert "event=kernel" in (tmp_path / "state" / "dispatchd" / log).read_text()
        # Now it answers: the next command uses it and starts no other.
        out = dispatch_cli("--socket", sock, "--no-autostart", "status", "--json", env=env)
        assert out.returncode == 0 and json.loads(out.stdout)["pid"] == pid
        out = dispatch_cli("--socket", sock, "status", "--json", env=env)
        assert out.returncode == 0 and json.loads(out.stdout)["pid"] == pid
    finally:
        if pid is not None:
            _stop(pid)
        shutil.rmtree(base, ignore_errors=True)
    assert not _alive(pid)
    assert not listening(sock)


def test_autostart_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    """The daemon cannot create its socket's directory (under root's /usr) and exits at
    once: the client says so in one line, with the log's reason, without waiting out
    its whole start timeout for a daemon that is already gone. The words "exited with
    status" are the proof: a client that waited the timeout out says "did not answer
    within" (a clock would measure the machine's load, not the client)."""
    sock = "/usr/dispatchd-test-nonexistent/dispatchd.sock"
    env = _env(XDG_STATE_HOME=str(tmp_path / "state"))
    out = dispatch_cli("--socket", sock, "status", env=env, timeout=60)
    assert_error(out, f"started dispatchd on {sock} but it exited with status 1",
                 "its log says: dispatchd: cannot create /usr/dispatchd-test-nonexistent: Permission denied")


def test_socket_path_under_a_file_is_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    sock = str(blocked / "dispatchd.sock")
    out = dispatch_cli("--socket", sock, "status", env=_env(XDG_STATE_HOME=str(tmp_path / "state")))
    assert_error(out, f"cannot connect to dispatchd at {sock}: Not a directory")


def test_exec_with_an_extra_read_only_path(daemon: Daemon, worktree: Path) -> None:
    """--read-only PATH (repeatable) on exec, as on session open, call and mcp."""
    tools = Path.home() / f".dispatch-cli-tools-{os.getpid()}"
    tools.mkdir()
    try:
        (tools / "version").write_text("1.2.3\n")
        out = run(daemon, "exec", "--worktree", str(worktree), "--read-only", str(tools), "--", "cat",
                  str(tools / "version"))
        assert (out.returncode, out.stdout) == (0, "1.2.3\n"), out.stderr
        without = run(daemon, "exec", "--worktree", str(worktree), "--", "cat", str(tools / "version"))
        assert without.returncode == 1 and "cat:" in without.stderr  # absent (full) or refused (degraded)
        ssh = credential_dir(".ssh")
        assert_error(run(daemon, "exec", "--worktree", str(worktree), "--read-only", str(ssh), "--", "true"),
                     f"read_only: {ssh} is or holds your credentials")
    finally:
        (tools / "version").unlink()
        tools.rmdir()
