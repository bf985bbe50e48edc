"""An Anthropic (Messages) agent working in a dispatchd sandbox.

    python examples/anthropic_loop.py [WORKTREE]       # default: $DISPATCH_WORKTREE, else .

With the ``anthropic`` package installed and ANTHROPIC_API_KEY set, a real
model (ANTHROPIC_MODEL, default claude-sonnet-4-5) does the task. Otherwise
a scripted FakeModel plays the same part, so the example runs anywhere a
daemon does. The run is traced to agent-trace.jsonl (TRACE_PATH) and can be
replayed offline: ``FakeModel.replaying(Trace.read_jsonl(path), provider="anthropic")``.
"""

from __future__ import annotations

import os
import sys

import dispatch
from dispatch.agent import FakeModel, Model, Trace, anthropic_model, run_tool_loop

SYSTEM = "You work in a sandboxed git worktree. Use the tools; keep answers short."
TASK = "Find every Python file, run the longest one with python3, and tell me what it printed."


def model() -> Model:
    try:
        import anthropic
    except ImportError:
        anthropic = None
    if anthropic is not None and os.environ.get("ANTHROPIC_API_KEY"):
        return anthropic_model(anthropic.Anthropic(), os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5"),
                               system=SYSTEM)
    print("(no Anthropic key: a scripted model plays the part)", file=sys.stderr)
    return FakeModel([
        [("search_files", {"query": "def ", "pattern": "*.py"})],
        [("shell_exec", {"command": "find . -name '*.py' -exec wc -l {} +"})],
        run_the_longest,  # a turn can depend on what the tools said
        lambda messages: f"It printed: {last_result(messages).strip() or '(nothing)'}",
    ], provider="anthropic")


def last_result(messages: list) -> str:
    return messages[-1]["content"][-1]["content"]


def run_the_longest(messages: list) -> list:
    counts = [line.split(None, 1) for line in last_result(messages).splitlines()]
    files = [(int(n), path) for n, path in (c for c in counts if len(c) == 2) if path != "total"]
    if not files:
        return [("shell_exec", {"command": "echo 'no Python files here'"})]
    return [("shell_exec", {"command": f"python3 {max(files)[1]}"})]


def main() -> int:
    worktree = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DISPATCH_WORKTREE", ".")
    trace_path = os.environ.get("TRACE_PATH", "agent-trace.jsonl")
    with dispatch.connect(autostart=True) as client, client.open_session(worktree) as session:
        # Reads run freely; every write and command is shown before it runs.
        def approve(definition: dispatch.Definition, params: dict, context: object) -> bool:
            print(f"  approving {definition.name} ({definition.risk}): {params}")
            return True

        trace = Trace()
        result = run_tool_loop(model(), session.registry.with_approval(approve),
                               [{"role": "user", "content": TASK}],
                               provider="anthropic", trace=trace, max_iterations=10)
        trace.write_jsonl(trace_path)
        print(f"{len(trace)} tool calls, traced to {trace_path}")
        print(f"{result.status} after {result.iterations} turns: {result.final}")
        return 0 if result.done else 1


if __name__ == "__main__":
    raise SystemExit(main())
