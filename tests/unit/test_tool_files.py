"""read_file, write_file, edit_file, create_file, list_files, called as the worker calls them.

The seed plan's per-tool tests, ported, plus the atomicity and race cases.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.redact import Redactor
from dispatchd.tools import native
from dispatchd.tools.base import Outcome, ToolContext, run_tool
from dispatchd.tools.table import TOOLS


@pytest.fixture(params=["by-fd", "by-path"])
def ctx(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ToolContext]:
    """Each test twice: as the tool server calls the tools (the worktree's
    root fd held: files opened and written below it by descriptor), and by
    path alone (a context without one)."""
    root = os.path.realpath(tmp_path)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if request.param == "by-fd" else -1
    try:
        yield ToolContext(root=root, limits=Limits(), env={"PATH": "/usr/bin:/bin"}, root_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)


def call(ctx: ToolContext, tool: str, **params: Any) -> Outcome:
    return run_tool(TOOLS[tool], ctx, params)


def with_limits(ctx: ToolContext, **changes: Any) -> ToolContext:
    return dataclasses.replace(ctx, limits=msgspec.structs.replace(ctx.limits, **changes))


def put(ctx: ToolContext, rel: str, content: str | bytes) -> Path:
    path = Path(ctx.root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def leftovers(directory: str | Path) -> list[str]:
    """Temporary files a write may have left behind."""
    return [n for n in os.listdir(directory) if ".dispatchd-" in n]


def outside_file(ctx: ToolContext, content: str = "secret\n") -> Path:
    path = Path(ctx.root).parent / f"{Path(ctx.root).name}-outside.txt"
    path.write_text(content)
    return path


# == read_file =================================================================


class TestReadFile:
    @pytest.fixture(autouse=True, params=["by-fd", "c", "python"])
    def line_loops(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
        """Each test three times: as the tool server calls it (the C helper,
        the worktree's root fd held: read_beneath's one openat2 first), by
        path with the C helper (tools/_lines.c, as the warm-up calls it), and
        by the pure-Python path that runs where it was not built (root fd
        held: opened by read_regular's openat2)."""
        if request.param == "python":
            monkeypatch.setattr(native, "lines", None)
        else:
            assert native.lines is not None, native.report()
        return str(request.param)

    @pytest.fixture
    def ctx(self, tmp_path: Path, line_loops: str) -> Iterator[ToolContext]:
        root = os.path.realpath(tmp_path)
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if line_loops != "c" else -1
        try:
            yield ToolContext(root=root, limits=Limits(), env={"PATH": "/usr/bin:/bin"}, root_fd=fd)
        finally:
            if fd >= 0:
                os.close(fd)

    def test_reads_the_whole_file_with_0_based_line_numbers(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "alpha\nbeta\ngamma\n")
        r = call(ctx, "read_file", path="a.txt")
        assert r.success and r.error is None
        assert r.output == "0: alpha\n1: beta\n2: gamma"
        assert r.metadata == {"path": "a.txt", "total_lines": 3, "start_line": 0, "end_line": 2}

    def test_reads_a_line_range_inclusive(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "l0\nl1\nl2\nl3\nl4\n")
        r = call(ctx, "read_file", path="a.txt", start_line=1, end_line=3)
        assert r.output == "1: l1\n2: l2\n3: l3"
        assert (r.metadata["start_line"], r.metadata["end_line"]) == (1, 3)

    def test_start_line_alone_reads_to_the_end(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "l0\nl1\nl2\n")
        assert call(ctx, "read_file", path="a.txt", start_line=2).output == "2: l2"

    def test_end_line_past_the_end_is_clamped(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "l0\nl1\n")
        r = call(ctx, "read_file", path="a.txt", end_line=99)
        assert r.output == "0: l0\n1: l1" and r.metadata["end_line"] == 1

    def test_printed_number_can_be_quoted_back_as_start_line(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "".join(f"line {i}\n" for i in range(20)))
        printed = call(ctx, "read_file", path="a.txt").output.splitlines()[13]
        number = int(printed.split(":", 1)[0])
        again = call(ctx, "read_file", path="a.txt", start_line=number, end_line=number)
        assert again.output == printed

    def test_last_line_without_newline(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "one\ntwo")
        r = call(ctx, "read_file", path="a.txt")
        assert r.output == "0: one\n1: two" and r.metadata["total_lines"] == 2

    def test_blank_lines_count(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "one\n\n\nfour\n")
        assert call(ctx, "read_file", path="a.txt").output == "0: one\n1: \n2: \n3: four"

    def test_only_newline_splits_lines(self, ctx: ToolContext) -> None:
        # A form feed or a lone CR must not shift the numbers search_files uses.
        put(ctx, "a.txt", "a\x0cb\rc\nd\n")
        assert call(ctx, "read_file", path="a.txt").output == "0: a\x0cb\rc\n1: d"

    def test_a_secret_s_lines_are_masked_before_they_are_numbered(self, ctx: ToolContext) -> None:
        """A session's multi-line secret (a key) in a file: each line it
        covers shows its label, whatever the window; the numbers are the
        file's. The twin: a file without it, read with the same secrets."""
        key = "-----BEGIN KEY-----\nQUJDREVG\nR0hJSktM\n-----END KEY-----\n"
        secret = dataclasses.replace(ctx, redactor=Redactor({"KEY": key}))
        put(ctx, "id_key", f"head\n{key}tail\n")
        label = "[secret KEY]"
        assert call(secret, "read_file", path="id_key").output == (
            f"0: head\n1: {label}\n2: {label}\n3: {label}\n4: {label}\n5: tail")
        inside = call(secret, "read_file", path="id_key", start_line=2, end_line=2)
        assert (inside.output, inside.metadata["total_lines"]) == (f"2: {label}", 6)
        assert call(secret, "read_file", path="id_key", start_line=4).output == f"4: {label}\n5: tail"
        put(ctx, "plain.txt", "head\nQUJDREVG is not the key\n")
        assert call(secret, "read_file", path="plain.txt").output == "0: head\n1: QUJDREVG is not the key"

    def test_empty_file_is_an_empty_success(self, ctx: ToolContext) -> None:
        put(ctx, "empty.txt", "")
        r = call(ctx, "read_file", path="empty.txt")
        assert r.success and r.output == ""
        assert r.metadata["total_lines"] == 0

    def test_start_line_past_the_end_names_the_line_count(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "l0\nl1\nl2\n")
        r = call(ctx, "read_file", path="a.txt", start_line=3)
        assert not r.success and r.output is None
        assert "start_line 3 is past the end of a.txt" in r.error and "3 lines" in r.error

    @pytest.mark.parametrize("start,end", [(0, 2**63 + 5), (1, 2**64), (2**63, -1), (2**70, 2**71)])
    def test_line_numbers_beyond_any_machine_word(self, ctx: ToolContext, start: int, end: int) -> None:
        put(ctx, "f.txt", "a\nb\n")
        out = call(ctx, "read_file", path="f.txt", start_line=start, end_line=end)
        if start == 0 or start == 1:
            assert out.success and out.output == ("0: a\n1: b" if start == 0 else "1: b")
            assert out.metadata["end_line"] == 1
        else:
            assert not out.success
            assert out.error == f"start_line {start} is past the end of f.txt: it has 2 lines (its lines are 0 to 1)"

    def test_start_line_after_end_line_fails(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "l0\nl1\nl2\n")
        r = call(ctx, "read_file", path="a.txt", start_line=2, end_line=1)
        assert not r.success and "after end_line" in r.error

    @pytest.mark.parametrize(("start", "end"), [(-1, -1), (0, -2)])
    def test_negative_line_numbers_fail(self, ctx: ToolContext, start: int, end: int) -> None:
        put(ctx, "a.txt", "l0\n")
        assert not call(ctx, "read_file", path="a.txt", start_line=start, end_line=end).success

    def test_file_not_found(self, ctx: ToolContext) -> None:
        r = call(ctx, "read_file", path="src/missing.py")
        assert not r.success and r.error == "file not found: src/missing.py"

    def test_directory_is_refused(self, ctx: ToolContext) -> None:
        os.mkdir(os.path.join(ctx.root, "src"))
        r = call(ctx, "read_file", path="src")
        assert r.error == "src is a directory; use list_files"

    def test_binary_file_is_refused(self, ctx: ToolContext) -> None:
        put(ctx, "img.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        r = call(ctx, "read_file", path="img.png")
        assert r.error == "img.png is a binary file; read_file only reads text"

    def test_nul_byte_after_the_sniffed_head_is_not_binary(self, ctx: ToolContext) -> None:
        put(ctx, "late.txt", b"x" * 9000 + b"\x00\n")
        assert call(ctx, "read_file", path="late.txt").success

    def test_file_over_the_size_cap_is_refused_naming_the_cap(self, ctx: ToolContext) -> None:
        small = with_limits(ctx, file_size_cap_bytes=10)
        put(ctx, "big.txt", "x" * 11)
        put(ctx, "fits.txt", "x" * 10)
        r = call(small, "read_file", path="big.txt")
        assert not r.success and "10 bytes" in r.error and "cap" in r.error
        assert call(small, "read_file", path="fits.txt").success

    def test_invalid_utf8_is_replaced_not_refused_and_said(self, ctx: ToolContext) -> None:
        put(ctx, "latin1.txt", b"caf\xe9\nok\n")
        r = call(ctx, "read_file", path="latin1.txt")
        assert r.output == ("0: caf\ufffd\n1: ok\n[latin1.txt holds bytes that are not UTF-8, shown as \ufffd: "
                            "edit_file keeps them, but its old_text cannot quote them (quote the text beside them); "
                            "text written back whole from these lines would lose them]")
        assert r.metadata["not_utf8"] is True and r.metadata["total_lines"] == 2
        # The twin: a U+FFFD the file holds itself is text like any other.
        put(ctx, "replacement.txt", "caf\ufffd\n")
        r = call(ctx, "read_file", path="replacement.txt")
        assert r.output == "0: caf\ufffd" and "not_utf8" not in r.metadata
        # Only the lines shown count: a U+FFFD of the file's own, the bad bytes elsewhere.
        put(ctx, "mixed.txt", "caf\ufffd\n".encode() + b"caf\xe9\n")
        r = call(ctx, "read_file", path="mixed.txt", start_line=0, end_line=0)
        assert r.output == "0: caf\ufffd" and "not_utf8" not in r.metadata
        assert call(ctx, "read_file", path="mixed.txt", start_line=1).metadata["not_utf8"] is True
        # An edit beside the bytes keeps them.
        assert call(ctx, "edit_file", path="latin1.txt", edits=[{"old_text": "ok", "new_text": "fine"}]).success
        assert Path(ctx.root, "latin1.txt").read_bytes() == b"caf\xe9\nfine\n"

    def test_fifo_is_refused_without_blocking(self, ctx: ToolContext) -> None:
        os.mkfifo(os.path.join(ctx.root, "pipe"))
        r = call(ctx, "read_file", path="pipe")
        assert r.error == "pipe is not a regular file"

    def test_symlink_inside_the_worktree_is_read_through(self, ctx: ToolContext) -> None:
        put(ctx, "real.txt", "real\n")
        os.symlink("real.txt", os.path.join(ctx.root, "link.txt"))
        r = call(ctx, "read_file", path="link.txt")
        assert r.output == "0: real" and r.metadata["path"] == "real.txt"

    def test_symlink_to_a_file_outside_is_refused(self, ctx: ToolContext) -> None:
        os.symlink(outside_file(ctx), os.path.join(ctx.root, "leak.txt"))
        r = call(ctx, "read_file", path="leak.txt")
        assert "escapes the worktree" in r.error and "secret" not in r.error

    @pytest.mark.parametrize("path", ["../x.txt", "/etc/passwd"])
    def test_paths_out_of_the_sandbox_are_refused(self, ctx: ToolContext, path: str) -> None:
        r = call(ctx, "read_file", path=path)
        assert not r.success and ("escapes" in r.error or "absolute" in r.error)

    def test_a_directory_on_the_way_that_links_outside_is_refused(self, ctx: ToolContext) -> None:
        """A symlinked directory in the middle of the path (the last part a
        plain name): refused by the walk, never read below the root fd."""
        outside = outside_file(ctx)
        os.symlink(outside.parent, os.path.join(ctx.root, "up"))
        r = call(ctx, "read_file", path=f"up/{outside.name}")
        assert r.error == f"path escapes the worktree: 'up/{outside.name}' (through a symlink that points outside it)"

    def test_a_directory_on_the_way_that_links_inside_is_read_through(self, ctx: ToolContext) -> None:
        """The twin: the same shape of path through a link that stays inside
        is read, and named by where it leads."""
        put(ctx, "real/in.txt", "inside\n")
        os.symlink("real", os.path.join(ctx.root, "alias"))
        r = call(ctx, "read_file", path="alias/in.txt")
        assert r.output == "0: inside" and r.metadata["path"] == "real/in.txt"

    @pytest.mark.parametrize("path", ["./a.txt", "d//b.txt", "d/./b.txt", "d/../a.txt", "d/b.txt"])
    def test_paths_that_are_not_plain_read_the_same_file_named_plainly(self, ctx: ToolContext, path: str) -> None:
        put(ctx, "a.txt", "a\n")
        put(ctx, "d/b.txt", "b\n")
        r = call(ctx, "read_file", path=path)
        expected = "a.txt" if path.endswith("a.txt") else "d/b.txt"
        assert r.success and r.metadata["path"] == expected and r.output == f"0: {expected[-5]}"

    def test_a_name_that_is_not_utf8_is_read_and_shown_printably(self, ctx: ToolContext) -> None:
        raw = os.path.join(os.fsencode(ctx.root), b"caf\xe9.txt")
        with open(raw, "wb") as f:
            f.write(b"x\n")
        r = call(ctx, "read_file", path=os.fsdecode(b"caf\xe9.txt"))
        assert r.output == "0: x" and r.metadata["path"] == "caf\ufffd.txt"


    def test_unknown_parameter_is_refused(self, ctx: ToolContext) -> None:
        r = call(ctx, "read_file", path="a.txt", start=1)
        assert not r.success and "unknown field" in r.error


_SWAP_LOOP = """
import ctypes, os, sys
root, away = sys.argv[1], sys.argv[2]
os.chdir(root)
os.symlink(away, "d-link")
libc = ctypes.CDLL(None, use_errno=True)
while True:  # renameat2(RENAME_EXCHANGE): "d" is the directory, then the symlink, never missing
    if libc.syscall(316, -100, b"d", -100, b"d-link", 2) != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""


def _until_swapping(root: str) -> None:
    """Wait for _SWAP_LOOP's symlink: its loop starts next."""
    deadline = time.monotonic() + 10
    while not os.path.lexists(os.path.join(root, "d-link")):
        assert time.monotonic() < deadline, "the swapping process did not start"
        time.sleep(0.001)


@pytest.mark.parametrize("helper", ["c", "python"])
@pytest.mark.process
def test_a_directory_swapped_for_a_link_outside_is_never_read_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: str) -> None:
    """read_file as the tool server runs it (the worktree's root fd held),
    with the C helper and without: a hostile session swaps a directory of
    the path for a symlink to outside while it is read, again and again.
    Every read is the inside file or a refusal, never the outside file's
    content: the file is opened below the root fd with openat2 refusing
    symlinks, so a swap after the path walk fails the open. (By path, the
    walk's lstat and the open are two steps, and the swap wins between them.)"""
    if helper == "python":
        monkeypatch.setattr(native, "lines", None)
    root = os.path.realpath(tmp_path / "wt")
    os.mkdir(root)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    ctx = ToolContext(root=root, limits=Limits(), env={}, root_fd=fd)
    put(ctx, "d/f.txt", "inside\n")
    outside = outside_file(ctx, "secret\n")
    away = Path(ctx.root).parent / f"{Path(ctx.root).name}-outside-dir"
    away.mkdir()
    (away / "f.txt").write_text("secret\n")
    # The twin: the inside file is read while nothing swaps it.
    assert call(ctx, "read_file", path="d/f.txt").output == "0: inside"
    # Another process swaps, so that it races the reads for real (a thread
    # would take turns with them under the GIL).
    swapper = subprocess.Popen([sys.executable, "-c", _SWAP_LOOP, root, str(away)])
    _until_swapping(root)
    try:
        for _ in range(3000):
            r = call(ctx, "read_file", path="d/f.txt")
            assert "secret" not in (r.output or "") + (r.error or "")
            assert r.output == "0: inside" or r.error is not None
        assert swapper.poll() is None  # the swap ran all along
    finally:
        swapper.kill()
        swapper.wait()
        os.close(fd)
    assert outside.read_text() == "secret\n"


@pytest.mark.parametrize("how", ["write_file", "create_file", "edit_file", "write_file in a new folder"])
@pytest.mark.process
def test_a_directory_swapped_for_a_link_outside_is_never_written_through(tmp_path: Path, how: str) -> None:
    """The writing tools as the tool server runs them (the worktree's root fd
    held), while another process swaps a directory of the path for a symlink
    to a directory outside, again and again: nothing is ever created or
    changed outside. The folder is opened below the root fd refusing
    symlinks, and the temporary file, the rename or link and the fsync all
    name their file relative to that descriptor. (By path, the check and the
    writes are separate lookups, and the swap wins between them.)"""
    root = os.path.realpath(tmp_path / "wt")
    os.mkdir(root)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    ctx = ToolContext(root=root, limits=Limits(), env={}, root_fd=fd)
    put(ctx, "d/f.txt", "inside\n")
    away = Path(root).parent / "outside-dir"
    away.mkdir()
    (away / "f.txt").write_text("inside\n")  # what edit_file would find there
    tool = how.split()[0]
    params: dict[str, Any] = {"edit_file": {"edits": [{"old_text": "inside", "new_text": "edited"}]},
                              "write_file": {"content": "written\n"},
                              "create_file": {"content": "created\n"}}[tool]

    def attempt(n: int) -> Outcome:
        path = ("d/f.txt" if tool == "edit_file" else f"d/new-{n}/f.txt" if "folder" in how
                else f"d/new-{n}.txt")
        return call(ctx, tool, path=path, **params)

    # The twin: with nothing swapping, the write lands inside.
    assert attempt(0).success
    if tool == "edit_file":
        assert Path(root, "d", "f.txt").read_text() == "edited\n"
        Path(root, "d", "f.txt").write_text("inside\n")
    else:
        assert Path(root, "d", "new-0/f.txt" if "folder" in how else "new-0.txt").exists()
    swapper = subprocess.Popen([sys.executable, "-c", _SWAP_LOOP, root, str(away)])
    _until_swapping(root)
    try:
        for n in range(1, 1500):
            attempt(n)
        assert swapper.poll() is None  # the swap ran all along
    finally:
        swapper.kill()
        swapper.wait()
        os.close(fd)
    assert sorted(p.name for p in away.iterdir()) == ["f.txt"]
    assert (away / "f.txt").read_text() == "inside\n"


# == write_file (and create_file: a new file) =================================


@pytest.mark.parametrize(
    ("tool", "content", "output"),
    [("write_file", "hello", "wrote 5 bytes to new.txt"), ("create_file", "fresh\n", "created new.txt (6 bytes)")],
)
def test_a_new_file_is_written_and_reported(ctx: ToolContext, tool: str, content: str, output: str) -> None:
    r = call(ctx, tool, path="new.txt", content=content)
    assert r.success and r.output == output
    assert r.metadata == {"path": "new.txt", "bytes": len(content), "changed": ["new.txt"]}
    assert Path(ctx.root, "new.txt").read_text() == content
    assert leftovers(ctx.root) == []


class TestWriteFile:
    def test_overwrites_an_existing_file(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "old content that is longer\n")
        assert call(ctx, "write_file", path="a.txt", content="new\n").success
        assert Path(ctx.root, "a.txt").read_text() == "new\n"

    def test_creates_parent_directories(self, ctx: ToolContext) -> None:
        assert call(ctx, "write_file", path="a/b/c/d.txt", content="deep").success
        assert Path(ctx.root, "a/b/c/d.txt").read_text() == "deep"

    def test_byte_count_is_of_the_utf8_encoding(self, ctx: ToolContext) -> None:
        r = call(ctx, "write_file", path="u.txt", content="caf\u00e9")
        assert r.metadata["bytes"] == 5 and r.output == "wrote 5 bytes to u.txt"

    def test_empty_content(self, ctx: ToolContext) -> None:
        assert call(ctx, "write_file", path="e.txt", content="").output == "wrote 0 bytes to e.txt"
        assert Path(ctx.root, "e.txt").read_bytes() == b""

    @pytest.mark.parametrize("path", ["../escape.txt", "a/../../escape.txt", "/tmp/escape.txt"])
    def test_refuses_paths_outside_the_worktree(self, ctx: ToolContext, path: str) -> None:
        r = call(ctx, "write_file", path=path, content="x")
        assert not r.success
        assert not Path(ctx.root).parent.joinpath("escape.txt").exists()

    def test_refuses_writing_through_a_symlink_that_points_outside(self, ctx: ToolContext) -> None:
        target = outside_file(ctx)
        os.symlink(target, os.path.join(ctx.root, "evil"))
        r = call(ctx, "write_file", path="evil", content="pwned")
        assert not r.success and "symlink" in r.error
        assert target.read_text() == "secret\n"

    def test_refuses_a_dangling_symlink_that_points_outside(self, ctx: ToolContext) -> None:
        target = Path(ctx.root).parent / "planted.txt"
        os.symlink(target, os.path.join(ctx.root, "evil"))
        assert not call(ctx, "write_file", path="evil", content="x").success
        assert not target.exists()

    def test_writes_through_an_inside_symlink_and_keeps_the_link(self, ctx: ToolContext) -> None:
        put(ctx, "real.txt", "old")
        link = os.path.join(ctx.root, "link.txt")
        os.symlink("real.txt", link)
        r = call(ctx, "write_file", path="link.txt", content="new")
        assert r.success and r.metadata["path"] == "real.txt"
        assert os.path.islink(link) and os.readlink(link) == "real.txt"
        assert Path(ctx.root, "real.txt").read_text() == "new"

    def test_keeps_the_permission_bits(self, ctx: ToolContext) -> None:
        script = put(ctx, "run.sh", "#!/bin/sh\n")
        os.chmod(script, 0o750)
        assert call(ctx, "write_file", path="run.sh", content="#!/bin/sh\necho hi\n").success
        assert stat.S_IMODE(os.stat(script).st_mode) == 0o750

    def test_new_file_gets_the_umask_mode(self, ctx: ToolContext) -> None:
        umask = os.umask(0o027)
        try:
            assert call(ctx, "write_file", path="fresh.txt", content="x").success
        finally:
            os.umask(umask)
        assert stat.S_IMODE(os.stat(os.path.join(ctx.root, "fresh.txt")).st_mode) == 0o640

    def test_replacement_is_a_new_inode(self, ctx: ToolContext) -> None:
        # The sign of rename-based replacement: a reader holding the old file
        # keeps a consistent old version.
        path = put(ctx, "a.txt", "old")
        with open(path) as held:
            assert call(ctx, "write_file", path="a.txt", content="new").success
            assert held.read() == "old"
        assert path.read_text() == "new"

    def test_failed_fsync_leaves_the_old_file_and_no_temp(self, ctx: ToolContext, monkeypatch) -> None:
        path = put(ctx, "a.txt", "precious")

        def broken_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", broken_fsync)
        r = call(ctx, "write_file", path="a.txt", content="replacement")
        assert not r.success and r.error == "cannot write a.txt: Input/output error"
        assert path.read_text() == "precious"
        assert leftovers(ctx.root) == []

    def test_failed_write_midway_leaves_the_old_file_and_no_temp(self, ctx: ToolContext, monkeypatch) -> None:
        path = put(ctx, "a.txt", "precious")
        real_write = os.write
        calls = []

        def short_then_fail(fd: int, data: Any) -> int:
            calls.append(len(data))
            if len(calls) == 1:
                return real_write(fd, bytes(data[:3]))  # a short write, then ENOSPC
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "write", short_then_fail)
        r = call(ctx, "write_file", path="a.txt", content="replacement")
        assert not r.success and "No space left on device" in r.error
        assert path.read_text() == "precious"
        assert leftovers(ctx.root) == []

    def test_failed_rename_leaves_no_temp(self, ctx: ToolContext, monkeypatch) -> None:
        path = put(ctx, "a.txt", "precious")

        def broken_replace(src: str, dst: str) -> None:
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr(os, "replace", broken_replace)
        assert not call(ctx, "write_file", path="a.txt", content="x").success
        assert path.read_text() == "precious"
        assert leftovers(ctx.root) == []

    def test_short_writes_are_completed(self, ctx: ToolContext, monkeypatch) -> None:
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
        content = "0123456789" * 10
        assert call(ctx, "write_file", path="a.txt", content=content).success
        assert Path(ctx.root, "a.txt").read_text() == content

    def test_fsyncs_the_file_and_the_directory_when_the_policy_says_so(self, ctx: ToolContext, monkeypatch) -> None:
        synced: list[int] = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
        assert call(ctx, "write_file", path="a.txt", content="x").success
        assert len(synced) == 2
        synced.clear()
        assert call(with_limits(ctx, fsync=False), "write_file", path="b.txt", content="x").success
        assert synced == []

    def test_content_over_the_size_cap_is_refused(self, ctx: ToolContext) -> None:
        small = with_limits(ctx, file_size_cap_bytes=4)
        path = put(ctx, "a.txt", "old")
        r = call(small, "write_file", path="a.txt", content="\u00e9\u00e9\u00e9")  # 3 chars, 6 bytes
        assert not r.success and "6 bytes" in r.error and "4 bytes" in r.error
        assert path.read_text() == "old"

    def test_refuses_to_write_over_a_directory(self, ctx: ToolContext) -> None:
        os.mkdir(os.path.join(ctx.root, "dir"))
        r = call(ctx, "write_file", path="dir", content="x")
        assert r.error == "dir is a directory; write_file writes files"
        assert os.path.isdir(os.path.join(ctx.root, "dir"))
        assert leftovers(ctx.root) == []

    def test_parent_that_is_a_file_fails_cleanly(self, ctx: ToolContext) -> None:
        put(ctx, "file", "x")
        r = call(ctx, "write_file", path="file/child.txt", content="x")
        assert not r.success and r.error.startswith("cannot create the folder file")

    def test_read_only_worktree_refuses(self, ctx: ToolContext) -> None:
        ro = dataclasses.replace(ctx, writable=False)
        r = call(ro, "write_file", path="a.txt", content="x")
        assert r.error == "the worktree is read-only under this policy"
        assert not os.path.exists(os.path.join(ctx.root, "a.txt"))

    def test_long_file_name_gets_a_temp_name_that_fits(self, ctx: ToolContext) -> None:
        name = "n" * 255
        assert call(ctx, "write_file", path=name, content="x").success
        assert leftovers(ctx.root) == []


# == edit_file =================================================================


class TestWritesLoseNothing:
    """What a write or an edit must not lose: another process's write between
    the edit's read and its replace, a FIFO at the name, the file's extended
    attributes."""

    def test_a_write_between_the_read_and_the_replace_is_kept(self, ctx: ToolContext,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
        """The user's process appends while the edit runs (once, right after
        the edit's first read): the edit reads again and lands on top of it.
        The twin: no writer, one read (below)."""
        from dispatchd.tools import files
        path = put(ctx, "log.txt", "header\nline 1\n")
        real, reads = files._load_text, []

        def racing(*args: Any) -> Any:
            got = real(*args)
            reads.append(got[2])
            if len(reads) == 1:
                with open(path, "a") as f:
                    f.write("the user's line\n")
            return got

        monkeypatch.setattr(files, "_load_text", racing)
        r = call(ctx, "edit_file", path="log.txt", edits=[{"old_text": "header", "new_text": "HEADER"}])
        assert r.success, r.error
        assert path.read_text() == "HEADER\nline 1\nthe user's line\n" and len(reads) == 2
        reads.clear()
        reads.append(b"")  # no more writes: the twin reads once
        assert call(ctx, "edit_file", path="log.txt", edits=[{"old_text": "line 1", "new_text": "LINE 1"}]).success
        assert len(reads) == 2 and leftovers(ctx.root) == []

    def test_a_file_written_at_every_read_is_left_to_its_writer(self, ctx: ToolContext,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        from dispatchd.tools import files
        path = put(ctx, "busy.txt", "a\n")
        real = files._load_text

        def racing(*args: Any) -> Any:
            got = real(*args)
            with open(path, "a") as f:
                f.write("w\n")
            return got

        monkeypatch.setattr(files, "_load_text", racing)
        r = call(ctx, "edit_file", path="busy.txt", edits=[{"old_text": "a", "new_text": "b"}])
        assert not r.success and r.error == ("busy.txt changed each of the 3 times it was read for the edit (another "
                                             "process keeps writing it); nothing was changed: stop what writes it, "
                                             "or edit it later")
        assert path.read_text() == "a\nw\nw\nw\n" and leftovers(ctx.root) == []

    @pytest.mark.parametrize("tool", ["write_file", "edit_file"])
    def test_a_fifo_at_the_name_is_refused_and_left(self, ctx: ToolContext, tool: str) -> None:
        fifo = Path(ctx.root, "pipe")
        os.mkfifo(fifo)
        args: dict[str, Any] = {"content": "x\n"} if tool == "write_file" else \
            {"edits": [{"old_text": "x", "new_text": "y"}]}
        r = call(ctx, tool, path="pipe", **args)
        assert not r.success and stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert r.error == ("pipe is a FIFO, not a regular file; write_file writes regular files only, and left it "
                           "as it is" if tool == "write_file" else "pipe is not a regular file")
        put(ctx, "plain", "x\n")  # the twin
        assert call(ctx, tool, path="plain", **args).success

    @pytest.mark.parametrize("tool", ["write_file", "edit_file"])
    def test_a_file_made_read_only_is_refused_and_left(self, ctx: ToolContext, tool: str) -> None:
        path = put(ctx, "locked.txt", "x\n")
        path.chmod(0o444)
        args: dict[str, Any] = {"content": "y\n"} if tool == "write_file" else \
            {"edits": [{"old_text": "x", "new_text": "y"}]}
        r = call(ctx, tool, path="locked.txt", **args)
        assert not r.success and r.error == ("cannot write locked.txt: the file is read-only (mode 0444); make it "
                                             "writable first (chmod u+w) if it should change")
        assert path.read_text() == "x\n" and leftovers(ctx.root) == []
        path.chmod(0o644)  # the twin
        assert call(ctx, tool, path="locked.txt", **args).success and path.read_text() == "y\n"

    @pytest.mark.parametrize("tool", ["write_file", "edit_file"])
    def test_extended_attributes_stay_with_the_file(self, ctx: ToolContext, tool: str) -> None:
        path = put(ctx, "tagged.txt", "x\n")
        os.setxattr(path, "user.origin", b"the user's")
        args: dict[str, Any] = {"content": "y\n"} if tool == "write_file" else \
            {"edits": [{"old_text": "x", "new_text": "y"}]}
        assert call(ctx, tool, path="tagged.txt", **args).success
        assert path.read_text() == "y\n" and os.getxattr(path, "user.origin") == b"the user's"


class TestEditFile:
    def test_single_edit(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.py", "def f():\n    return 1\n")
        r = call(ctx, "edit_file", path="a.py", edits=[{"old_text": "return 1", "new_text": "return 2"}])
        assert r.success and r.output == "applied 1 edit(s) to a.py"
        assert path.read_text() == "def f():\n    return 2\n"

    def test_multiple_edits(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.py", "x = 1\ny = 2\nz = 3\n")
        edits = [{"old_text": "x = 1", "new_text": "x = 10"}, {"old_text": "z = 3", "new_text": "z = 30"}]
        r = call(ctx, "edit_file", path="a.py", edits=edits)
        assert r.output == "applied 2 edit(s) to a.py" and r.metadata["edits"] == 2
        assert path.read_text() == "x = 10\ny = 2\nz = 30\n"

    def test_edits_apply_in_sequence(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "alpha\n")
        edits = [{"old_text": "alpha", "new_text": "beta"}, {"old_text": "beta", "new_text": "gamma"}]
        assert call(ctx, "edit_file", path="a.txt", edits=edits).success
        assert path.read_text() == "gamma\n"

    def test_a_later_edit_sees_a_duplicate_made_by_an_earlier_one(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "one two\n")
        edits = [{"old_text": "two", "new_text": "one"}, {"old_text": "one", "new_text": "1"}]
        r = call(ctx, "edit_file", path="a.txt", edits=edits)
        assert not r.success and r.error.startswith("edits[1]: old_text occurs 2 times")
        assert path.read_text() == "one two\n"

    def test_new_text_may_be_empty(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "keep\ndrop me\nkeep too\n")
        assert call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "drop me\n", "new_text": ""}]).success
        assert path.read_text() == "keep\nkeep too\n"

    def test_old_text_not_found_names_the_edit_and_changes_nothing(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "hello world\n")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "goodbye", "new_text": "x"}])
        assert not r.success
        assert r.error.startswith("edits[0]: old_text not found in a.txt") and "'goodbye'" in r.error
        assert path.read_text() == "hello world\n"

    def test_long_old_text_is_shortened_in_the_message(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "x\n")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "y" * 5000, "new_text": ""}])
        assert len(r.error) < 300 and "..." in r.error

    def test_a_failing_later_edit_writes_nothing(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "one\ntwo\n")
        edits = [{"old_text": "one", "new_text": "ONE"}, {"old_text": "three", "new_text": "THREE"}]
        r = call(ctx, "edit_file", path="a.txt", edits=edits)
        assert r.error.startswith("edits[1]: old_text not found in a.txt (after the earlier edits)")
        assert path.read_text() == "one\ntwo\n"
        assert leftovers(ctx.root) == []

    def test_ambiguous_match_asks_for_more_context(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "x = 1\nx = 1\nx = 1\n")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "x = 1", "new_text": "x = 2"}])
        assert "occurs 3 times" in r.error and "surrounding" in r.error
        assert path.read_text() == "x = 1\nx = 1\nx = 1\n"

    def test_overlapping_occurrences_are_ambiguous(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "aaa")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "aa", "new_text": "b"}])
        assert not r.success and "occurs 2 times" in r.error
        assert path.read_text() == "aaa"

    def test_empty_old_text_fails(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "x\n")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "", "new_text": "y"}])
        assert r.error.startswith("edits[0]: old_text is empty")

    def test_no_edits_fails(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "x\n")
        assert "edits is empty" in call(ctx, "edit_file", path="a.txt", edits=[]).error

    def test_edit_with_a_missing_field_is_invalid(self, ctx: ToolContext) -> None:
        put(ctx, "a.txt", "x\n")
        r = call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "x"}])
        assert "invalid arguments" in r.error

    def test_file_not_found(self, ctx: ToolContext) -> None:
        r = call(ctx, "edit_file", path="nope.txt", edits=[{"old_text": "a", "new_text": "b"}])
        assert r.error == "file not found: nope.txt"
        assert not os.path.exists(os.path.join(ctx.root, "nope.txt"))

    def test_binary_file_is_refused(self, ctx: ToolContext) -> None:
        put(ctx, "bin", b"a\x00b")
        r = call(ctx, "edit_file", path="bin", edits=[{"old_text": "a", "new_text": "b"}])
        assert r.error == "bin is a binary file; edit_file only edits text"

    def test_bytes_that_are_not_utf8_survive_elsewhere(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", b"caf\xe9 = 1\nname = 'x'\n")
        assert call(ctx, "edit_file", path="a.txt", edits=[{"old_text": "'x'", "new_text": "'y'"}]).success
        assert path.read_bytes() == b"caf\xe9 = 1\nname = 'y'\n"

    def test_crlf_files_get_a_hint(self, ctx: ToolContext) -> None:
        put(ctx, "win.txt", b"one\r\ntwo\r\n")
        r = call(ctx, "edit_file", path="win.txt", edits=[{"old_text": "one\ntwo", "new_text": "x"}])
        assert "CRLF" in r.error

    def test_keeps_the_permission_bits(self, ctx: ToolContext) -> None:
        path = put(ctx, "run.sh", "echo 1\n")
        os.chmod(path, 0o700)
        assert call(ctx, "edit_file", path="run.sh", edits=[{"old_text": "1", "new_text": "2"}]).success
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700

    def test_result_over_the_size_cap_is_refused(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "abc")
        r = call(with_limits(ctx, file_size_cap_bytes=5), "edit_file", path="a.txt",
                 edits=[{"old_text": "b", "new_text": "bbbbbb"}])
        assert not r.success and "cap" in r.error
        assert path.read_text() == "abc"

    def test_refuses_a_path_outside(self, ctx: ToolContext) -> None:
        target = outside_file(ctx)
        os.symlink(target, os.path.join(ctx.root, "evil"))
        r = call(ctx, "edit_file", path="evil", edits=[{"old_text": "secret", "new_text": "x"}])
        assert "escapes" in r.error and target.read_text() == "secret\n"

    def test_read_only_worktree_refuses(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "x")
        r = call(dataclasses.replace(ctx, writable=False), "edit_file", path="a.txt",
                 edits=[{"old_text": "x", "new_text": "y"}])
        assert r.error == "the worktree is read-only under this policy" and path.read_text() == "x"


# == create_file ===============================================================


class TestCreateFile:
    def test_fails_on_an_existing_file(self, ctx: ToolContext) -> None:
        path = put(ctx, "a.txt", "original")
        r = call(ctx, "create_file", path="a.txt", content="other")
        assert r.error == "file already exists: a.txt (use write_file to replace it)"
        assert path.read_text() == "original"

    def test_fails_on_an_existing_directory(self, ctx: ToolContext) -> None:
        os.mkdir(os.path.join(ctx.root, "d"))
        assert call(ctx, "create_file", path="d", content="x").error == (
            "d is a directory; create_file creates files, and left it as it is")
        assert os.listdir(os.path.join(ctx.root, "d")) == []

    def test_fails_on_a_dangling_symlink(self, ctx: ToolContext) -> None:
        os.symlink("not-there", os.path.join(ctx.root, "link"))
        r = call(ctx, "create_file", path="link", content="x")
        assert not r.success and "already exists" in r.error
        assert not os.path.exists(os.path.join(ctx.root, "not-there"))

    def test_creates_parent_directories(self, ctx: ToolContext) -> None:
        assert call(ctx, "create_file", path="x/y/z.txt", content="z").success
        assert Path(ctx.root, "x/y/z.txt").read_text() == "z"

    @pytest.mark.parametrize("path", ["../created.txt", "/tmp/created.txt"])
    def test_refuses_paths_outside(self, ctx: ToolContext, path: str) -> None:
        assert not call(ctx, "create_file", path=path, content="x").success
        assert not Path(ctx.root).parent.joinpath("created.txt").exists()

    def test_race_with_another_creator_fails_cleanly(self, ctx: ToolContext, monkeypatch) -> None:
        # Someone creates the file after our existence check, before the link.
        real_link = os.link

        def racing_link(src: str, dst: str, **how: Any) -> None:
            Path(ctx.root, os.path.basename(dst)).write_text("theirs")
            real_link(src, dst, **how)

        monkeypatch.setattr(os, "link", racing_link)
        r = call(ctx, "create_file", path="contested.txt", content="ours")
        assert r.error == "file already exists: contested.txt (use write_file to replace it)"
        assert Path(ctx.root, "contested.txt").read_text() == "theirs"
        assert leftovers(ctx.root) == []

    def test_new_file_gets_the_umask_mode(self, ctx: ToolContext) -> None:
        assert call(ctx, "create_file", path="m.txt", content="").success
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(os.stat(os.path.join(ctx.root, "m.txt")).st_mode) == 0o666 & ~umask

    def test_read_only_worktree_refuses(self, ctx: ToolContext) -> None:
        r = call(dataclasses.replace(ctx, writable=False), "create_file", path="a.txt", content="x")
        assert r.error == "the worktree is read-only under this policy"


# == list_files ================================================================


@pytest.fixture
def tree(ctx: ToolContext) -> ToolContext:
    for rel in ["README.md", "a.txt", "src/main.py", "src/util.py", "src/pkg/mod.py", "docs/guide.md", "a/b.txt"]:
        put(ctx, rel, "x\n")
    put(ctx, ".git/HEAD", "ref: refs/heads/main\n")
    put(ctx, ".git/objects/ab/cdef", "blob")
    return ctx


def lines(r: Outcome) -> list[str]:
    assert r.success, r.error
    return r.output.split("\n") if r.output else []


class TestListFiles:
    def test_lists_every_file_recursively_sorted(self, tree: ToolContext) -> None:
        r = call(tree, "list_files")
        assert lines(r) == [
            "README.md", "a.txt", "a/b.txt", "docs/guide.md", "src/main.py", "src/pkg/mod.py", "src/util.py",
        ]
        assert r.metadata == {"count": 7, "truncated": False}

    def test_order_is_plain_sorted_order(self, tree: ToolContext) -> None:
        put(tree, "a-b/c.txt", "")
        put(tree, "a0", "")
        out = lines(call(tree, "list_files"))
        assert out == sorted(out)

    def test_paths_are_relative_to_the_worktree_root(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", path="src")) == ["src/main.py", "src/pkg/mod.py", "src/util.py"]

    def test_non_recursive_lists_files_and_directories(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", recursive=False)) == [
            ".git/", "README.md", "a.txt", "a/", "docs/", "src/",
        ]
        assert lines(call(tree, "list_files", path="src", recursive=False)) == [
            "src/main.py", "src/pkg/", "src/util.py",
        ]

    def test_glob_on_base_names(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", pattern="*.py")) == ["src/main.py", "src/pkg/mod.py", "src/util.py"]
        assert lines(call(tree, "list_files", pattern="*.md")) == ["README.md", "docs/guide.md"]

    def test_glob_with_a_slash_matches_the_root_relative_path(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", pattern="src/*.py")) == [
            "src/main.py", "src/pkg/mod.py", "src/util.py",
        ]
        assert lines(call(tree, "list_files", pattern="src/pkg/*")) == ["src/pkg/mod.py"]

    def test_glob_is_case_sensitive(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", pattern="readme.md")) == []

    def test_glob_in_a_non_recursive_listing(self, tree: ToolContext) -> None:
        assert lines(call(tree, "list_files", recursive=False, pattern="a*")) == ["a.txt", "a/"]

    def test_nothing_under_git_is_listed(self, tree: ToolContext) -> None:
        put(tree, "vendor/sub/.git/config", "x")
        out = lines(call(tree, "list_files"))
        assert not any(".git" in p for p in out)
        r = call(tree, "list_files", path=".git")
        assert not r.success and ".git" in r.error

    def test_git_file_of_a_linked_worktree_is_listed_as_a_file(self, ctx: ToolContext) -> None:
        # Only the contents of .git directories are skipped.
        put(ctx, ".git", "gitdir: /elsewhere\n")
        assert lines(call(ctx, "list_files")) == [".git"]
        assert lines(call(ctx, "list_files", recursive=False)) == [".git"]

    def test_symlinks_are_listed_not_followed(self, tree: ToolContext) -> None:
        os.symlink("src", os.path.join(tree.root, "srclink"))
        os.symlink("/etc", os.path.join(tree.root, "etc"))
        out = lines(call(tree, "list_files"))
        assert "srclink" in out and "etc" in out
        assert not any(p.startswith(("srclink/", "etc/")) for p in out)

    def test_truncates_at_the_limit(self, tree: ToolContext) -> None:
        r = call(with_limits(tree, list_max_entries=3), "list_files")
        assert r.output.split("\n") == ["README.md", "a.txt", "a/b.txt", "... (truncated at 3 entries)"]
        assert r.metadata == {"count": 3, "truncated": True}

    def test_exactly_the_limit_is_not_truncated(self, tree: ToolContext) -> None:
        r = call(with_limits(tree, list_max_entries=7), "list_files")
        assert r.metadata == {"count": 7, "truncated": False}

    def test_empty_directory_is_an_empty_success(self, ctx: ToolContext) -> None:
        os.mkdir(os.path.join(ctx.root, "empty"))
        r = call(ctx, "list_files", path="empty")
        assert r.success and r.output == "" and r.metadata == {"count": 0, "truncated": False}

    def test_not_a_directory_fails(self, tree: ToolContext) -> None:
        r = call(tree, "list_files", path="a.txt")
        assert not r.success and "not a directory" in r.error

    def test_directory_not_found_fails(self, tree: ToolContext) -> None:
        assert call(tree, "list_files", path="nope").error == "directory not found: nope"

    @pytest.mark.parametrize("path", ["..", "../..", "/"])
    def test_refuses_paths_outside(self, tree: ToolContext, path: str) -> None:
        assert not call(tree, "list_files", path=path).success

    def test_refuses_a_symlinked_directory_outside(self, tree: ToolContext) -> None:
        os.symlink("/etc", os.path.join(tree.root, "etc"))
        r = call(tree, "list_files", path="etc")
        assert not r.success and "symlink" in r.error

    def test_file_names_that_are_not_utf8_are_shown_replaced(self, ctx: ToolContext) -> None:
        with open(os.path.join(os.fsencode(ctx.root), b"bad\xff.txt"), "w"):
            pass
        assert lines(call(ctx, "list_files")) == ["bad\ufffd.txt"]


@pytest.mark.parametrize("tool", ["write_file", "edit_file"])
def test_a_file_whose_name_is_long_in_bytes_is_written(ctx: ToolContext, tool: str) -> None:
    """A name of 85 three-byte characters (255 bytes, NAME_MAX): its
    temporary name was cut to 200 characters, over NAME_MAX in bytes, and
    every write failed (``File name too long``)."""
    name = "é" * 127  # 254 bytes
    path = put(ctx, name, "x\n")
    args: dict[str, Any] = {"content": "y\n"} if tool == "write_file" else \
        {"edits": [{"old_text": "x", "new_text": "y"}]}
    r = call(ctx, tool, path=name, **args)
    assert r.success, r.error
    assert path.read_text() == "y\n" and leftovers(ctx.root) == []


@pytest.mark.parametrize("tool", ["write_file", "create_file"])
@pytest.mark.parametrize("path", [".", "./", "sub/..", "newdir/.", "newdir/", "link-to-root"])
def test_a_path_naming_a_directory_is_refused_and_nothing_is_written(ctx: ToolContext, tool: str, path: str) -> None:
    """``.`` resolved to the root, whose parent's path, taken as below the
    root, wrote a file named after the worktree inside it: the user's own
    file of that name overwritten, the reply saying "wrote 11 bytes to ."."""
    name = os.path.basename(ctx.root)
    put(ctx, name, "the user's\n")
    (Path(ctx.root) / "sub").mkdir()
    os.symlink(".", Path(ctx.root) / "link-to-root")
    before = sorted(os.listdir(ctx.root))
    r = call(ctx, tool, path=path, content="the agent's")
    assert r.error == (f"{path} names a directory (the worktree itself, or one ending in '/', '.' or '..'); {tool} "
                       "writes files: give the file's path, e.g. 'notes.txt'")
    assert Path(ctx.root, name).read_text() == "the user's\n" and sorted(os.listdir(ctx.root)) == before


@pytest.mark.parametrize("tool", ["write_file", "create_file"])
def test_a_file_named_after_the_worktree_is_written_by_its_own_name(ctx: ToolContext, tool: str) -> None:
    """The twin: the same file, named as a file, is written."""
    name = os.path.basename(ctx.root)
    if tool == "write_file":
        put(ctx, name, "the user's\n")
    r = call(ctx, tool, path=f"./{name}", content="the agent's")
    assert r.success, r.error
    assert Path(ctx.root, name).read_text() == "the agent's" and r.metadata["changed"] == [name]
