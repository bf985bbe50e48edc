"""The code's shape, held: no Python module of the daemon or the client
library over 500 lines (docs/design.md, "Rooms and names": a module does
one job; a longer one has become two). C helpers are not counted."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MOST_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    modules = [p for top in ("dispatchd", "client") for p in (REPO / top).rglob("*.py")]
    assert len(modules) > 50  # the walk found the code
    long = {str(p.relative_to(REPO)): n for p in modules if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert long == {}, f"over {MOST_LINES} lines: split by job"
