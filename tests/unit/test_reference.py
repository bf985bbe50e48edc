"""docs/reference.md cannot go stale: every command and option of the
``dispatch`` and ``dispatchd`` parsers, every name the public modules export,
and every public method of the documented classes appear in it.

A command is documented on a line that names it (``dispatch session open``,
or ``dispatch jobs`` with ``output``), and each of its options on such a line
too, so an option added to a command and not to its synopsis fails here. The
check is one way: the reference may say more than the parsers."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

import dispatch
import dispatch.agent
import dispatch.aio
import dispatch.errors
import dispatch.tools
from dispatch import cli as dispatch_cli
from dispatchd import cli as dispatchd_cli
from dispatchd import units
from tests.conftest import REPO

REFERENCE = (REPO / "docs" / "reference.md").read_text()
LINES = REFERENCE.splitlines()


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
              ) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """(command words, its own option strings) for the parser and each subcommand, depth first."""
    options = [opt for action in parser._actions if action.help != argparse.SUPPRESS
               and not isinstance(action, argparse._HelpAction)
               for opt in action.option_strings if opt.startswith("--")]
    yield path, options
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _lines_naming(prog: str, path: tuple[str, ...]) -> list[str]:
    """The reference's lines that name this command: the program and first word
    together (`dispatch session`), and every further word as a word."""
    if not path:
        return LINES
    head = f"{prog} {path[0]}"
    return [line for line in LINES if re.search(rf"`{re.escape(head)}\b", line)
            and all(re.search(rf"\b{re.escape(word)}\b", line) for word in path[1:])]


CASES = [("dispatch", path, options) for path, options in _commands(dispatch_cli._parser())] + \
        [("dispatchd", path, options) for path, options in _commands(dispatchd_cli._parser())]


@pytest.mark.parametrize(("prog", "path", "options"), CASES,
                         ids=[" ".join((prog, *path)) for prog, path, _ in CASES])
def test_every_command_and_option_is_in_the_reference(prog: str, path: tuple[str, ...], options: list[str]) -> None:
    lines = _lines_naming(prog, path)
    assert lines, f"docs/reference.md has no line naming `{' '.join((prog, *path))}`"
    text = "\n".join(lines)
    missing = [opt for opt in options if not re.search(rf"{re.escape(opt)}\b", text)]
    assert missing == [], f"`{' '.join((prog, *path))}`: options not in docs/reference.md"


def test_the_hidden_testing_options_stay_out_of_the_reference() -> None:
    assert dispatchd_cli.PROXY_HOSTS_FLAG not in REFERENCE


def test_the_unit_commands_are_in_the_reference() -> None:
    for command in units.COMMANDS:
        assert f"dispatchd {command}" in REFERENCE
    assert "--dry-run" in REFERENCE


PUBLIC_MODULES = [dispatch, dispatch.tools, dispatch.agent, dispatch.aio, dispatch.errors]


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=[m.__name__ for m in PUBLIC_MODULES])
def test_every_exported_name_is_in_the_reference(module: object) -> None:
    names = list(getattr(module, "__all__"))
    missing = [n for n in names if not re.search(rf"`[^`\n]*\b{re.escape(n)}\b[^`\n]*`", REFERENCE)]
    assert missing == [], f"{getattr(module, '__name__')}: exported names not in docs/reference.md"


DOCUMENTED_CLASSES = [dispatch.Client, dispatch.Session, dispatch.tools.Registry, dispatch.tools.Definition,
                      dispatch.tools.Result, dispatch.aio.AsyncClient, dispatch.aio.AsyncSession,
                      dispatch.aio.AsyncRegistry, dispatch.aio.AsyncDefinition, dispatch.agent.Trace, dispatch.agent.FakeModel]


@pytest.mark.parametrize("cls", DOCUMENTED_CLASSES, ids=[c.__qualname__ for c in DOCUMENTED_CLASSES])
def test_every_public_method_of_a_documented_class_is_in_the_reference(cls: type) -> None:
    public = sorted(n for n in vars(cls) if not n.startswith("_"))
    missing = [n for n in public if not re.search(rf"\b{re.escape(n)}\b", REFERENCE)]
    assert missing == [], f"{cls.__qualname__}: public methods not in docs/reference.md"
