"""The daemon's reader of the user's git identity: git's config syntax, git's file order."""

from __future__ import annotations

from pathlib import Path

from dispatchd.daemon.gitguard.identity import identity_env, parse_user, read_identity


def test_plain_section():
    assert parse_user("[user]\n\tname = Ada Lovelace\n\temail = ada@example.org\n") == {
        "name": "Ada Lovelace", "email": "ada@example.org"}


def test_quotes_comments_escapes_and_case():
    text = '[User]\n  Name = "Ada  \\"L\\" Lovelace" # nick\n EMAIL=ada@example.org ; work\n'
    assert parse_user(text) == {"name": 'Ada  "L" Lovelace', "email": "ada@example.org"}


def test_other_sections_and_subsections_are_ignored():
    text = '[core]\nname = no\n[user "x"]\nname = no\n[user]\nname = yes\n[alias]\nemail = no\n'
    assert parse_user(text) == {"name": "yes"}


def test_the_last_value_wins_and_a_continued_line_joins():
    text = "[user]\nname = first\nname = sec\\\nond\n"
    assert parse_user(text) == {"name": "second"}


def test_a_key_on_the_section_line():
    assert parse_user("[user] name = Ada\n") == {"name": "Ada"}


def test_file_order_later_wins(tmp_path: Path):
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".config" / "git" / "config").write_text("[user]\nname = Xdg\nemail = x@example.org\n")
    (home / ".gitconfig").write_text("[user]\nname = Home\n")
    assert read_identity(str(home), {}) == {"name": "Home", "email": "x@example.org"}
    other = tmp_path / "global"
    other.write_text("[user]\nemail = g@example.org\n")
    found = read_identity(str(home), {"GIT_CONFIG_GLOBAL": str(other)})
    assert found.get("email") == "g@example.org" and found.get("name") != "Home"


def test_missing_files_give_nothing(tmp_path: Path, monkeypatch):
    import dispatchd.daemon.gitguard.identity as g

    monkeypatch.setattr(g, "_read", lambda path: "" if path == "/etc/gitconfig" else Path(path).read_text()
                        if Path(path).exists() else "")
    assert read_identity(str(tmp_path / "nobody"), {"XDG_CONFIG_HOME": str(tmp_path / "none")}) == {}


def test_environment_built_and_bad_values_dropped():
    assert identity_env({"name": "Ada", "email": "ada@example.org"}) == {
        "GIT_AUTHOR_NAME": "Ada", "GIT_COMMITTER_NAME": "Ada",
        "GIT_AUTHOR_EMAIL": "ada@example.org", "GIT_COMMITTER_EMAIL": "ada@example.org"}
    assert identity_env({"name": "Ada\nEvil", "email": "x" * 300}) == {}
    assert identity_env({}) == {}
