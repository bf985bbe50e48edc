"""A session's tools over the Model Context Protocol (MCP), on stdio.

``dispatch mcp --worktree DIR`` runs ``serve(session)``: any MCP client
(Claude Desktop, Claude Code, an IDE, the ``mcp`` SDK's ``ClientSession``)
gets dispatchd's confined tools without code.

Guarantees:
- ``tools/list`` is the registry's advertised tools (``retrieve_output``
  included when the registry compacts), with MCP annotations from each tool's
  risk: ``read`` tools are ``readOnlyHint``, ``write`` and ``execute`` ones
  ``destructiveHint``.
- ``tools/call`` goes through ``Registry.run_call``, the same path a model's
  tool call takes: validated, asked of the registry's approval (none by
  default: an MCP client asks its user itself), compacted to the policy's
  budget. The result is one ``TextContent`` with ``isError`` on failure;
  never a protocol error, so a model can read what went wrong. Its
  ``structuredContent`` is the Result's metadata without the command's
  ``stdout`` and ``stderr`` (already in the text): ``exit_code``,
  ``duration_s``, ``timed_out``, ``truncated``, ``job``, ``usage``,
  ``network_denied``... as the tool gives them, plus ``success``.
- Only the protocol reaches stdout: the SDK points fd 1 at stderr while it
  serves, so nothing a tool or a library prints can corrupt the stream.
- The network stays as the person who started the server set it
  (``--network``, and ``--domains`` for "domains"): switching it is not a tool.
- A call whose request carries a ``progressToken`` gets a
  ``notifications/progress`` for each piece of output as it comes (the
  command's latest output as ``message``, the bytes so far as ``progress``).
- ``notifications/cancelled`` for a call in flight cancels it in the sandbox:
  the command and every process it started end (``Cancellation``).
- ``serve`` returns when the client closes stdin, or on SIGTERM, SIGINT or
  SIGHUP; a call still running is abandoned (closing the session ends it).
- A line that is not a JSON-RPC message (not JSON, nested deeper than the
  SDK's parser reads, or no request object) is answered with a JSON-RPC
  error (``-32700`` or ``-32600``, with its ``id`` when one can be read,
  else ``null``) and a line on stderr, and the next is served: the SDK
  alone drops it, and the host would wait for that id for ever
  (``_mcp_unreadable.py``).

Written for the ``mcp`` SDK 2.x (its low-level ``Server`` takes its handlers
as constructor arguments).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterable
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from dispatch._mcp_unreadable import refusal
from dispatch._providers import Anthropic
from dispatch.client import Cancellation
from dispatch.tools import Registry
from dispatchd import __version__

__all__ = ["build_server", "serve", "serve_stdio"]

SERVER_NAME = "dispatchd"

_INSTRUCTIONS = (
    "These tools act on one git worktree inside a sandbox (Landlock, seccomp, namespaces). "
    "Paths are relative to the worktree root. A long result is shown as its head and tail with "
    "an id; retrieve_output returns the rest."
)


def _annotations(risk: str) -> types.ToolAnnotations:
    read_only = risk == "read"
    return types.ToolAnnotations(read_only_hint=read_only, destructive_hint=not read_only)


def build_server(registry: Registry, *, name: str = SERVER_NAME, version: str = __version__) -> Server[Any]:
    """An MCP server offering ``registry``'s tools (see the module's guarantees)."""

    async def list_tools(_ctx: Any, _params: Any) -> types.ListToolsResult:
        tools = [
            types.Tool(name=s["name"], description=s["description"], input_schema=s["inputSchema"],
                       annotations=_annotations(registry.get(s["name"]).risk))
            for s in registry.schemas("mcp")
        ]
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        # An MCP call is an Anthropic tool_use in all but name: run it as one,
        # so validation, approval and compaction are the model path's own.
        call = Anthropic.tool_call("", params.name, params.arguments or {})
        cancellation = Cancellation()
        on_output = _progress_reporter(ctx) if _progress_token(ctx) is not None else None
        # Tool calls block (a socket to the worker): run them off the event
        # loop, several at once if the client sends several. When the client
        # cancels the request (or we shut down) do not wait for the thread
        # (abandon_on_cancel), but end the call in the sandbox.
        try:
            outcome = await anyio.to_thread.run_sync(
                lambda: registry.run_call(call, {"cancellation": cancellation}, on_output), abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            cancellation.cancel()
            raise
        reply = outcome.reply
        return types.CallToolResult(content=[types.TextContent(type="text", text=reply["content"])],
                                    is_error=reply["is_error"], structured_content=_structured(outcome.result))

    return Server(name, version=version, instructions=_INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


_IN_THE_TEXT = ("stdout", "stderr")  # what the text content shows already


def _structured(result: Any) -> dict[str, Any]:
    """A call's ``structuredContent``: ``success`` and the Result's metadata,
    without the output the text carries."""
    structured = {k: v for k, v in result.metadata.items() if k not in _IN_THE_TEXT}
    structured["success"] = result.is_success
    return structured


def _progress_token(ctx: Any) -> Any:
    meta = getattr(ctx, "meta", None) or {}
    try:
        return meta.get("progress_token", meta.get("progressToken"))
    except AttributeError:
        return getattr(meta, "progress_token", None)


_PROGRESS_MESSAGE_MAX = 4096  # the tail of each piece of output, in characters


def _progress_reporter(ctx: Any) -> Any:
    """``on_output`` for a call whose client asked for progress: each piece of
    output becomes a ``notifications/progress`` sent from the event loop."""
    sent = [0]

    def on_output(_stream: str, text: str) -> None:
        sent[0] += len(text.encode("utf-8", "surrogatepass"))
        message = text[-_PROGRESS_MESSAGE_MAX:]
        try:
            anyio.from_thread.run(lambda: ctx.session.report_progress(float(sent[0]), None, message))
        except Exception:
            pass  # the request is over or the client gone: the Result still comes

    return on_output


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve_stdio(registry: Registry) -> None:
    """Serve ``registry`` on this process's stdin and stdout until the client
    closes stdin or one of ``STOP_SIGNALS`` arrives.

    A caller that opened a session for this may block ``STOP_SIGNALS``
    (``pthread_sigmask``) before opening it: they are unblocked here once they
    are listened for, so one sent at any moment still lets the caller close
    the session, rather than killing the process with the session left open.
    """
    server = build_server(registry)
    async with anyio.create_task_group() as tasks:

        async def stop_on_signal(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
                task_status.started()
                async for _ in signals:
                    tasks.cancel_scope.cancel()
                    return

        await tasks.start(stop_on_signal)
        async with stdio_server() as (read_stream, write_stream):
            readable, inbound = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            async with anyio.create_task_group() as reading:
                reading.start_soon(_answer_unreadable, read_stream, readable, write_stream)
                await server.run(inbound, write_stream, server.create_initialization_options())
        tasks.cancel_scope.cancel()  # stdin closed: stop listening for signals too


async def _answer_unreadable(lines: AsyncIterable[SessionMessage | Exception],
                             readable: anyio.abc.ObjectSendStream[SessionMessage | Exception],
                             replies: Any) -> None:
    """Pass on what the transport read; answer what it could not (the SDK's
    session would drop it without a word: _mcp_unreadable.py)."""
    async with readable:
        async for item in lines:
            if not isinstance(item, Exception):
                await readable.send(item)
                continue
            refused = refusal(item)
            print(refused.note(), file=sys.stderr, flush=True)
            if refused.answer:
                await replies.send(SessionMessage(types.JSONRPCError(
                    jsonrpc="2.0", id=refused.id, error=types.ErrorData(code=refused.code, message=refused.message))))


def serve(registry: Registry) -> None:
    """``serve_stdio`` in a fresh event loop; returns when the client is gone."""
    anyio.run(serve_stdio, registry)
