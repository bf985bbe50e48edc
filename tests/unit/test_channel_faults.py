"""A call that fails outside its tool (a thread that could not start, a
fault of the tool server's own) is answered, and its channel read on: the
client is told why, not left with a channel closed for a cause unknown
(worker/channel.py)."""

from __future__ import annotations

import socket
import threading
from typing import Any

from dispatchd import protocol
from dispatchd.worker.activity import Activity
from dispatchd.worker.channel import Channel


class _Server:
    """A tool server whose dispatch fails for the tools named in ``faulty``
    and answers the others."""

    def __init__(self, faulty: set[str]) -> None:
        self.faulty = faulty
        self.activity = Activity()
        self.redactor = None
        self.fast_read = None
        self.ctx: Any = None
        self.closed = threading.Event()

    def _records_due(self) -> None:
        pass

    def dispatch(self, channel: Channel, req: protocol.CallTool) -> None:
        if req.tool in self.faulty:
            raise RuntimeError("can't start new thread")
        channel.reply(protocol.ToolReply(id=req.id, success=True, output="served"))

    def channel_closed(self, channel: Channel) -> None:
        self.closed.set()


def test_a_call_failing_outside_its_tool_is_answered_and_the_channel_reads_on() -> None:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)  # a reader that died answers nothing: the test fails, it does not hang
    server = _Server({"write_file"})
    reader = threading.Thread(target=Channel(ours, server).run, daemon=True)  # type: ignore[arg-type]
    reader.start()
    client = protocol.FrameSocket(theirs)
    try:
        client.send(protocol.CallTool(id=1, tool="write_file", params={}))
        failed = client.recv(protocol.channel_reply_decoder)
        assert failed == protocol.ToolReply(
            id=1, success=False, error="write_file: dispatchd could not serve this call: RuntimeError: "
                                       "can't start new thread")
        # The twin: the same channel serves the next call (before: nobody read it).
        client.send(protocol.CallTool(id=2, tool="read_file", params={}))
        assert client.recv(protocol.channel_reply_decoder) == protocol.ToolReply(id=2, success=True,
                                                                                 output="served")
        assert not server.closed.is_set()
    finally:
        client.close()
    reader.join(5)
    assert not reader.is_alive() and server.closed.is_set()  # the client's close ends it, as ever
