"""dispatch.aio against a real daemon: the same API awaited, cancellation-safe."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import dispatch
import dispatch.aio
from dispatch.agent import FakeModel
from tests.conftest import sleepers as _sleepers


def run(coro):
    return asyncio.run(coro)


def test_the_async_client_opens_calls_and_closes(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            assert client.daemon_version
            async with await client.open_session(str(worktree)) as session:
                assert session.registry.has("shell_exec") and "read_file" in session.registry.tool_names
                result = await session.registry.call("shell_exec", {"command": "echo hi; cat src/main.py | head -1"})
                assert (result.is_success, result.metadata["stdout"]) == (True, "hi\nimport os\n")
                reply = await session.registry.dispatch(
                    {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "src/main.py", "end_line": 0}})
                assert reply == {"type": "tool_result", "tool_use_id": "t1", "content": "0: import os",
                                 "is_error": False}
                assert (await session.status())["id"] == session.id
                assert session.id in [s["id"] for s in await client.list_sessions()]
                sid = session.id
            assert sid not in [s["id"] for s in await client.list_sessions()]

    run(main())


def test_independent_calls_run_concurrently(daemon, worktree: Path) -> None:
    async def main():
        client = await dispatch.aio.connect(daemon.socket)
        async with client, await client.open_session(str(worktree)) as session:
            started = time.monotonic()
            results = await asyncio.gather(*(session.registry.call("shell_exec", {"command": "sleep 0.5"})
                                             for _ in range(3)))
            took = time.monotonic() - started
        assert all(r.is_success for r in results)
        return took

    assert run(main()) < 1.4  # three 0.5 s sleeps at once, not one after another


def test_a_cancelled_call_does_not_hurt_the_session(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with await client.open_session(str(worktree)) as session:
                call = asyncio.ensure_future(session.registry.call("shell_exec", {"command": "sleep 1"}))
                await asyncio.sleep(0.1)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                after = await session.registry.call("shell_exec", {"command": "echo still here"})
                assert after.output.startswith("still here")

    run(main())


def test_a_cancelled_open_closes_the_session_it_opened(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            before = {s["id"] for s in await client.list_sessions()}
            opening = asyncio.ensure_future(client.open_session(str(worktree)))
            await asyncio.sleep(0)  # it has started
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
            for _ in range(100):
                await asyncio.sleep(0.05)
                if {s["id"] for s in await client.list_sessions()} == before:
                    return True
            return False

    assert run(main())


def test_an_async_approval_runs_on_the_callers_loop(daemon, worktree: Path) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        async def approve(definition, params, context):
            seen.append(asyncio.get_running_loop() is loop)
            return "not today" if "rm" in params.get("command", "") else True

        async with dispatch.aio.connect(daemon.socket) as client:
            async with await client.open_session(str(worktree)) as session:
                tools = session.registry.with_approval(approve)
                denied = await tools.call("shell_exec", {"command": "rm -rf src"})
                allowed = await tools.call("shell_exec", {"command": "ls src"})
        assert denied.error == "shell_exec: denied by approval: not today"
        assert allowed.output.startswith("main.py")
        return seen

    assert run(main()) == [True, True]
    assert (worktree / "src" / "main.py").exists()


def test_the_loop_runs_from_async_code(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with await client.open_session(str(worktree)) as session:
                model = FakeModel([[("read_file", {"path": "src/main.py", "end_line": 0})], "done"])
                return await dispatch.aio.run_tool_loop(model, session.registry, [])

    result = run(main())
    assert result.final == "done" and result.messages[1]["content"] == "0: import os"


def test_no_daemon_raises_the_same_error(tmp_path: Path) -> None:
    async def main():
        async with dispatch.aio.connect(str(tmp_path / "none.sock")):
            pass

    with pytest.raises(dispatch.DaemonUnavailable, match="no dispatchd is listening on"):
        run(main())


async def _until(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return bool(predicate())


def test_open_session_is_an_async_context_manager_without_await(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with client.open_session(str(worktree)) as session:
                sid = session.id
                assert (await session.registry.call("shell_exec", {"command": "echo hi"})).output == "hi\n"
                assert sid in [s["id"] for s in await client.list_sessions()]
            assert sid not in [s["id"] for s in await client.list_sessions()]
            session = await client.open_session(str(worktree))  # awaited, it is still the session
            try:
                assert session.id != sid
            finally:
                await session.close()

    run(main())


def test_a_wait_for_timeout_ends_the_command_in_the_sandbox(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with client.open_session(str(worktree)) as session:
                # The twin: while the call is awaited, its process runs.
                call = asyncio.ensure_future(session.registry.call("shell_exec", {"command": "sleep 4241"}))
                assert await _until(lambda: len(_sleepers("4241")) == 1)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert await _until(lambda: _sleepers("4241") == [])
                # wait_for's timeout cancels the awaiting task: the same.
                started = time.monotonic()
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(session.registry.call("shell_exec", {"command": "sleep 4242"}), 0.5)
                assert time.monotonic() - started < 30  # at its timeout, not at the end of the sleep
                assert await _until(lambda: _sleepers("4242") == [])
                # The session goes on.
                assert (await session.registry.call("shell_exec", {"command": "echo on"})).output == "on\n"

    run(main())


def test_a_cancelled_dispatch_ends_its_command(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with client.open_session(str(worktree)) as session:
                call = {"id": "c1", "type": "function",
                        "function": {"name": "shell_exec", "arguments": '{"command": "sleep 4243"}'}}
                task = asyncio.ensure_future(session.registry.dispatch(call))
                assert await _until(lambda: len(_sleepers("4243")) == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await _until(lambda: _sleepers("4243") == [])

    run(main())


def test_session_cancel_ends_every_call_in_flight(daemon, worktree: Path) -> None:
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client:
            async with client.open_session(str(worktree)) as session:
                calls = [asyncio.ensure_future(session.registry.call("shell_exec", {"command": "sleep 4244"}))
                         for _ in range(2)]
                assert await _until(lambda: len(_sleepers("4244")) == 2)
                assert await session.cancel() == 2
                results = await asyncio.gather(*calls)
                assert [r.metadata["cancelled"] for r in results] == [True, True]
                assert await _until(lambda: _sleepers("4244") == [])

    run(main())


def test_output_streams_to_an_async_callback_on_the_loop(daemon, worktree: Path) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, bool]] = []

        async def on_output(stream: str, text: str) -> None:
            seen.append((text, asyncio.get_running_loop() is loop))

        async with dispatch.aio.connect(daemon.socket) as client:
            async with client.open_session(str(worktree)) as session:
                r = await session.registry.call("shell_exec", {"command": "echo a; sleep 0.2; echo b"},
                                                on_output=on_output)
        assert r.output == "a\nb\n"
        assert "".join(t for t, _ in seen) == "a\nb\n" and all(on_loop for _, on_loop in seen)

    run(main())


def test_a_definitions_call_is_awaited_and_leaves_the_loop_running(daemon, worktree: Path) -> None:
    """``registry.get(name).call`` as in the sync client, awaited: before, it
    was the sync definition's, which held the loop for the whole command."""
    async def main():
        async with dispatch.aio.connect(daemon.socket) as client, client.open_session(str(worktree)) as session:
            shell = session.registry.get("shell_exec")
            assert isinstance(shell, dispatch.aio.AsyncDefinition)
            assert shell.name == "shell_exec" and shell.risk == session.registry.sync.get("shell_exec").risk
            assert {d.name for d in session.registry} == set(session.registry.tool_names)
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.ensure_future(tick())
            result = await shell.call({"command": "sleep 0.5; echo done"})
            ticker.cancel()
            assert (result.is_success, result.metadata["stdout"]) == (True, "done\n")
            assert ticks >= 5, ticks  # the loop ran while the command did
            failed = await session.registry.get("read_file").call({"path": "no/such/file"})
            assert failed.is_failure and "no/such/file" in (failed.error or "")

    run(main())
