"""A session's tools over the Model Context Protocol (MCP), on stdio.

``dispatch mcp --worktree DIR`` runs ``serve(session)``: any MCP client
(Claude Desktop, Claude Code, an IDE, the ``mcp`` SDK's ``ClientSession``)
gets dispatchd's confined tools without code.

Guarantees:
- ``tools/list`` is the registry's advertised tools (``retrieve_output``
  included when the registry compacts), with MCP annotations from each tool's
  risk: ``read`` tools are ``readOnlyHint``, ``write`` and ``execute`` ones
  ``destructiveHint``.
- What a client may show on a terminal acts on nothing there: the text, the
  structured content (file names and hosts the session chose) and the
  progress messages hold no control a terminal acts on, colour dropped and
  the rest escaped (``_mcp_text``).
- ``tools/call`` goes through ``Registry.run_call``, the same path a model's
  tool call takes: validated, asked of the registry's approval (none by
  default: an MCP client asks its user itself), compacted to the policy's
  budget. The result is one ``TextContent`` with ``isError`` on failure;
  never a protocol error, so a model can read what went wrong. Its
  ``structuredContent`` is the Result's metadata without the command's
  ``stdout`` and ``stderr`` (already in the text): ``exit_code``,
  ``duration_s``, ``timed_out``, ``truncated``, ``job``, ``usage``,
  ``network_denied``... as the tool gives them, plus ``success``.
- Only the protocol reaches stdout: fd 1 points at stderr (and fd 0 at the
  null device) while it serves, so nothing a tool or a library prints can
  corrupt the stream (``_mcp_stdio``).
- The network stays as the person who started the server set it
  (``--network``, and ``--domains`` for "domains"): switching it is not a tool.
- A call whose request carries a ``progressToken`` gets a
  ``notifications/progress`` for each piece of output as it comes (the
  command's latest output as ``message``, the bytes so far as ``progress``).
- ``notifications/cancelled`` for a call in flight cancels it in the sandbox:
  the command and every process it started end (``Cancellation``).
- ``serve`` returns when the client closes stdin, or on SIGTERM, SIGINT or
  SIGHUP at once, whether the client keeps stdin open or not (every wait on
  the pipes ends at a stop: ``_mcp_stdio``); a call still running is
  answered "Connection closed" and cancelled in the sandbox (closing the
  session ends what is left of it).
- A call that finds the session over (closed from outside, its daemon gone)
  is answered with the reason and a line saying that the server stops; then
  ``serve`` returns that reason (``dispatch mcp`` exits 4): a server with no
  session would fail every call.
- A line that is not a JSON-RPC message (not JSON, nested deeper than the
  SDK's parser reads, or no request object) is answered with a JSON-RPC
  error (``-32700`` or ``-32600``, with its ``id`` when one can be read,
  else ``null``) and a line on stderr, and the next is served: the SDK
  alone drops it, and the host would wait for that id for ever; so is a
  request whose ``id`` is neither a string nor an integer (``-32600``, id
  ``null``, not run), which the SDK takes for a notification
  (``_mcp_unreadable.py``).
- A line is read as UTF-8 strictly: one that is not is refused (``-32700``
  "Parse error: the line is not UTF-8 (byte N)"), never run with its bad
  bytes replaced, which a ``write_file`` would have written as U+FFFD.
- A batch (a JSON array) gets ``-32600`` "batches are not supported" for
  each request in it, one answer a line, with its id; none is run.
- A ``tools/call`` whose ``params``, ``name`` or ``arguments`` is of the
  wrong type gets ``-32602`` saying which ("tools/call: arguments must be an
  object, not string"), not the SDK's "Invalid request parameters".
- A line over ``MAX_LINE`` bytes (a little over the largest frame dispatchd
  takes) gets ``-32600`` naming its size; it is dropped as it is read,
  never held whole.

Written for the ``mcp`` SDK 2.x (its low-level ``Server`` takes its handlers
as constructor arguments).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.shared.message import SessionMessage

from dispatch._mcp_stdio import MAX_LINE, LineTooLong, StdioPipes, Stopped
from dispatch._mcp_text import for_client, for_client_all
from dispatch._mcp_unreadable import Refusal, bad_call, bad_id, not_utf8, refusals, too_long
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
# What a call that found the session over adds to its answer.
_STOPPING = ("\n[dispatch mcp stops serving: its dispatchd session has ended. The MCP host must start it again "
             "for a new session.]")


def _annotations(risk: str) -> types.ToolAnnotations:
    read_only = risk == "read"
    return types.ToolAnnotations(read_only_hint=read_only, destructive_hint=not read_only)


def build_server(registry: Registry, *, name: str = SERVER_NAME, version: str = __version__,
                 on_session_ended: Callable[[Any, str], None] | None = None) -> Server[Any]:
    """An MCP server offering ``registry``'s tools (see the module's guarantees).
    ``on_session_ended(request_id, why)``: a call found the session over
    (``metadata["session_ended"]``); its answer then says the server stops."""

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
        reply, text = outcome.reply, for_client(outcome.reply["content"])
        why = outcome.result.metadata.get("session_ended")
        if why and on_session_ended is not None:
            on_session_ended(ctx.request_id, str(why))
            text += _STOPPING
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    is_error=reply["is_error"], structured_content=_structured(outcome.result))

    return Server(name, version=version, instructions=_INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


_IN_THE_TEXT = ("stdout", "stderr")  # what the text content shows already


def _structured(result: Any) -> dict[str, Any]:
    """A call's ``structuredContent``: ``success`` and the Result's metadata,
    without the output the text carries."""
    structured = {k: v for k, v in result.metadata.items() if k not in _IN_THE_TEXT}
    structured["success"] = result.is_success
    shown: dict[str, Any] = for_client_all(structured)  # names and hosts the session chose: shown too
    return shown


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
        message = for_client(text[-_PROGRESS_MESSAGE_MAX:])
        try:
            anyio.from_thread.run(lambda: ctx.session.report_progress(float(sent[0]), None, message))
        except Exception:
            pass  # the request is over or the client gone: the Result still comes

    return on_output


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Once serving stops, how long the answers already made (to calls in flight:
# "Connection closed") may take to reach a client; then the pipes stop.
_DRAIN_S = 1.0


async def serve_stdio(registry: Registry) -> str | None:
    """Serve ``registry`` on this process's stdin and stdout until the client
    closes stdin, one of ``STOP_SIGNALS`` arrives, or a call finds the
    session over (its answer is sent first). Returns None, or in the last
    case why the session ended (``metadata["session_ended"]``).

    Every wait on the pipes ends at a stop (``_mcp_stdio``): a signal stops
    serving at once, whether the client keeps its stdin open or not.
    A caller that opened a session for this may block ``STOP_SIGNALS``
    (``pthread_sigmask``) before opening it: they are unblocked here once they
    are listened for, so one sent at any moment still lets the caller close
    the session, rather than killing the process with the session left open.
    """
    pipes = StdioPipes()
    try:
        return await _serve(registry, pipes)
    finally:
        pipes.close()


async def _serve(registry: Registry, pipes: StdioPipes) -> str | None:
    ended: dict[Any, str] = {}  # the calls that found the session over: request id -> why
    server = build_server(registry, on_session_ended=ended.__setitem__)
    inbound_writer, inbound = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outbound, to_write = anyio.create_memory_object_stream[SessionMessage](0)
    serving = anyio.CancelScope()
    written = anyio.Event()

    def after(message: Any) -> None:
        if isinstance(message, (types.JSONRPCResponse, types.JSONRPCError)) and message.id in ended:
            serving.cancel()  # the call that found the session over has its answer: stop

    async with anyio.create_task_group() as tasks:
        await tasks.start(_stop_on_signal, serving, pipes)
        tasks.start_soon(_write_lines, pipes, to_write, after, serving, written)
        with serving:
            async with anyio.create_task_group() as reading:
                reading.start_soon(_read_lines, pipes, inbound_writer, outbound.clone())
                await server.run(inbound, outbound, server.create_initialization_options())
        with anyio.move_on_after(_DRAIN_S):
            await written.wait()
        pipes.stop()
        tasks.cancel_scope.cancel()
    return next(iter(ended.values()), None)


async def _stop_on_signal(serving: anyio.CancelScope, pipes: StdioPipes, *,
                          task_status: anyio.abc.TaskStatus[None]) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        task_status.started()
        async for _ in signals:
            if serving.cancel_called:
                pipes.stop()  # a second one: no waiting for the last answers to go out
            serving.cancel()


async def _read_lines(pipes: StdioPipes, messages: anyio.abc.ObjectSendStream[SessionMessage | Exception],
                      replies: anyio.abc.ObjectSendStream[SessionMessage]) -> None:
    """Pass on each message read; answer what cannot be served as it came
    (the SDK's session would drop it, or run a request as a notification:
    ``_mcp_unreadable``). Ends at EOF, closing ``messages``."""
    async with messages, replies:
        while True:
            try:
                raw = await anyio.to_thread.run_sync(pipes.read_line, abandon_on_cancel=True)
            except (Stopped, OSError):  # stopped, or stdin itself broken: the end of input
                return
            except LineTooLong as long:
                answers: list[Refusal | types.JSONRPCMessage] = [too_long(long.size, long.head, long.tail, MAX_LINE)]
            else:
                if not raw:
                    return
                answers = _refusals(raw)
            for refused in answers:
                if isinstance(refused, Refusal):
                    print(refused.note(), file=sys.stderr, flush=True)
                    if refused.answer:
                        await replies.send(SessionMessage(types.JSONRPCError(
                            jsonrpc="2.0", id=refused.id,
                            error=types.ErrorData(code=refused.code, message=refused.message))))
                else:
                    await messages.send(SessionMessage(refused))


def _refusals(raw: bytes) -> list[Refusal | types.JSONRPCMessage]:
    """What to do with the line ``raw``: the message to pass on, or what to
    answer instead (``_mcp_unreadable``)."""
    try:
        line = raw.decode("utf-8")  # strictly: a replaced byte would reach a file a call writes
    except UnicodeDecodeError as exc:
        return [not_utf8(raw, exc)]
    try:
        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except Exception as exc:  # what the SDK's transport passes on for its session to drop
        return list(refusals(exc, line))
    if isinstance(message, types.JSONRPCNotification):
        return [bad_id(line) or message]
    if isinstance(message, types.JSONRPCRequest):
        return [bad_call(message.method, message.params, message.id) or message]
    return [message]


async def _write_lines(pipes: StdioPipes, messages: anyio.abc.ObjectReceiveStream[SessionMessage],
                       after: Callable[[Any], None], serving: anyio.CancelScope, done: anyio.Event) -> None:
    """Write each message as one line, until every sender has closed (or a
    stop); ``after`` sees each one written."""
    try:
        async with messages:
            async for item in messages:
                line = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await anyio.to_thread.run_sync(pipes.write, line.encode("utf-8"), abandon_on_cancel=True)
                after(item.message)
    except Stopped:
        pass
    except OSError as exc:  # the client closed its end: nobody to answer
        print(f"dispatch mcp: stdout is closed ({exc}): stopped serving", file=sys.stderr, flush=True)
        serving.cancel()
    finally:
        done.set()


def serve(registry: Registry) -> str | None:
    """``serve_stdio`` in a fresh event loop; returns when the client is gone
    (None), or once a call found the session over (why it ended)."""
    return anyio.run(serve_stdio, registry)
