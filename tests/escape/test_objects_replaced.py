"""A session that puts garbage at the names of the user's git objects
(``mv -f``: a directory's write permission is all it takes, which git's own
writes need), or writes it into them in place, loses the user nothing: the
kept files are put back at the session's end, the session's moved aside
(daemon/gitguard/replaced.py). The packs are read-only in the session, a
pack given a second name is made the repository's own again, and a new
pack naming the user's objects at other bytes is moved aside (packlinks.py,
newpacks.py); a session without namespaces joining a full-mode one's
worktree finds the keep owning copies (history.own_unheld_packs). Each
attack beside its control and git's honest work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, daemon_with_nons, shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

REPLACE = ("for f in .git/objects/??/*; do printf garbage > .git/planted && mv -f .git/planted \"$f\"; done; "
           "git log >/dev/null 2>&1 || echo broken")


REWRITE_IN_PLACE = ("for f in .git/objects/??/*; do chmod u+w \"$f\" && printf garbage > \"$f\" && chmod a-w \"$f\"; "
                    "done; git log >/dev/null 2>&1 || echo broken")


@pytest.mark.parametrize("attack", [REPLACE, REWRITE_IN_PLACE], ids=["replaced", "rewritten_in_place"])
def test_objects_replaced_or_rewritten_in_place_by_a_session_are_put_back(client: dispatch.Client, repo: Path,
                                                                          attack: str) -> None:
    """Garbage at the names of the user's objects, by a rename or written in
    place (``chmod`` is not refused: a session's own files need it; the write
    keeps the inode and its directory's ctime): the kept bytes, a copy of
    their own, are put back."""
    original = git(repo, "log", "--format=%H").stdout
    with client.open_session(str(repo)) as s:
        r = shell(s, attack)
        assert (r.output or "").startswith("broken"), (r.output, r.error)  # the attack landed
    reports = [p["why"] for p in s.protected if p["path"].endswith("objects")]
    assert any("object files a session replaced put back" in why for why in reports), s.protected
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
    assert git(repo, "log", "--format=%H").stdout == original


def test_a_session_s_own_commits_and_gc_are_not_reported_replaced(client: dispatch.Client, repo: Path) -> None:
    """The twin: git's own work in a session (new objects, a repack, objects
    freshened by a commit of a tree that exists already) replaces nothing."""
    with client.open_session(str(repo)) as s:
        r = shell(s, "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m again && "
                     "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m again2 && "
                     "git repack -q -a -d --write-bitmap-index && git gc -q")
        assert r.is_success, (r.output, r.error)
    assert not [p for p in s.protected if "replaced" in p["why"]], s.protected
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_the_user_s_packs_cannot_be_changed_in_a_session(mode_daemon: tuple[str, object], client: dispatch.Client,
                                                         repo: Path) -> None:
    """Full mode: each pack file the repository had is read-only over itself
    (chmod: EROFS, so a write stays refused; rm: EBUSY), while git's own work, a commit
    and a gc writing new packs, succeeds (the twin). Degraded mode: no mount
    namespace to hold them, and the session's report says so; the keep holds
    copies of them, and one rewritten in place is put back at the end."""
    git(repo, "gc", "-q")
    pack = next(p for p in (repo / ".git" / "objects" / "pack").iterdir() if p.suffix == ".pack")
    rel = pack.relative_to(repo)
    before = pack.read_bytes()
    with client.open_session(str(repo)) as s:
        gaps = s.status()["protections"]["leaves_open"]
        if mode_daemon[0] == "full":
            r = shell(s, f"chmod u+w {rel}; printf x >> {rel}; rm -f {rel}; ls {rel}")
            assert f"chmod: changing permissions of '{rel}': Read-only file system" in (r.output or ""), r.output
            # The write: its mode, which the chmod could not change, refuses it.
            assert f"{rel}: Permission denied" in (r.output or "") and \
                f"rm: cannot remove '{rel}': Device or resource busy" in (r.output or ""), r.output
            assert not [g for g in gaps if "packs can be made writable" in g], gaps
        else:
            assert any(g.startswith("the repository's packs can be made writable (chmod)") for g in gaps), gaps
            # Nothing holds them: the keep holds copies, and the end puts the bytes back.
            r = shell(s, f"chmod u+w {rel} && printf garbage | dd of={rel} bs=1 seek=100 conv=notrunc status=none")
            assert r.is_success and pack.read_bytes() != before, (r.output, r.error)  # the attack landed
    assert pack.read_bytes() == before
    with client.open_session(str(repo)) as s:
        r = shell(s, "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m more && "
                     "git gc -q && git count-objects -v | grep packs")
        assert r.is_success, (r.output, r.error)
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_a_pack_given_a_second_name_cannot_be_rewritten_by_a_later_session(client: dispatch.Client,
                                                                           repo: Path) -> None:
    """A session repacks (its new pack is not held: it did not exist at the
    open) and hard-links the pack under a name of its own in the worktree;
    a later session makes that name writable and rewrites it in place. The
    first session's end made the repository's pack an inode of its own, so
    the later write lands on the session's file only; the user's history
    and ``git fsck`` are untouched (the control: the two names did share
    the inode while the first session ran)."""
    with client.open_session(str(repo)) as s:
        r = shell(s, "git repack -q -a -d && ln .git/objects/pack/pack-*.pack .git/mine && "
                     "stat -c %h .git/objects/pack/pack-*.pack")
        assert r.is_success and (r.output or "").strip().endswith("2"), (r.output, r.error)  # shared, then
    assert any("pack files with more names than at the baseline (hard links made meanwhile) given an inode of their own" in p["why"]
               for p in s.protected), s.protected
    original = git(repo, "log", "--format=%H").stdout
    with client.open_session(str(repo)) as s:
        r = shell(s, "chmod u+w .git/mine && printf garbage | dd of=.git/mine bs=1 seek=12 conv=notrunc status=none && "
                     "echo written")
        assert (r.output or "").strip() == "written", (r.output, r.error)
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
    assert git(repo, "log", "--format=%H").stdout == original


FORGE_PACK = r"""set -e
out=$(echo {other} | git pack-objects -q .git/objects/pack/tmp)
python3 - "$out" <<'PY'
import os, sys
d = ".git/objects/pack"
data = bytearray(open(f"{{d}}/tmp-{{sys.argv[1]}}.idx", "rb").read())
victim = bytes.fromhex("{victim}")
data[8 + 1024:8 + 1024 + 20] = victim
for i in range(256):
    data[8 + i * 4:12 + i * 4] = (1 if i >= victim[0] else 0).to_bytes(4, "big")
open(f"{{d}}/pack-{forged}.idx", "wb").write(bytes(data))
os.rename(f"{{d}}/tmp-{{sys.argv[1]}}.pack", f"{{d}}/pack-{forged}.pack")
os.unlink(f"{{d}}/tmp-{{sys.argv[1]}}.idx")
PY
touch -d "@$(( $(date +%s) + 100 ))" .git/objects/pack/pack-{forged}.pack
git show {victim}
"""


def test_a_pack_naming_the_user_s_objects_for_other_bytes_is_moved_aside(client: dispatch.Client,
                                                                         repo: Path) -> None:
    """A session writes a pack whose index names one of the user's objects
    (the blob of ``f`` at ``HEAD``) at the bytes of another; git reads the
    newest pack first, so the user's ``git show`` and ``checkout`` would
    read the session's bytes (the control: inside the session they do).
    The end reads each of the user's objects a new pack names, and moves
    this one aside; the twin, a session's honest gc, is left (above)."""
    victim = git(repo, "rev-parse", "HEAD:f").stdout.strip()
    other = git(repo, "rev-parse", "HEAD~2:f").stdout.strip()
    original = git(repo, "show", victim).stdout
    with client.open_session(str(repo)) as s:
        r = shell(s, FORGE_PACK.format(other=other, victim=victim, forged="e" * 40))
        assert r.is_success and (r.output or "") == git(repo, "show", other).stdout, (r.output, r.error)
    assert any("names your objects for other bytes" in p["why"] for p in s.protected), s.protected
    assert git(repo, "show", victim).stdout == original
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


@pytest.fixture(scope="module")
def mixed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A full-mode daemon with a policy whose sessions run without namespaces."""
    d = daemon_with_nons(tmp_path_factory.mktemp("mixed"))
    yield d
    assert d.stop() == 0, d.log()


def test_a_session_without_namespaces_joining_cannot_rewrite_the_packs_for_good(mixed_daemon: Daemon,
                                                                                repo: Path) -> None:
    """A full-mode session holds the user's packs read-only, and its keep
    linked them; a session of a policy without namespaces then joins the
    same worktree, where nothing holds them, and rewrites one in place. Its
    join made the keep own copies, so the last end puts the bytes back; the
    control: the rewrite landed (and git, inside, reads the broken pack)."""
    git(repo, "gc", "-q")
    pack = next((repo / ".git" / "objects" / "pack").glob("*.pack"))
    rel, original = pack.relative_to(repo), pack.read_bytes()
    with mixed_daemon.connect() as client:
        with client.open_session(str(repo)) as held, client.open_session(str(repo), policy="nons") as loose:
            assert held.status()["protections"]["mode"] == "full"
            assert loose.status()["protections"]["mode"] == "degraded"
            r = shell(loose, f"chmod u+w {rel} && printf garbage | dd of={rel} bs=1 seek=100 conv=notrunc "
                             "status=none && git fsck --no-progress >/dev/null 2>&1 || echo broken")
            assert (r.output or "").strip() == "broken", (r.output, r.error)  # the attack landed
    assert pack.read_bytes() == original
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_a_session_on_a_worktree_around_the_repository_cannot_rewrite_its_packs_for_good(
        mixed_daemon: Daemon, tmp_path: Path) -> None:
    """A full-mode session holds ``inner``'s packs read-only, and its keep
    linked them; a full-mode session on ``outer``, around it, holds only its
    own repository's packs, and rewrites one of ``inner``'s in place. Its
    join made ``inner``'s keep own copies, so the last end puts the bytes
    back (the control: the rewrite landed)."""
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q", "-b", "main")
    inner = outer / "inner"
    inner.mkdir()
    git(inner, "init", "-q", "-b", "main")
    (inner / "f").write_text("inner\n")
    git(inner, "add", "f")
    git(inner, "commit", "-qm", "inner")
    git(inner, "gc", "-q")
    pack = next((inner / ".git" / "objects" / "pack").glob("*.pack"))
    original = pack.read_bytes()
    with mixed_daemon.connect() as client:
        with client.open_session(str(inner)) as held, client.open_session(str(outer)) as around:
            assert held.status()["protections"]["mode"] == around.status()["protections"]["mode"] == "full"
            rel = pack.relative_to(outer)
            r = shell(around, f"chmod u+w {rel} && printf garbage | dd of={rel} bs=1 seek=100 conv=notrunc "
                              "status=none && git -C inner fsck --no-progress >/dev/null 2>&1 || echo broken")
            assert (r.output or "").strip() == "broken", (r.output, r.error)  # the attack landed
    assert pack.read_bytes() == original
    assert git(inner, "fsck", "--no-progress", check=False).returncode == 0


@pytest.mark.parametrize("linked_first", [True, False], ids=["linked_first", "around_first"])
def test_a_session_around_a_linked_worktree_s_repository_cannot_rewrite_its_packs_for_good(
        mixed_daemon: Daemon, tmp_path: Path, linked_first: bool) -> None:
    """A full-mode session on ``w``, a linked worktree of ``x/r``, holds r's
    packs read-only (its keep linked them); a session on ``x`` holds r's
    files as its own worktree's and rewrites a pack in place. The two are
    one domain (``inside.worktrees_relate``: x holds w's repository), so
    r's keep owns copies and the last end puts the bytes back, whichever
    opened first (the control: the rewrite landed)."""
    x = tmp_path / "x"
    r = x / "r"
    r.mkdir(parents=True)
    git(r, "init", "-q", "-b", "main")
    (r / "f").write_text("x\n")
    git(r, "add", "f")
    git(r, "commit", "-qm", "one")
    git(r, "gc", "-q")
    git(r, "worktree", "add", "-q", str(tmp_path / "w"), "-b", "side")
    pack = next((r / ".git" / "objects" / "pack").glob("*.pack"))
    rel, original = pack.relative_to(x), pack.read_bytes()
    with mixed_daemon.connect() as client:
        first, second = (tmp_path / "w", x) if linked_first else (x, tmp_path / "w")
        with client.open_session(str(first)) as one, client.open_session(str(second)) as two:
            around = two if linked_first else one
            out = shell(around, f"chmod u+w {rel} && printf garbage | dd of={rel} bs=1 seek=100 conv=notrunc "
                                "status=none && git -C r fsck --no-progress >/dev/null 2>&1 || echo broken")
            assert (out.output or "").strip() == "broken", (out.output, out.error)  # the attack landed
    assert pack.read_bytes() == original
    assert git(r, "fsck", "--no-progress", check=False).returncode == 0
