"""The user's own tools stay theirs: one trusted baseline per worktree that
holds across overlapping sessions and a daemon killed half way, and every
tool that runs what a repository says (daemon/gitguard/baselines.py).

Every attack plants something the user's git (or editor, agent, shell)
would run: ``core.fsmonitor``, a hook, a rebase todo's ``exec``, a
``.vscode/tasks.json``. The probe is a marker file outside the worktree
that only the user's own git, run outside any sandbox by the test after
the sessions end, can create. Each attack has its control: the same plant,
made by the test itself with no session involved, makes the user's git run
it (so a probe that cannot fire cannot pass).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, shell

MODES = ("full", "degraded")
IDENTITY = {"GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.invalid",
            "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.invalid"}
SESSION_IDENTITY = " ".join(f"{k}={v}" for k, v in IDENTITY.items())


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **IDENTITY, "GIT_EDITOR": "true"}
    return subprocess.run(["git", *args], cwd=cwd, check=check, capture_output=True, text=True, env=env, timeout=60)


def user_runs_git(repo: Path) -> None:
    """What the user does after the sessions: status, a commit, a rebase's continue."""
    git(repo, "status", check=False)
    (repo / "user-file").write_text("x\n")
    git(repo, "add", "user-file", check=False)
    git(repo, "commit", "-qm", "user", check=False)
    git(repo, "rebase", "--continue", check=False)


@pytest.fixture(scope="module", params=MODES)
def mode_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Daemon]]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp(f"daemon-{request.param}"),
               *(["--no-user-namespaces"] if request.param == "degraded" else []))
    try:
        yield request.param, d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def client(mode_daemon: tuple[str, Daemon]) -> Iterator[dispatch.Client]:
    with mode_daemon[1].connect() as c:
        yield c


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    for n in range(5):
        (r / "f").write_text(f"{n}\n")
        git(r, "add", "f")
        git(r, "commit", "-qm", f"c{n}")
    return r


def fsmonitor_config(marker: Path) -> str:
    return f"[core]\n\trepositoryformatversion = 0\n\tfsmonitor = \"touch {marker}\"\n"


def plant_commondir(repo: Path, marker: Path) -> str:
    """A shell script that redirects ``.git`` to an evil common directory."""
    return (f"mkdir -p evil/objects evil/refs && cp .git/HEAD evil/HEAD && "
            f"printf '{fsmonitor_config(marker)}' > evil/config && echo ../evil > .git/commondir")


# --- controls: the plants work against the user's git ------------------------------------------


def test_control_a_planted_commondir_runs_for_the_user(repo: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    subprocess.run(["bash", "-c", plant_commondir(repo, marker)], cwd=repo, check=True)
    user_runs_git(repo)
    assert marker.exists()


def test_control_a_new_repository_runs_for_the_user(repo: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (repo / "sub").mkdir()
    git(repo / "sub", "init", "-q")
    git(repo / "sub", "config", "core.fsmonitor", f"touch {marker}")
    git(repo / "sub", "status", check=False)
    assert marker.exists()


def rebase_plant(marker: Path) -> str:
    """Start an interactive rebase that stops at ``break`` with ``exec`` next."""
    ed = '"$ed"'
    return (f"ed=$(mktemp) && printf '#!/bin/sh\\nprintf \"break\\\\nexec touch {marker}\\\\n\" > \"$1\"\\n' > {ed} && "
            f"chmod +x {ed} && GIT_SEQUENCE_EDITOR={ed} {SESSION_IDENTITY} "
            "git rebase -q -i HEAD~1 >/dev/null 2>&1; test -d .git/rebase-merge && echo stopped")


def test_control_a_rebase_todo_runs_for_the_user(repo: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = subprocess.run(["bash", "-c", rebase_plant(marker)], cwd=repo, capture_output=True, text=True)
    assert out.stdout == "stopped\n" and not marker.exists()
    git(repo, "rebase", "--continue", check=False)
    assert marker.exists()


# --- attacks --------------------------------------------------------------------------------


def test_overlapping_sessions_cannot_carry_a_plant_past_the_baseline(client: dispatch.Client, repo: Path,
                                                                     tmp_path: Path) -> None:
    """A plants; B opens (its own look would include the plant); A closes
    (moved aside); B plants again; B closes: the baseline is the user's, so
    the second plant is moved aside too."""
    marker = tmp_path / "ran"
    a = client.open_session(str(repo))
    r = shell(a, plant_commondir(repo, marker))
    assert r.is_success, r.error
    b = client.open_session(str(repo))
    a.close()
    assert any(".git/commondir" in p["path"] for p in a.protected), a.protected
    assert not (repo / ".git" / "commondir").exists()
    r = shell(b, "echo ../evil > .git/commondir && cat .git/commondir")
    assert r.output == "../evil\n", r.error
    assert any(".git/commondir" in p["path"] for p in b.status()["protected"])  # A's end, seen from B
    b.close()
    assert not (repo / ".git" / "commondir").exists()
    user_runs_git(repo)
    assert not marker.exists()


def test_a_poisoned_test_script_run_by_two_overlapping_sessions(client: dispatch.Client, repo: Path,
                                                               tmp_path: Path) -> None:
    """The repository's own test script re-plants at every run: a long
    session and a one-off one both run it."""
    marker = tmp_path / "ran"
    (repo / "test.sh").write_text(plant_commondir(repo, marker) + "\n")
    git(repo, "add", "test.sh")
    git(repo, "commit", "-qm", "tests")
    long = client.open_session(str(repo))
    assert shell(long, "bash test.sh").is_success
    long.release_write_lock()  # one writer at a time: the long session lets the one-off one run
    with client.open_session(str(repo)) as once:
        shell(once, "bash test.sh")  # (in full mode the commondir it finds is held read-only: refused)
    shell(long, "bash test.sh")
    long.close()
    user_runs_git(repo)
    assert not marker.exists()


def test_a_new_repository_anywhere_in_the_worktree_is_disarmed(client: dispatch.Client, repo: Path,
                                                              tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with client.open_session(str(repo)) as s:
        r = shell(s, f"mkdir -p deep/er && cd deep/er && git init -q && git config core.fsmonitor 'touch {marker}' "
                     "&& echo made")
        assert r.output == "made\n", r.error
    assert any("deep/er/.git/config" in p["path"] for p in s.protected), s.protected
    git(repo / "deep" / "er", "status", check=False)
    assert not marker.exists()
    assert (repo / "deep" / "er" / ".git" / "HEAD").exists()  # its history is left where it is


def test_a_worktree_inside_a_repository_gets_no_repository_of_its_own(client: dispatch.Client, repo: Path,
                                                                     tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    sub = repo / "pkg"
    sub.mkdir()
    (sub / "a.txt").write_text("a\n")
    with client.open_session(str(sub)) as s:
        r = shell(s, f"git init -q && git config core.fsmonitor 'touch {marker}' && echo made")
        assert r.output == "made\n", r.error
    git(sub, "status", check=False)
    assert not marker.exists()
    assert (sub / "a.txt").read_text() == "a\n"  # the allowed twin: the session's files are untouched


def test_a_rebase_todo_left_by_a_session_runs_nothing(client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with client.open_session(str(repo)) as s:
        r = shell(s, rebase_plant(marker))
        assert r.output == "stopped\n", (r.output, r.error)
    assert any("rebase-merge" in p["path"] for p in s.protected), s.protected
    git(repo, "rebase", "--continue", check=False)
    assert not marker.exists()


def test_includes_and_hooks_path_in_the_worktree_are_checked(client: dispatch.Client, repo: Path,
                                                            tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (repo / ".githooks").mkdir()
    hook = repo / ".githooks" / "pre-commit"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    (repo / "project.gitconfig").write_text("[alias]\n\tst = status\n")
    git(repo, "config", "core.hooksPath", ".githooks")
    git(repo, "config", "include.path", "../project.gitconfig")
    with client.open_session(str(repo)) as s:
        r = shell(s, f"printf '#!/bin/sh\\ntouch {marker}\\n' > .githooks/pre-commit && "
                     f"printf '[core]\\n\\tfsmonitor = \"touch {marker}\"\\n' > project.gitconfig && "
                     "echo src > src.txt && echo done")
        assert r.output == "done\n", r.error
    moved = {Path(p["path"]).name.split(".quarantined-by-dispatchd-")[0] for p in s.protected}
    assert {"pre-commit", "project.gitconfig"} <= moved, s.protected
    assert (repo / "src.txt").read_text() == "src\n"  # the allowed twin
    user_runs_git(repo)
    assert not marker.exists()


def test_the_users_other_tools_files_are_moved_aside(client: dispatch.Client, repo: Path) -> None:
    (repo / ".mcp.json").write_text('{"mcpServers": {}}\n')
    with client.open_session(str(repo)) as s:
        r = shell(s, "mkdir -p .vscode && echo '{}' > .vscode/tasks.json && echo 'export X=1' > .envrc && "
                     "echo '{\"mcpServers\": {\"x\": {\"command\": \"sh\"}}}' > .mcp.json && "
                     "mkdir -p lib/.claude && echo '{}' > lib/.claude/settings.json && echo code > lib/code.py && "
                     "echo done")
        assert r.output == "done\n", r.error
    names = sorted(Path(p["path"]).relative_to(repo).as_posix().split(".quarantined-by-dispatchd-")[0]
                   for p in s.protected)
    assert names == [".envrc", ".mcp.json", ".vscode", "lib/.claude"], s.protected
    assert not (repo / ".vscode").exists() and not (repo / ".envrc").exists() and not (repo / ".mcp.json").exists()
    assert (repo / "lib" / "code.py").read_text() == "code\n"  # the allowed twin


def test_a_policy_may_let_sessions_write_a_tools_file(mode_daemon: tuple[str, Daemon], repo: Path,
                                                     tmp_path: Path) -> None:
    mode, daemon = mode_daemon
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "envrc.toml").write_text('tools = ["shell_exec"]\n[protect]\npaths = [".vscode"]\n')
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies), *(["--no-user-namespaces"] if mode == "degraded" else []))
    try:
        with d.connect() as c, c.open_session(str(repo), policy="envrc") as s:
            assert shell(s, "echo 'export X=1' > .envrc && mkdir .vscode && echo x > .vscode/t").is_success
        assert (repo / ".envrc").read_text() == "export X=1\n"
        assert not (repo / ".vscode").exists()
    finally:
        d.stop()


def test_history_survives_a_hostile_linked_worktree(client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    original = git(repo, "log", "--format=%H", "main").stdout
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    with client.open_session(str(linked)) as s:
        r = shell(s, "common=$(git rev-parse --git-common-dir) && git update-ref refs/heads/main HEAD~3 && "
                     "rm -rf \"$common\"/objects/* \"$common\"/refs/*; git log main >/dev/null 2>&1 || echo destroyed")
        assert (r.output or r.error or "").startswith("destroyed\n"), (r.output, r.error)
    assert any(p["path"] == "refs/heads/main" for p in s.protected), s.protected
    assert git(repo, "log", "--format=%H", "main").stdout == original
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_objects_a_session_packed_with_git_gc_are_not_reported_deleted(client: dispatch.Client, repo: Path) -> None:
    """A session's ``git gc`` packs the loose objects and removes them: its
    end puts loose copies back (nothing a session packs can be lost that
    way) but no longer reports them as deleted by the session; nor the old
    pack (a repository already packed, as a clone is, with a commit since).
    The twin, objects deleted outright and reported, is the test above."""
    objects = repo / ".git" / "objects"
    git(repo, "gc", "-q")
    (repo / "since.txt").write_text("since\n")
    git(repo, "add", "since.txt")
    git(repo, "commit", "-qm", "since")
    loose = sorted(f.name for d in objects.iterdir() if len(d.name) == 2 for f in d.iterdir())
    assert loose and any(p.suffix == ".pack" for p in (objects / "pack").iterdir())
    with client.open_session(str(repo)) as s:
        r = shell(s, "git gc -q --prune=now && git count-objects")
        assert r.is_success and r.output.startswith("0 objects"), (r.output, r.error)
    assert not [p for p in s.protected if "objects" in p["path"]], s.protected
    assert sorted(f.name for d in objects.iterdir() if len(d.name) == 2 for f in d.iterdir()) == loose
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_a_fast_forward_of_another_branch_is_kept(client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    """The user commits on main in the main worktree while a session works
    in a linked one: their commit is kept (history only grew)."""
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    with client.open_session(str(linked)) as s:
        (repo / "f").write_text("user\n")
        git(repo, "commit", "-qam", "the user's")
        assert shell(s, f"echo x > g && git add g && {SESSION_IDENTITY} git commit -qm agent").is_success
    assert git(repo, "log", "-1", "--format=%s", "main").stdout == "the user's\n"
    assert git(repo, "log", "-1", "--format=%s", "side").stdout == "agent\n"
    # Said, not put back: a session's commit on main would look the same.
    assert [p["why"][:39] for p in s.protected if p["path"].startswith("refs/")] == [
        "moved forward while a session ran, kept"]


# A session's own pack whose index names the user's blob at another blob's
# bytes (the newest pack: git reads it first), made inside the session with
# git and python3 as an agent could; SHA-1 or SHA-256 ids by their length.
FORGE_PACK = """
import os, subprocess, sys, time
victim, other = sys.argv[1], sys.argv[2]
d = ".git/objects/pack"
out = subprocess.run(["git", "pack-objects", "-q", d + "/tmp"], input=other + "\\n", text=True,
                     capture_output=True, check=True).stdout.strip()
data = bytearray(open(f"{d}/tmp-{out}.idx", "rb").read())
h, start = len(victim) // 2, 8 + 256 * 4
data[start:start + h] = bytes.fromhex(victim)
for i in range(256):
    data[8 + i * 4:12 + i * 4] = (1 if i >= data[start] else 0).to_bytes(4, "big")
name = d + "/pack-" + "f" * len(victim)
open(name + ".idx", "wb").write(bytes(data))
os.rename(f"{d}/tmp-{out}.pack", name + ".pack")
os.unlink(f"{d}/tmp-{out}.idx")
later = time.time() + 100
os.utime(name + ".pack", (later, later))
"""


def test_a_forged_pack_in_a_sha256_repository_is_moved_aside(client: dispatch.Client, tmp_path: Path) -> None:
    """A SHA-256 repository's new packs are verified as a SHA-1 one's: the
    forged one goes, and the user's git reads the user's bytes again; the
    twin, the session's honest ``git gc`` beside it, is left unreported."""
    repo = tmp_path / "repo256"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main", "--object-format=sha256")
    for n in range(3):
        (repo / "f").write_text(f"{n}\n")
        git(repo, "add", "f")
        git(repo, "commit", "-qm", f"c{n}")
    victim = git(repo, "rev-parse", "HEAD:f").stdout.strip()
    other = git(repo, "rev-parse", "HEAD~1:f").stdout.strip()
    assert len(victim) == 64
    with client.open_session(str(repo)) as s:
        r = shell(s, f"git gc -q && python3 -c '{FORGE_PACK}' {victim} {other} && git cat-file -p {victim}")
        assert r.is_success and r.output == "1\n", (r.output, r.error)  # the control: git reads the session's bytes
    moved = [p for p in s.protected if "names your objects for other bytes" in p.get("why", "")]
    assert moved and [p for p in s.protected if "objects/pack" in p["path"]] == moved, s.protected
    assert git(repo, "cat-file", "-p", victim).stdout == "2\n"
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


# The session's edit of ``f`` staged, then the index's entry given the
# committed object id back (its stat data still the file's): git takes the
# file as unchanged.
HIDE_EDIT = """
import hashlib, subprocess, time
committed = subprocess.run(["git", "rev-parse", "HEAD:f"], capture_output=True, text=True).stdout.strip()
open("f", "w").write("BACKDOOR\\n")
time.sleep(1.1)
subprocess.run(["git", "add", "f"], check=True)
data = bytearray(open(".git/index", "rb").read())
at = data.index(b"f\\0") - 2 - 20
data[at:at + 20] = bytes.fromhex(committed)
data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
open(".git/index", "wb").write(bytes(data))
print(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout, end="")
"""


def test_an_index_hiding_a_session_s_edit_shows_it_after_the_end(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as s:
        r = shell(s, f"python3 -c '{HIDE_EDIT}'")
        assert r.is_success and r.output == "", (r.output, r.error)  # the control: git says clean
    assert (repo / "f").read_text() == "BACKDOOR\n"
    assert git(repo, "status", "--porcelain").stdout == " M f\n"
    assert "+BACKDOOR" in git(repo, "diff").stdout
    assert [p["path"] for p in s.protected if "their entries reset" in p["why"]] == [str(repo / ".git" / "index")]


def test_an_honest_commit_s_index_says_nothing(client: dispatch.Client, repo: Path) -> None:
    """The twin: a session's add and commit; nothing said, the user's git shows it."""
    with client.open_session(str(repo)) as s:
        r = shell(s, f"echo more >> f && git add f && {SESSION_IDENTITY} git commit -qm agent && git status --porcelain")
        assert r.is_success and r.output == "", (r.output, r.error)
    assert not [p for p in s.protected if "index" in p["path"]], s.protected
    assert git(repo, "status", "--porcelain").stdout == "" and git(repo, "log", "-1", "--format=%s").stdout == "agent\n"


def test_a_merge_head_left_by_a_session_is_moved_aside(client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    """``MERGE_HEAD`` makes the user's next ``git commit`` a merge that takes
    the named commit, history and all, as a parent (here the only one: git
    drops the user's, an ancestor of it). The control: the same plant made
    by hand does; after a session's, the user's commit does not."""
    plant = (f"git checkout -q -b side && echo s > s && git add s && {SESSION_IDENTITY} git commit -qm side && "
             f"git checkout -q main && git rev-parse side > .git/MERGE_HEAD")
    control = tmp_path / "control"
    shutil.copytree(repo, control, symlinks=True)
    subprocess.run(["bash", "-c", plant], cwd=control, check=True, env={**os.environ, **IDENTITY})

    def users_commit_takes_side(r: Path) -> bool:
        (r / "u").write_text("the user's\n")
        git(r, "add", "u")
        git(r, "commit", "-qm", "the user's")
        return git(r, "merge-base", "--is-ancestor", "side", "HEAD", check=False).returncode == 0

    assert users_commit_takes_side(control)  # the control
    with client.open_session(str(repo)) as s:
        assert shell(s, plant).is_success
    assert any("MERGE_HEAD.quarantined-by-dispatchd-" in p["path"] for p in s.protected), s.protected
    assert not users_commit_takes_side(repo)


def _linked_with_submodule(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A repository with a submodule, a linked worktree of it where the
    submodule is checked out (its git directory then is the linked
    worktree's own: ``.git/worktrees/linked/modules/sub``), and that
    git directory."""
    src = tmp_path / "sub-src"
    src.mkdir(parents=True)
    git(src, "init", "-q", "-b", "main")
    git(src, "commit", "-q", "--allow-empty", "-m", "sub")
    main = tmp_path / "main"
    main.mkdir()
    git(main, "init", "-q", "-b", "main")
    git(main, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(src), "sub")
    git(main, "commit", "-qm", "with sub")
    linked = tmp_path / "linked"
    git(main, "worktree", "add", "-q", str(linked), "-b", "side")
    git(linked, "-c", "protocol.file.allow=always", "submodule", "update", "-q", "--init")
    moddir = main / ".git" / "worktrees" / "linked" / "modules" / "sub"
    assert (moddir / "config").is_file()
    return main, linked, moddir


def _held_in_full_mode(mode: str, r: dispatch.Result, full_error: str) -> None:
    """A write the read-only binds refuse in full mode (with ``full_error``)
    and degraded mode lets through (the end then deals with it)."""
    assert r.is_success == (mode == "degraded"), (r.output, r.error)
    if mode == "full":
        assert full_error in str(r.error), r


def _controlled(tmp_path: Path, marker: Path, plant: Callable[[Path, Path, Path], str],
                probe: Callable[[Path, Path], Path]) -> tuple[Path, Path, Path]:
    """The control: ``plant`` (a shell script, given main, linked and the
    submodule's git directory) made by hand on a repository of its own
    makes the user's `git status` (in ``probe(main, linked)``) run the
    command; then a fresh repository for the attack: (main, linked, moddir)."""
    main, linked, moddir = _linked_with_submodule(tmp_path / "control")
    subprocess.run(["bash", "-c", plant(main, linked, moddir)], check=True, capture_output=True, cwd=linked)
    git(probe(main, linked), "status", check=False)
    assert marker.exists()  # the control
    marker.unlink()
    return _linked_with_submodule(tmp_path / "attack")


@pytest.mark.parametrize("second", [False, True])
def test_a_submodule_git_directory_rebuilt_with_a_symlinked_head_runs_nothing(mode_daemon: tuple[str, Daemon],
                                                                             tmp_path: Path, second: bool) -> None:
    """A session on a linked worktree rebuilds its submodule's git directory
    (`.git/worktrees/N/modules/sub`: moved away, copied back, the binds go
    with the old one) with `HEAD` a symlink, which git takes, and
    `core.fsmonitor` in its config; ``second``: a session on the main
    worktree opens after it. The check had walked only directories with a
    regular `HEAD`: the rebuilt one dropped out of the linked part's look,
    and the main part, which saw it, left it to the linked part. The
    control: the same plant by hand runs in the user's `git status`."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    plant = ("cd {m}/.. && mv sub sub.old && cp -a sub.old sub && cd sub && "
             "git rev-parse HEAD > refs/heads/x 2>/dev/null || cp ../sub.old/HEAD refs/heads/x; "
             "cd {m} && rm HEAD && ln -s refs/heads/x HEAD && "
             "printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' >> config && echo PLANTED")
    main, linked, moddir = _controlled(tmp_path, marker, lambda m, l, d: plant.format(m=d, marker=marker),
                                       lambda m, l: l / "sub")
    with daemon.connect() as c:
        s = c.open_session(str(linked))
        r = shell(s, plant.format(m=moddir, marker=marker))
        assert r.is_success and "PLANTED" in r.output, (r.output, r.error)
        t = c.open_session(str(main)) if second else None
        s.close()
        if t is not None:
            t.close()
    git(linked / "sub", "status", check=False)
    assert not marker.exists(), (s.protected, t.protected if t else None)


@pytest.mark.parametrize("link", ["modules/sub", "modules"])
def test_a_submodule_git_directory_behind_a_symlink_is_moved_aside_at_once(mode_daemon: tuple[str, Daemon],
                                                                           tmp_path: Path, link: str) -> None:
    """A session on a linked worktree copies its submodule's git directory
    aside with `core.fsmonitor` in the copy's config, and puts a symlink at
    `.git/worktrees/N/modules/sub` (or at `modules`) to a directory whose
    `commondir` leads there; a session on the main worktree runs on. The
    linked session's own end moves the symlink aside (before: only the
    domain's last end's sweep did, and the user's `git status` in the linked
    worktree ran the command meanwhile). The control: the plant by hand runs."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    entry = "{m}/../.."
    plant = ("cd {e} && cp -a modules/sub xe && printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' >> xe/config"
             " && mkdir -p xl/sub && cp modules/sub/HEAD modules/sub/index xl/sub/ 2>/dev/null; "
             "echo ../../xe > xl/sub/commondir && " +
             ("mv modules/sub sub.orig && ln -s ../xl/sub modules/sub" if link == "modules/sub" else
              "mv modules modules.orig && ln -s xl modules") + " && echo PLANTED")
    main, linked, moddir = _controlled(tmp_path, marker,
                                       lambda m, l, d: plant.format(e=entry.format(m=d), marker=marker),
                                       lambda m, l: l / "sub")
    with daemon.connect() as c:
        m = c.open_session(str(main))
        s = c.open_session(str(linked))
        r = shell(s, plant.format(e=entry.format(m=moddir), marker=marker))
        assert r.is_success and "PLANTED" in r.output, (r.output, r.error)
        s.close()
        git(linked / "sub", "status", check=False)  # while the main worktree's session still runs
        assert not marker.exists(), s.protected
        m.close()
    git(linked / "sub", "status", check=False)
    assert not marker.exists()


def test_a_symlinked_logs_grants_no_later_linked_session_the_repository(mode_daemon: tuple[str, Daemon],
                                                                         tmp_path: Path) -> None:
    """A session on the main worktree makes `.git/logs` a symlink to `.git`
    itself. A linked worktree's session is granted `logs` writable (its
    reflogs): the grant had followed the symlink, and a later session on the
    linked worktree wrote the repository's config (`core.fsmonitor`), which
    the user's `git status` ran. The end moves the symlink aside, and a
    linked worktree's open refuses one (its git directory not granted). The
    twin: with `logs` a directory, the linked session cannot write the config
    (EROFS in full mode, EACCES in degraded)."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    main, linked, _ = _linked_with_submodule(tmp_path / "repo")
    write_config = (f"printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' >> {main}/.git/config "
                    "&& echo WROTE")
    with daemon.connect() as c:
        with c.open_session(str(linked)) as s:  # the twin: logs a directory
            r = shell(s, write_config)
            assert not r.is_success and ("Read-only file system" if mode == "full" else "Permission denied") in \
                str(r.error), r
        with c.open_session(str(main)) as a:
            assert shell(a, "rm -rf .git/logs && ln -s . .git/logs && echo LINKED").output == "LINKED\n"
        assert any(p["path"] == f"{main}/.git/logs" and "not a directory" in p["why"] for p in a.protected), \
            a.protected
        shutil.rmtree(main / ".git" / "logs")  # the user's reflogs, put back by the end: out of the plant's way
        os.symlink(".", main / ".git" / "logs.tmp")  # the same by anyone: the open refuses it
        os.replace(main / ".git" / "logs.tmp", main / ".git" / "logs")
        with c.open_session(str(linked)) as s:
            r = shell(s, write_config)
            assert not r.is_success, r
            assert "is not a directory (a symlink?); not granted" in s.status()["protections"]["git"]["note"]
    git(main, "status", check=False)
    assert not marker.exists()


def test_a_hard_link_of_the_repositorys_config_grants_no_linked_session_a_write(mode_daemon: tuple[str, Daemon],
                                                                                 tmp_path: Path) -> None:
    """A session on the main worktree hard-links `.git/config` into
    `.git/logs` (degraded mode; full mode: EXDEV, the config a mount of its
    own): the content unchanged, nothing differed at its end, and a later
    linked worktree's session, granted `logs` writable, wrote the config
    through the link (`core.fsmonitor`, run by the user's `git status`).
    Now the end makes the config a file of its own, and a linked open
    refuses a common directory whose config has another link (one made by
    hand here). The twin: the linked session's write through the left-over
    name changes only that file."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    main, linked, _ = _linked_with_submodule(tmp_path / "repo")
    config = main / ".git" / "config"
    before = config.read_bytes()
    plant = (f"printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' >> {main}/.git/logs/cfg "
             "&& echo WROTE")
    with daemon.connect() as c:
        with c.open_session(str(main)) as a:
            r = shell(a, "ln .git/config .git/logs/cfg && echo LINKED")
            assert r.is_success == (mode == "degraded"), (r.output, r.error)
            if mode == "full":
                assert "Invalid cross-device link" in str(r.error), r
        if mode == "degraded":
            # The name in logs, where a linked session writes, made a file of its own.
            assert [(p["path"], p["why"]) for p in a.protected] == [(str(main / ".git" / "logs" / "cfg"), AREA)], \
                a.protected
            assert config.stat().st_nlink == 1
            with c.open_session(str(linked)) as s:  # the twin: the left-over name is a file of its own now
                assert shell(s, plant).output == "WROTE\n"
        assert config.read_bytes() == before
        (main / ".git" / "logs" / "cfg").unlink(missing_ok=True)
        os.link(config, main / ".git" / "logs" / "cfg")  # the same by anyone: the open refuses it
        with c.open_session(str(linked)) as s:
            assert "has another hard link" in s.status()["protections"]["git"]["note"]
            assert not shell(s, plant).is_success
    (main / ".git" / "logs" / "cfg").unlink()
    git(main, "status", check=False)
    assert not marker.exists() and config.read_bytes() == before


def _hooks_path_repo(main: Path, linked: Path, ran: Path) -> Path:
    """A repository at ``main`` whose ``core.hooksPath`` is ``.git/myhooks``,
    its pre-commit (mode 0750) touching ``ran``, with a linked worktree at
    ``linked``; returns the hook."""
    main.mkdir(parents=True)
    git(main, "init", "-q", "-b", "main")
    git(main, "commit", "-q", "--allow-empty", "-m", "init")
    hook = main / ".git" / "myhooks" / "pre-commit"
    hook.parent.mkdir()
    hook.write_text(f"#!/bin/sh\ntouch {ran}\n")
    hook.chmod(0o750)
    git(main, "config", "core.hooksPath", ".git/myhooks")
    git(main, "worktree", "add", "-q", str(linked), "-b", "side")
    return hook


@pytest.mark.parametrize("where", ["own", "nested"])
def test_a_hard_link_of_a_hooks_path_hook_grants_no_linked_session_a_write(mode_daemon: tuple[str, Daemon],
                                                                           tmp_path: Path, where: str) -> None:
    """``core.hooksPath = .git/myhooks``: a session hard-links the user's
    pre-commit into ``.git/logs``, its bytes unchanged: ``own``, a session on
    the repository (full mode: EXDEV, the hooks path a mount of its own);
    ``nested``, a session on an outer worktree holding the repository as a
    clone (which holds nothing of it read-only). A later session of the
    repository's linked worktree, granted ``logs`` writable, wrote the hook
    through the link, and the user's next commit ran it: the ends made only
    ``config`` and ``hooks/*`` files of their own, and the linked open
    refused only where those had another link. Now the end makes the hook
    a file of its own, saying so, and a linked open refuses while it has
    another link (one made by hand here). The twin: the linked session's
    write through the left-over name changes only that file. The control:
    the link and the write by hand run at the user's commit."""
    mode, daemon = mode_daemon
    marker, ran = tmp_path / "PWNED", tmp_path / "users-hook-ran"
    real = Path(os.path.realpath(tmp_path))
    plant = f"#!/bin/sh\\ntouch {marker}\\n"
    main = real / "control"
    hook = _hooks_path_repo(main, real / "control-linked", ran)
    os.link(hook, main / ".git" / "logs" / "hk")
    subprocess.run(["bash", "-c", f"printf '{plant}' > {main}/.git/logs/hk"], check=True)
    git(main, "commit", "-q", "--allow-empty", "-m", "user")
    assert marker.exists()  # the control
    marker.unlink()
    top = real / "outer"
    top.mkdir()
    git(top, "init", "-q", "-b", "main")
    (top / ".git" / "info" / "exclude").write_text("inner/\n")
    main = top / "inner" if where == "nested" else real / "main"
    linked = real / "linked"
    hook = _hooks_path_repo(main, linked, ran)
    users = hook.read_bytes()
    link = main / ".git" / "logs" / "hk"
    write = f"printf '{plant}' > {link} && echo WROTE"
    with daemon.connect() as c:
        with c.open_session(str(top if where == "nested" else main)) as a:
            r = shell(a, f"ln {hook} {link} && echo LINKED")
        if where == "own" and mode == "full":
            assert not r.is_success and "Invalid cross-device link" in str(r.error), r
        else:
            assert r.output == "LINKED\n", (r.output, r.error)
            said = {p["path"]: p["why"] for p in a.protected}  # own: the name in logs split; nested: the hook
            assert said == ({str(link): AREA} if where == "own" else {str(hook): SPLIT}), a.protected
            assert hook.stat().st_nlink == 1 and link.stat().st_nlink == 1
            with c.open_session(str(linked)) as s:  # the twin: the left-over name is a file of its own now
                assert shell(s, write).output == "WROTE\n"
            assert str(marker) in link.read_text()
        assert hook.read_bytes() == users
        link.unlink(missing_ok=True)
        os.link(hook, link)  # the same by anyone: the open refuses it
        with c.open_session(str(linked)) as s:
            assert s.status()["protections"]["git"]["note"] == (
                f"{link} has another hard link (a name elsewhere for the same file, which a write through would "
                f"change); not granted{NEXT_END}")
            assert not shell(s, write).is_success
    link.unlink()
    git(main, "commit", "-q", "--allow-empty", "-m", "user")
    assert hook.read_bytes() == users and hook.stat().st_mode & 0o7777 == 0o750
    assert ran.exists() and not marker.exists()


SPLIT = ("had 1 other hard link(s), more than at the session start, a way to write it from where a session could; "
         "made a file of its own (the other names keep the old one)")
AREA = ("had 1 other hard link(s), a name a linked worktree's session could write them through; made a file of its "
        "own (the other names keep the old one)")
NEXT_END = " (the next end of a session on the main worktree makes this name a file of its own)"


def _clone_beside(real: Path, where: str, files: dict[str, bytes]) -> tuple[Path, Path, Path]:
    """An outer repository at ``real/outer`` (ignoring ``inner/``) and a
    repository holding ``files`` (a ``.githooks/pre-commit`` among them made
    executable, ``core.hooksPath = .githooks``, ``.envrc`` ignored): the
    outer's clone ``inner`` (``nested``) or ``real/main`` (``own``), with a
    linked worktree at ``real/linked``. Returns (the outer, the repository,
    the linked worktree)."""
    top = real / "outer"
    top.mkdir()
    git(top, "init", "-q", "-b", "main")
    (top / ".git" / "info" / "exclude").write_text("inner/\n")
    main = top / "inner" if where == "nested" else real / "main"
    main.mkdir()
    git(main, "init", "-q", "-b", "main")
    (main / ".gitignore").write_text(".envrc\n")
    for name, data in files.items():
        (main / name).parent.mkdir(parents=True, exist_ok=True)
        (main / name).write_bytes(data)
    (main / ".githooks" / "pre-commit").chmod(0o755)
    git(main, "add", "-A")
    git(main, "commit", "-qm", "init")
    git(main, "config", "core.hooksPath", ".githooks")
    git(main, "worktree", "add", "-q", str(real / "linked"), "-b", "side")
    return top, main, real / "linked"


@pytest.mark.parametrize("where", ["own", "nested"])
@pytest.mark.parametrize("size", [1024, 300 * 1024])
def test_a_big_hook_beside_the_code_linked_into_logs_grants_no_linked_session_a_write(
        mode_daemon: tuple[str, Daemon], tmp_path: Path, size: int, where: str) -> None:
    """A hook of a hooks path beside the code (``.githooks``) bigger than
    ``keptfiles.MAX_FILE`` (a compiled one), hard-linked into ``.git/logs``
    by a session (``own``, degraded mode: full mode refuses the link,
    EXDEV; ``nested``, a session on an outer worktree holding the
    repository as a clone): the end read only files within the bound and
    left it linked, said nowhere, and the linked open looked at the common
    directory alone, so the linked worktree's session wrote the main
    worktree's hook and the user's next commit ran it. Now the end streams
    a copy into a file of its own, saying so: the name in ``logs`` (own:
    the repository's end walks its ``logs``), or the hook (nested: the
    outer's end does not). The twin: a 1 KiB hook, the same;
    the linked session's write changes only the left-over name."""
    mode, daemon = mode_daemon
    real = Path(os.path.realpath(tmp_path))
    marker = real / "PWNED"
    top, main, linked = _clone_beside(real, where, {".githooks/pre-commit": b"#!/bin/sh\nexit 0\n" + b"#" * size})
    hook = main / ".githooks" / "pre-commit"
    users = hook.read_bytes()
    link = main / ".git" / "logs" / "hk"
    with daemon.connect() as c:
        with c.open_session(str(top if where == "nested" else main)) as a:
            r = shell(a, f"ln {hook} {link} && echo LINKED")
        if where == "own" and mode == "full":
            assert not r.is_success and "Invalid cross-device link" in str(r.error), r
            return
        assert r.output == "LINKED\n", (r.output, r.error)
        said = {str(link): AREA} if where == "own" else {str(hook): SPLIT}
        assert {p["path"]: p["why"] for p in a.protected} == said, a.protected
        assert hook.stat().st_nlink == 1 and link.stat().st_nlink == 1
        with c.open_session(str(linked)) as s:
            r = shell(s, f"printf '#!/bin/sh\\ntouch {marker}\\n' > {link} && echo WROTE")
            assert r.output == "WROTE\n", (r.output, r.error)
    git(main, "commit", "-q", "--allow-empty", "-m", "user's")
    assert not marker.exists() and hook.read_bytes() == users


@pytest.mark.parametrize("name", [".envrc", ".githooks/pre-commit", "main.c"])
def test_any_file_of_the_main_worktree_linked_into_logs_grants_no_linked_session_a_write(
        mode_daemon: tuple[str, Daemon], tmp_path: Path, name: str) -> None:
    """A session on an outer worktree (full mode too: it holds nothing of
    the clone) links a file of the clone it holds into the clone's
    ``.git/logs``: an ignored ``.envrc`` (direnv's: the user's shell runs
    it), which git neither runs nor reads, so the end's split passed it by,
    and a later session of the clone's linked worktree wrote it through
    ``logs``, which no end of that session looks at. Now the end makes
    every file the user's tools run a file of its own, saying so, and a
    linked open refuses while any file in ``logs`` or ``refs`` has another
    link (git never makes one there): a code file (``main.c``), which no end
    splits, refuses it. The twins: the hook of the clone's hooks path, split
    as before; the left-over name, written, changes nothing of the user's."""
    mode, daemon = mode_daemon
    real = Path(os.path.realpath(tmp_path))
    files = {".githooks/pre-commit": b"#!/bin/sh\nexit 0\n", ".envrc": b"export A=1\n",
             "main.c": b"int main(void) { return 0; }\n"}
    top, main, linked = _clone_beside(real, "nested", files)
    target, link = main / name, main / ".git" / "logs" / "hk"
    write = f"echo 'touch {real}/PWNED' >> {link} && echo WROTE"
    with daemon.connect() as c:
        with c.open_session(str(top)) as a:
            assert shell(a, f"ln {target} {link} && echo LINKED").output == "LINKED\n"
        with c.open_session(str(linked)) as s:
            if name == "main.c":
                assert a.protected == []
                assert s.status()["protections"]["git"]["note"] == (
                    f"{link} has another hard link (a name elsewhere for the same file, which a write through would "
                    f"change); not granted{NEXT_END}")
                assert not shell(s, write).is_success
            else:
                assert {p["path"]: p["why"] for p in a.protected} == {str(target): SPLIT}, a.protected
                assert shell(s, write).output == "WROTE\n"
    assert target.read_bytes() == files[name], mode


def test_a_linked_worktrees_git_file_made_a_repository_runs_nothing(mode_daemon: tuple[str, Daemon],
                                                                    tmp_path: Path) -> None:
    """A session on a linked worktree replaces its `.git` file with a
    repository of its own (`git init`) whose config names a command. Full
    mode: the file is held (EBUSY). Degraded mode: the directory is moved
    aside at the end (before: a directory there was taken for nothing to
    judge). The control: the same by hand runs in the user's `git status`."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    plant = f"rm .git && git init -q . && git config core.fsmonitor 'touch {marker}; false' && echo PLANTED"
    main, linked, _ = _controlled(tmp_path, marker, lambda m, l, d: plant, lambda m, l: l)
    with daemon.connect() as c, c.open_session(str(linked)) as s:
        r = shell(s, plant)
        assert r.is_success == (mode == "degraded"), (r.output, r.error)
    if mode == "degraded":
        assert any(p["path"].startswith(f"{linked}/.git.quarantined-by-dispatchd-") for p in s.protected), s.protected
    git(linked, "status", check=False)
    assert not marker.exists()


def _hook_and_controlled_config(repo: Path, marker: Path, hook_text: str) -> tuple[Path, Path, bytes]:
    """The user's pre-commit hook (``hook_text``, mode 0750) in ``repo``, and
    the control: its config given ``core.fsmonitor`` by hand makes the
    user's ``git status`` touch ``marker``; the config then set back.
    Returns the hook, the config and the config's bytes."""
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text(hook_text)
    hook.chmod(0o750)
    config = repo / ".git" / "config"
    original = config.read_bytes()
    config.write_text(fsmonitor_config(marker))
    git(repo, "status", check=False)
    assert marker.exists()  # the control
    marker.unlink()
    config.write_bytes(original)
    return hook, config, original


def test_the_users_config_and_hook_stay_theirs_after_a_session_rewrote_them(mode_daemon: tuple[str, Daemon],
                                                                          repo: Path, tmp_path: Path) -> None:
    """A session rewrites ``.git/config`` (``core.fsmonitor``) and deletes the
    user's pre-commit hook. Full mode: held read-only (EROFS).
    Degraded mode: written; the end moves the session's config aside and
    puts the user's config and hook back, byte for byte, the hook's mode
    with it: the user's git runs nothing of the session's, keeps their
    settings, and their own hook runs at their next commit. The control: the
    same config by hand runs."""
    mode, daemon = mode_daemon
    marker, hook_ran = tmp_path / "PWNED", tmp_path / "hook-ran"
    git(repo, "config", "user.email", "me@example.invalid")
    hook, config, original = _hook_and_controlled_config(repo, marker, f"#!/bin/sh\ntouch {hook_ran}\n")
    with daemon.connect() as c, c.open_session(str(repo)) as s:
        plant = f"printf '{fsmonitor_config(marker)}' > .git/config && rm .git/hooks/pre-commit && echo WROTE"
        _held_in_full_mode(mode, shell(s, plant), ".git/config: Read-only file system")
    if mode == "degraded":
        put = {p["path"]: p["why"] for p in s.protected if "put back" in p["why"]}
        assert put == {str(config): "yours, as it was before the session changed it, put back",
                       str(hook): "yours, as it was before the session deleted it, put back"}, s.protected
        [aside] = [p for p in config.parent.iterdir() if p.name.startswith("config.quarantined-by-dispatchd-")]
        assert "fsmonitor" in aside.read_text()  # the session's, beside, for review
    assert config.read_bytes() == original
    assert hook.stat().st_mode & 0o7777 == 0o750
    user_runs_git(repo)
    assert not marker.exists() and hook_ran.exists()
    assert git(repo, "config", "user.email").stdout == "me@example.invalid\n"


@pytest.mark.parametrize("where", [".git/myhooks", ".githooks"])
def test_the_users_hooks_of_a_hooks_path_stay_theirs_after_a_session_rewrote_them(
        mode_daemon: tuple[str, Daemon], repo: Path, tmp_path: Path, where: str) -> None:
    """``core.hooksPath`` names a directory in the worktree. In ``.git``, full
    mode: held read-only as ``.git/hooks`` is (EROFS). Otherwise (tracked
    beside the code, or degraded mode) a session rewrites the user's
    pre-commit and deletes their pre-push: the end keeps the session's aside
    and puts the user's back, byte for byte, with their modes, and says so;
    before, the user's bytes were gone and the deleted hook unnamed. The
    control: the session's plant, there at the user's commit, runs."""
    mode, daemon = mode_daemon
    marker, ran = tmp_path / "PWNED", tmp_path / "users-hook-ran"
    hooks = repo / where
    hooks.mkdir()
    users = {"pre-commit": f"#!/bin/sh\ntouch {ran}\n", "pre-push": "#!/bin/sh\n# the user's checks\n"}
    for name, text in users.items():
        (hooks / name).write_text(text)
        (hooks / name).chmod(0o750)
    git(repo, "config", "core.hooksPath", where)
    held = mode == "full" and where.startswith(".git/")
    plant = f"printf '#!/bin/sh\\ntouch {marker}\\n' > {where}/pre-commit && rm {where}/pre-push && echo WROTE"
    with daemon.connect() as c, c.open_session(str(repo)) as s:
        r = shell(s, plant)
        if held:
            assert not r.is_success and f"{where}/pre-commit: Read-only file system" in str(r.error), r
        else:
            assert r.is_success and r.output == "WROTE\n", (r.output, r.error)
            git(repo, "commit", "--allow-empty", "-qm", "while the session runs")
            assert marker.exists()  # the control: the plant is what the user's git runs
            marker.unlink()
    put = {p["path"]: p["why"] for p in s.protected if "put back" in p["why"]}
    assert put == ({} if held else {
        str(hooks / "pre-commit"): "yours, as it was before the session changed it, put back",
        str(hooks / "pre-push"): "yours, as it was before the session deleted it, put back"}), s.protected
    asides = [p for p in hooks.iterdir() if p.name.startswith("pre-commit.quarantined-by-dispatchd-")]
    assert [str(marker) in p.read_text() for p in asides] == ([] if held else [True])  # the session's, for review
    for name, text in users.items():
        assert (hooks / name).read_text() == text and (hooks / name).stat().st_mode & 0o7777 == 0o750
    user_runs_git(repo)
    assert ran.exists() and not marker.exists()


@pytest.mark.parametrize("where", ["outer", "inner-beside-outer"])
def test_a_nested_repositorys_config_and_hook_come_back_after_a_session_rewrote_them(
        mode_daemon: tuple[str, Daemon], repo: Path, tmp_path: Path, where: str) -> None:
    """A repository of the user's inside the worktree (``inner``, a clone the
    outer repository ignores). A session rewrites its ``.git/config``
    (``core.fsmonitor``) and deletes its pre-commit hook: from a session on
    the outer worktree (which holds nothing of ``inner`` read-only), or from
    a session on ``inner`` opened while one on the outer worktree reads
    (its baseline is the outer's: full mode holds ``inner``'s config
    read-only, degraded mode does not). The end keeps the session's config
    aside and puts the user's config and hook back; before, the config was
    only moved aside, the user's remote and identity gone with it, and the
    hook gone. The control: the plant, by hand, runs in the user's git."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    (repo / ".git" / "info" / "exclude").write_text("inner/\n")
    inner = repo / "inner"
    inner.mkdir()
    git(inner, "init", "-q", "-b", "trunk")
    git(inner, "commit", "--allow-empty", "-qm", "inner")
    git(inner, "remote", "add", "origin", "https://example.invalid/users-remote.git")
    hook, config, original = _hook_and_controlled_config(inner, marker, "#!/bin/sh\n# the user's checks\n")
    plant = f"printf '{fsmonitor_config(marker)}' > .git/config && rm .git/hooks/pre-commit && echo WROTE"
    held = mode == "full" and where == "inner-beside-outer"
    with daemon.connect() as c, c.open_session(str(repo)) as outer:
        if where == "outer":
            r = shell(outer, f"cd inner && {plant}")
        else:
            with c.open_session(str(inner)) as s:
                r = shell(s, plant)
        if held:
            assert not r.is_success and ".git/config: Read-only file system" in str(r.error), r
        else:
            assert r.is_success and r.output == "WROTE\n", (r.output, r.error)
    said = {p["path"]: p["why"] for p in outer.protected + (s.protected if where != "outer" else [])}
    if not held:
        assert said[str(config)] == "yours, as it was before the session changed it, put back", said
        assert said[str(hook)] == "yours, as it was before the session deleted it, put back", said
        [aside] = [p for p in config.parent.iterdir() if p.name.startswith("config.quarantined-by-dispatchd-")]
        assert "fsmonitor" in aside.read_text()  # the session's, beside, for review
    assert config.read_bytes() == original and hook.stat().st_mode & 0o7777 == 0o750
    git(inner, "status", check=False)
    assert not marker.exists()
    assert git(inner, "remote", "get-url", "origin").stdout == "https://example.invalid/users-remote.git\n"


def test_a_linked_worktrees_submodule_config_a_session_wrote_runs_nothing(mode_daemon: tuple[str, Daemon],
                                                                         tmp_path: Path) -> None:
    """A linked worktree keeps its submodules' git directories below its
    own entry (``.git/worktrees/N/modules``), outside the worktree: a
    session there wrote ``core.fsmonitor`` into one, and the user's ``git
    status`` in the linked worktree ran it. Full mode: held read-only (a
    file bind: EBUSY when git renames its lock over it); degraded mode:
    written, and the end moves the submodule's git directory aside. The
    control: the same plant by hand runs."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    main, linked, moddir = _linked_with_submodule(tmp_path / "control")
    git(linked / "sub", "config", "core.fsmonitor", f"touch {marker}; false")
    git(linked, "status", check=False)
    assert marker.exists()  # the control
    marker.unlink()
    main, linked, moddir = _linked_with_submodule(tmp_path / "attack")
    with daemon.connect() as c, c.open_session(str(linked)) as s:
        plant = f"cd sub && git config core.fsmonitor 'touch {marker}; false' && echo WROTE"
        _held_in_full_mode(mode, shell(s, plant), "config: Device or resource busy")
    if mode == "degraded":
        assert any("modules/sub" in p["path"] for p in s.protected), s.protected
    git(linked, "status", check=False)
    assert not marker.exists()


def test_a_linked_worktrees_submodule_config_from_the_main_worktree(mode_daemon: tuple[str, Daemon],
                                                                   tmp_path: Path) -> None:
    """The same git directory written from a session on the main worktree:
    full mode holds ``.git/worktrees`` read-only (EROFS); degraded mode
    cannot, and the end moves the config aside."""
    mode, daemon = mode_daemon
    marker = tmp_path / "PWNED"
    main, linked, moddir = _linked_with_submodule(tmp_path)
    with daemon.connect() as c, c.open_session(str(main)) as s:
        r = shell(s, f"git config -f .git/worktrees/linked/modules/sub/config core.fsmonitor 'touch {marker}; false'")
        assert r.is_success == (mode == "degraded"), (r.output, r.error)
        if mode == "full":  # held: a read-only bind (a file one: EBUSY when git renames its lock over it)
            assert "config: Device or resource busy" in str(r.error), r
    if mode == "degraded":  # the submodule's git directory changed: moved aside whole, as below .git/modules
        assert any("worktrees/linked/modules/sub" in p["path"] for p in s.protected), s.protected
    git(linked, "status", check=False)
    assert not marker.exists()


# --- a daemon killed half way -------------------------------------------------------------------


def _daemon(base: Path, mode: str, state: Path) -> Daemon:
    base.mkdir(parents=True, exist_ok=True)
    return Daemon(base, *(["--no-user-namespaces"] if mode == "degraded" else []), state=state)


@pytest.mark.parametrize("mode", MODES)
def test_a_plant_survives_no_sigkill_of_the_daemon(mode: str, repo: Path, tmp_path: Path) -> None:
    _refuse_root()
    marker = tmp_path / "ran"
    state = tmp_path / "state"
    d = _daemon(tmp_path / "d1", mode, state)
    with d.connect() as c:
        s = c.open_session(str(repo), detached=True)
        assert shell(s, plant_commondir(repo, marker)).is_success
        assert shell(s, f"mkdir -p n && cd n && git init -q && git config core.fsmonitor 'touch {marker}'").is_success
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        s.detach()  # the handle's channel: its daemon is gone
    d.stop()
    assert (repo / ".git" / "commondir").exists()  # nothing checked yet
    d2 = _daemon(tmp_path / "d2", mode, state)
    try:
        with d2.connect() as c:
            recovered = c.status()["protected"]
            assert any(p["path"].endswith("commondir") or ".git/commondir" in p["path"] for p in recovered), recovered
            assert any("n/.git/config" in p["path"] for p in recovered), recovered
            with c.open_session(str(repo)) as s:  # the worktree opens again
                assert shell(s, "true").is_success
    finally:
        assert d2.stop() == 0, d2.log()
    user_runs_git(repo)
    git(repo / "n", "status", check=False)
    assert not marker.exists()


def test_randomized_interleaving_with_daemon_kills(repo: Path, tmp_path: Path) -> None:
    """Sessions on one worktree open, plant, re-plant and close in a random
    order while the daemon is killed and restarted at random points."""
    _refuse_root()
    seed = int(os.environ.get("DISPATCH_INTERLEAVE_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    marker = tmp_path / "ran"
    state = tmp_path / "state"
    plants = [plant_commondir(repo, marker),
              f"mkdir -p r{rng.randrange(9)} && cd r* && git init -q 2>/dev/null; git config core.fsmonitor 'touch {marker}'",
              f"printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/post-commit 2>/dev/null; chmod +x .git/hooks/post-commit",
              rebase_plant(marker)]
    original = git(repo, "log", "--format=%H", "main").stdout
    n = 0
    d = _daemon(tmp_path / f"d{n}", "full", state)
    client = d.connect()
    open_: list[dispatch.Session] = []
    try:
        for _ in range(14):
            step = rng.choice(["open", "open", "plant", "plant", "close", "kill"])
            if step == "open" and len(open_) < 3:
                open_.append(client.open_session(str(repo), detached=True))
            elif step == "plant" and open_:
                shell(rng.choice(open_), rng.choice(plants))
            elif step == "close" and open_:
                open_.pop(rng.randrange(len(open_))).close()
            elif step == "kill":
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait()
                d.stop()
                for s in open_:
                    s.detach()
                client.close()
                open_ = []
                n += 1
                d = _daemon(tmp_path / f"d{n}", "full", state)
                client = d.connect()
        for s in open_:
            s.close()
    finally:
        client.close()
        assert d.stop() == 0, d.log()
    user_runs_git(repo)
    for sub in repo.glob("r*"):
        git(sub, "status", check=False)
    assert not marker.exists(), f"seed {seed}"
    assert original in git(repo, "log", "--format=%H", "main").stdout + original, f"seed {seed}"
    assert set(original.split()) <= set(git(repo, "log", "--format=%H", "--all").stdout.split()), f"seed {seed}"


# --- walks a session cannot break ------------------------------------------------------------


def test_deep_trees_and_many_links_do_not_break_the_checks(client: dispatch.Client, repo: Path) -> None:
    with client.open_session(str(repo)) as s:
        # One process makes it all (a process a directory and a link took
        # minutes on a loaded machine): 600 levels deep, made a level at a
        # time (the whole path is longer than PATH_MAX), and 2,000 hard
        # links to one file of 16 MiB.
        r = shell(s, """python3 - <<'EOF'
import os
top = os.getcwd()
os.makedirs(".git/modules/x/hooks", exist_ok=True)
for name in ("objects", "refs"):
    os.makedirs(f".git/modules/x/{name}", exist_ok=True)
with open(".git/modules/x/HEAD", "w") as f:
    f.write("ref: refs/heads/m\\n")
with open(".git/modules/x/hooks/big", "wb") as f:
    f.write(bytes(16 * 2**20))
for i in range(1, 2001):
    os.link(".git/modules/x/hooks/big", f".git/modules/x/hooks/h{i}")
os.chdir(".git/modules")
for _ in range(600):
    os.makedirs("a/modules")
    os.chdir("a/modules")
os.chdir(top)
print("made")
EOF""")
        assert r.output == "made\n", r.error
    try:
        started = time.monotonic()
        with client.open_session(str(repo)) as s:  # opens again, promptly
            assert shell(s, "true").is_success
        assert time.monotonic() - started < 60  # not a walk of it all (minutes); room for a loaded machine
    finally:
        # pytest's own clean-up of old temporary directories recurses
        subprocess.run(["rm", "-rf", str(repo)], check=True)
