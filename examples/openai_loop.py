"""An OpenAI (Chat Completions) agent working in a dispatchd sandbox.

    python examples/openai_loop.py [WORKTREE]          # default: $DISPATCH_WORKTREE, else .

With the ``openai`` package installed and OPENAI_API_KEY set, a real model
(OPENAI_MODEL, default gpt-4.1-mini) does the task. Otherwise a scripted
FakeModel plays the same part, so the example runs anywhere a daemon does
(``dispatch`` starts one when none answers; DISPATCH_SOCKET picks the socket).
"""

from __future__ import annotations

import json
import os
import sys

import dispatch
from dispatch.agent import FakeModel, Model, Trace, openai_chat_model, run_tool_loop

TASK = ("Read README.md, then append the line 'Checked by an agent.' to it, "
        "then run `wc -l README.md` and tell me the count.")


def model() -> Model:
    try:
        import openai
    except ImportError:
        openai = None
    if openai is not None and os.environ.get("OPENAI_API_KEY"):
        return openai_chat_model(openai.OpenAI(), os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"))
    print("(no OpenAI key: a scripted model plays the part)", file=sys.stderr)
    return FakeModel([
        [("read_file", {"path": "README.md"})],
        [("shell_exec", {"command": "rm -rf ."}),  # denied by approve() below
         ("write_file", {"path": "README.md"})],   # invalid: no content; the model reads why
        [("shell_exec", {"command": "echo 'Checked by an agent.' >> README.md && wc -l README.md"})],
        "README.md ends with 'Checked by an agent.' now.",
    ])


def approve(definition: dispatch.Definition, params: dict, context: object) -> bool | str:
    """Asked before every write or command: here, a rule instead of a person."""
    if "rm -rf" in params.get("command", ""):
        return "no recursive deletes in this example"
    return True


def main() -> int:
    worktree = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DISPATCH_WORKTREE", ".")
    with dispatch.connect(autostart=True) as client, client.open_session(worktree) as session:
        tools = session.registry.with_approval(approve)
        trace = Trace()
        result = run_tool_loop(
            model(), tools,
            [{"role": "system", "content": "You work in a sandboxed git worktree. Use the tools."},
             {"role": "user", "content": TASK}],
            provider="openai", trace=trace, max_iterations=10,
        )
        for call in trace:
            print(f"{call.tool}({json.dumps(call.arguments)}) -> {'ok' if call.success else 'failed'} "
                  f"in {call.duration_s * 1000:.1f} ms: {call.content.splitlines()[0] if call.content else ''}")
        print(f"{result.status} after {result.iterations} turns: {result.final}")
        return 0 if result.done else 1


if __name__ == "__main__":
    raise SystemExit(main())
