"""Every code block of the README and of docs/ is accounted for, and the
runnable ones run.

Each fenced block is preceded by a marker: ``<!-- runnable -->`` (run here,
against a real daemon, on a fresh worktree of its own) or ``<!-- not run:
WHY -->``. A block without one fails this test, so a new example cannot slip
in untested. Substitutions make the blocks run as a user would run them:
``/path/to/worktree`` and ``~/src/myproject`` become the temporary worktree,
``.venv/bin/`` the interpreter's own bin directory, and ``DISPATCH_SOCKET``
points at the test daemon. Relative links (relative to the file that holds
them) must name files of the repository.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Daemon

DOCS = [REPO / "README.md", REPO / "SECURITY.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w*)\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, str | None, str, str]]:
    """(where, marker, language, code) of every fenced block; where is FILE:LINE."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start(2 if m.group(1) is None else 1)) + 1
            found.append((f"{doc.relative_to(REPO)}:{line}", m.group(1), m.group(2), m.group(3)))
    return found


RUNNABLE = [(where, lang, code) for where, marker, lang, code in blocks()
            if marker is not None and marker.startswith("<!-- runnable")]


def test_every_block_is_marked() -> None:
    unmarked = [where for where, marker, _, _ in blocks()
                if marker is None or not (marker.startswith("<!-- runnable") or
                                          re.match(r"<!-- not run: \S.* -->$", marker))]
    assert unmarked == [], "mark each block <!-- runnable --> or <!-- not run: why -->"
    assert len([r for r in RUNNABLE if r[0].startswith("README.md:")]) >= 4
    assert len(RUNNABLE) >= 6


def test_relative_links_name_files_of_the_repository() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        links = re.findall(r"\]\((?!https?://|#)([^)]+)\)", text)
        if doc.name == "README.md":
            assert links, "the README links its examples and docs"
        missing += [f"{doc.relative_to(REPO)}: {link}" for link in links
                    if not (doc.parent / link.split("#")[0]).exists()]
        assert "../shared" not in text
    assert missing == []


def test_the_readme_is_for_users() -> None:
    """Design notes, figures and history live in docs/ and the CHANGELOG."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 400


@pytest.fixture
def fresh_worktree(tmp_path: Path) -> Path:
    wt = tmp_path / "myproject"
    (wt / "src").mkdir(parents=True)
    (wt / "README.md").write_text("hello\nworld\n")
    (wt / "src" / "main.py").write_text("import os\n\ndef main():\n    return 42\n")
    (wt / "Makefile").write_text("test:\n\t@echo all tests passed\n")
    return wt


@pytest.mark.parametrize(("where", "lang", "code"), RUNNABLE, ids=[where for where, _, _ in RUNNABLE])
def test_runnable_block_runs(where: str, lang: str, code: str, daemon: Daemon, fresh_worktree: Path,
                             tmp_path: Path) -> None:
    if lang == "json":
        json.loads(code)
        return
    code = (code.replace("/path/to/worktree", str(fresh_worktree))
                .replace("~/src/myproject", str(fresh_worktree))
                .replace(".venv/bin/", f"{Path(sys.executable).parent}/"))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(DISPATCH_SOCKET=daemon.socket, PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               TRACE_PATH=str(tmp_path / "trace.jsonl"))
    if lang == "python":
        argv = [sys.executable, "-c", code]
    elif lang == "sh":
        argv = ["bash", "-e", "-c", code]
    else:
        pytest.fail(f"{where}: no way to run a {lang!r} block")
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{where} failed:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr


def test_the_python_example_prints_what_it_says(daemon: Daemon, fresh_worktree: Path) -> None:
    (_, _, code), = [b for b in RUNNABLE if b[1] == "python" and "model_tool_call" in b[2]]
    env = {**os.environ, "DISPATCH_SOCKET": daemon.socket}
    out = subprocess.run([sys.executable, "-c", code.replace("/path/to/worktree", str(fresh_worktree))],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line]  # the output ends with its own newline
    assert lines[0] == "True all tests passed" and lines[1].startswith("0 ")
    # then the mode, the dispatched call's reply, the streamed lines, and the job still running
    assert lines[2:] == ["full", "0: hello False", "building", "done", "True"]
