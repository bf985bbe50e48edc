"""Adapters from a dispatch ``Registry`` to agent frameworks, each an optional extra.

- ``dispatch.integrations.langchain.tools(registry)``: LangChain ``StructuredTool``s
  (``pip install 'dispatchd[langchain]'``);
- ``dispatch.integrations.openai_agents.tools(registry)``: OpenAI Agents SDK
  ``FunctionTool``s (``pip install 'dispatchd[openai-agents]'``).

Both run each call through ``Registry.run_call`` (the approval callback, the
model output budget and the argument checks apply as for ``dispatch``), take a
sync ``Registry`` or a ``dispatch.aio.AsyncRegistry``, and, when the framework
awaits a tool, run it in a thread whose call is cancelled in the sandbox when
the awaiting task is (``dispatch.aio``). Importing this package imports
neither framework.
"""

from __future__ import annotations

from typing import Any

from dispatch._registry import Registry

__all__: list[str] = []


def sync_registry(registry: Any) -> Registry:
    """The sync ``Registry`` under ``registry`` (itself, or an AsyncRegistry's)."""
    inner = getattr(registry, "sync", registry)
    if not isinstance(inner, Registry):
        raise TypeError(f"expected a dispatch Registry or AsyncRegistry, not {type(registry).__name__}")
    return inner


def chat_call(name: str, arguments: Any, call_id: str = "") -> dict[str, Any]:
    """A Chat Completions tool call, the shape ``Registry.run_call`` reads."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
