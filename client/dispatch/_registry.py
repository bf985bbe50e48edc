"""``Registry``: tools by name, the schemas a model is shown, and a model's calls run.

Guarantees: safe to share between threads (tables are swapped whole, tools
only ever added); ``call``, ``dispatch`` and ``run_call`` never raise but for
a ``KeyboardInterrupt`` on ``call`` (``dispatch`` answers the model instead):
an unknown tool, bad JSON, invalid arguments and a denied approval come back
as failures a model can read, in the shape of the provider that asked. The
approval callback is asked only for ``write`` and ``execute`` tools, with
arguments already valid, and a denial is anything but ``True`` (fail closed).
A hidden tool stays hidden from a model unless ``allow_hidden``.
Provider shapes are ``_providers``'; compaction is ``_compact``'s.
Re-exported by ``dispatch.tools``.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dispatch._asyncbridge import await_from_sync
from dispatch._compact import RETRIEVE_OUTPUT, OutputStore, compact, retrieve_output_tool, utf8_size
from dispatch._definition import Definition
from dispatch._plain import plain
from dispatch._providers import (
    SCHEMA_FORMATS,
    STRICT_FORMATS,
    decode_arguments,
    guess_reply,
    read_tool_call,
)
from dispatch._result import Result
from dispatch.errors import DuplicateToolError, ExecutionError, ToolNotFoundError, ValidationError

__all__ = ["Approval", "Registry", "ToolCallOutcome"]

Approval = Callable[[Definition, dict[str, Any], Any], "bool | str"]
"""``approve(definition, params, context)``: True runs the call; a str denies it, saying why."""

_NEEDS_APPROVAL = ("write", "execute")

def _unwrapped(item: Any) -> Any:
    """The ``Definition`` a ``dispatch.aio.AsyncDefinition`` wraps, else ``item``."""
    inner = getattr(item, "sync", None) if not isinstance(item, Definition) else None
    return inner if isinstance(inner, Definition) else item


class Registry:
    """Tools by name, in registration order.

    Safe to share between threads: ``register`` builds a new table under a lock
    and swaps it in whole, and every reader works on the table it picked up, so
    no reader sees a half-registered tool. Tools are only ever added.
    ``tools``, ``tool_names``, ``size``, ``len`` and lookups cover every tool;
    ``to_list``, ``schemas`` and the "Available tools" a model is told cover
    only advertised ones.

    Two settings, fixed at construction (``with_approval``, ``subset`` make
    new registries that keep them):

    - ``approve(definition, params, context)``: asked by ``call`` and
      ``dispatch`` before a ``write`` or ``execute`` tool runs, with arguments
      already validated. Only ``True`` lets the call run; a str is a denial
      with that reason, anything else (``False``, ``None``, an exception) a
      denial without one. A denial is ``Result.failure("<tool>: denied by
      approval: <reason>")`` with metadata ``{"denied": True, "reason"}``.
      ``Definition.call`` asks no one: the registry is the gate.
      ``approve`` may be a coroutine function (``async def``): its answer is
      awaited, on the caller's event loop when the call came through
      ``dispatch.aio``, else on a loop of its own.
    - ``allow_hidden``: whether a model may call a tool that is not advertised
      (``Definition(advertised=False)``). By default it may not: ``dispatch``
      and ``run_call`` answer as for an unknown tool (seed 002: a model must
      not commit facts itself). ``call(name, ...)`` is the application's own
      call, and runs hidden tools either way.
    - ``output_budget`` (bytes): ``dispatch``, the path to a model, shows a
      result longer than this as head and tail around a marker; the whole text
      goes to ``outputs`` (an ``OutputStore``), and a ``retrieve_output`` tool,
      registered here, gives a model the rest piece by piece. ``call`` always
      returns the whole ``Result``.
    """

    def __init__(
        self,
        tools: Iterable[Definition] = (),
        *,
        approve: Approval | None = None,
        output_budget: int | None = None,
        outputs: OutputStore | None = None,
        allow_hidden: bool = False,
    ) -> None:
        if approve is not None and not callable(approve):
            raise TypeError("approve must be callable: approve(definition, params, context)")
        if output_budget is not None and (
            isinstance(output_budget, bool) or not isinstance(output_budget, int) or output_budget < 1
        ):
            raise ValueError(f"output_budget must be a positive number of bytes, not {output_budget!r}")
        if outputs is not None and output_budget is None:
            raise ValueError("outputs are kept only for a registry with an output_budget")
        self._lock = threading.Lock()
        self._tools: dict[str, Definition] = {}
        self._approve = approve
        self._allow_hidden = bool(allow_hidden)
        self._budget = output_budget
        self._outputs = outputs if outputs is not None or output_budget is None else OutputStore()
        for defn in tools:
            self.register(defn)
        # A marker names retrieve_output, so a compacting registry always has
        # one (a registry made from another's tools already holds its twin).
        if self._budget is not None and RETRIEVE_OUTPUT not in self._tools:
            assert self._outputs is not None
            self.register(retrieve_output_tool(self._outputs, self._budget))

    # -- building

    def register(self, defn: Definition) -> Registry:
        """Add ``defn``; returns the registry so calls chain. A definition
        of ``dispatch.aio`` (``AsyncDefinition``) adds the one it wraps."""
        defn = _unwrapped(defn)
        if not isinstance(defn, Definition):
            raise TypeError(f"register() takes a Definition, not {type(defn).__name__}")
        with self._lock:
            if defn.name in self._tools:
                raise DuplicateToolError(defn.name)
            self._tools = {**self._tools, defn.name: defn}
        return self

    def subset(self, *names: str) -> Registry:
        """A new registry with just ``names``, in the order given; an unknown name raises.

        It keeps this registry's approval and output budget (and store); when
        the budget is set, ``retrieve_output`` comes along, last, unless named.
        """
        tools = self._tools
        picked: dict[str, Definition] = {}
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"subset() takes names as separate str arguments, not {name!r}")
            if name not in tools:
                raise ToolNotFoundError(name, tools)
            picked[name] = tools[name]
        if RETRIEVE_OUTPUT in tools and self._budget is not None:
            picked.setdefault(RETRIEVE_OUTPUT, tools[RETRIEVE_OUTPUT])
        return self._like(picked.values(), self._approve)

    def with_approval(self, approve: Approval | None) -> Registry:
        """A new registry with the same tools, budget and store, asking ``approve``
        (None: asking no one)."""
        return self._like(self._tools.values(), approve)

    def _like(self, tools: Iterable[Definition], approve: Approval | None) -> Registry:
        return Registry(tools, approve=approve, output_budget=self._budget, outputs=self._outputs,
                        allow_hidden=self._allow_hidden)

    @property
    def allow_hidden(self) -> bool:
        """Whether a model's tool call may run a tool that is not advertised."""
        return self._allow_hidden

    @property
    def approve(self) -> Approval | None:
        return self._approve

    @property
    def output_budget(self) -> int | None:
        return self._budget

    @property
    def outputs(self) -> OutputStore | None:
        """Where whole outputs go when a model sees them in part (None without a budget)."""
        return self._outputs

    # -- reading

    def get(self, name: str) -> Definition:
        defn = self._find(name)
        if defn is None:
            raise ToolNotFoundError(name, self.tool_names)
        return defn

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def _find(self, name: object) -> Definition | None:
        # Not a str (None from a malformed tool call, a list...) is simply not found.
        return self._tools.get(name) if isinstance(name, str) else None

    @property
    def tools(self) -> list[Definition]:
        return list(self._tools.values())

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    @property
    def size(self) -> int:
        return len(self._tools)

    @property
    def is_empty(self) -> bool:
        return not self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Definition]:
        return iter(list(self._tools.values()))

    def __contains__(self, item: object) -> bool:
        """A name, or a Definition (true when that very definition is registered)."""
        item = _unwrapped(item)
        if isinstance(item, Definition):
            return self._tools.get(item.name) is item
        return self.has(item)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Registry({self.tool_names!r})"

    # -- for models

    def to_list(self) -> list[dict[str, Any]]:
        """``to_dict()`` of each advertised tool."""
        return [d.to_dict() for d in self._tools.values() if d.advertised]

    def schemas(self, format: str = "plain", *, strict: bool = False) -> list[dict[str, Any]]:
        """The advertised tools in a provider's shape: plain (or json), openai,
        openai-responses, anthropic, mcp, gemini (function declarations).
        Another format raises ValueError.

        ``strict=True`` (openai and openai-responses only) gives OpenAI's
        strict-mode shapes: every property required, the optional ones
        nullable, ``additionalProperties: false``; a null argument is then
        read as "not given". openai-responses always carries ``strict``.
        """
        try:
            shape = SCHEMA_FORMATS[format]
        except (KeyError, TypeError):
            known = ", ".join(SCHEMA_FORMATS)
            raise ValueError(f"unknown schema format {format!r}; known: {known}") from None
        if strict and format not in STRICT_FORMATS:
            raise ValueError(f"strict=True is for {' and '.join(STRICT_FORMATS)}, not {format!r}")
        return [shape(d, bool(strict)) for d in self.to_list()]

    def call(self, name: str, params: Any, context: Any = None,
             on_output: Callable[[str, str], None] | None = None) -> Result:
        """Run tool ``name``, asking for approval first when its risk needs it.
        Never raises: an unknown name, invalid arguments and a denial are failures.
        ``on_output`` as in ``Definition.call``."""
        defn = self._find(name)
        if defn is None:
            return self._unknown(name)
        if self._approve is None or defn._risk not in _NEEDS_APPROVAL:
            # Nobody to ask: Definition.call is _arguments then _invoke, the
            # same checks, failures and catches, with its usual case written
            # out (a tuple and two Python calls fewer a call).
            return defn.call(params, context, on_output)
        args, failure = defn._arguments(params)
        if args is None:
            return failure  # type: ignore[return-value]
        denial = self._ask(defn, args, context)
        return denial if denial is not None else defn._invoke(args, context, on_output)

    def _ask(self, defn: Definition, args: dict[str, Any], context: Any) -> Result | None:
        """None when the call may run; the denial otherwise. Fails closed."""
        if self._approve is None or defn.risk not in _NEEDS_APPROVAL:
            return None
        try:
            answer = self._approve(defn, plain(args), context)  # a copy: what it saw is what runs
            if inspect.isawaitable(answer):
                answer = await_from_sync(answer)
        except Exception as exc:
            answer = f"the approval callback failed: {type(exc).__name__}: {exc}"
        if answer is True:
            return None
        reason = answer.strip() if isinstance(answer, str) else ""
        return Result.failure(
            f"{defn.name}: denied by approval" + (f": {reason}" if reason else ""),
            {"denied": True, "reason": reason},
        )

    def dispatch(self, tool_call: Any, context: Any = None,
                 on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """Run a tool call as a model returned it; answer in the same provider's shape.

        Takes a dict or an SDK object with the same attribute names:

        - OpenAI Chat Completions ``{"id", "type": "function", "function":
          {"name", "arguments"}}`` → ``{"role": "tool", "tool_call_id", "content"}``;
        - OpenAI Responses ``{"type": "function_call", "call_id", "name",
          "arguments"}`` → ``{"type": "function_call_output", "call_id", "output"}``;
        - Anthropic ``{"type": "tool_use", "id", "name", "input"}`` →
          ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``.

        ``arguments`` may be a JSON string (empty means ``{}``) or already an
        object. Never raises: an unknown tool, bad JSON, arguments that are not
        an object, invalid arguments and a denied approval all come back as
        content the model can read. OpenAI shapes have no error flag, so there
        the content of a failure starts with ``"Error: "``. A tool call of no
        known shape gets an error reply keeping its id (``id``, ``call_id``…)
        in the shape its keys suggest (OpenAI Chat Completions when none do).
        A tool that is not advertised is unknown here unless ``allow_hidden``.
        With an ``output_budget``, long content is compacted (see the class).
        ``run_call`` does the same and also returns the whole ``Result``.
        ``on_output(stream, text)`` as in ``Definition.call``.
        """
        return self.run_call(tool_call, context, on_output).reply

    def run_call(self, tool_call: Any, context: Any = None,
                 on_output: Callable[[str, str], None] | None = None) -> ToolCallOutcome:
        """``dispatch``, returning everything an agent loop or a trace wants to know
        (``on_output`` as in ``Definition.call``)."""
        shape = read_tool_call(tool_call)
        if shape is None:
            result = Result.failure(
                "unrecognised tool call: expected an OpenAI tool call with a 'function', "
                "an OpenAI Responses 'function_call' or an Anthropic 'tool_use' block"
            )
            call_id, reply = guess_reply(tool_call)
            return ToolCallOutcome(call_id, None, None, result, reply(call_id, str(result), True), None)
        call_id, name, arguments, reply = shape
        try:
            params: Any = decode_arguments(name, arguments)
            bad_arguments = None
        except ValidationError as exc:
            params, bad_arguments = arguments, Result.failure(str(exc))
        defn = self._find(name)
        if defn is None or not (defn.advertised or self._allow_hidden):
            # Before the arguments: the name is the first thing to fix. A
            # hidden tool is the application's, not the model's (seed 002).
            result = self._unknown(name)
        elif bad_arguments is not None:
            result = bad_arguments
        else:
            try:
                result = self.call(name, params, context, on_output)
            except KeyboardInterrupt as exc:
                # Ctrl-C during a model's call ends that call, not the
                # conversation: the model's call is answered, and
                # run_tool_loop stops ("interrupted") once the turn is.
                result = Result.failure(str(ExecutionError.wrapping(name, exc)), {"interrupted": True})
        text, output_id = self._for_model(name, result)
        return ToolCallOutcome(call_id, name, params, result, reply(call_id, text, result.is_failure), output_id)

    def _for_model(self, name: object, result: Result) -> tuple[str, str | None]:
        """The text a model reads, and the id of the whole when that text is a part."""
        text = str(result)
        budget = self._budget
        # retrieve_output's pieces are already cut to the budget, footer aside.
        if budget is None or name == RETRIEVE_OUTPUT or len(text) * 4 <= budget:
            return text, None
        if utf8_size(text) <= budget:
            return text, None
        assert self._outputs is not None
        output_id = self._outputs.put(text)
        return compact(text, budget, output_id), output_id

    def _unknown(self, name: object) -> Result:
        # Only advertised names: a hidden tool stays hidden from the model.
        advertised = [d.name for d in self._tools.values() if d.advertised]
        return Result.failure(str(ToolNotFoundError(name, advertised)))


@dataclasses.dataclass(frozen=True)
class ToolCallOutcome:
    """What ``Registry.run_call`` made of one tool call."""

    call_id: str
    """The provider's id of the call (``""`` when it had none)."""
    name: Any
    """The tool named, as given (None when the call named none)."""
    arguments: Any
    """The arguments as an object when they could be decoded, else as given."""
    result: Result
    """The whole result (compaction only touches ``reply``)."""
    reply: dict[str, Any]
    """The provider-shaped message for the model."""
    output_id: str | None
    """Where the whole output is kept when ``reply`` shows only part of it."""
