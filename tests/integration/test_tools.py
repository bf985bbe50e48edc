"""Every tool of a session, through the public client against a real daemon.

Each tool's success cases and failure cases from the dispatch-tool-files plan
and the contract, with the exact text a model reads. Every refusal stands
beside its allowed twin (the same call on a path or value that is fine), so a
test cannot pass because everything fails.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import stat
import time
from pathlib import Path

import pytest

import dispatch
from dispatch.tools import ToolNotFoundError
from tests.conftest import Daemon, gone, shell, sleepers

ALL_TOOLS = ["read_file", "write_file", "edit_file", "create_file", "list_files", "search_files", "shell_exec",
             "job_output", "job_stop", "job_list"]
TEMP_NAME = re.compile(r"\.dispatchd-[0-9a-f]+\.tmp$")


def _meta(r: dispatch.Result) -> dict[str, object]:
    """A Result's metadata without its usage (numbers that vary from run to run)."""
    return {k: v for k, v in r.metadata.items() if k != "usage"}


def call(session: dispatch.Session, tool: str, **params: object) -> dispatch.Result:
    """The usual way: the registry's remote definition, validated client-side first."""
    return session.registry.get(tool).call(params)


def ok(result: dispatch.Result) -> str:
    assert result.is_success, result.error
    assert result.error is None
    assert result.output is not None
    return result.output


def fail(result: dispatch.Result) -> str:
    assert result.is_failure, result.output
    assert result.output is None
    assert result.error is not None
    return result.error


def temp_files(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if TEMP_NAME.search(n)]


# ----------------------------------------------------------------- the session's tools


def test_the_default_session_offers_every_tool(session: dispatch.Session) -> None:
    # The remote tools, in the policy's order; the client may register local ones after them.
    assert session.registry.tool_names[: len(ALL_TOOLS)] == ALL_TOOLS
    for name in ALL_TOOLS:
        schema = session.registry.get(name).parameters
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False


# ----------------------------------------------------------------- read_file


def test_read_file_whole_file_with_line_numbers(session: dispatch.Session) -> None:
    r = call(session, "read_file", path="src/main.py")
    assert ok(r) == "0: import os\n1: \n2: def main():\n3:     return 42"
    assert _meta(r) == {"path": "src/main.py", "total_lines": 4, "start_line": 0, "end_line": 3}
    assert str(r) == r.output


def test_read_file_range_is_zero_based_and_inclusive(session: dispatch.Session) -> None:
    assert ok(call(session, "read_file", path="src/main.py", start_line=2, end_line=3)) == "2: def main():\n3:     return 42"
    assert ok(call(session, "read_file", path="src/main.py", start_line=1, end_line=1)) == "1: "
    assert ok(call(session, "read_file", path="src/main.py", start_line=3)) == "3:     return 42"
    assert ok(call(session, "read_file", path="src/main.py", start_line=0, end_line=0)) == "0: import os"
    # -1 is the end; an end past the last line is cut to it.
    assert ok(call(session, "read_file", path="src/main.py", start_line=2, end_line=-1)) == "2: def main():\n3:     return 42"
    r = call(session, "read_file", path="src/main.py", start_line=2, end_line=99)
    assert ok(r) == "2: def main():\n3:     return 42"
    assert r.metadata["end_line"] == 3


def test_read_file_numbers_can_be_quoted_back(session: dispatch.Session) -> None:
    """The number before a line is the start_line that returns that very line first."""
    whole = ok(call(session, "read_file", path="src/main.py")).split("\n")
    for line in whole:
        number = int(line.split(": ", 1)[0])
        assert ok(call(session, "read_file", path="src/main.py", start_line=number, end_line=number)) == line


def test_read_file_range_errors(session: dispatch.Session) -> None:
    assert fail(call(session, "read_file", path="README.md", start_line=2)) == (
        "start_line 2 is past the end of README.md: it has 2 lines (its lines are 0 to 1)"
    )
    assert ok(call(session, "read_file", path="README.md", start_line=1)) == "1: world"
    assert fail(call(session, "read_file", path="README.md", start_line=1, end_line=0)) == (
        "start_line 1 is after end_line 0"
    )
    # Client-side the schema's minimum refuses a negative start; worker-side the tool does.
    assert "-1 is less than the minimum of 0" in fail(call(session, "read_file", path="README.md", start_line=-1))
    assert fail(session.call_tool("read_file", {"path": "README.md", "start_line": -1})) == (
        "start_line must be 0 or more, not -1"
    )
    assert fail(session.call_tool("read_file", {"path": "README.md", "end_line": -2})) == (
        "end_line must be a line number or -1 (the end), not -2"
    )


def test_read_file_empty_file_and_missing_final_newline(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "empty.txt").write_text("")
    (worktree / "nonl.txt").write_text("a\nb")
    r = call(session, "read_file", path="empty.txt")
    assert ok(r) == ""
    assert r.metadata["total_lines"] == 0
    assert ok(call(session, "read_file", path="nonl.txt")) == "0: a\n1: b"


def test_read_file_not_found(session: dispatch.Session) -> None:
    assert fail(call(session, "read_file", path="missing.txt")) == "file not found: missing.txt"
    assert fail(call(session, "read_file", path="src/missing.py")) == "file not found: src/missing.py"
    assert ok(call(session, "read_file", path="README.md")) == "0: hello\n1: world"


def test_read_file_refuses_binary_files(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "blob.bin").write_bytes(b"PK\x03\x04\x00\x00binary")
    (worktree / "text.bin").write_bytes(b"no nul here\n")
    assert fail(call(session, "read_file", path="blob.bin")) == "blob.bin is a binary file; read_file only reads text"
    assert ok(call(session, "read_file", path="text.bin")) == "0: no nul here"


def test_read_file_refuses_files_over_the_size_cap(session: dispatch.Session, worktree: Path) -> None:
    cap = 16 * 1024 * 1024  # the default policy's file_size_cap_bytes
    (worktree / "big.txt").write_bytes(b"x" * (cap + 1))
    assert fail(call(session, "read_file", path="big.txt")) == (
        f"big.txt is {cap + 1} bytes, over the file size cap of {cap} bytes"
    )
    (worktree / "big.txt").write_bytes(b"x" * 100)
    assert ok(call(session, "read_file", path="big.txt")) == "0: " + "x" * 100


def test_read_file_refuses_a_fifo_without_blocking(session: dispatch.Session, worktree: Path) -> None:
    os.mkfifo(worktree / "pipe")
    started = time.monotonic()
    assert fail(call(session, "read_file", path="pipe")) == "pipe is not a regular file"
    assert time.monotonic() - started < 2


def test_read_file_refuses_a_directory(session: dispatch.Session) -> None:
    assert fail(call(session, "read_file", path="src")) == "src is a directory; use list_files"
    assert fail(call(session, "read_file", path=".")) == ". is a directory; use list_files"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../outside.txt", "path escapes the worktree: '../outside.txt'"),
        ("src/../../outside.txt", "path escapes the worktree: 'src/../../outside.txt'"),
        ("..", "path escapes the worktree: '..'"),
        ("/etc/passwd", "absolute paths are not allowed: '/etc/passwd' (give a path relative to the worktree root)"),
        ("", "path is empty (give a path relative to the worktree root, e.g. '.')"),
    ],
)
def test_read_file_refuses_paths_out_of_the_worktree(
    session: dispatch.Session, worktree: Path, path: str, message: str
) -> None:
    (worktree.parent / "outside.txt").write_text("outside secret\n")
    assert fail(call(session, "read_file", path=path)) == message
    # The allowed twin: the same walk that stays inside.
    assert ok(call(session, "read_file", path="src/../README.md")) == "0: hello\n1: world"


def test_read_file_refuses_an_absolute_path_even_inside_the_worktree(session: dispatch.Session, worktree: Path) -> None:
    absolute = str(worktree / "README.md")
    assert fail(call(session, "read_file", path=absolute)) == (
        f"absolute paths are not allowed: {absolute!r} (give a path relative to the worktree root)"
    )


def test_read_file_refuses_symlinks_out_and_follows_symlinks_in(session: dispatch.Session, worktree: Path) -> None:
    (worktree.parent / "outside.txt").write_text("outside secret\n")
    os.symlink(worktree.parent / "outside.txt", worktree / "out-link")
    os.symlink(worktree.parent, worktree / "out-dir")
    os.symlink("README.md", worktree / "in-link")
    assert fail(call(session, "read_file", path="out-link")) == (
        "path escapes the worktree: 'out-link' (through a symlink that points outside it)"
    )
    assert fail(call(session, "read_file", path="out-dir/outside.txt")) == (
        "path escapes the worktree: 'out-dir/outside.txt' (through a symlink that points outside it)"
    )
    r = call(session, "read_file", path="in-link")
    assert ok(r) == "0: hello\n1: world"
    assert r.metadata["path"] == "README.md"


# ----------------------------------------------------------------- write_file


def test_write_file_creates_a_new_file(session: dispatch.Session, worktree: Path) -> None:
    r = call(session, "write_file", path="new.txt", content="hello")
    assert ok(r) == "wrote 5 bytes to new.txt"
    assert _meta(r) == {"path": "new.txt", "bytes": 5, "changed": ["new.txt"]}
    assert (worktree / "new.txt").read_text() == "hello"


def test_write_file_counts_bytes_not_characters(session: dispatch.Session, worktree: Path) -> None:
    r = call(session, "write_file", path="utf8.txt", content="héllo ✓\n")
    assert ok(r) == "wrote 11 bytes to utf8.txt"
    assert (worktree / "utf8.txt").read_bytes() == "héllo ✓\n".encode()
    assert ok(call(session, "write_file", path="empty.txt", content="")) == "wrote 0 bytes to empty.txt"
    assert (worktree / "empty.txt").read_bytes() == b""


def test_write_file_overwrites_whole(session: dispatch.Session, worktree: Path) -> None:
    assert ok(call(session, "write_file", path="README.md", content="new\n")) == "wrote 4 bytes to README.md"
    assert (worktree / "README.md").read_text() == "new\n"
    assert ok(call(session, "read_file", path="README.md")) == "0: new"


def test_write_file_creates_parent_folders(session: dispatch.Session, worktree: Path) -> None:
    assert ok(call(session, "write_file", path="a/b/c/deep.txt", content="x")) == "wrote 1 bytes to a/b/c/deep.txt"
    assert (worktree / "a" / "b" / "c" / "deep.txt").read_text() == "x"
    assert (worktree / "a" / "b").is_dir()


def test_write_file_replaces_atomically_keeping_the_mode(session: dispatch.Session, worktree: Path) -> None:
    target = worktree / "script.sh"
    target.write_text("old\n")
    target.chmod(0o750)
    os.link(target, worktree / "hardlink")  # sees the old inode
    before = target.stat().st_ino
    assert ok(call(session, "write_file", path="script.sh", content="new\n")) == "wrote 4 bytes to script.sh"
    st = target.stat()
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(st.st_mode) == 0o750
    # Replaced by a rename: a new inode, the old one untouched (never half written).
    assert st.st_ino != before
    assert (worktree / "hardlink").read_text() == "old\n"
    assert temp_files(worktree) == []


def test_write_file_leaves_no_temporary_files_even_on_failure(session: dispatch.Session, worktree: Path) -> None:
    assert fail(call(session, "write_file", path="src", content="x")) == "src is a directory; write_file writes files"
    assert (worktree / "src").is_dir()
    for i in range(5):
        ok(call(session, "write_file", path=f"src/f{i}.txt", content=str(i) * 1000))
    assert temp_files(worktree) == [] and temp_files(worktree / "src") == []


def test_write_file_refuses_content_over_the_size_cap(session: dispatch.Session, worktree: Path) -> None:
    cap = 16 * 1024 * 1024
    assert fail(call(session, "write_file", path="big.txt", content="x" * (cap + 1))) == (
        f"content is {cap + 1} bytes, over the file size cap of {cap} bytes"
    )
    assert not (worktree / "big.txt").exists()
    assert temp_files(worktree) == []


def test_write_file_writes_through_an_inside_symlink(session: dispatch.Session, worktree: Path) -> None:
    os.symlink("README.md", worktree / "alias.md")
    assert ok(call(session, "write_file", path="alias.md", content="via link\n")) == "wrote 9 bytes to README.md"
    assert (worktree / "alias.md").is_symlink()
    assert (worktree / "README.md").read_text() == "via link\n"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../escaped.txt", "path escapes the worktree: '../escaped.txt'"),
        ("out-dir/escaped.txt", "path escapes the worktree: 'out-dir/escaped.txt' (through a symlink that points outside it)"),
    ],
)
def test_write_file_refuses_paths_out_of_the_worktree(
    session: dispatch.Session, worktree: Path, path: str, message: str
) -> None:
    os.symlink(worktree.parent, worktree / "out-dir")
    assert fail(call(session, "write_file", path=path, content="x")) == message
    assert not (worktree.parent / "escaped.txt").exists()
    absolute = str(worktree.parent / "escaped.txt")
    assert fail(call(session, "write_file", path=absolute, content="x")).startswith("absolute paths are not allowed")
    assert not (worktree.parent / "escaped.txt").exists()
    assert ok(call(session, "write_file", path="escaped.txt", content="x")) == "wrote 1 bytes to escaped.txt"


# ----------------------------------------------------------------- edit_file


def test_edit_file_single_edit(session: dispatch.Session, worktree: Path) -> None:
    r = call(session, "edit_file", path="src/main.py", edits=[{"old_text": "return 42", "new_text": "return 43"}])
    assert ok(r) == "applied 1 edit(s) to src/main.py"
    assert r.metadata["edits"] == 1
    assert (worktree / "src" / "main.py").read_text() == "import os\n\ndef main():\n    return 43\n"


def test_edit_file_applies_several_edits_in_order(session: dispatch.Session, worktree: Path) -> None:
    # The second edit only matches the text the first one left.
    edits = [
        {"old_text": "def main():", "new_text": "def main(argv):"},
        {"old_text": "main(argv):\n    return 42", "new_text": "main(argv):\n    return len(argv)"},
        {"old_text": "import os\n", "new_text": ""},
    ]
    assert ok(call(session, "edit_file", path="src/main.py", edits=edits)) == "applied 3 edit(s) to src/main.py"
    assert (worktree / "src" / "main.py").read_text() == "\ndef main(argv):\n    return len(argv)\n"


def test_edit_file_missing_text_changes_nothing(session: dispatch.Session, worktree: Path) -> None:
    path = worktree / "src" / "main.py"
    before, st = path.read_bytes(), path.stat()
    assert fail(call(session, "edit_file", path="src/main.py", edits=[{"old_text": "return 99", "new_text": "x"}])) == (
        "edits[0]: old_text not found in src/main.py: 'return 99'; nothing was changed"
    )
    # A later edit failing undoes nothing because nothing was written: the first is not applied either.
    edits = [{"old_text": "return 42", "new_text": "return 43"}, {"old_text": "return 42", "new_text": "return 44"}]
    assert fail(call(session, "edit_file", path="src/main.py", edits=edits)) == (
        "edits[1]: old_text not found in src/main.py (after the earlier edits): 'return 42'; nothing was changed"
    )
    assert path.read_bytes() == before
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns
    assert temp_files(path.parent) == []


def test_edit_file_ambiguous_match_changes_nothing(session: dispatch.Session, worktree: Path) -> None:
    path = worktree / "dup.txt"
    path.write_text("x = 1\ny = 1\nx = 1\n")
    assert fail(call(session, "edit_file", path="dup.txt", edits=[{"old_text": "x = 1", "new_text": "x = 2"}])) == (
        "edits[0]: old_text occurs 2 times in dup.txt; include more of the surrounding text "
        "so that it matches exactly once; nothing was changed"
    )
    assert path.read_text() == "x = 1\ny = 1\nx = 1\n"
    # More context makes it unique: the allowed twin.
    assert ok(call(session, "edit_file", path="dup.txt", edits=[{"old_text": "y = 1\nx = 1", "new_text": "y = 1\nx = 2"}]))
    assert path.read_text() == "x = 1\ny = 1\nx = 2\n"


def test_edit_file_overlapping_match_is_ambiguous(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "aaa.txt").write_text("aaa\n")
    assert "occurs 2 times" in fail(call(session, "edit_file", path="aaa.txt", edits=[{"old_text": "aa", "new_text": "b"}]))
    assert (worktree / "aaa.txt").read_text() == "aaa\n"


def test_edit_file_failures_on_the_file(session: dispatch.Session, worktree: Path) -> None:
    one = [{"old_text": "a", "new_text": "b"}]
    assert fail(call(session, "edit_file", path="nope.py", edits=one)) == "file not found: nope.py"
    assert fail(call(session, "edit_file", path="src", edits=one)) == "src is a directory; use list_files"
    (worktree / "blob.bin").write_bytes(b"a\x00b")
    assert fail(call(session, "edit_file", path="blob.bin", edits=one)) == "blob.bin is a binary file; edit_file only edits text"
    assert (worktree / "blob.bin").read_bytes() == b"a\x00b"
    assert fail(call(session, "edit_file", path="../x", edits=one)) == "path escapes the worktree: '../x'"


def test_edit_file_empty_edits_are_refused_on_both_sides(session: dispatch.Session) -> None:
    assert fail(call(session, "edit_file", path="README.md", edits=[])) == (
        "edit_file: invalid arguments: $.edits: [] should be non-empty"
    )
    assert fail(session.call_tool("edit_file", {"path": "README.md", "edits": []})) == (
        "edits is empty: give at least one {old_text, new_text}"
    )
    assert fail(session.call_tool("edit_file", {"path": "README.md", "edits": [{"old_text": "", "new_text": "x"}]})) == (
        "edits[0]: old_text is empty; quote the text to replace"
    )


# ----------------------------------------------------------------- create_file


def test_create_file_new(session: dispatch.Session, worktree: Path) -> None:
    r = call(session, "create_file", path="docs/new.md", content="# new\n")
    assert ok(r) == "created docs/new.md (6 bytes)"
    assert _meta(r) == {"path": "docs/new.md", "bytes": 6, "changed": ["docs/new.md"]}
    assert (worktree / "docs" / "new.md").read_text() == "# new\n"
    assert temp_files(worktree / "docs") == []


def test_create_file_refuses_an_existing_file(session: dispatch.Session, worktree: Path) -> None:
    assert fail(call(session, "create_file", path="README.md", content="clobbered")) == (
        "file already exists: README.md (use write_file to replace it)"
    )
    assert (worktree / "README.md").read_text() == "hello\nworld\n"
    assert fail(call(session, "create_file", path="src", content="x")) == (
        "src is a directory; create_file creates files, and left it as it is"
    )
    # Created once, refused the second time.
    assert ok(call(session, "create_file", path="once.txt", content="1")) == "created once.txt (1 bytes)"
    assert fail(call(session, "create_file", path="once.txt", content="2")) == (
        "file already exists: once.txt (use write_file to replace it)"
    )
    assert (worktree / "once.txt").read_text() == "1"
    assert temp_files(worktree) == []


def test_create_file_refuses_paths_out_of_the_worktree(session: dispatch.Session, worktree: Path) -> None:
    assert fail(call(session, "create_file", path="../created.txt", content="x")) == (
        "path escapes the worktree: '../created.txt'"
    )
    assert not (worktree.parent / "created.txt").exists()


# ----------------------------------------------------------------- list_files


@pytest.fixture
def tree(worktree: Path) -> Path:
    (worktree / "src" / "pkg").mkdir()
    (worktree / "src" / "pkg" / "util.py").write_text("x = 1\n")
    (worktree / "src" / "notes.txt").write_text("notes\n")
    (worktree / "docs").mkdir()
    (worktree / "docs" / "guide.md").write_text("guide\n")
    (worktree / "empty").mkdir()
    (worktree / ".git").mkdir()
    (worktree / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return worktree


def test_list_files_recursive_by_default(session: dispatch.Session, tree: Path) -> None:
    r = call(session, "list_files")
    assert ok(r) == "README.md\ndocs/guide.md\nsrc/main.py\nsrc/notes.txt\nsrc/pkg/util.py"
    assert _meta(r) == {"count": 5, "truncated": False}
    assert ok(call(session, "list_files", path=".", recursive=True)) == r.output


def test_list_files_non_recursive_marks_directories(session: dispatch.Session, tree: Path) -> None:
    assert ok(call(session, "list_files", recursive=False)) == ".git/\nREADME.md\ndocs/\nempty/\nsrc/"
    assert ok(call(session, "list_files", path="src", recursive=False)) == "src/main.py\nsrc/notes.txt\nsrc/pkg/"


def test_list_files_paths_are_relative_to_the_worktree_root(session: dispatch.Session, tree: Path) -> None:
    assert ok(call(session, "list_files", path="src")) == "src/main.py\nsrc/notes.txt\nsrc/pkg/util.py"
    assert ok(call(session, "list_files", path="src/pkg")) == "src/pkg/util.py"
    assert ok(call(session, "list_files", path="src/pkg/..")) == "src/main.py\nsrc/notes.txt\nsrc/pkg/util.py"
    assert ok(call(session, "list_files", path="empty")) == ""


def test_list_files_glob(session: dispatch.Session, tree: Path) -> None:
    assert ok(call(session, "list_files", pattern="*.py")) == "src/main.py\nsrc/pkg/util.py"
    assert ok(call(session, "list_files", pattern="src/*.py")) == "src/main.py\nsrc/pkg/util.py"
    assert ok(call(session, "list_files", pattern="docs/*")) == "docs/guide.md"
    assert ok(call(session, "list_files", path="src", pattern="*.txt")) == "src/notes.txt"
    assert ok(call(session, "list_files", pattern="*.rs")) == ""
    assert ok(call(session, "list_files", pattern="*.PY")) == ""  # case-sensitive
    assert ok(call(session, "list_files", path="src", pattern="p*", recursive=False)) == "src/pkg/"


def test_list_files_failures(session: dispatch.Session, tree: Path) -> None:
    assert fail(call(session, "list_files", path="nope")) == "directory not found: nope"
    assert fail(call(session, "list_files", path="README.md")) == "README.md is not a directory; use read_file to read a file"
    assert fail(call(session, "list_files", path="..")) == "path escapes the worktree: '..'"
    assert fail(call(session, "list_files", path=".git")) == ".git is git's metadata; list_files does not look inside .git"
    assert fail(call(session, "list_files", path="/")).startswith("absolute paths are not allowed")


def test_list_files_stops_at_the_entry_limit(session: dispatch.Session, worktree: Path) -> None:
    many = worktree / "many"
    many.mkdir()
    for i in range(10_001):
        (many / f"f{i:05d}").touch()
    r = call(session, "list_files", path="many")
    lines = ok(r).split("\n")
    assert len(lines) == 10_001
    assert lines[:2] == ["many/f00000", "many/f00001"] and lines[9_999] == "many/f09999"
    assert lines[-1] == "... (truncated at 10000 entries)"
    assert _meta(r) == {"count": 10_000, "truncated": True}
    (many / "f10000").unlink()
    r = call(session, "list_files", path="many")
    assert r.metadata["truncated"] is False and ok(r).split("\n")[-1] == "many/f09999"


def test_list_files_lists_symlinks_without_following_them(session: dispatch.Session, tree: Path) -> None:
    os.symlink(tree.parent, tree / "docs" / "up")
    assert ok(call(session, "list_files", path="docs")) == "docs/guide.md\ndocs/up"
    assert fail(call(session, "list_files", path="docs/up")) == (
        "path escapes the worktree: 'docs/up' (through a symlink that points outside it)"
    )


# ----------------------------------------------------------------- search_files


def test_search_files_plain_text(session: dispatch.Session) -> None:
    r = call(session, "search_files", query="hello")
    assert ok(r) == "README.md:0: hello"
    assert r.metadata["count"] == 1 and r.metadata["truncated"] is False
    # Plain means literal: regex metacharacters match themselves.
    assert ok(call(session, "search_files", query="main()")) == "src/main.py:2: def main():"
    assert ok(call(session, "search_files", query="m.in")) == "no matches"
    assert ok(call(session, "search_files", query="o")) == "README.md:0: hello\nREADME.md:1: world\nsrc/main.py:0: import os"


def test_search_files_regex(session: dispatch.Session) -> None:
    assert ok(call(session, "search_files", query=r"^def \w+\(", is_regex=True)) == "src/main.py:2: def main():"
    assert ok(call(session, "search_files", query="m.in", is_regex=True)) == "src/main.py:2: def main():"
    assert ok(call(session, "search_files", query=r"\d+$", is_regex=True)) == "src/main.py:3:     return 42"


def test_search_files_invalid_regex(session: dispatch.Session) -> None:
    assert fail(call(session, "search_files", query="(unclosed", is_regex=True)) == (
        "invalid regular expression: missing ), unterminated subpattern at position 0"
    )
    # The same text, taken literally, is fine.
    assert ok(call(session, "search_files", query="(unclosed")) == "no matches"


def test_search_files_path_scoping(session: dispatch.Session, tree: Path) -> None:
    assert ok(call(session, "search_files", query="x = 1")) == "src/pkg/util.py:0: x = 1"
    assert ok(call(session, "search_files", query="x = 1", path="docs")) == "no matches"
    assert ok(call(session, "search_files", query="o", path="src")) == "src/main.py:0: import os\nsrc/notes.txt:0: notes"
    assert ok(call(session, "search_files", query="o", path="README.md")) == "README.md:0: hello\nREADME.md:1: world"
    assert fail(call(session, "search_files", query="o", path="nope")) == "not found: nope"
    assert fail(call(session, "search_files", query="o", path="..")) == "path escapes the worktree: '..'"
    # .git is never searched.
    assert ok(call(session, "search_files", query="refs/heads")) == "no matches"


def test_search_files_pattern_filter(session: dispatch.Session, tree: Path) -> None:
    assert ok(call(session, "search_files", query="o", pattern="*.txt")) == "src/notes.txt:0: notes"
    assert ok(call(session, "search_files", query="o", pattern="*.md")) == "README.md:0: hello\nREADME.md:1: world"
    assert ok(call(session, "search_files", query="o", pattern="src/*.py")) == "src/main.py:0: import os"


def test_search_files_skips_binary_files(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "blob.bin").write_bytes(b"needle\x00")
    (worktree / "text.txt").write_bytes(b"needle\n")
    assert ok(call(session, "search_files", query="needle")) == "text.txt:0: needle"


def test_search_files_reports_a_line_once(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "many.txt").write_text("aaa aaa\nb\naaa\n")
    r = call(session, "search_files", query="a", path="many.txt")
    assert ok(r) == "many.txt:0: aaa aaa\nmany.txt:2: aaa"
    assert r.metadata["count"] == 2


def test_search_files_stops_at_100_matches(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "big.txt").write_text("".join(f"match {i}\n" for i in range(150)))
    r = call(session, "search_files", query="match")
    lines = ok(r).split("\n")
    assert len(lines) == 101
    assert lines[:100] == [f"big.txt:{i}: match {i}" for i in range(100)]
    assert lines[100] == "... (stopped at 100 matches)"
    assert r.metadata["count"] == 100 and r.metadata["truncated"] is True


def test_search_files_exactly_100_matches_is_not_truncated(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "big.txt").write_text("".join(f"match {i}\n" for i in range(100)))
    r = call(session, "search_files", query="match")
    lines = ok(r).split("\n")
    assert len(lines) == 100 and lines[-1] == "big.txt:99: match 99"
    assert r.metadata["truncated"] is False


def test_search_files_cuts_long_lines(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "long.txt").write_text("needle " + "y" * 1000 + "\n")
    assert ok(call(session, "search_files", query="needle")) == "long.txt:0: needle " + "y" * 493 + " [...]"


def test_search_files_empty_query_is_refused_on_both_sides(session: dispatch.Session) -> None:
    assert fail(call(session, "search_files", query="")) == "search_files: invalid arguments: $.query: '' should be non-empty"
    assert fail(session.call_tool("search_files", {"query": ""})) == "query is empty"


# ----------------------------------------------------------------- shell_exec


def test_shell_exec_keeps_stdout_and_stderr_apart(session: dispatch.Session) -> None:
    r = shell(session, "echo out; echo err >&2; echo more")
    assert ok(r) == "out\nmore\n[stderr]\nerr\n"
    assert r.metadata["stdout"] == "out\nmore\n"
    assert r.metadata["stderr"] == "err\n"
    assert r.metadata["exit_code"] == 0
    assert r.metadata["timed_out"] is False
    assert r.metadata["truncated"] is False
    assert 0 <= r.metadata["duration_s"] < 5


def test_shell_exec_non_zero_exit_is_a_failure_carrying_the_output(session: dispatch.Session) -> None:
    r = shell(session, "echo partial; echo oops >&2; exit 3")
    assert fail(r) == "command exited with status 3\npartial\n[stderr]\noops\n"
    assert r.metadata["exit_code"] == 3
    assert r.metadata["stdout"] == "partial\n" and r.metadata["stderr"] == "oops\n"
    assert fail(shell(session, "false")) == "command exited with status 1"
    assert ok(shell(session, "true")) == ""


def test_shell_exec_killed_by_a_signal(session: dispatch.Session) -> None:
    r = shell(session, "kill -KILL $$")
    assert fail(r) == "command was killed by signal 9 (SIGKILL)"
    assert r.metadata["exit_code"] == -9


def test_shell_exec_timeout_kills_the_command(session: dispatch.Session) -> None:
    started = time.monotonic()
    r = shell(session, "echo before; sleep 31.25 & sleep 31.5", timeout=0.5)
    elapsed = time.monotonic() - started
    assert fail(r) == "command timed out after 0.5 s\nbefore\n[timed out after 0.5 s]"
    assert r.metadata["timed_out"] is True
    assert r.metadata["exit_code"] == -9
    assert r.metadata["stdout"] == "before\n"
    assert 0.5 <= r.metadata["duration_s"] < 3 and elapsed < 5
    # Both the foreground sleep and the background job are gone.
    assert gone(lambda: sleepers("31.25") + sleepers("31.5"))
    # The allowed twin: a command that ends in time is not cut.
    r = shell(session, "sleep 0.1; echo done", timeout=5)
    assert ok(r) == "done\n" and r.metadata["timed_out"] is False


def test_shell_exec_timeout_bounds(session: dispatch.Session) -> None:
    assert fail(shell(session, "true", timeout=7200)) == "timeout 7200 s is over the maximum of 3600 s this policy allows"
    assert "0 is less than or equal to the minimum of 0" in fail(shell(session, "true", timeout=0))
    assert fail(session.call_tool("shell_exec", {"command": "true", "timeout": 0})) == (
        "timeout must be a positive number of seconds, not 0.0"
    )
    assert ok(shell(session, "true", timeout=3600)) == ""


def test_shell_exec_runs_in_the_worktree_or_cwd(session: dispatch.Session, worktree: Path) -> None:
    assert ok(shell(session, "pwd")) == f"{worktree}\n"
    assert ok(shell(session, "pwd; ls", cwd="src")) == f"{worktree}/src\nmain.py\n"
    assert ok(shell(session, "pwd", cwd=".")) == f"{worktree}\n"


def test_shell_exec_cwd_failures(session: dispatch.Session, worktree: Path) -> None:
    assert fail(shell(session, "touch ran", cwd="nope")) == "cwd nope does not exist"
    assert fail(shell(session, "touch ran", cwd="README.md")) == "cwd README.md is not a directory"
    assert fail(shell(session, "touch ran", cwd="..")) == "path escapes the worktree: '..'"
    assert fail(shell(session, "touch ran", cwd=str(worktree))).startswith("absolute paths are not allowed")
    assert not (worktree / "ran").exists() and not (worktree.parent / "ran").exists()


def test_shell_exec_output_cap_truncates(session: dispatch.Session) -> None:
    cap = 1024 * 1024  # the default policy's output_cap_bytes
    r = shell(session, f"head -c {cap + 500_000} /dev/zero | tr '\\0' x; echo tail >&2")
    assert r.is_success, r.error
    assert r.metadata["truncated"] is True
    assert r.metadata["stdout"] == "x" * cap
    assert r.metadata["stderr"] == "tail\n"
    assert r.output.endswith("\n[stderr]\ntail\n[output truncated at 1048576 bytes per stream]")
    # Exactly at the cap is not truncated: the allowed twin.
    r = shell(session, f"head -c {cap} /dev/zero | tr '\\0' y")
    assert r.metadata["truncated"] is False
    assert r.metadata["stdout"] == "y" * cap
    assert "truncated" not in r.output


# DISPATCH_CALL_ID marks the processes of one call (tools/proctree.py).
EXPECTED_ENV = {"PATH", "HOME", "TMPDIR", "SHELL", "TERM", "LANG", "DISPATCH_SESSION", "DISPATCH_CALL_ID"}
# The user's git identity, when their global git config has one (daemon/gitguard/identity.py).
MAYBE_ENV = {"USER", "LOGNAME", "LC_ALL", "LC_CTYPE", "TZ", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL",
             "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"}
BASH_ENV = {"PWD", "SHLVL", "_"}  # bash itself exports these to what it runs


def test_shell_exec_environment_is_the_allowlist_only(session: dispatch.Session, daemon: Daemon) -> None:
    r = shell(session, "env -0")
    env = dict(item.split("=", 1) for item in ok(r).split("\0") if item)
    assert EXPECTED_ENV <= set(env), env
    assert set(env) - EXPECTED_ENV - MAYBE_ENV - BASH_ENV == set(), env
    # The daemon runs with these set (see conftest): they must not leak through.
    assert "XDG_STATE_HOME" not in env and "PYTHONDONTWRITEBYTECODE" not in env
    scratch = os.path.realpath(daemon.state / "dispatchd" / "sessions" / session.id)
    assert env["HOME"] == f"{scratch}/home"
    full = session.status()["protections"]["mode"] == "full"
    # Full mode: the private /tmp of the session's own root (its scratch tmp, bound there).
    assert env["TMPDIR"] == ("/tmp" if full else f"{scratch}/tmp")
    assert env["DISPATCH_SESSION"] == session.id
    assert env["SHELL"] == "/bin/bash" and env["TERM"] == "dumb"
    assert env["HOME"] != os.path.expanduser("~")


def test_shell_exec_home_and_tmpdir_are_private_and_writable(session: dispatch.Session, daemon: Daemon) -> None:
    r = shell(session, 'echo h > "$HOME/h.txt" && echo t > "$TMPDIR/t.txt" && cat "$HOME/h.txt" "$TMPDIR/t.txt"')
    assert ok(r) == "h\nt\n"
    scratch = daemon.state / "dispatchd" / "sessions" / session.id
    assert (scratch / "home" / "h.txt").read_text() == "h\n"
    assert (scratch / "tmp" / "t.txt").read_text() == "t\n"
    for d in (scratch / "home", scratch / "tmp"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    # The user's real home is not the session's to write.
    real_home = os.path.expanduser("~")
    r = shell(session, f"touch {real_home}/dispatch-leak")
    assert r.is_failure
    assert not os.path.exists(f"{real_home}/dispatch-leak")


def test_shell_exec_calls_run_in_parallel_on_one_session(session: dispatch.Session) -> None:
    def run(n: int) -> dispatch.Result:
        return shell(session, f"sleep 0.5; echo {n}")

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(4)))
    elapsed = time.monotonic() - started
    assert [ok(r) for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert elapsed < 1.5, f"4 calls of 0.5 s took {elapsed:.2f} s: they ran one after another"


def test_a_fast_tool_is_not_held_up_behind_a_slow_command(session: dispatch.Session) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        slow = pool.submit(shell, session, "sleep 2; echo slow")
        time.sleep(0.2)
        started = time.monotonic()
        assert ok(call(session, "read_file", path="README.md")) == "0: hello\n1: world"
        assert time.monotonic() - started < 1.0
        assert not slow.done()
        assert ok(slow.result(timeout=10)) == "slow\n"


def test_shell_exec_stdin_is_empty(session: dispatch.Session) -> None:
    started = time.monotonic()
    assert ok(shell(session, "cat; echo eof")) == "eof\n"
    assert time.monotonic() - started < 2


def test_shell_exec_a_process_left_holding_the_output_is_ended_and_the_call_returns(session: dispatch.Session) -> None:
    started = time.monotonic()
    r = shell(session, "sleep 30.75 & echo started", timeout=20)
    assert time.monotonic() - started < 2
    assert ok(r) == ("started\n[dispatchd: ended 1 process the command left running (a call's processes end "
                     "with it); to keep one running, start it with background: true]")
    assert r.metadata["ended_processes"] == 1
    assert sleepers("30.75") == []


def test_shell_exec_description_agrees_with_background_jobs(session: dispatch.Session) -> None:
    """The model reads the description: it must not promise a wait that does not happen
    (the call returns about 0.2 s after bash exits, see the test above)."""
    description = session.registry.get("shell_exec").description
    assert "make the call wait for the timeout" not in description, description


def test_shell_exec_empty_command(session: dispatch.Session) -> None:
    assert fail(shell(session, "")) == "shell_exec: invalid arguments: $.command: '' should be non-empty"
    assert fail(shell(session, "   ")) == "command is empty"


# ----------------------------------------------------------------- unknown tools, invalid arguments


def test_unknown_tool_names_the_available_ones(session: dispatch.Session) -> None:
    assert fail(session.call_tool("nope", {})) == (
        "unknown tool: 'nope' (this session has: read_file, write_file, edit_file, create_file, "
        "list_files, search_files, shell_exec, job_output, job_stop, job_list)"
    )
    with pytest.raises(ToolNotFoundError) as exc:
        session.registry.get("nope")
    assert str(exc.value).startswith(
        "Unknown tool: nope. Available tools: read_file, write_file, edit_file, create_file, "
        "list_files, search_files, shell_exec, job_output, job_stop, job_list"
    )
    assert fail(session.registry.call("nope", {})) == str(exc.value)
    assert ok(session.call_tool("read_file", {"path": "README.md"})) == "0: hello\n1: world"


@pytest.mark.parametrize(
    ("tool", "params", "client_error", "worker_error"),
    [
        (
            "read_file",
            {"path": 1},
            "read_file: invalid arguments: $.path: 1 is not of type 'string'",
            "read_file: invalid arguments: Expected `str`, got `int` - at `$.path`",
        ),
        (
            "read_file",
            {"path": "README.md", "pth": "x"},
            "read_file: invalid arguments: Additional properties are not allowed ('pth' was unexpected)",
            "read_file: invalid arguments: Object contains unknown field `pth`",
        ),
        (
            "read_file",
            {},
            "read_file: invalid arguments: 'path' is a required property",
            "read_file: invalid arguments: Object missing required field `path`",
        ),
        (
            "read_file",
            {"path": "README.md", "start_line": "1"},
            "read_file: invalid arguments: $.start_line: '1' is not of type 'integer'",
            "read_file: invalid arguments: Expected `int`, got `str` - at `$.start_line`",
        ),
        (
            "list_files",
            {"recursive": "yes"},
            "list_files: invalid arguments: $.recursive: 'yes' is not of type 'boolean'",
            "list_files: invalid arguments: Expected `bool`, got `str` - at `$.recursive`",
        ),
        (
            "edit_file",
            {"path": "README.md", "edits": [{"old_text": "hello"}]},
            "edit_file: invalid arguments: $.edits[0]: 'new_text' is a required property",
            "edit_file: invalid arguments: Object missing required field `new_text` - at `$.edits[0]`",
        ),
    ],
)
def test_invalid_arguments_are_refused_on_both_sides(
    session: dispatch.Session, tool: str, params: dict[str, object], client_error: str, worker_error: str
) -> None:
    assert fail(session.registry.get(tool).call(params)) == client_error
    # Bypassing the client's jsonschema check, the worker's msgspec check refuses it too.
    assert fail(session.call_tool(tool, params)) == worker_error


@pytest.mark.parametrize(
    "params",
    [
        {"path": "x.txt", "content": "lone surrogate \ud800"},
        {"path": object(), "content": "x"},
    ],
    ids=["surrogate", "object"],
)
def test_call_tool_never_raises_on_unsendable_arguments(session: dispatch.Session, worktree: Path, params) -> None:
    """The client's guarantee: tool calls never raise, they return a failed Result."""
    try:
        r = session.call_tool("write_file", params)
    except Exception as exc:  # noqa: BLE001 - the bug this test shows
        pytest.fail(f"Session.call_tool raised {type(exc).__name__}: {exc}")
    assert r.is_failure and r.error.startswith("write_file: ")
    assert not (worktree / "x.txt").exists()
    # The channel is still usable afterwards.
    assert ok(session.call_tool("read_file", {"path": "README.md"})) == "0: hello\n1: world"
    # Through the registry (the usual way) the same arguments are a failed Result.
    assert session.registry.get("write_file").call(params).is_failure


def test_a_request_over_the_frame_limit_is_refused_as_too_large(session: dispatch.Session, worktree: Path) -> None:
    """Arguments that do not fit in one frame (64 MiB) never leave the client: the
    failure says so, and the channel was not touched (the next call just works)."""
    content = "x" * (65 * 1024 * 1024)
    error = fail(session.registry.get("write_file").call({"path": "huge.txt", "content": content}))
    assert error.startswith("write_file: the arguments cannot be sent: frame of "), error[:200]
    assert "exceeds the 67108864-byte limit" in error
    assert not (worktree / "huge.txt").exists()
    assert ok(call(session, "read_file", path="README.md")) == "0: hello\n1: world"


@pytest.mark.parametrize(
    ("tool", "params", "made"),
    [
        ("write_file", {"path": "made.txt", "content": "x", "mode": 0o777}, "made.txt"),
        ("create_file", {"path": "made.txt", "content": 5}, "made.txt"),
        ("shell_exec", {"command": "touch made.txt", "shell": "/bin/sh"}, "made.txt"),
        ("shell_exec", {"command": "touch made.txt", "timeout": "soon"}, "made.txt"),
    ],
)
def test_invalid_arguments_are_refused_before_anything_runs(
    session: dispatch.Session, worktree: Path, tool: str, params: dict[str, object], made: str
) -> None:
    assert fail(session.registry.get(tool).call(params)).startswith(f"{tool}: invalid arguments: ")
    assert fail(session.call_tool(tool, params)).startswith(f"{tool}: invalid arguments: ")
    assert not (worktree / made).exists()
    # The allowed twin: the same call without the bad argument runs.
    good = {k: v for k, v in params.items() if k in ("path", "command")}
    if tool != "shell_exec":
        good["content"] = "x"
    assert session.call_tool(tool, good).is_success
    assert (worktree / made).exists()
