"""A session's environment and secrets, against a real daemon: the commands see
them; a secret's value never comes back (results, streamed output, status), nor
reaches the daemon's log; refused names are refused with their reason."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell
from tests.integration.test_cli import _env, dispatch_cli

TOKEN = "s3cr3t-Token-9f8e7d6c"


def test_the_commands_see_env_and_secrets(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), env={"GREETING": "hello"}, secrets={"TOKEN": TOKEN}) as s:
        r = shell(s, 'echo "$GREETING"; test "$TOKEN" = ' + TOKEN + ' && echo token-matches')
        assert r.output == "hello\ntoken-matches\n"
        # One call's env, over the session's.
        r = shell(s, 'echo "$GREETING $ONLY"', env={"GREETING": "hi", "ONLY": "here"})
        assert r.output == "hi here\n"
        assert shell(s, 'echo "$GREETING ${ONLY-unset}"').output == "hello unset\n"


def test_a_secret_in_output_comes_back_redacted(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        r = shell(s, 'echo "token=$TOKEN"; echo "again $TOKEN" >&2')
        assert r.output == "token=[secret TOKEN]\n[stderr]\nagain [secret TOKEN]\n"
        assert (r.metadata["stdout"], r.metadata["stderr"]) == ("token=[secret TOKEN]\n", "again [secret TOKEN]\n")
        failed = shell(s, 'echo "$TOKEN"; exit 3')
        assert failed.is_failure and TOKEN not in failed.error and "[secret TOKEN]" in failed.error
        # Written to a file by a command, then read: still redacted.
        shell(s, 'echo "$TOKEN" > leaked.txt')
        read = s.registry.get("read_file").call({"path": "leaked.txt"})
        assert read.output == "0: [secret TOKEN]"
        found = s.registry.get("search_files").call({"query": "Token"})
        assert TOKEN not in str(found) and "[secret TOKEN]" in str(found)
        status = s.status()
        assert TOKEN not in json.dumps(status) and TOKEN not in json.dumps(client.status())
        sid = s.id
    log = daemon.log()
    assert f"session={sid}" in log  # the log at debug level is the one read
    assert TOKEN not in log


def test_a_secret_split_across_streamed_chunks_is_redacted(client: dispatch.Client, worktree: Path) -> None:
    # The value printed in two halves, 0.3 s apart: two chunks on the wire.
    half = len(TOKEN) // 2
    command = f'printf "a%s" "${{TOKEN:0:{half}}}"; sleep 0.3; printf "%s b\\n" "${{TOKEN:{half}}}"'
    chunks: list[str] = []
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        r = s.registry.get("shell_exec").call({"command": command}, on_output=lambda _s, t: chunks.append(t))
    assert r.output == "a[secret TOKEN] b\n"
    assert "".join(chunks) == "a[secret TOKEN] b\n"
    assert all(TOKEN[:half] not in c for c in chunks)


def test_streamed_output_without_a_secret_is_not_held(client: dispatch.Client, worktree: Path) -> None:
    # The twin: output that cannot begin a secret goes out as it comes.
    seen: list[str] = []
    first = threading.Event()

    def on_output(_stream: str, text: str) -> None:
        seen.append(text)
        first.set()

    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        done: list[dispatch.Result] = []
        t = threading.Thread(target=lambda: done.append(s.registry.get("shell_exec").call(
            {"command": "echo early; sleep 1; echo late"}, on_output=on_output)))
        t.start()
        assert first.wait(0.8) and seen == ["early\n"]
        t.join(5)
    assert done[0].output == "early\nlate\n"


@pytest.mark.parametrize("name, why", [
    ("LD_PRELOAD", "LD_PRELOAD is refused: LD_* variables are the loader's and the sandbox relies on them"),
    ("DISPATCH_CALL_ID", "DISPATCH_CALL_ID is refused: DISPATCH_* variables are dispatchd's own"),
    ("HOME", "HOME is refused: the sandbox sets it itself"),
    ("https_proxy", "https_proxy is refused: the sandbox sets it itself"),
    ("1X", "'1X' is not a variable name"),
])
def test_names_the_sandbox_relies_on_are_refused(client: dispatch.Client, worktree: Path, name: str,
                                                 why: str) -> None:
    with pytest.raises(ValueError, match="^env: " + why.replace("*", r"\*")):
        client.open_session(str(worktree), env={name: "x"})
    # The daemon refuses them too (a client that does not check).
    from dispatchd import protocol

    with pytest.raises(dispatch.RequestFailed, match=why.replace("*", r"\*")):
        client._daemon_request(lambda rid: protocol.OpenSession(id=rid, worktree=str(worktree), env={name: "x"}))
    with client.open_session(str(worktree)) as s:
        r = shell(s, "true", env={name: "x"})
        assert r.is_failure and r.error.startswith("env: " + why.split(" (")[0].rstrip("*"))
        assert shell(s, 'echo "$PATH_EXTRA"', env={"PATH_EXTRA": "ok"}).output == "ok\n"  # the allowed twin


def test_a_short_secret_is_refused_without_its_value(client: dispatch.Client, worktree: Path) -> None:
    with pytest.raises(ValueError) as err:
        client.open_session(str(worktree), secrets={"PIN": "123"})
    assert str(err.value) == ("secrets: the value of PIN is shorter than 4 characters: too short to find and "
                              "redact in output without mangling it")


def test_env_and_secrets_survive_a_sandbox_replacement(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), env={"GREETING": "hello"}, secrets={"TOKEN": TOKEN}) as s:
        s.set_network("domains", domains=["example.org"])  # replaces the sandbox
        r = shell(s, 'echo "$GREETING $TOKEN"')
        assert r.output == "hello [secret TOKEN]\n"


def test_the_cli_passes_env_and_secrets(daemon: Daemon, worktree: Path) -> None:
    env = _env(MY_TOKEN=TOKEN)
    out = dispatch_cli("--socket", daemon.socket, "--no-autostart", "exec", "--worktree", str(worktree),
                       "--env", "A=1", "--env", "B=two words", "--secret", "MY_TOKEN", "--",
                       "bash", "-c", 'echo "$A $B $MY_TOKEN"', env=env)
    assert (out.returncode, out.stdout) == (0, "1 two words [secret MY_TOKEN]\n"), out.stderr
    opened = dispatch_cli("--socket", daemon.socket, "--no-autostart", "session", "open", "--worktree",
                          str(worktree), "--env", "A=1", "--secret", "MY_TOKEN", env=env)
    sid = opened.stdout.strip()
    try:
        out = dispatch_cli("--socket", daemon.socket, "--no-autostart", "exec", "--session", sid,
                           "--env", "C=3", "--", "bash", "-c", 'echo "$A $C $MY_TOKEN"', env=env)
        assert (out.returncode, out.stdout) == (0, "1 3 [secret MY_TOKEN]\n"), out.stderr
        refused = dispatch_cli("--socket", daemon.socket, "--no-autostart", "exec", "--session", sid,
                               "--secret", "MY_TOKEN", "--", "true", env=env)
        assert (refused.returncode, refused.stderr.strip()) == (
            2, "dispatch: --secret is given when a session opens: not with --session")
    finally:
        dispatch_cli("--socket", daemon.socket, "--no-autostart", "session", "close", sid)
    missing = dispatch_cli("--socket", daemon.socket, "--no-autostart", "exec", "--worktree", str(worktree),
                           "--secret", "NOT_SET_HERE", "--", "true")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "dispatch: --secret NOT_SET_HERE: no NOT_SET_HERE in our environment to read its value from"


# ----------------------------------------------------------------- usage


def test_every_call_carries_its_usage(session: dispatch.Session) -> None:
    # A command that burns about 0.3 s of CPU and holds about 64 MiB.
    busy = shell(session, "/usr/bin/python3 -c 'b = bytearray(64 << 20); import time\n"
                          "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass'")
    assert busy.is_success, busy.error
    usage = busy.metadata["usage"]
    assert 0.25 <= usage["cpu_s"] < 2.0
    assert 64 <= usage["peak_mib"] < 200
    idle = shell(session, "sleep 0.3")  # the twin: time passes, no CPU is used
    assert idle.metadata["usage"]["cpu_s"] < 0.1 and idle.metadata["usage"]["peak_mib"] < 64
    # read_file is left out: its usual call is answered by the C lane
    # (tools/_fastread.c), which adds no usage (docs/agents-features.md).
    for name, params in [("list_files", {}),
                         ("search_files", {"query": "main"}), ("write_file", {"path": "x", "content": "y"})]:
        usage = session.registry.get(name).call(params).metadata["usage"]
        assert set(usage) == {"cpu_s", "peak_mib"} and usage["cpu_s"] >= 0 and usage["peak_mib"] > 0, name


# ----------------------------------------------------------------- streaming through dispatch and the loop


def test_dispatch_and_the_loop_stream_output(session: dispatch.Session) -> None:
    from dispatch.agent import FakeModel, run_tool_loop

    seen: list[tuple[str, str]] = []
    call = {"type": "tool_use", "id": "t1", "name": "shell_exec", "input": {"command": "echo out; echo err >&2"}}
    reply = session.registry.dispatch(call, on_output=lambda s, t: seen.append((s, t)))
    assert reply["is_error"] is False and sorted(seen) == [("stderr", "err\n"), ("stdout", "out\n")]
    seen.clear()
    model = FakeModel([[("shell_exec", {"command": "echo looped"})], "done"])
    result = run_tool_loop(model, session.registry, [], on_output=lambda s, t: seen.append((s, t)))
    assert result.final == "done" and seen == [("stdout", "looped\n")]


# ----------------------------------------------------------------- refusals in results

_FETCH = ("/usr/bin/python3 -c 'import urllib.request, sys\n"
          "try:\n    urllib.request.urlopen(\"https://{host}/\", timeout=5)\n"
          "except OSError as e:\n    print(e)\n    sys.exit(7)'")


def test_a_call_during_which_the_proxy_refused_a_host_says_so(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), network="domains", domains=["example.org"]) as s:
        r = shell(s, _FETCH.format(host="notallowed.invalid"))
        assert r.is_failure and r.metadata["exit_code"] == 7
        assert r.metadata["network_denied"] == ["notallowed.invalid:443"]
        assert "Tunnel connection failed: 403" in r.metadata["stdout"]
        assert r.error.splitlines()[-1] == (
            "[network: dispatchd refused notallowed.invalid:443 (not in this session's domains); to allow: "
            f"dispatch network {s.id} domains --domains example.org,notallowed.invalid]")
        assert [(d["host"], d["port"], d["count"]) for d in s.status()["network"]["denied"]] == [
            ("notallowed.invalid", 443, 1)]
        # The twin: a call with no refusal in its time is left as it was.
        quiet = shell(s, "echo quiet")
        assert quiet.output == "quiet\n" and "network_denied" not in quiet.metadata
        # A success that was refused on the way ends with the line too.
        ok = shell(s, _FETCH.format(host="other.invalid") + "; exit 0")
        assert ok.is_success and ok.metadata["network_denied"] == ["other.invalid:443"]
        assert ok.output.splitlines()[-1].startswith("[network: dispatchd refused other.invalid:443 ")


def test_status_sums_the_sessions_usage(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    import time

    with client.open_session(str(worktree)) as s:
        assert s.status()["usage"] == {"calls": 0, "cpu_s": 0.0, "peak_mib": 0.0}
        burn = ("/usr/bin/python3 -c 'import time\nt = time.process_time()\n"
                "while time.process_time() - t < 0.2: pass'")
        used = [shell(s, burn).metadata["usage"] for _ in range(2)]
        deadline = time.monotonic() + 5  # reported in batches, about every half second
        while s.status()["usage"]["calls"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        total = s.status()["usage"]
        assert total["calls"] == 2
        assert total["cpu_s"] == pytest.approx(sum(u["cpu_s"] for u in used), abs=0.01)
        assert total["peak_mib"] == max(u["peak_mib"] for u in used)
        text = dispatch_cli("--socket", daemon.socket, "--no-autostart", "status").stdout
        assert (f"    usage: 2 calls, {total['cpu_s']:g} s CPU, largest peak {total['peak_mib']:g} MiB"
                in text.splitlines())


# ----------------------------------------------------------------- changes


def test_writing_calls_say_what_they_changed(session: dispatch.Session) -> None:
    call = session.registry.call
    assert call("write_file", {"path": "a/b.txt", "content": "x"}).metadata["changed"] == ["a/b.txt"]
    assert call("create_file", {"path": "c.txt", "content": "x"}).metadata["changed"] == ["c.txt"]
    edited = call("edit_file", {"path": "c.txt", "edits": [{"old_text": "x", "new_text": "y"}]})
    assert edited.metadata["changed"] == ["c.txt"]
    # A command: what it created, wrote, deleted, and the directories it made with what is in them.
    r = shell(session, "mkdir -p new/dir && echo x > new/dir/f && echo y >> README.md && rm src/main.py && "
                       "mv c.txt d.txt")
    assert r.is_success, r.error
    assert sorted(r.metadata["changed"]) == ["README.md", "c.txt", "d.txt", "new", "new/dir", "new/dir/f",
                                             "src/main.py"]
    assert "changed_truncated" not in r.metadata and "changed_unknown" not in r.metadata
    # A name that is not UTF-8 does not break the reply.
    odd = shell(session, "touch $'odd\\xff'")
    assert odd.is_success and odd.metadata["changed"] == ["odd\\xff"]
    # The twin: a command that only reads changed nothing.
    assert shell(session, "cat README.md; ls -R > /dev/null").metadata["changed"] == []


def test_changes_are_cut_at_a_thousand(session: dispatch.Session) -> None:
    r = shell(session, "mkdir many && cd many && for i in $(seq 1 1100); do : > f$i; done")
    assert r.is_success, r.error
    assert len(r.metadata["changed"]) == 1000 and r.metadata["changed_truncated"] is True
    assert r.metadata["changed"][0] == "many" and all(p.startswith("many/f") for p in r.metadata["changed"][1:])


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_a_secret_split_across_job_output_polls_is_redacted(client: dispatch.Client, worktree: Path,
                                                            as_secret: bool) -> None:
    """A background job writes the value in two parts, 1 s apart; the model
    polls job_output from each reply's next_offset. The part that could begin
    the value waits for the next poll, which shows it redacted whole; the
    twin (a plain variable) is shown as written, poll by poll."""
    half = len(TOKEN) // 2
    command = f'printf "key %s" "${{TOKEN:0:{half}}}"; sleep 1; printf "%s done\\n" "${{TOKEN:{half}}}"'
    given = {"secrets": {"TOKEN": TOKEN}} if as_secret else {"env": {"TOKEN": TOKEN}}
    with client.open_session(str(worktree), **given) as s:  # type: ignore[arg-type]
        job = shell(s, command, background=True).metadata["job"]
        poll = s.registry.get("job_output")
        first = poll.call({"job": job, "wait": 10})
        offset = first.metadata["next_offset"]
        second = poll.call({"job": job, "offset": offset, "wait": 10})
        while second.metadata["running"] and "done" not in second.output:
            second = poll.call({"job": job, "offset": second.metadata["next_offset"], "wait": 10})
    if as_secret:
        assert (first.output, offset) == (f"key \n[job {job} running; next_offset 4]", 4)
        assert second.output.startswith("[secret TOKEN] done\n"), second.output
    else:
        assert first.output.startswith(f"key {TOKEN[:half]}\n") and offset == 4 + half, first.output
        assert second.output.startswith(f"{TOKEN[half:]} done\n"), second.output
