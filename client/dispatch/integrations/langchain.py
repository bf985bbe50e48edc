"""LangChain tools from a dispatch registry: ``tools(registry)``.

    from dispatch.integrations.langchain import tools
    lc_tools = tools(session.registry)          # list[StructuredTool]
    agent = create_agent(model, lc_tools)       # or model.bind_tools(lc_tools)

Guarantees:
- one ``StructuredTool`` per advertised tool, with its name, description and
  JSON Schema (``args_schema`` as the schema itself: no pydantic model to drift);
- a successful call returns the text a model reads (``Registry.run_call``'s
  reply, compacted to the registry's output budget); a failed one raises
  ``ToolException`` with the tool's error (LangChain's ``handle_tool_error``,
  False by default here, decides whether the model sees it instead);
- ``ainvoke`` runs the call in a thread, cancelled in the sandbox when the
  awaiting task is cancelled (as ``dispatch.aio``).

Needs ``langchain-core`` (``pip install 'dispatchd[langchain]'``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.tools import StructuredTool, ToolException

from dispatch.integrations import chat_call, sync_registry

__all__ = ["tools"]


def tools(registry: Any, *, context: Any = None, handle_tool_error: bool = False,
          on_output: Callable[[str, str], None] | None = None) -> list[StructuredTool]:
    """A ``StructuredTool`` for each advertised tool of ``registry`` (a
    ``Registry`` or ``AsyncRegistry``). ``context`` goes to every call (and
    the approval callback); ``on_output`` gets streamed output."""
    sync = sync_registry(registry)
    return [_tool(sync, d, context, handle_tool_error, on_output) for d in sync.to_list()]


def _tool(registry: Any, spec: dict[str, Any], context: Any, handle_tool_error: bool,
          on_output: Callable[[str, str], None] | None) -> StructuredTool:
    name = spec["name"]

    def text_of(outcome: Any) -> str:
        if outcome.result.is_failure:
            raise ToolException(str(outcome.result))
        return str(outcome.reply["content"])

    def run(**arguments: Any) -> str:
        return text_of(registry.run_call(chat_call(name, arguments), context, on_output))

    async def arun(**arguments: Any) -> str:
        from dispatch.aio import _cancellable

        return text_of(await _cancellable(registry.run_call, (chat_call(name, arguments),), context,
                                          on_output=on_output))

    return StructuredTool(name=name, description=spec["description"], args_schema=spec["parameters"],
                          func=run, coroutine=arun, handle_tool_error=handle_tool_error)
