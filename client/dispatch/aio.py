"""The client for asyncio: ``dispatch.aio.connect()``, the same API awaited.

    import dispatch.aio

    async with dispatch.aio.connect() as client:
        async with client.open_session("/path/to/worktree") as session:
            result = await session.registry.call("shell_exec", {"command": "make test"})
            reply = await session.registry.dispatch(tool_call)

A thin facade over the synchronous client: each request runs in a worker
thread (``asyncio.to_thread``), so the event loop never blocks. Why threads,
not a second protocol implementation: the sync client already multiplexes
many requests on one connection without a thread of its own, the daemon
hands a session's channel over as a file descriptor (``SCM_RIGHTS``, which
asyncio streams do not carry), and a thread hop costs tens of microseconds
beside a tool call's hundreds. One code path means one set of guarantees.

Guarantees:
- every method that talks to the daemon or a sandbox is a coroutine, a
  definition's ``call`` too (``await session.registry.get(name).call(...)``:
  the definitions the registry gives are ``AsyncDefinition``s); pure ones
  (``schemas``, ``tool_names``…) are the sync registry's own;
- ``open_session`` returns an object that is both awaitable (``s = await
  c.open_session(wt)``) and an async context manager (``async with
  c.open_session(wt) as s``), the latter closing the session on the way out;
- cancellation-safe: cancelling an ``await`` stops the wait at once; the
  request it made still completes in its thread and its answer is dropped.
  A session opened by a cancelled ``open_session`` is closed, not leaked. A
  tool call whose awaiting task is cancelled (``task.cancel()``, an
  ``asyncio.wait_for`` timeout) is cancelled in the sandbox too, as
  ``session.cancel()`` does: its processes are ended (``CancelCall`` for that
  call only). ``await session.cancel()`` ends all the session's calls in flight;
- an ``async def`` approval callback is awaited on the caller's loop;
- tool calls never raise, as in the sync client; daemon requests raise the
  same ``DispatchError`` subclasses.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from dispatch import client as _sync
from dispatch.client import Cancellation
from dispatch.agent import LoopResult
from dispatch._asyncbridge import CALLER_LOOP, await_from_sync
from dispatch._definition import Definition
from dispatch._registry import Registry, ToolCallOutcome
from dispatch._result import Result

__all__ = ["AsyncClient", "AsyncDefinition", "AsyncRegistry", "AsyncSession", "connect", "run_tool_loop"]

T = TypeVar("T")


async def _run(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``func(*args)`` in a thread; the caller's loop is known there (for
    async approval callbacks)."""
    token = CALLER_LOOP.set(asyncio.get_running_loop())
    try:
        return await asyncio.to_thread(func, *args, **kwargs)  # copies the context, loop included
    finally:
        CALLER_LOOP.reset(token)


def _with_cancellation(context: Any, cancellation: Cancellation) -> Any:
    """``context`` with ``cancellation`` in it, for a call the awaiting task can
    cancel. A caller's own ``Cancellation`` there still cancels the call (it
    cancels ours); a context that is not a dict is passed as it is (the call
    then cannot be cancelled from the task: documented)."""
    if context is None:
        return {"cancellation": cancellation}
    if not isinstance(context, dict):
        return context
    theirs = context.get("cancellation")
    if isinstance(theirs, Cancellation):
        theirs._bind(cancellation.cancel)
    return {**context, "cancellation": cancellation}


def _cancel_aside(cancellation: Cancellation) -> None:
    """Cancel in a thread: sending ``CancelCall`` may wait for the channel's
    send lock (bounded, 1 s), which the loop must not."""
    threading.Thread(target=cancellation.cancel, name="dispatch-aio-cancel", daemon=True).start()


async def _cancellable(func: Callable[..., T], args: tuple[Any, ...], context: Any, **kwargs: Any) -> T:
    """``func(*args, context, **kwargs)`` in a thread; when the awaiting task is
    cancelled, the tool call it made is cancelled in the sandbox."""
    cancellation = Cancellation()
    try:
        return await _run(func, *args, _with_cancellation(context, cancellation), **kwargs)
    except asyncio.CancelledError:
        _cancel_aside(cancellation)
        raise


def _output_on_loop(on_output: Callable[[str, str], Any] | None) -> Callable[[str, str], None] | None:
    """``on_output`` for the worker thread: an ``async def`` one is awaited on
    the caller's loop; a plain one is called in the worker thread."""
    if on_output is None:
        return None
    callback = on_output

    def forward(stream: str, text: str) -> None:
        value = callback(stream, text)
        if asyncio.iscoroutine(value):
            await_from_sync(value)

    return forward


class AsyncDefinition:
    """A ``Definition`` whose ``call`` is awaited, as ``AsyncRegistry.call``
    is (in a thread, cancellable); its name, schema and the rest are the sync
    definition's own; ``sync`` is that definition."""

    def __init__(self, definition: Definition) -> None:
        self.sync = definition

    async def call(self, params: Any, context: Any = None,
                   on_output: Callable[[str, str], Any] | None = None) -> Result:
        return await _cancellable(self.sync.call, (params,), context, on_output=_output_on_loop(on_output))

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def description(self) -> str:
        return self.sync.description

    @property
    def parameters(self) -> dict[str, Any]:
        return self.sync.parameters

    @property
    def risk(self) -> str:
        return self.sync.risk

    @property
    def advertised(self) -> bool:
        return self.sync.advertised

    def __getattr__(self, name: str) -> Any:
        # Public attributes only: the private ones would run the call on the
        # loop (``_invoke``), and ``sync`` unset (a copy, a pickle) must not
        # look itself up for ever.
        if name == "sync" or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.sync, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsyncDefinition) and other.sync is self.sync

    def __hash__(self) -> int:
        return hash(self.sync)

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"


class AsyncRegistry:
    """A session's ``Registry`` with its calls awaited: ``call``,
    ``dispatch``, ``run_call``, and the ``call`` of the definitions ``get``,
    ``tools`` and iteration give. Anything not defined here (``schemas``,
    ``has``, ``tool_names``…) is the sync registry's own; ``sync`` is that
    registry."""

    def __init__(self, registry: Registry) -> None:
        self.sync = registry

    def get(self, name: str) -> AsyncDefinition:
        return AsyncDefinition(self.sync.get(name))

    @property
    def tools(self) -> list[AsyncDefinition]:
        return [AsyncDefinition(d) for d in self.sync.tools]

    def __iter__(self) -> Iterator[AsyncDefinition]:
        return iter(self.tools)

    def register(self, defn: Definition | AsyncDefinition) -> AsyncRegistry:
        self.sync.register(defn.sync if isinstance(defn, AsyncDefinition) else defn)
        return self

    async def call(self, name: str, params: Any, context: Any = None,
                   on_output: Callable[[str, str], Any] | None = None) -> Result:
        return await _cancellable(self.sync.call, (name, params), context, on_output=_output_on_loop(on_output))

    async def dispatch(self, tool_call: Any, context: Any = None,
                       on_output: Callable[[str, str], Any] | None = None) -> dict[str, Any]:
        return (await self.run_call(tool_call, context, on_output)).reply

    async def run_call(self, tool_call: Any, context: Any = None,
                       on_output: Callable[[str, str], Any] | None = None) -> ToolCallOutcome:
        return await _cancellable(self.sync.run_call, (tool_call,), context, on_output=_output_on_loop(on_output))

    def with_approval(self, approve: Any) -> AsyncRegistry:
        return AsyncRegistry(self.sync.with_approval(approve))

    def subset(self, *names: str) -> AsyncRegistry:
        return AsyncRegistry(self.sync.subset(*names))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)

    def __len__(self) -> int:
        return len(self.sync)

    def __contains__(self, item: object) -> bool:
        return (item.sync if isinstance(item, AsyncDefinition) else item) in self.sync

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"


class AsyncSession:
    """``dispatch.Session``, awaited. ``sync`` is the session underneath."""

    def __init__(self, session: _sync.Session) -> None:
        self.sync = session
        self.registry = AsyncRegistry(session.registry)

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def network(self) -> bool:
        return self.sync.network

    @property
    def network_mode(self) -> str:
        return self.sync.network_mode

    @property
    def info(self) -> dict[str, Any]:
        return self.sync.info

    async def call_tool(self, name: str, params: dict[str, Any],
                        on_output: Callable[[str, str], Any] | None = None) -> Result:
        cancellation = Cancellation()
        try:
            return await _run(self.sync.call_tool, name, params, on_output=_output_on_loop(on_output),
                              cancellation=cancellation)
        except asyncio.CancelledError:
            _cancel_aside(cancellation)
            raise

    async def cancel(self) -> int:
        """End the session's tool calls in flight (made through this handle);
        each returns a failure with ``metadata["cancelled"]``. Returns how many."""
        return await _run(self.sync.cancel)

    async def set_network(self, network: bool | str, ports: list[int] | None = None,
                          bind_ports: list[int] | None = None, **more: Any) -> bool:
        return await _run(self.sync.set_network, network, ports, bind_ports, **more)

    async def status(self) -> dict[str, Any]:
        return await _run(self.sync.status)

    async def release_write_lock(self) -> dict[str, Any]:
        return await _run(self.sync.release_write_lock)

    async def checkpoint(self, label: str = "") -> str:
        return await _run(self.sync.checkpoint, label)

    async def checkpoints(self) -> list[dict[str, Any]]:
        return await _run(self.sync.checkpoints)

    async def restore(self, checkpoint_id: str, force: bool = False) -> dict[str, Any]:
        return await _run(self.sync.restore, checkpoint_id, force)

    async def detach(self) -> None:
        await _run(self.sync.detach)

    async def close(self) -> None:
        # Shielded: a close that was cancelled half-way still closes.
        await asyncio.shield(_run(self.sync.close))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncClient:
    """``dispatch.Client``, awaited. ``sync`` is the client underneath."""

    def __init__(self, client: _sync.Client) -> None:
        self.sync = client

    @property
    def socket_path(self) -> str:
        return self.sync.socket_path

    @property
    def daemon_version(self) -> str:
        return str(self.sync.daemon_version)

    def open_session(self, worktree: str, policy: str = "default", network: bool | str | None = None,
                     ports: list[int] | None = None, bind_ports: list[int] | None = None,
                     **more: Any) -> _Opening:
        """``async with client.open_session(wt) as s`` (closed on the way out),
        or ``s = await client.open_session(wt)``. Arguments as ``Client.open_session``."""
        return _Opening(self, (worktree, policy, network, ports, bind_ports), more)

    async def _open_session(self, args: tuple[Any, ...], more: dict[str, Any]) -> AsyncSession:
        future = asyncio.ensure_future(_run(self.sync.open_session, *args, **more))
        try:
            return AsyncSession(await asyncio.shield(future))
        except asyncio.CancelledError:
            # The open goes on in its thread: close what it opens, never leak it.
            future.add_done_callback(_close_opened)
            raise

    async def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(await _run(self.sync.session, session_id))

    async def close_session(self, session_id: str) -> None:
        await _run(self.sync.close_session, session_id)

    async def release_write_lock(self, session_id: str) -> dict[str, Any]:
        return await _run(self.sync.release_write_lock, session_id)

    async def checkpoint(self, session_id: str, label: str = "") -> str:
        return await _run(self.sync.checkpoint, session_id, label)

    async def checkpoints(self, session_id: str) -> list[dict[str, Any]]:
        return await _run(self.sync.checkpoints, session_id)

    async def restore(self, session_id: str, checkpoint_id: str, force: bool = False) -> dict[str, Any]:
        return await _run(self.sync.restore, session_id, checkpoint_id, force)

    async def set_network(self, session_id: str, network: bool | str, ports: list[int] | None = None,
                          bind_ports: list[int] | None = None, **more: Any) -> dict[str, Any]:
        return await _run(self.sync.set_network, session_id, network, ports, bind_ports, **more)

    async def list_sessions(self) -> list[dict[str, Any]]:
        return await _run(self.sync.list_sessions)

    async def status(self) -> dict[str, Any]:
        return await _run(self.sync.status)

    async def tools(self, policy: str = "default") -> list[dict[str, Any]]:
        return await _run(self.sync.tools, policy)

    async def close(self) -> None:
        self.sync.close()  # a shutdown and a close: does not block

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _close_opened(future: asyncio.Future[Any]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    # Closing talks to the daemon: not on the loop.
    threading.Thread(target=_quiet_close, args=(future.result(),), daemon=True).start()


def _quiet_close(session: _sync.Session) -> None:
    try:
        session.close()
    except Exception:
        pass


class _Opening:
    """What ``AsyncClient.open_session`` returns: ``await`` it for a session, or
    ``async with`` it (the session is closed when the block ends)."""

    def __init__(self, client: AsyncClient, args: tuple[Any, ...], more: dict[str, Any]) -> None:
        self._client = client
        self._args = args
        self._more = more
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._client._open_session(self._args, self._more).__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._client._open_session(self._args, self._more)
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


class _Connecting:
    """What ``connect`` returns: ``await`` it for a client, or ``async with`` it."""

    def __init__(self, socket: str | None, kwargs: dict[str, Any]) -> None:
        self._socket = socket
        self._kwargs = kwargs
        self._client: AsyncClient | None = None

    async def _open(self) -> AsyncClient:
        return AsyncClient(await _run(_sync.connect, self._socket, **self._kwargs))

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


def connect(socket: str | None = None, **kwargs: Any) -> _Connecting:
    """``async with dispatch.aio.connect() as client`` (or ``client = await
    dispatch.aio.connect()``): ``dispatch.connect`` with the same arguments."""
    return _Connecting(socket, kwargs)


async def run_tool_loop(model: Callable[..., Any], registry: AsyncRegistry | Registry, messages: Any,
                        **kwargs: Any) -> LoopResult:
    """``dispatch.agent.run_tool_loop`` in a thread. ``model`` is called from
    that thread: a sync function (an ``async def`` model is awaited on the
    caller's loop)."""
    from dispatch import agent

    sync_registry = registry.sync if isinstance(registry, AsyncRegistry) else registry

    def ask(history: list[Any], tools: list[dict[str, Any]]) -> Any:
        reply = model(history, tools)
        return await_from_sync(reply) if asyncio.iscoroutine(reply) else reply

    return await _run(agent.run_tool_loop, ask, sync_registry, messages, **kwargs)
