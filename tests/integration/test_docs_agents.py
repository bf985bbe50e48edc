"""docs/agents-features.md: every code block is marked, and the runnable ones run
against a real daemon (as tests/integration/test_readme.py does for the README)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Daemon

DOC = (REPO / "docs" / "agents-features.md").read_text()
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w*)\n(.*?)^```$", re.S | re.M)
BLOCKS = [(DOC.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(DOC)]
RUNNABLE = [(line, lang, code) for line, marker, lang, code in BLOCKS if marker == "<!-- runnable -->"]


def test_every_block_is_marked() -> None:
    assert [line for line, marker, _, _ in BLOCKS
            if marker is None or not (marker == "<!-- runnable -->" or marker.startswith("<!-- not run: "))] == []
    assert len(RUNNABLE) >= 5


@pytest.mark.parametrize(("line", "lang", "code"), RUNNABLE, ids=[f"line{line}" for line, _, _ in RUNNABLE])
def test_runnable_block_runs(line: int, lang: str, code: str, daemon: Daemon, worktree: Path) -> None:
    code = code.replace("/path/to/worktree", str(worktree))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(DISPATCH_SOCKET=daemon.socket, PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}")
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", code]
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"docs/agents-features.md:{line} failed:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr
