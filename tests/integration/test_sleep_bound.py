"""What bounds a session that sleeps: at most ``limits.max_wakes`` wakes
(each adds a rule to its kept Landlock ruleset, its fresh /proc, which the
kernel cannot take back, so past the bound it stays awake; one wake short
of the bound it still sleeps), and its channel limit, kept by the daemon
while it sleeps as by its tool server while awake."""

from __future__ import annotations

import socket
from pathlib import Path

from dispatchd import protocol
from dispatchd.policy import Limits, max_channels, too_many_channels
from tests.conftest import Daemon, shell
from tests.integration.test_protocol import REPLIES, greeted
from tests.sleeping import daemon_with_policies, stays_awake, wait_until_asleep


def _daemon(tmp_path: Path) -> Daemon:
    return daemon_with_policies(tmp_path, twice='description = "sleeps twice at most"\n'
                                                '[limits]\nsleep_after_s = 0.3\nmax_wakes = 2\n')


def test_a_session_stays_awake_past_its_wakes(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="twice")
            for nap in (1, 2):
                wait_until_asleep(client, s.id, 10, d.log())
                r = shell(s, "ls /proc/self/fd >/dev/null && echo awake")  # wakes it; its /proc readable
                assert r.output == "awake\n", (nap, r.error)
            # Woken twice: the most its policy allows. Asked again, it stays awake.
            assert stays_awake(client, s.id, 3), d.log()
            assert f"event=sleep_no_more session={s.id} wakes=2" in d.log()
            assert d.log().count(f"event=session_woken session={s.id}") == 2
            assert shell(s, "echo still").output == "still\n"
            s.close()
    finally:
        assert d.stop() == 0, d.log()


def _daemon_few_channels(tmp_path: Path) -> Daemon:
    # max_processes 16: four channels at most (policy.max_channels).
    return daemon_with_policies(tmp_path, few='description = "four channels"\n'
                                              '[limits]\nsleep_after_s = 0.3\nmax_processes = 16\n')


def _attach(frames: protocol.FrameSocket, rid: int, sid: str) -> protocol.FrameSocket:
    frames.send(protocol.Attach(id=rid, session=sid))
    assert isinstance(frames.recv(REPLIES), protocol.Attached)
    channel = protocol.FrameSocket(socket.socket(fileno=frames.take_fd()))
    channel.sock.settimeout(10)
    return channel


def _refusal(channel: protocol.FrameSocket) -> str:
    reply = protocol.decode(protocol.channel_reply_decoder, channel.recv_payload())
    assert isinstance(reply, protocol.ErrorReply) and (reply.id, reply.code) == (0, "too_many_channels"), reply
    assert channel.recv_payload() is None  # then closed
    return reply.message


def _served(channel: protocol.FrameSocket, rid: int) -> bool:
    channel.send(protocol.CallTool(id=rid, tool="read_file", params={"path": "README.md"}))
    reply = channel.recv(protocol.channel_reply_decoder)
    return isinstance(reply, protocol.ToolReply) and reply.success


def test_a_sleeping_session_refuses_a_channel_over_its_limit_as_an_awake_one_does(tmp_path: Path,
                                                                                   worktree: Path) -> None:
    """While a session sleeps the daemon holds its channels, and refuses one
    over the session's limit itself, with the tool server's own words: the
    channels attached while it slept never crowd out, at the wake, those a
    client closes meanwhile (found by test_1100_attach_on_one_session when
    its session fell asleep on a slow machine). Its twin: the same refusal
    from the awake tool server."""
    d = _daemon_few_channels(tmp_path)
    try:
        with d.connect() as client, greeted(d, fds=True) as frames:
            limit = max_channels(16, Limits().max_open_files)
            assert limit == 4
            awake = client.open_session(str(worktree), policy="few")
            asleep = client.open_session(str(worktree), policy="few")
            awake_channels = [_attach(frames, 10 + n, awake.id) for n in range(limit)]  # the opener's + these: over
            assert _served(awake_channels[1], 1)
            assert _refusal(awake_channels[-1]) == too_many_channels(limit)
            wait_until_asleep(client, asleep.id, 10, d.log())
            held = [_attach(frames, 20 + n, asleep.id) for n in range(limit - 1)]  # with the opener's: the limit
            over = _attach(frames, 30, asleep.id)
            assert _refusal(over) == too_many_channels(limit)  # refused while it sleeps: no wake for it
            assert f"event=session_woken session={asleep.id}" not in d.log()
            assert all(_served(ch, 40 + n) for n, ch in enumerate(held))  # the first wakes it: all served
            for ch in [*awake_channels, *held, over]:
                ch.close()
            awake.close()
            asleep.close()
    finally:
        assert d.stop() == 0, d.log()
