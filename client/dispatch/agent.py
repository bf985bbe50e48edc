"""A model's tool calls in a loop: a runaway cap, a trace, and fake models for tests.

    from dispatch.agent import run_tool_loop

    outcome = run_tool_loop(model, session.registry, messages, provider="anthropic")
    outcome.status            # "done", or "max_iterations" when the cap stopped it
    outcome.messages          # the conversation, every tool call answered
    outcome.final             # the model's last words ("done" only)

- ``model(messages, tools)`` is any callable that sends the conversation and
  the tool schemas to a model and returns the assistant's message in the
  provider's shape (a dict, or the SDK's object: it is turned into the plain
  dict the provider accepts back). ``openai_chat_model`` and
  ``anthropic_model`` wrap the official SDKs' clients; ``FakeModel`` plays a
  script, for tests and for examples without a key.
- ``run_tool_loop`` asks the model, runs every tool call it made (in order,
  through ``Registry.run_call``: validated, approved, compacted), hands the
  results back, and stops when a reply has no tool call, or after
  ``max_iterations`` model calls. The cap is a status, not an exception: the
  conversation it returns is whole (every call answered), so a caller can go
  on, or ask the model to sum up. An exception from ``model`` propagates.
- ``Trace`` records each call (turn, tool, arguments, success, duration, the
  text the model was shown) and is written and read as JSON lines;
  ``FakeModel.replaying(trace)`` makes the same calls again, so a recorded run
  becomes a deterministic offline test.

Providers: ``"openai"`` (Chat Completions: the assistant's ``tool_calls``,
answered by one ``{"role": "tool"}`` message each), ``"openai-responses"``
(the Responses API: the reply is the response's ``output`` items, added to the
input list as they are, each ``function_call`` answered by a
``function_call_output`` item) and ``"anthropic"`` (Messages: ``tool_use``
blocks, answered by one user message of ``tool_result`` blocks). Their
shapes are spelled once, in ``dispatch._providers``, beside the code that
reads a tool call and answers it for ``Registry.run_call``.

Within one turn, consecutive calls of ``read`` tools run at once, on threads
(``parallel_reads``, default 4); a ``write`` or ``execute`` call waits for
those before it and runs alone. Replies keep the order of the calls.

A loop also stops, status ``"stopped"``, when a tool's Result says
``metadata["stop_loop"]`` (seed 000: a tool that finishes the task), and,
status ``"interrupted"``, when a Ctrl-C ended a tool call: in both cases
after every call of the turn is answered.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from dispatch._providers import provider as _provider
from dispatch._providers import read_tool_call, reply_content
from dispatch._registry import Registry, ToolCallOutcome

__all__ = [
    "FakeModel",
    "LoopResult",
    "Model",
    "ScriptExhausted",
    "Trace",
    "TraceEntry",
    "anthropic_model",
    "openai_chat_model",
    "openai_responses_model",
    "run_tool_loop",
]

Model = Callable[[list[Any], list[dict[str, Any]]], Any]
"""``model(messages, tools) -> assistant message`` in the provider's shape."""

Provider = Literal["openai", "openai-responses", "anthropic"]


# ---------------------------------------------------------------- the loop


@dataclasses.dataclass(frozen=True)
class LoopResult:
    status: Literal["done", "max_iterations", "stopped", "interrupted"]
    """"done": the model answered without a tool call; "max_iterations": the cap
    stopped it; "stopped": a tool's Result said ``metadata["stop_loop"]``;
    "interrupted": a Ctrl-C (KeyboardInterrupt) ended a tool call."""
    messages: list[Any]
    """The conversation: the messages given, then each reply and its tool results."""
    iterations: int
    """How many times the model was asked."""
    final: str | None
    """The text of the model's last reply when done; the stopping tool's text
    when stopped; None otherwise."""

    @property
    def done(self) -> bool:
        return self.status == "done"


def run_tool_loop(
    model: Model,
    registry: Registry,
    messages: Iterable[Any],
    *,
    max_iterations: int = 25,
    trace: Trace | None = None,
    provider: Provider = "openai",
    context: Any = None,
    parallel_reads: int = 4,
    on_output: Callable[[str, str], None] | None = None,
) -> LoopResult:
    """Ask ``model``, run its tool calls, repeat until it answers without one.

    ``messages`` is not changed: the result holds the longer conversation.
    The model is asked at most ``max_iterations`` times; when its last reply
    still calls tools, those calls run and the status is ``"max_iterations"``.
    ``context`` goes to every tool (and to the registry's approval callback).
    The tools offered are the registry's advertised ones, read afresh for each
    turn, in the provider's schema shape. Consecutive ``read`` calls of a
    turn run on up to ``parallel_reads`` threads (1: one after another).
    ``on_output(stream, text)`` gets the output of the calls that stream it
    (``shell_exec``) as it comes, as in ``Definition.call``.
    """
    shape = _provider(provider)
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
        raise ValueError(f"max_iterations must be a positive int, not {max_iterations!r}")
    if isinstance(parallel_reads, bool) or not isinstance(parallel_reads, int) or parallel_reads < 1:
        raise ValueError(f"parallel_reads must be a positive int, not {parallel_reads!r}")
    history: list[Any] = list(messages)
    for turn in range(1, max_iterations + 1):
        message = shape.message(model(list(history), registry.schemas(shape.schema_format)))
        shape.add(history, message)  # type: ignore[arg-type]
        calls = shape.tool_calls(message)  # type: ignore[arg-type]
        if not calls:
            return LoopResult("done", history, turn, shape.text(message))  # type: ignore[arg-type]
        timed = _run_turn(registry, calls, context, parallel_reads, on_output)
        if trace is not None:
            for outcome, took in timed:
                trace.record(turn, outcome, took)
        history.extend(shape.answers([outcome.reply for outcome, _ in timed]))
        results = [outcome.result for outcome, _ in timed]
        if any(r.metadata.get("interrupted") for r in results):
            return LoopResult("interrupted", history, turn, None)
        stopping = [r for r in results if r.metadata.get("stop_loop")]
        if stopping:
            return LoopResult("stopped", history, turn, str(stopping[0]))
    return LoopResult("max_iterations", history, max_iterations, None)


def _timed(registry: Registry, call: Any, context: Any,
           on_output: Callable[[str, str], None] | None = None) -> tuple[ToolCallOutcome, float]:
    started = time.monotonic()
    outcome = registry.run_call(call, context, on_output)
    return outcome, time.monotonic() - started


def _is_read(registry: Registry, call: Any) -> bool:
    """Whether ``call`` names a read tool (one that may run beside others)."""
    shape = read_tool_call(call)
    if shape is None or not isinstance(shape[1], str) or not registry.has(shape[1]):
        return False
    return registry.get(shape[1]).risk == "read"


def _run_turn(registry: Registry, calls: list[Any], context: Any,
              parallel: int, on_output: Callable[[str, str], None] | None = None) -> list[tuple[ToolCallOutcome, float]]:
    """Every call of a turn, answered in call order. A run of consecutive read
    calls goes to threads at once; a write or execute call is a barrier, so a
    read the model asked for after a write sees the write."""
    done: list[tuple[ToolCallOutcome, float]] = []
    i = 0
    while i < len(calls):
        j = i
        while j < len(calls) and parallel > 1 and _is_read(registry, calls[j]):
            j += 1
        if j - i > 1:
            with ThreadPoolExecutor(min(parallel, j - i)) as pool:
                done.extend(pool.map(lambda c: _timed(registry, c, context, on_output), calls[i:j]))
            i = j
        else:
            done.append(_timed(registry, calls[i], context, on_output))
            i += 1
    return done


# ---------------------------------------------------------------- trace


@dataclasses.dataclass(frozen=True)
class TraceEntry:
    """One tool call of a loop, as JSON-able data."""

    turn: int
    """The model call (1, 2, ...) that asked for it; calls of one turn share it."""
    call_id: str
    tool: str | None
    arguments: Any
    """As an object when they could be decoded; else as the model sent them."""
    success: bool
    duration_s: float
    content: str
    """What the model was shown (the output, or the error; compacted if long)."""
    output_id: str | None = None
    """Where the whole output is kept when ``content`` is a part of it."""
    denied: bool = False
    """Whether the registry's approval refused the call."""

    @classmethod
    def of(cls, turn: int, outcome: ToolCallOutcome, duration_s: float) -> TraceEntry:
        name = outcome.name if isinstance(outcome.name, str) or outcome.name is None else str(outcome.name)
        return cls(turn, outcome.call_id, name, copy.deepcopy(outcome.arguments), outcome.result.is_success,
                   round(duration_s, 6), reply_content(outcome.reply), outcome.output_id,
                   bool(outcome.result.metadata.get("denied")))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceEntry:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


class Trace:
    """The tool calls of one or more loops, in order. Safe to share between threads."""

    def __init__(self, entries: Iterable[TraceEntry] = ()) -> None:
        self._lock = threading.Lock()
        self._entries = list(entries)

    def record(self, turn: int, outcome: ToolCallOutcome, duration_s: float) -> TraceEntry:
        entry = TraceEntry.of(turn, outcome, duration_s)
        with self._lock:
            self._entries.append(entry)
        return entry

    @property
    def entries(self) -> list[TraceEntry]:
        with self._lock:
            return list(self._entries)

    def calls(self) -> list[tuple[str | None, Any, bool]]:
        """``(tool, arguments, success)`` per call: what a replay should repeat,
        without the ids, timings and texts that may differ."""
        return [(e.tool, e.arguments, e.success) for e in self.entries]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[TraceEntry]:
        return iter(self.entries)

    def __getitem__(self, index: int) -> TraceEntry:
        with self._lock:
            return self._entries[index]

    def to_jsonl(self) -> str:
        return "".join(json.dumps(e.to_dict(), default=repr, ensure_ascii=False) + "\n" for e in self.entries)

    def write_jsonl(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_jsonl())

    @classmethod
    def from_jsonl(cls, text: str) -> Trace:
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(TraceEntry.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"trace line {n} is not a trace entry: {exc}") from exc
        return cls(entries)

    @classmethod
    def read_jsonl(cls, path: str | os.PathLike[str]) -> Trace:
        with open(path, encoding="utf-8") as f:
            return cls.from_jsonl(f.read())

    def __repr__(self) -> str:
        return f"Trace({len(self)} calls)"


# ---------------------------------------------------------------- fake models


class ScriptExhausted(RuntimeError):
    """A ``FakeModel`` was asked for more turns than its script has."""


Call = tuple[str, Any]
Turn = str | Sequence[Call | Mapping[str, Any]] | Callable[[list[Any]], Any]


class FakeModel:
    """A deterministic model for offline tests and examples.

    ``turns`` is its script, one item per reply (any iterable: an
    ``itertools.repeat`` makes a model that never stops):

    - a str: the final answer, with no tool call;
    - a list of calls, each ``(name, arguments)`` — arguments as an object, or
      as a str sent exactly as written (to send broken JSON) — or a tool call
      already in the provider's shape;
    - a callable ``turn(messages)`` returning either of the above, for a reply
      that depends on what the tools said (it sees the conversation so far).

    Tool call ids are ``call_1``, ``call_2``… (OpenAI) or ``toolu_1``…
    (Anthropic). ``requests`` keeps a copy of each ``(messages, tools)`` it
    was given. Asked once more than its script has, it raises ``ScriptExhausted``.
    """

    def __init__(self, turns: Iterable[Turn], *, provider: Provider = "openai") -> None:
        self.provider = provider
        self._shape = _provider(provider)
        self._turns = iter(turns)
        self._ids = itertools.count(1)
        self.requests: list[tuple[list[Any], list[dict[str, Any]]]] = []

    @classmethod
    def replaying(cls, trace: Trace, *, provider: Provider = "openai", final: str = "done") -> FakeModel:
        """A model that makes the calls of ``trace`` again, turn by turn, then says ``final``."""
        turns: list[Turn] = [
            [(e.tool, e.arguments) for e in group]  # type: ignore[misc]
            for _, group in itertools.groupby(trace.entries, key=lambda e: e.turn)
        ]
        return cls([*turns, final], provider=provider)

    def __call__(self, messages: list[Any], tools: list[dict[str, Any]]) -> dict[str, Any] | list[Any]:
        """The next turn: a chat message, or for "responses" the list of output items."""
        self.requests.append((copy.deepcopy(list(messages)), copy.deepcopy(tools)))
        try:
            turn = next(self._turns)
        except StopIteration:
            raise ScriptExhausted(
                f"the fake model's script has {len(self.requests) - 1} turns; asked for another") from None
        if callable(turn):
            turn = turn(list(messages))
        if isinstance(turn, str):
            return self._shape.assistant(turn, [])
        calls = [
            copy.deepcopy(dict(call)) if isinstance(call, Mapping)
            else self._shape.tool_call(f"{self._shape.id_prefix}{next(self._ids)}", *call)
            for call in turn
        ]
        return self._shape.assistant(None, calls)


# ---------------------------------------------------------------- real models


def openai_chat_model(client: Any, model: str, **create: Any) -> Model:
    """A ``Model`` for an ``openai.OpenAI()`` client (Chat Completions).

    ``create`` goes to ``client.chat.completions.create`` as it is
    (``temperature``, ``tool_choice``…).
    """

    def ask(messages: list[Any], tools: list[dict[str, Any]]) -> Any:
        response = client.chat.completions.create(model=model, messages=messages, tools=tools, **create)
        return response.choices[0].message

    return ask


def openai_responses_model(client: Any, model: str, *, instructions: str | None = None,
                           **create: Any) -> Model:
    """A ``Model`` for an ``openai.OpenAI()`` client (the Responses API), for
    ``run_tool_loop(..., provider="openai-responses")``.

    The conversation is the ``input`` list; the reply is ``response.output``.
    ``create`` goes to ``client.responses.create`` as it is. ``store=False``
    is a sensible addition when reasoning items should not be kept server-side.
    """
    if instructions is not None:
        create["instructions"] = instructions

    def ask(messages: list[Any], tools: list[dict[str, Any]]) -> Any:
        return client.responses.create(model=model, input=messages, tools=tools, **create).output

    return ask


def anthropic_model(client: Any, model: str, *, max_tokens: int = 4096, system: str | None = None,
                    **create: Any) -> Model:
    """A ``Model`` for an ``anthropic.Anthropic()`` client (Messages).

    ``system`` is the system prompt (Anthropic takes it apart from the
    messages); ``create`` goes to ``client.messages.create`` as it is.
    """
    if system is not None:
        create["system"] = system

    def ask(messages: list[Any], tools: list[dict[str, Any]]) -> Any:
        return client.messages.create(model=model, max_tokens=max_tokens, messages=messages, tools=tools,
                                      **create)

    return ask
