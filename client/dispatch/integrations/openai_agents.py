"""OpenAI Agents SDK tools from a dispatch registry: ``tools(registry)``.

    from agents import Agent, Runner
    from dispatch.integrations.openai_agents import tools
    agent = Agent(name="coder", tools=tools(session.registry))

Guarantees:
- one ``FunctionTool`` per advertised tool, with its name, description and
  JSON Schema (not strict: the tools have optional parameters);
- the SDK awaits ``on_invoke_tool``: the call runs in a thread, and is
  cancelled in the sandbox when the awaiting task is (``dispatch.aio``);
- the tool returns the text a model reads (``Registry.run_call``'s reply,
  compacted to the registry's output budget); a failure is text starting
  with ``"Error: "``, as in ``registry.dispatch``'s OpenAI shapes, so the
  model reads why and the run goes on.

Needs ``openai-agents`` (``pip install 'dispatchd[openai-agents]'``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents import FunctionTool

from dispatch.integrations import chat_call, sync_registry

__all__ = ["tools"]


def tools(registry: Any, *, context: Any = None,
          on_output: Callable[[str, str], None] | None = None) -> list[FunctionTool]:
    """A ``FunctionTool`` for each advertised tool of ``registry`` (a
    ``Registry`` or ``AsyncRegistry``). ``context`` goes to every call (and
    the approval callback); ``on_output`` gets streamed output."""
    sync = sync_registry(registry)
    return [_tool(sync, d, context, on_output) for d in sync.to_list()]


def _tool(registry: Any, spec: dict[str, Any], context: Any,
          on_output: Callable[[str, str], None] | None) -> FunctionTool:
    name = spec["name"]

    async def invoke(tool_context: Any, arguments: str) -> str:
        from dispatch.aio import _cancellable

        call_id = str(getattr(tool_context, "tool_call_id", "") or "")
        outcome = await _cancellable(registry.run_call, (chat_call(name, arguments or "{}", call_id),), context,
                                     on_output=on_output)
        return str(outcome.reply["content"])

    return FunctionTool(name=name, description=spec["description"], params_json_schema=spec["parameters"],
                        on_invoke_tool=invoke, strict_json_schema=False)
