"""dispatchd.cli: what the daemon's command line refuses before it starts anything."""

from __future__ import annotations

import pytest

from dispatchd import cli


def test_root_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    assert cli.main(["--socket", "/nonexistent/dispatchd.sock"]) == 2
    assert "refusing to run as root" in capsys.readouterr().err


def test_the_testing_flag_is_listed_not_hidden(capsys: pytest.CaptureFixture[str]):
    # CONTRACT.md: root is refused "unless an explicit testing flag says
    # otherwise"; the flag is in --help with what it costs, never silent.
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--allow-root-for-testing" in out and "testing only: run as root anyway" in out
