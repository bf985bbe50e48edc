"""Two agents on two worktrees of one repository, each with a session of its
own: the worktrees' files are each session's own, but the repository's git
directory is shared (git keeps one object store, one set of refs for all its
worktrees), so what one agent stages is readable from the other's session.
Pinned here as the limit it is (SECURITY.md, "Known limits")."""

from __future__ import annotations

from pathlib import Path

import dispatch
import pytest

from tests.conftest import shell
from tests.integration.test_git import git, repo  # noqa: F401 - the fixture, shared

MARKER = "AGENT_X_PRIVATE_NOTES_4c1d"


def _stage(session: dispatch.Session, name: str) -> None:
    """What an agent does in its worktree before it commits: a new file, staged."""
    result = shell(session, f"echo '{MARKER} {name}' > notes-{name}.txt && git add notes-{name}.txt "
                            f"&& git status --short")
    assert result.is_success, result.error
    assert result.output == f"A  notes-{name}.txt\n"


@pytest.mark.known_limit
def test_what_one_worktree_stages_is_readable_from_a_session_on_another_known_limit(
        client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    agent_y = tmp_path / "wt-y"
    git(repo, "worktree", "add", "-q", "-b", "agent-y", str(agent_y))
    with client.open_session(str(repo)) as x, client.open_session(str(agent_y)) as y:
        _stage(x, "x")
        # The limit: the staged blob is an object of the shared store.
        found = shell(y, "git cat-file --batch-all-objects --batch | grep -a -o 'AGENT_X_PRIVATE_NOTES_4c1d x'")
        assert found.output == f"{MARKER} x\n", found.metadata
        # The twin: the other worktree's files themselves are out of the session's sight.
        seen = shell(y, f"cat {repo}/notes-x.txt")
        assert f"cat: {repo}/notes-x.txt: No such file or directory" in seen.metadata["stderr"], seen.metadata


def test_a_linked_worktrees_session_keeps_its_own_index_and_the_shared_history(
        client: dispatch.Client, repo: Path, tmp_path: Path) -> None:
    """What the shared git directory is for: the session's own index and the
    repository's history (objects, refs, logs) work from a linked worktree."""
    agent_y = tmp_path / "wt-y"
    git(repo, "worktree", "add", "-q", "-b", "agent-y", str(agent_y))
    with client.open_session(str(repo)), client.open_session(str(agent_y)) as y:
        _stage(y, "y")
        result = shell(y, "git ls-files --stage notes-y.txt | cut -f2; git log --format=%s HEAD")
        assert result.is_success, result.error
        assert result.output == "notes-y.txt\ninit\n"
