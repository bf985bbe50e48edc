"""dispatch/_cli_args.py ``not_utf8``: the first argument the command line
would send dispatchd that is not UTF-8 (Python holds its bad bytes as lone
surrogates; the protocol's JSON cannot carry them), named; what is only used
here (--socket, an @FILE's name) may be any bytes."""

from __future__ import annotations

import os

import pytest

from dispatch._cli_args import not_utf8, parser

BAD = os.fsdecode(b"x\xff")


@pytest.mark.parametrize(("argv", "why"), [
    (["exec", "--worktree", BAD, "--", "pwd"],
     f"--worktree: the path is not UTF-8 ({BAD}), which dispatchd cannot carry"),
    (["mcp", "--worktree", "/w", "--read-only", "/r", "--read-only", BAD],
     f"--read-only: the path is not UTF-8 ({BAD}), which dispatchd cannot carry"),
    (["session", "open", "--worktree", "/w", "--policy", BAD],
     f"--policy: the name is not UTF-8 ({BAD}), which dispatchd cannot carry"),
    (["exec", "--worktree", "/w", "--env", f"A={BAD}", "--", "true"],
     f"--env: the variable is not UTF-8 ({BAD}), which dispatchd cannot carry"),
    (["exec", "--worktree", "/w", "--", "echo", BAD],
     f"the command: an argument is not UTF-8 ({BAD}), which dispatchd cannot carry"),
    (["call", "--worktree", "/w", "list_files", '{"path": "%s"}' % BAD],
     f'the tool\'s arguments: the text is not UTF-8 ({{"path": "{BAD}"}}), which dispatchd cannot carry'),
    (["session", "close", BAD], f"the session id: it is not UTF-8 ({BAD}), which dispatchd cannot carry"),
])
def test_an_argument_sent_to_dispatchd_that_is_not_utf8_is_named(argv: list[str], why: str) -> None:
    assert not_utf8(parser().parse_args(argv)) == why


def test_utf8_arguments_and_local_paths_pass() -> None:
    assert not_utf8(parser().parse_args(["--socket", BAD, "call", "--worktree", "/w\u00e9\n",
                                         "list_files", f"@{BAD}"])) is None
    assert not_utf8(parser().parse_args(["exec", "--worktree", "/w", "--", "echo", "\u00e9"])) is None
