"""dispatchd.cli: what the daemon's command line refuses before it starts anything."""

from __future__ import annotations

import pytest

from dispatchd import cli


def test_root_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    assert cli.main(["--socket", "/nonexistent/dispatchd.sock"]) == 2
    assert "refusing to run as root" in capsys.readouterr().err


def test_no_flag_lets_root_through(capsys: pytest.CaptureFixture[str]):
    # The testing flag that once switched the check off is gone: argparse refuses it.
    with pytest.raises(SystemExit) as info:
        cli.main(["--allow-root-for-testing"])
    assert info.value.code == 2
    assert "unrecognized arguments: --allow-root-for-testing" in capsys.readouterr().err
