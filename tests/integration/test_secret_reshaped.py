"""A secret's value in text the session's own tools reshape: read_file numbers
a file's lines, search_files shows one line a match, strips its newline and
cuts it at 500 characters, a background job's output goes to a log file whose
path the caller is given. Each is masked before it is reshaped, so no piece
of a value (a line of a key, its first characters at a cut) comes back; each
case beside its twin, a plain variable or a command's own output."""

from __future__ import annotations

from pathlib import Path

import pytest

import dispatch
from tests.conftest import shell

# A private key, as an application gives one: the usual multi-line secret.
KEY_BODY = ("QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVowMTIzNDU2Nzg5",
            "YWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXpBQkNERUZHSElK")
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(KEY_BODY) + "\n-----END OPENSSH PRIVATE KEY-----\n"
TOKEN = "ghp_Zr9Kq2Lm7Xw4Vb8Nc3"
LABEL = "[secret DEPLOY_KEY]"


def test_a_multi_line_secret_read_with_read_file_shows_its_label_on_each_line(client: dispatch.Client,
                                                                             worktree: Path) -> None:
    with client.open_session(str(worktree), secrets={"DEPLOY_KEY": KEY}) as s:
        shell(s, 'printf "before\\n%safter\\n" "$DEPLOY_KEY" > id_deploy')
        whole = s.registry.call("read_file", {"path": "id_deploy"})
        # A window that starts, or ends, inside the key masks the part it shows.
        inside = s.registry.call("read_file", {"path": "id_deploy", "start_line": 2, "end_line": 3})
        ending = s.registry.call("read_file", {"path": "id_deploy", "start_line": 0, "end_line": 2})
    # Before: "1: -----BEGIN ...\n2: QUJD...": "N: " inside the value hid it from the reply's redaction.
    assert whole.output == f"0: before\n1: {LABEL}\n2: {LABEL}\n3: {LABEL}\n4: {LABEL}\n5: after"
    assert whole.metadata["total_lines"] == 6  # the lines keep their numbers
    assert inside.output == f"2: {LABEL}\n3: {LABEL}"
    assert ending.output == f"0: before\n1: {LABEL}\n2: {LABEL}"


def test_a_multi_line_secret_found_by_search_files_shows_its_label(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), secrets={"DEPLOY_KEY": KEY}) as s:
        shell(s, 'printf "%s" "$DEPLOY_KEY" > id_deploy; echo "Quite plain" > notes.txt')
        found = s.registry.call("search_files", {"query": "Q"})
        regex = s.registry.call("search_files", {"query": "^Q", "is_regex": True})
    # Before: "id_deploy:1: QUJD...": the key's lines, one a match.
    assert found.output == f"id_deploy:1: {LABEL}\nid_deploy:2: {LABEL}\nnotes.txt:0: Quite plain"
    assert regex.output == f"id_deploy:1: {LABEL}\nnotes.txt:0: Quite plain"


def test_a_multi_line_secret_printed_by_a_command_is_one_label(client: dispatch.Client, worktree: Path) -> None:
    # The twin: the same file, printed whole by a command, is one occurrence.
    with client.open_session(str(worktree), secrets={"DEPLOY_KEY": KEY}) as s:
        shell(s, 'printf "%s" "$DEPLOY_KEY" > id_deploy')
        r = shell(s, "cat id_deploy; echo end")
    assert r.output == f"{LABEL}end\n"


@pytest.mark.parametrize("tool", ["read_file", "search_files"])
def test_a_secret_read_from_a_file_with_its_newline_is_redacted(client: dispatch.Client, worktree: Path,
                                                                tool: str) -> None:
    """``secrets={"TOKEN": Path("token.txt").read_text()}``: the value keeps
    the file's newline, which the tools drop from a line, and a command's
    output may not have: the value without its surrounding whitespace is
    redacted too."""
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN + "\n"}) as s:
        shell(s, 'printf "%s" "$TOKEN" > token.txt; printf "x=%s;" "$TOKEN" | tr -d "\\n" > inline.txt')
        params = {"path": "token.txt"} if tool == "read_file" else {"query": "ghp_"}
        r = s.registry.call(tool, params)
        printed = shell(s, 'echo "[$(cat token.txt)]"')  # $(...) drops the newline
    # Before: "0: ghp_Zr9Kq2Lm7Xw4Vb8Nc3", "token.txt:0: ghp_...".
    assert r.output == ("0: [secret TOKEN]" if tool == "read_file"
                        else "inline.txt:0: x=[secret TOKEN];\ntoken.txt:0: [secret TOKEN]")
    assert printed.output == "[[secret TOKEN]]\n"


@pytest.mark.parametrize("tool", ["read_file", "search_files"])
def test_a_secret_without_a_newline_is_redacted_by_the_file_tools(client: dispatch.Client, worktree: Path,
                                                                   tool: str) -> None:
    # The twin: the value alone on its line, given without a newline.
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        shell(s, 'printf "%s\\n" "$TOKEN" > token.txt')
        params = {"path": "token.txt"} if tool == "read_file" else {"query": "ghp_"}
        r = s.registry.call(tool, params)
    assert r.output == ("0: [secret TOKEN]" if tool == "read_file" else "token.txt:0: [secret TOKEN]")


def test_search_files_cut_across_a_secret_shows_none_of_it(client: dispatch.Client, worktree: Path) -> None:
    """A long line (minified JSON, a lock file) holding a token where
    search_files cuts it at 500 characters: the line is masked before it is
    cut, so the cut falls in the label. Before, the cut kept the value's
    first characters, which the reply's redaction no longer recognised."""
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        shell(s, 'printf \'{"pad":"%s","token":"%s"}\\n\' "$(printf "x%.0s" $(seq 476))" "$TOKEN" > config.json')
        found = s.registry.call("search_files", {"query": "pad"})
    assert found.output == 'config.json:0: {"pad":"' + "x" * 476 + '","token":"[secr [...]'  # before: ...ghp_Z [...]


def test_search_files_cut_after_a_secret_redacts_it(client: dispatch.Client, worktree: Path) -> None:
    # The twin: the same line cut well after the value.
    with client.open_session(str(worktree), secrets={"TOKEN": TOKEN}) as s:
        shell(s, 'printf \'{"token":"%s","pad":"%s"}\\n\' "$TOKEN" "$(printf "x%.0s" $(seq 600))" > config.json')
        found = s.registry.call("search_files", {"query": "pad"})
    assert found.output.startswith('config.json:0: {"token":"[secret TOKEN]","pad":"xxx'), found.output[:60]
    assert found.output.endswith(" [...]")


@pytest.mark.parametrize("as_secret", [True, False], ids=["secret", "plain-variable"])
def test_a_background_job_s_log_file_holds_the_secret_redacted(client: dispatch.Client, worktree: Path,
                                                               as_secret: bool) -> None:
    """``metadata["log"]`` names the job's log, a file of the daemon's the
    caller may read (``tail -f``): written redacted, a value split across
    the pipe's reads included. The twin, a plain variable, is written as is."""
    half = len(TOKEN) // 2
    command = f'printf "key %s" "${{TOKEN:0:{half}}}"; sleep 0.3; printf "%s done\\n" "${{TOKEN:{half}}}"'
    given = {"secrets": {"TOKEN": TOKEN}} if as_secret else {"env": {"TOKEN": TOKEN}}
    with client.open_session(str(worktree), **given) as s:  # type: ignore[arg-type]
        started = shell(s, command, background=True)
        job = started.metadata["job"]
        ended = s.registry.call("job_output", {"job": job, "wait": 30})
        while ended.metadata["running"]:
            ended = s.registry.call("job_output", {"job": job, "wait": 30})
        log = Path(started.metadata["log"]).read_text()
    assert log == ("key [secret TOKEN] done\n" if as_secret else f"key {TOKEN} done\n")
