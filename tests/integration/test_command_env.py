"""``SetCommandEnv``: the daemon changes the environment of a session's later
commands without replacing its sandbox (how an in-place switch into or out of
network "domains" sets or removes the proxy variables).

The tool server (``dispatchd.worker.tool_server.serve``) runs here in a thread of
the test process, unconfined, on a real control channel and a real client
channel; the message is the one the daemon's ``send_command_env`` sends.
"""

from __future__ import annotations

import queue
import socket
import threading
from pathlib import Path

from dispatchd import protocol
from dispatchd.domains import proxy_env
from dispatchd.confine.plan import SessionPaths, plan_session
from dispatchd.policy import Policy
from dispatchd.worker.tool_server import serve
from tests.unit.test_plan import kernel


def test_set_command_env_applies_to_later_commands(tmp_path: Path) -> None:
    paths = SessionPaths(worktree=str(tmp_path), scratch=str(tmp_path), runtime_dirs=[], code=[])
    plan = plan_session(Policy(), kernel(), session="s1", paths=paths, network="off", uid=0, gid=0, base_env={})
    ours, theirs = socket.socketpair()
    control = protocol.FrameSocket(ours, fds=True)
    server_end = protocol.FrameSocket(theirs, fds=True)
    # Not a child subreaper: this test process has children of its own.
    server = threading.Thread(target=serve, args=(server_end, plan, False), daemon=True)
    server.start()
    mine, worker_end = socket.socketpair()
    control.send(protocol.AddChannel(id=0), fds=[worker_end.fileno()])
    worker_end.close()
    channel = protocol.FrameSocket(mine)
    granted = threading.Event()
    acks: queue.Queue[int] = queue.Queue()

    def answer_write_lock() -> None:  # the daemon's part: grant the lock shell_exec asks for
        try:
            while (msg := control.recv(protocol.from_worker_decoder)) is not None:
                if isinstance(msg, protocol.AcquireWriteLock):
                    control.send(protocol.OkReply(id=msg.id))
                    granted.set()
                elif isinstance(msg, protocol.OkReply):
                    acks.put(msg.id)
        except (OSError, protocol.ProtocolError):
            pass  # closed at the end of the test

    threading.Thread(target=answer_write_lock, daemon=True).start()

    def proxy_vars(rid: int) -> str:
        channel.send(protocol.CallTool(id=rid, tool="shell_exec", params={"command": "env | grep -i _proxy= | sort"}))
        reply = channel.recv(protocol.channel_reply_decoder)
        assert reply.id == rid and "exit_code" in reply.metadata, reply
        return reply.metadata["stdout"]

    try:
        assert proxy_vars(1) == ""
        control.send(protocol.SetCommandEnv(set=proxy_env(), id=7))
        assert acks.get(timeout=5) == 7  # confirmed: commands from now on have it
        assert proxy_vars(2) == "".join(f"{k}={v}\n" for k, v in sorted(proxy_env().items()))
        control.send(protocol.SetCommandEnv(unset=list(proxy_env()), id=8))
        assert acks.get(timeout=5) == 8
        assert proxy_vars(3) == ""
        assert granted.is_set()
    finally:
        channel.close()
        control.close()  # the tool server returns when its control channel closes
        server.join(5)
        server_end.close()  # ours to close (the worker's process would exit here)
