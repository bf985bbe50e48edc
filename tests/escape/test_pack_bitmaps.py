"""A pack's reachability bitmap that a session forged (a commit's reach
swapped with an older commit's) makes the user's ``git push`` fail and
``git bundle create --all`` write a bundle without the newest commit, exit
status 0 (the controls, on git alone). At the session's end a bitmap or
reverse index it made or changed is moved aside, a kept one of the user's
put back (daemon/gitguard/derived.py); git's own reverse index of a new pack
is kept (the twin)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

# Swaps the reach of two commits in a pack's bitmap: argv: the pack's .bitmap and .idx, two commit ids.
FORGE = r"""
import hashlib, os, struct, sys
bitmap, idx, a, b = sys.argv[1:5]
data = bytearray(open(bitmap, "rb").read())
count = struct.unpack(">I", data[8:12])[0]
pos = 32
def ewah(at):
    return 8 + struct.unpack(">I", data[at + 4:at + 8])[0] * 8 + 4
for _ in range(4):
    pos += ewah(pos)
raw = open(idx, "rb").read()
n = struct.unpack(">I", raw[1028:1032])[0]
names = [raw[1032 + i * 20:1052 + i * 20].hex() for i in range(n)]
at = {}
for _ in range(count):
    at[names[struct.unpack(">I", data[pos:pos + 4])[0]]] = pos
    pos += 6 + ewah(pos + 6)
(pa, pb) = (at[a], at[b])
data[pa:pa + 4], data[pb:pb + 4] = data[pb:pb + 4], data[pa:pa + 4]
data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
os.chmod(bitmap, 0o644)
open(bitmap, "r+b").write(data)
"""


def _forge_cmd(python: str) -> str:
    """Shell: the forged bitmap of the newest pack, the tip's reach swapped with its parent's."""
    return ("b=$(ls -t .git/objects/pack/*.bitmap | head -1) && "
            f"{python} -c '{FORGE}' \"$b\" \"${{b%.bitmap}}.idx\" $(git rev-parse HEAD HEAD~1)")


def _reach_by_bitmap(repo: Path) -> int:
    return len(git(repo, "rev-list", "--use-bitmap-index", "--objects", "--all").stdout.split("\n"))


def _push_and_bundle_work(repo: Path, tmp: Path) -> bool:
    """The user's own git: a push to a bare repository and a bundle of
    everything, restored; True when both hold the tip."""
    remote = tmp / "remote.git"
    git(tmp, "init", "-q", "--bare", str(remote))
    pushed = git(repo, "push", "-q", str(remote), "HEAD:refs/heads/main", check=False).returncode == 0
    bundle = tmp / "all.bundle"
    git(repo, "bundle", "create", "-q", str(bundle), "--all", check=False)
    restored = git(tmp, "clone", "-q", str(bundle), str(tmp / "restored"), check=False).returncode == 0
    return pushed and restored


def test_control_a_forged_bitmap_breaks_the_user_s_push_and_backups(repo: Path, tmp_path: Path) -> None:
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a", "-d")
    honest = _reach_by_bitmap(repo)
    subprocess.run(["bash", "-c", _forge_cmd(sys.executable)], cwd=repo, check=True)
    assert _reach_by_bitmap(repo) < honest  # the tip and what it added: gone from the bitmap's answer
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0  # fsck does not see it
    bundled = git(repo, "bundle", "create", "-q", str(tmp_path / "b.bundle"), "--all", check=False)
    assert bundled.returncode == 0  # a backup, written without complaint ...
    assert not _push_and_bundle_work(repo, tmp_path)  # ... that cannot be restored, and no push goes


def test_a_bitmap_a_session_forged_for_its_own_pack_is_moved_aside(client: dispatch.Client, repo: Path,
                                                                     tmp_path: Path) -> None:
    with client.open_session(str(repo)) as s:
        r = shell(s, "git -c repack.writeBitmaps=true repack -q -a -d && "
                     "before=$(git rev-list --use-bitmap-index --objects --all | wc -l) && "
                     f"{_forge_cmd('python3')} && "
                     "after=$(git rev-list --use-bitmap-index --objects --all | wc -l) && "
                     "test $after -lt $before && echo forged")
        assert (r.output or "").strip() == "forged", (r.output, r.error)  # the attack landed in the session
    assert any("pack bitmaps or reverse indexes made or changed by a session moved aside" in p["why"]
               for p in s.protected), s.protected
    assert not list((repo / ".git" / "objects" / "pack").glob("*.bitmap"))
    assert _push_and_bundle_work(repo, tmp_path)
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_the_user_s_bitmap_cannot_be_forged_in_a_session(mode_daemon: tuple[str, object], client: dispatch.Client,
                                                         repo: Path, tmp_path: Path) -> None:
    """The user's own bitmap: read-only in a session in full mode (the twin:
    git's commit there works); in degraded mode it can be rewritten in place,
    and the kept copy is put back at the end."""
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a", "-d")
    bitmap = next((repo / ".git" / "objects" / "pack").glob("*.bitmap"))
    original = bitmap.read_bytes()
    with client.open_session(str(repo)) as s:
        r = shell(s, _forge_cmd("python3") + " && echo forged")
        if mode_daemon[0] == "full":
            assert "Read-only file system" in (r.error or "") + (r.output or ""), (r.output, r.error)
            done = shell(s, "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m more")
            assert done.is_success, (done.output, done.error)
        else:
            assert (r.output or "").strip() == "forged", (r.output, r.error)
    assert bitmap.read_bytes() == original
    bitmaps = [p for p in s.protected if "pack bitmaps or reverse indexes" in p["why"]]
    assert bitmaps if mode_daemon[0] == "degraded" else not bitmaps, s.protected
    assert _push_and_bundle_work(repo, tmp_path)


def test_git_s_own_reverse_index_of_a_new_pack_is_kept(client: dispatch.Client, repo: Path) -> None:
    """The twin: a session's repack writing a reverse index (git 2.41 and
    later do by default) leaves it in place, and nothing is reported."""
    with client.open_session(str(repo)) as s:
        r = shell(s, "git -c pack.writeReverseIndex=true repack -q -a -d && ls .git/objects/pack/*.rev")
        assert r.is_success, (r.output, r.error)
    assert len(list((repo / ".git" / "objects" / "pack").glob("*.rev"))) == 1
    assert not [p for p in s.protected if "bitmaps" in p["why"]], s.protected
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
