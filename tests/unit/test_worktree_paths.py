"""The path rules (dispatchd.tools.worktree_paths): the seed plan's Sandbox tests, ported.

Each refusal is paired with an allowed twin so a pass shows the rule, not an
accident of the fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.tools.base import ToolFailure
from dispatchd.inside import is_within
from dispatchd.tools.worktree_paths import printable, relative, resolve


@pytest.fixture
def root(tmp_path: Path) -> str:
    wt = tmp_path / "wt"
    (wt / "src").mkdir(parents=True)
    (wt / "src" / "main.py").write_text("x\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret\n")
    return os.path.realpath(wt)


def outside(root: str) -> str:
    return os.path.join(os.path.dirname(root), "outside")


def within_worktree(root: str, path: str) -> bool:
    """Whether ``path`` (absolute, or relative to ``root``) lies in the worktree,
    by the package's own lexical test after symlinks and ``..`` are resolved.
    Never raises."""
    if not path or "\x00" in path:
        return False
    try:
        return is_within(os.path.realpath(os.path.join(root, path)), root)
    except (OSError, ValueError):
        return False


def refused(root: str, path: str) -> str:
    with pytest.raises(ToolFailure) as info:
        resolve(root, path)
    return info.value.message


# -- resolution --------------------------------------------------------------


def test_relative_path_resolves_inside_root(root: str) -> None:
    assert resolve(root, "src/main.py") == os.path.join(root, "src", "main.py")


def test_dot_is_the_root(root: str) -> None:
    assert resolve(root, ".") == root
    assert resolve(root, "./") == root


def test_redundant_components_are_normalised(root: str) -> None:
    assert resolve(root, "./src//./main.py") == os.path.join(root, "src", "main.py")
    assert resolve(root, "src/../src/main.py") == os.path.join(root, "src", "main.py")


def test_path_that_does_not_exist_yet_resolves(root: str) -> None:
    assert resolve(root, "new/dir/file.txt") == os.path.join(root, "new", "dir", "file.txt")


def test_must_exist_reports_a_missing_file(root: str) -> None:
    assert resolve(root, "src/main.py", must_exist=True).endswith("main.py")
    with pytest.raises(ToolFailure, match=r"^file not found: src/nope\.py$"):
        resolve(root, "src/nope.py", must_exist=True)


def test_empty_path_is_refused(root: str) -> None:
    assert "path is empty" in refused(root, "")


def test_nul_byte_is_refused(root: str) -> None:
    assert "NUL" in refused(root, "src/main.py\x00.txt")


# -- absolute paths ------------------------------------------------------------


def test_absolute_path_is_refused_with_the_documented_message(root: str) -> None:
    assert refused(root, "/etc/passwd") == (
        "absolute paths are not allowed: '/etc/passwd' (give a path relative to the worktree root)"
    )


def test_absolute_path_inside_the_root_is_refused_too(root: str) -> None:
    # Refused rather than re-rooted: one way to name a file, so none is a surprise.
    path = os.path.join(root, "src", "main.py")
    assert refused(root, path).startswith("absolute paths are not allowed")


# -- traversal -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "src/../../outside", "src/../../wt/../outside"])
def test_dotdot_out_of_the_root_is_refused(root: str, path: str) -> None:
    assert refused(root, path) == f"path escapes the worktree: {path!r}"


def test_dotdot_that_stays_inside_is_allowed(root: str) -> None:
    assert resolve(root, "src/../src/main.py") == os.path.join(root, "src", "main.py")


def test_dotdot_back_into_the_root_by_name_is_allowed(root: str) -> None:
    # "../wt/x" leaves and comes back: where it ends is what counts.
    name = os.path.basename(root)
    assert resolve(root, f"../{name}/src") == os.path.join(root, "src")


def test_sibling_with_the_root_as_name_prefix_is_outside(root: str) -> None:
    sibling = root + "2"  # /tmp/.../wt2: a string-prefix check would let it in
    os.mkdir(sibling)
    os.symlink(sibling, os.path.join(root, "sib"))
    assert "escapes" in refused(root, "sib")
    assert "escapes" in refused(root, f"../{os.path.basename(sibling)}")
    assert not within_worktree(root, sibling)


# -- symlinks ------------------------------------------------------------------


def test_symlinked_directory_pointing_outside_is_refused(root: str) -> None:
    os.symlink(outside(root), os.path.join(root, "out"))
    message = refused(root, "out/secret.txt")
    assert message.startswith("path escapes the worktree: 'out/secret.txt'")
    assert "symlink" in message


def test_symlink_as_the_last_component_pointing_outside_is_refused(root: str) -> None:
    os.symlink(os.path.join(outside(root), "secret.txt"), os.path.join(root, "secret"))
    assert "symlink" in refused(root, "secret")


def test_relative_symlink_pointing_outside_is_refused(root: str) -> None:
    os.symlink("../outside/secret.txt", os.path.join(root, "rel"))
    assert "symlink" in refused(root, "rel")


def test_dangling_symlink_pointing_outside_is_refused(root: str) -> None:
    os.symlink(os.path.join(outside(root), "not-yet.txt"), os.path.join(root, "dangling"))
    assert "symlink" in refused(root, "dangling")


def test_chain_of_symlinks_leading_outside_is_refused(root: str) -> None:
    os.symlink("../outside", os.path.join(root, "hop2"))
    os.symlink("hop2", os.path.join(root, "hop1"))
    assert "symlink" in refused(root, "hop1/secret.txt")


def test_dotdot_after_a_symlink_climbs_from_its_target(root: str) -> None:
    # The kernel resolves "deep/.." from the link's target; a lexical
    # normalisation would wrongly land on the root.
    os.makedirs(os.path.join(outside(root), "sub"))
    os.symlink(os.path.join(outside(root), "sub"), os.path.join(root, "deep"))
    assert "symlink" in refused(root, "deep/../secret.txt")


def test_symlink_inside_the_root_resolves_to_its_target(root: str) -> None:
    os.symlink("src/main.py", os.path.join(root, "link.py"))
    assert resolve(root, "link.py") == os.path.join(root, "src", "main.py")


def test_dangling_symlink_inside_the_root_resolves_to_its_target(root: str) -> None:
    os.symlink("src/later.py", os.path.join(root, "later"))
    assert resolve(root, "later") == os.path.join(root, "src", "later.py")


def test_symlink_to_the_root_itself_is_allowed(root: str) -> None:
    os.symlink(".", os.path.join(root, "self"))
    assert resolve(root, "self/src/main.py") == os.path.join(root, "src", "main.py")


def test_symlink_loop_is_refused(root: str) -> None:
    os.symlink("loop2", os.path.join(root, "loop1"))
    os.symlink("loop1", os.path.join(root, "loop2"))
    assert "symlink loop" in refused(root, "loop1")


# -- within_worktree -----------------------------------------------------------


def test_within_worktree_for_paths_inside(root: str) -> None:
    assert within_worktree(root, "src/main.py")
    assert within_worktree(root, ".")
    assert within_worktree(root, "not/yet/there")
    assert within_worktree(root, os.path.join(root, "src"))


def test_within_worktree_for_paths_outside(root: str) -> None:
    assert not within_worktree(root, "../outside")
    assert not within_worktree(root, "/etc/passwd")
    assert not within_worktree(root, "")
    assert not within_worktree(root, "a\x00b")


def test_within_worktree_follows_symlinks(root: str) -> None:
    os.symlink(outside(root), os.path.join(root, "out"))
    os.symlink("src", os.path.join(root, "in"))
    assert not within_worktree(root, "out")
    assert not within_worktree(root, "out/secret.txt")
    assert within_worktree(root, "in/main.py")


# -- display -------------------------------------------------------------------


def test_relative_gives_worktree_relative_paths(root: str) -> None:
    assert relative(root, root) == "."
    assert relative(root, os.path.join(root, "src", "main.py")) == "src/main.py"


def test_printable_replaces_bytes_json_cannot_carry() -> None:
    assert printable("plain.txt") == "plain.txt"
    assert printable("caf\u00e9") == "caf\u00e9"
    assert printable(os.fsdecode(b"bad\xff.txt")) == "bad\ufffd.txt"
    assert printable("lone\ud800") == "lone?"
