"""search_files: the seed plan's tests (plain, regex, invalid regex, path scope,
pattern filter, result limit), plus what the contract adds (0-based lines that
read_file agrees with, skipped files, stable order)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.redact import Redactor
from dispatchd.tools import native
from dispatchd.tools.base import Outcome, ToolContext, run_tool
from dispatchd.tools.table import TOOLS


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = Path(os.path.realpath(tmp_path))
    files = {
        "README.md": "# Project\nTODO: write docs\n",
        "src/main.py": "import os\n\ndef main():\n    # TODO: handle errors\n    return 42\n",
        "src/util.py": "def helper(x):\n    return x * 2  # TODO\n",
        "tests/test_main.py": "from src.main import main\n\ndef test_main():\n    assert main() == 42\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return ToolContext(root=str(root), limits=Limits(), env={"PATH": "/usr/bin:/bin"})


def search(ctx: ToolContext, **params: Any) -> Outcome:
    return run_tool(TOOLS["search_files"], ctx, params)


def with_limits(ctx: ToolContext, **changes: Any) -> ToolContext:
    return dataclasses.replace(ctx, limits=msgspec.structs.replace(ctx.limits, **changes))


def put(ctx: ToolContext, rel: str, content: str | bytes) -> None:
    path = Path(ctx.root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)


def test_plain_text_search_reports_path_line_and_text(ctx: ToolContext) -> None:
    r = search(ctx, query="TODO")
    assert r.success
    assert r.output.split("\n") == [
        "README.md:1: TODO: write docs",
        "src/main.py:3:     # TODO: handle errors",
        "src/util.py:1:     return x * 2  # TODO",
    ]
    assert r.metadata == {"count": 3, "truncated": False, "files_searched": 4}


def test_line_numbers_are_the_ones_read_file_prints(ctx: ToolContext) -> None:
    hit = search(ctx, query="return 42").output
    path, line, _ = hit.split(":", 2)
    read = run_tool(TOOLS["read_file"], ctx, {"path": path, "start_line": int(line), "end_line": int(line)})
    assert read.output == "4:     return 42"


def test_query_is_literal_unless_is_regex(ctx: ToolContext) -> None:
    put(ctx, "dots.txt", "axb\na.b\n")
    assert search(ctx, query="a.b").output == "dots.txt:1: a.b"
    assert search(ctx, query="a.b", is_regex=True).output == "dots.txt:0: axb\ndots.txt:1: a.b"


def test_regex_search(ctx: ToolContext) -> None:
    r = search(ctx, query=r"def \w+\(", is_regex=True)
    assert r.output.split("\n") == [
        "src/main.py:2: def main():",
        "src/util.py:0: def helper(x):",
        "tests/test_main.py:2: def test_main():",
    ]


def test_anchors_work_per_line(ctx: ToolContext) -> None:
    r = search(ctx, query=r"^\s+return", is_regex=True, path="src")
    assert r.output == "src/main.py:4:     return 42\nsrc/util.py:1:     return x * 2  # TODO"


def test_invalid_regex_fails(ctx: ToolContext) -> None:
    r = search(ctx, query="foo(", is_regex=True)
    assert not r.success and r.error.startswith("invalid regular expression: ")


def test_empty_query_fails(ctx: ToolContext) -> None:
    r = search(ctx, query="")
    assert not r.success and r.error == "query is empty"


def test_search_is_scoped_to_path(ctx: ToolContext) -> None:
    r = search(ctx, query="main", path="tests")
    assert r.output.split("\n") == [
        "tests/test_main.py:0: from src.main import main",
        "tests/test_main.py:2: def test_main():",
        "tests/test_main.py:3:     assert main() == 42",
    ]
    assert r.metadata["files_searched"] == 1


def test_path_may_name_one_file(ctx: ToolContext) -> None:
    assert search(ctx, query="TODO", path="src/util.py").output == "src/util.py:1:     return x * 2  # TODO"


def test_pattern_filters_files_by_base_name(ctx: ToolContext) -> None:
    r = search(ctx, query="TODO", pattern="*.md")
    assert r.output == "README.md:1: TODO: write docs"
    assert r.metadata["files_searched"] == 1


def test_pattern_with_a_slash_filters_by_root_relative_path(ctx: ToolContext) -> None:
    r = search(ctx, query="42", pattern="tests/*.py")
    assert r.output == "tests/test_main.py:3:     assert main() == 42"


def test_each_line_is_reported_once(ctx: ToolContext) -> None:
    put(ctx, "many.txt", "x x x x\nno\nx\n")
    r = search(ctx, query="x", path="many.txt")
    assert r.output == "many.txt:0: x x x x\nmany.txt:2: x"
    assert r.metadata["count"] == 2


def test_match_across_lines_reports_its_first_line(ctx: ToolContext) -> None:
    put(ctx, "ml.txt", "zero\nbegin\nend\n")
    assert search(ctx, query=r"begin\nend", is_regex=True, path="ml.txt").output == "ml.txt:1: begin"


def test_results_stop_at_the_limit(ctx: ToolContext) -> None:
    put(ctx, "big.txt", "".join(f"hit {i}\n" for i in range(150)))
    r = search(ctx, query="hit", path="big.txt")
    out = r.output.split("\n")
    assert len(out) == 101 and out[-1] == "... (stopped at 100 matches)"
    assert out[0] == "big.txt:0: hit 0" and out[99] == "big.txt:99: hit 99"
    assert r.metadata["count"] == 100 and r.metadata["truncated"] is True


def test_limit_comes_from_the_policy_and_spans_files(ctx: ToolContext) -> None:
    r = search(with_limits(ctx, search_max_results=2), query="TODO")
    assert r.output.split("\n") == [
        "README.md:1: TODO: write docs",
        "src/main.py:3:     # TODO: handle errors",
        "... (stopped at 2 matches)",
    ]
    assert r.metadata["truncated"] is True


def test_exactly_the_limit_is_not_truncated(ctx: ToolContext) -> None:
    r = search(with_limits(ctx, search_max_results=3), query="TODO")
    assert r.metadata["count"] == 3 and r.metadata["truncated"] is False
    assert "stopped" not in r.output


def test_no_matches(ctx: ToolContext) -> None:
    r = search(ctx, query="no such text anywhere")
    assert r.success and r.output == "no matches"
    assert r.metadata == {"count": 0, "truncated": False, "files_searched": 4}


def test_binary_and_oversized_files_are_skipped(ctx: ToolContext) -> None:
    put(ctx, "blob.bin", b"TODO\x00\x01")
    put(ctx, "huge.txt", "TODO " * 100)
    r = search(with_limits(ctx, file_size_cap_bytes=100), query="TODO")
    assert "blob.bin" not in r.output and "huge.txt" not in r.output
    assert r.metadata["count"] == 3


def test_git_directory_is_skipped(ctx: ToolContext) -> None:
    put(ctx, ".git/COMMIT_EDITMSG", "TODO in git\n")
    put(ctx, "vendor/lib/.git/HEAD", "TODO in a nested repo\n")
    assert ".git" not in search(ctx, query="TODO").output
    r = search(ctx, query="TODO", path=".git")
    assert not r.success and ".git" in r.error


def test_symlinks_are_not_followed(ctx: ToolContext, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("TODO secret\n")
    os.symlink(outside, os.path.join(ctx.root, "out"))
    os.symlink("src/util.py", os.path.join(ctx.root, "util_link.py"))
    r = search(ctx, query="TODO")
    assert "secret" not in r.output and "util_link" not in r.output
    assert r.metadata["count"] == 3


def test_order_is_deterministic(ctx: ToolContext) -> None:
    for name in ["z.txt", "b/a.txt", "a.txt", "b.txt", "a-b.txt"]:
        put(ctx, name, "needle\n")
    out = search(ctx, query="needle").output.split("\n")
    assert out == sorted(out)
    assert out == search(ctx, query="needle").output.split("\n")


def test_long_lines_are_cut(ctx: ToolContext) -> None:
    put(ctx, "long.txt", "needle " + "y" * 2000 + "\n")
    line = search(ctx, query="needle").output
    text = line.split(": ", 1)[1]
    assert text.startswith("needle ") and len(text) <= 510


def test_crlf_and_invalid_utf8_lines_are_shown_cleanly_and_said(ctx: ToolContext) -> None:
    put(ctx, "win.txt", b"caf\xe9 needle\r\nnext\r\n")
    note = ("[win.txt holds bytes that are not UTF-8, shown as \ufffd: edit_file's old_text cannot quote them "
            "(quote the text beside them)]")
    for params in ({"query": "needle"}, {"query": "need[l]e", "is_regex": True}):  # the literal's path and the regex's
        r = search(ctx, **params)
        assert r.output == "win.txt:0: caf\ufffd needle\n" + note, params
        assert r.metadata["not_utf8"] == ["win.txt"]
    # The twin: a U+FFFD of the file's own is text like any other.
    put(ctx, "win.txt", "caf\ufffd needle\n")
    r = search(ctx, query="needle")
    assert r.output == "win.txt:0: caf\ufffd needle" and "not_utf8" not in r.metadata


def test_non_ascii_query(ctx: ToolContext) -> None:
    put(ctx, "u.txt", "na\u00efve\nnaive\n")
    assert search(ctx, query="na\u00efve").output == "u.txt:0: na\u00efve"


def test_path_not_found(ctx: ToolContext) -> None:
    assert search(ctx, query="x", path="nope").error == "not found: nope"


@pytest.mark.parametrize("path", ["..", "/etc"])
def test_paths_outside_are_refused(ctx: ToolContext, path: str) -> None:
    assert not search(ctx, query="root", path=path).success


def test_symlinked_directory_outside_is_refused(ctx: ToolContext) -> None:
    os.symlink("/etc", os.path.join(ctx.root, "etc"))
    r = search(ctx, query="root", path="etc")
    assert not r.success and "symlink" in r.error


def test_a_short_read_reads_the_file_again(ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    # search_files reads a file in one read of the size fstat gave; less
    # than that (a network file system, or a file cut meanwhile) sends it
    # to read_regular, which reads on to the end. (The Python path's read,
    # which os.read can be swapped in; the C helper's is tested with a
    # /proc file in test_native_lines.py.)
    monkeypatch.setattr(native, "lines", None)
    put(ctx, "short.txt", "a\n" * 5000 + "needle\n")
    real_read = os.read
    calls: list[int] = []

    def short_read(fd: int, n: int) -> bytes:
        calls.append(n)
        return real_read(fd, min(n, 100) if len(calls) == 1 else n)

    monkeypatch.setattr(os, "read", short_read)
    assert search(ctx, query="needle", path="short.txt").output == "short.txt:5000: needle"
    assert len(calls) > 1


TOKEN = "ghp_Zr9Kq2Lm7Xw4Vb8Nc3"


@pytest.mark.parametrize("helper", ["c", "python"])
def test_a_file_holding_a_secret_is_matched_as_it_is_and_shown_masked(ctx: ToolContext, helper: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line a value covers shows its label (a key's lines, one a
    match, no longer show it line by line), found by what the file holds;
    a value given with its newline is found without it too. The twin: a
    file without a value, in the same search, is shown as it is."""
    if helper == "python":
        monkeypatch.setattr(native, "lines", None)
    key = "-----BEGIN KEY-----\nQUJDREVG\nR0hJSktM\n-----END KEY-----\n"
    secret = dataclasses.replace(ctx, redactor=Redactor({"KEY": key, "TOKEN": TOKEN + "\n"}))
    put(ctx, "id_key", key)
    put(ctx, "token.env", f"TOKEN={TOKEN}")
    put(ctx, "z.txt", "QUJDREVG is not the key\n")
    assert search(secret, query="QUJD").output == "id_key:1: [secret KEY]\nz.txt:0: QUJDREVG is not the key"
    assert search(secret, query="KEY-").output == "id_key:0: [secret KEY]\nid_key:3: [secret KEY]"
    assert search(secret, query="TOKEN=").output == "token.env:0: TOKEN=[secret TOKEN]"
    assert search(secret, query="^R0h", is_regex=True).output == "id_key:2: [secret KEY]"


def test_a_line_cut_at_500_characters_inside_a_secret_shows_none_of_it(ctx: ToolContext) -> None:
    """The line is masked before it is cut: the cut falls in the label. The
    twin: the same line without the value is cut where it was."""
    secret = dataclasses.replace(ctx, redactor=Redactor({"TOKEN": TOKEN}))
    line = '{"pad":"' + "x" * 476 + '","token":"%s"}\n'
    put(ctx, "config.json", line % TOKEN)
    assert search(secret, query="pad").output == 'config.json:0: {"pad":"' + "x" * 476 + '","token":"[secr [...]'
    put(ctx, "config.json", line % ("y" * len(TOKEN)))
    assert search(secret, query="pad").output == 'config.json:0: {"pad":"' + "x" * 476 + '","token":"yyyyy [...]'
